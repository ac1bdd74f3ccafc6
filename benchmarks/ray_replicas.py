"""One dataset job, two ways to run two replicas of the model: accelgen's own launcher on one machine against a Ray
cluster of two nodes on the same machine.

    A  accelgen run --world-size 2 --data-parallel 2 ...        two ranks, each a copy of the model (torch's launcher)
    B  accelgen run --ray ADDRESS --replicas 2 ...               two Ray actors, one on each node of a local cluster

Both run the same command otherwise, as a user runs it: ``python -m accelgen.cli run --dataset rows.jsonl --output
out.jsonl --max-new-tokens N --quiet``, the built-in default model, greedy, each job a process of its own timed from
its start to its exit. The rows (``--rows`` short prompts of varied lengths) are written by the script into a temp
folder. Contenders alternate A, B, A, B... for ``--rounds`` rounds; medians reported. Each round's two outputs must be
byte-equal (and equal to the first round's), else the script fails.

The cluster is started once, before the rounds, as a user starts one (its start is timed and reported apart): a head
(``ray start --head --num-cpus=1``) and a second node (``ray start --address ... --num-cpus=1``), each with a temp
folder of its own, so each replica runs on a node of its own. Its processes run with ``RAY_AUTH_MODE=disabled`` (a
cluster on loopback only; Ray 2.60 turns token authentication on wherever ``~/.ray/auth_token`` exists), as in
tests/test_ray_cluster.py. Both contenders get the same environment. At the end, the script kills its own nodes'
processes only (``ray stop`` would end every Ray instance of the machine).

Memory: the summed RSS (VmRSS) of a node's processes (those whose command line names the node's temp folder, and
their descendants: the raylet's workers), sampled every ``--sample-seconds`` while job B runs (the peak of each
node's sum), and idle before each job B; the job's own process tree (A: the launcher and its ranks; B: the driver)
sampled the same way during both jobs, so the sampling costs both alike.

Prints a Markdown table ready for benchmarks/RESULTS-log.md.

    python benchmarks/ray_replicas.py                           # 200 rows, 32 new tokens, 3 rounds
    python benchmarks/ray_replicas.py --rows 16 --rounds 1      # a check that it works
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SUMMARY = re.compile(r"accelgen: ([\d,]+) rows?, ([\d,]+) new tokens in ([\d.]+) s")
WORDS = ("the river city light morning engine paper garden winter market window story music number silver forest "
         "question machine answer travel letter mountain kitchen village summer friend history island doctor bridge "
         "always quickly never slowly often under over between across before after because while though").split()
OPENERS = ("Write a sentence about", "Tell me why", "Describe", "Explain how", "A short story:", "Translate into French:",
           "List three facts about", "Once upon a time", "Q: What is", "Summarize:")


def write_rows(path: Path, rows: int) -> None:
    """``rows`` JSON lines of short prompts of 2 to 30 words (a fixed seed: the same rows every run)."""
    draw = random.Random(0)
    with path.open("w") as lines:
        for _ in range(rows):
            words = " ".join(draw.choice(WORDS) for _ in range(draw.randint(1, 28)))
            lines.write(json.dumps({"text": f"{draw.choice(OPENERS)} {words}"}) + "\n")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parents


def _descendants(tops: list[int], parents: dict[int, int]) -> set[int]:
    """``tops`` and every live process descended from them."""
    found, frontier = set(tops), set(tops)
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _naming(folder: str) -> list[int]:
    """The processes whose command line names ``folder`` (a node's raylet, GCS, log monitor, agents...)."""
    named = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if folder.encode() in (entry / "cmdline").read_bytes():
                    named.append(int(entry.name))
    return named


def _rss_mib(pids: set[int]) -> float:
    total_kib = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
                    break
    return total_kib / 1024


class LocalCluster:
    """A head node and a second node on this machine, one CPU each, each its processes under a temp folder of its own."""

    def __init__(self, environment: dict):
        self.environment = environment
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # short folders: Ray's socket paths live inside them and a Unix socket's path is short
        self.folders = {"head": tempfile.mkdtemp(prefix="agbh", dir="/tmp"),
                        "second": tempfile.mkdtemp(prefix="agbs", dir="/tmp")}
        self.start_seconds: dict[str, float] = {}

    def start(self) -> None:
        self._ray("head", ["start", "--head", f"--port={self.port}", "--num-cpus=1", f"--temp-dir={self.folders['head']}",
                           "--include-dashboard=false", f"--dashboard-agent-listen-port={_free_port()}"])
        self._ray("second", ["start", f"--address={self.address}", "--num-cpus=1",
                             f"--temp-dir={self.folders['second']}", f"--dashboard-agent-listen-port={_free_port()}"])

    def _ray(self, node: str, arguments: list[str]) -> None:
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        started = time.perf_counter()
        done = subprocess.run([ray, *arguments], env=self.environment, capture_output=True, text=True, timeout=180)
        self.start_seconds[node] = time.perf_counter() - started
        if done.returncode:
            sys.exit(f"ray {' '.join(arguments)} failed:\n{done.stdout}\n{done.stderr}")

    def node_processes(self, parents: dict[int, int]) -> dict[str, set[int]]:
        return {node: _descendants(_naming(folder), parents) for node, folder in self.folders.items()}

    def node_of(self, pid: int) -> str | None:
        """Which node ran the worker process ``pid`` (its log files are in the node's folder)."""
        for node, folder in self.folders.items():
            if any(Path(folder).glob(f"session_*/logs/worker-*-{pid}.out")):
                return node
        return None

    def rss_mib(self) -> dict[str, float]:
        """Each node's summed RSS now, and both nodes'."""
        sums = {node: _rss_mib(pids) for node, pids in self.node_processes(_parents()).items()}
        return {**sums, "nodes": sums["head"] + sums["second"]}

    def stop(self) -> None:
        """SIGKILL every process of both nodes (and their workers), then remove the nodes' folders."""
        parents = _parents()
        for pids in self.node_processes(parents).values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for folder in self.folders.values():
            shutil.rmtree(folder, ignore_errors=True)


class MemorySampler:
    """Every ``interval`` s, the summed RSS of each node's processes and of the job's process tree; the peak of each."""

    def __init__(self, cluster: LocalCluster | None, job_pid: int, interval: float):
        self.cluster, self.job_pid, self.interval = cluster, job_pid, interval
        self.peaks: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        parents = _parents()
        groups = {"job": _descendants([self.job_pid], parents)}
        if self.cluster is not None:
            groups.update(self.cluster.node_processes(parents))
        sums = {name: _rss_mib(pids) for name, pids in groups.items()}
        if self.cluster is not None:
            sums["nodes"] = sums["head"] + sums["second"]
        for name, mib in sums.items():
            self.peaks[name] = max(self.peaks.get(name, 0.0), mib)

    def stop(self) -> dict[str, float]:
        self._done.set()
        self._thread.join()
        return self.peaks


def run_job(name: str, command: list[str], environment: dict, cluster: LocalCluster | None, interval: float) -> dict:
    """Run one job to its end: its seconds (process start to exit), its generate phase's rows and seconds (from its
    summary line), the peaks of memory the sampler saw."""
    started = time.perf_counter()
    job = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = MemorySampler(cluster, job.pid, interval)
    _, stderr = job.communicate()
    seconds = time.perf_counter() - started
    peaks = sampler.stop()
    if job.returncode:
        sys.exit(f"job {name} failed (exit status {job.returncode}): {' '.join(command)}\n{stderr}")
    summary = SUMMARY.search(stderr)
    if summary is None:
        sys.exit(f"job {name}: no summary line in its output:\n{stderr}")
    if cluster is not None:
        pids = re.findall(r" ready on node \S+ \(\w+, pid (\d+)\)", stderr)
        if sorted(cluster.node_of(int(pid)) for pid in pids) != ["head", "second"]:
            sys.exit(f"job {name}: its 2 replicas were not on 2 nodes of the cluster:\n{stderr}")
    return {"seconds": seconds, "rows": int(summary[1].replace(",", "")), "generate_seconds": float(summary[3]),
            "peaks": peaks}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample-seconds", type=float, default=0.5, help="memory sampling interval")
    arguments = parser.parse_args()
    # a SIGTERM ends the script through its finally blocks (the cluster stopped, the folder removed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    environment = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    load_before = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="agbench", dir="/tmp"))
    cluster = LocalCluster(environment)
    keep_scratch = False
    try:
        rows = scratch / "rows.jsonl"
        write_rows(rows, arguments.rows)
        cluster.start()
        print(f"cluster started: head {cluster.start_seconds['head']:.1f} s, second node "
              f"{cluster.start_seconds['second']:.1f} s ({cluster.address})", file=sys.stderr, flush=True)
        time.sleep(2)  # let the nodes settle before the first idle figure
        job = [sys.executable, "-m", "accelgen.cli", "run", "--dataset", str(rows),
               "--max-new-tokens", str(arguments.max_new_tokens), "--quiet"]
        contenders = {"A": ["--world-size", "2", "--data-parallel", "2"],
                      "B": ["--ray", cluster.address, "--replicas", "2"]}
        results: dict[str, list[dict]] = {"A": [], "B": []}
        idle: list[dict[str, float]] = []
        reference = None
        for round_number in range(1, arguments.rounds + 1):
            outputs = {}
            for name, options in contenders.items():
                output = scratch / f"out-{name}-{round_number}.jsonl"
                if name == "B":
                    idle.append(cluster.rss_mib())
                result = run_job(name, [*job, *options, "--output", str(output)], environment,
                                 cluster if name == "B" else None, arguments.sample_seconds)
                results[name].append(result)
                outputs[name] = output.read_bytes()
                print(f"round {round_number}: {name} {result['seconds']:6.2f} s, {result['rows'] / result['seconds']:6.2f} "
                      f"rows/s (generate phase {result['rows'] / result['generate_seconds']:6.2f} rows/s)",
                      file=sys.stderr, flush=True)
                if result["rows"] != arguments.rows:
                    sys.exit(f"job {name} of round {round_number} completed {result['rows']} rows of {arguments.rows}")
            reference = reference if reference is not None else outputs["A"]
            for name, written in outputs.items():
                if written != reference:
                    keep_scratch = True
                    sys.exit(f"round {round_number}: job {name}'s output differs from job A's of round 1 "
                             f"(kept in {scratch}); the benchmark stops")
            for name in outputs:
                (scratch / f"out-{name}-{round_number}.jsonl").unlink()
        print_tables(arguments, cluster, results, idle, load_before)
    finally:
        cluster.stop()
        if not keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def print_tables(arguments, cluster: LocalCluster, results: dict[str, list[dict]], idle: list[dict[str, float]],
                 load_before: float) -> None:
    import ray
    import torch

    def rates(name: str, seconds: str) -> float:
        return _median([result["rows"] / result[seconds] for result in results[name]])

    def peak(name: str, group: str) -> float:
        return _median([result["peaks"].get(group, 0.0) for result in results[name]])

    labels = {"A": "A: `--world-size 2 --data-parallel 2`", "B": "B: `--ray ADDRESS --replicas 2` (2 nodes)"}
    print(f"\n{arguments.rows} rows, {arguments.max_new_tokens} new tokens at most, greedy, built-in model; "
          f"{arguments.rounds} rounds (A, B interleaved), medians; {os.cpu_count()} cores, load average "
          f"{load_before:.1f} before and {os.getloadavg()[0]:.1f} after; ray {ray.__version__}, torch {torch.__version__}; "
          f"outputs byte-equal in every round. Cluster start (once, not per job): head "
          f"{cluster.start_seconds['head']:.1f} s, second node {cluster.start_seconds['second']:.1f} s.\n")
    print("| contender | job s | min | max | rows/s, user's clock | B / A | rows/s, generate phase | B / A |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base_clock, base_generate = rates("A", "seconds"), rates("A", "generate_seconds")
    for name, label in labels.items():
        seconds = [result["seconds"] for result in results[name]]
        clock, generate = rates(name, "seconds"), rates(name, "generate_seconds")
        print(f"| {label} | {_median(seconds):.2f} | {min(seconds):.2f} | {max(seconds):.2f} | {clock:.2f} | "
              f"{clock / base_clock:.2f}x | {generate:.2f} | {generate / base_generate:.2f}x |")
    print("\n| memory, summed RSS (MiB, medians of rounds) | head node | second node | both nodes | the job's processes |")
    print("| --- | ---: | ---: | ---: | ---: |")
    idle_head, idle_second = _median([s["head"] for s in idle]), _median([s["second"] for s in idle])
    print(f"| Ray cluster idle (before each job B) | {idle_head:.0f} | {idle_second:.0f} | "
          f"{_median([s['nodes'] for s in idle]):.0f} | - |")
    print(f"| during job B, peak (Ray's processes and the replicas; the driver apart) | {peak('B', 'head'):.0f} | "
          f"{peak('B', 'second'):.0f} | {peak('B', 'nodes'):.0f} | {peak('B', 'job'):.0f} (the driver) |")
    print(f"| during job A, peak (the launcher and its 2 ranks) | - | - | - | {peak('A', 'job'):.0f} |")


if __name__ == "__main__":
    main()
