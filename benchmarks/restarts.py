"""What a dying rank costs a job that restarts itself: a 2-rank data-parallel dataset job, uninterrupted against the
same job with rank 1 SIGKILLed once half its rows are written (torch's agent starts the workers again, they load
the model and resume the output), wall time from start to exit, one thread per process.

The workload is dataset_throughput.py's (random-weight Llama, prompts of 3 to 40 words, sampled completions whose
lengths spread geometrically around ``--mean-length``), written as a JSON-lines dataset and completed with
``accelgen run --world-size 2 --data-parallel 2`` exactly as a user would. Contenders are interleaved round by
round, medians reported; each killed job must end with exit 0, one restart line, and the same rows as the
uninterrupted job (checked).

    python benchmarks/restarts.py                         # 256 rows, batch 8, 64-token cap, 3 rounds
    python benchmarks/restarts.py --prompts 64 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from dataset_throughput import build_workload, output_rows


def rank_pid(marker: str, rank: str) -> int | None:
    """The pid of the live process carrying ``marker`` in its environment, as rank ``rank``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environment = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in environment and f"RANK={rank}".encode() in environment:
                return int(entry.name)
    return None


def run_once(folder: Path, dataset: Path, output: Path, arguments, kill_at: int | None) -> tuple[float, list, str]:
    """Wall seconds of one job, the rows it wrote (by index), and its stderr; with ``kill_at``, rank 1 is SIGKILLed
    once the output holds that many rows."""
    marker = f"ACCELGEN_BENCH_JOB={uuid.uuid4().hex}"
    environment = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELGEN_BENCH_JOB=marker.split("=")[1])
    started = time.monotonic()
    job = subprocess.Popen(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--data-parallel", "2",
         "--model", str(folder), "--dataset", str(dataset), "--batch-size", str(arguments.batch_size),
         "--max-new-tokens", str(arguments.max_new_tokens), "--do-sample", "--seed", "0", "--output", str(output),
         "--overwrite", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)
    if kill_at is not None:
        while job.poll() is None:
            if output.exists() and output.read_text().count("\n") >= kill_at:
                pid = rank_pid(marker, "1")
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    break
            time.sleep(0.02)
    _, stderr = job.communicate()
    seconds = time.monotonic() - started
    if job.returncode:
        sys.exit(f"the job failed (status {job.returncode}):\n{stderr}")
    rows = sorted((row["index"], row["completion_token_ids"])
                  for row in output_rows(output))
    return seconds, rows, stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mean-length", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.set_defaults(workload="varied")  # dataset_throughput's default workload
    arguments = parser.parse_args()

    seconds: dict[str, list[float]] = {"uninterrupted": [], "killed_at_half": []}
    with tempfile.TemporaryDirectory() as scratch:
        folder, dataset = Path(scratch, "model"), Path(scratch, "rows.jsonl")
        prompts_of, _ = build_workload(arguments, folder)
        prompts = prompts_of(0)
        dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in prompts))
        same, restart_lines = True, []
        for round_number in range(arguments.rounds):
            # a new output each run: the killed job's rank must not be killed on the rows of a run before
            wall, expected, _ = run_once(folder, dataset, Path(scratch, f"whole-{round_number}.jsonl"), arguments, None)
            seconds["uninterrupted"].append(wall)
            print(f"round {round_number + 1}: uninterrupted  {wall:6.1f} s", file=sys.stderr, flush=True)
            wall, rows, stderr = run_once(folder, dataset, Path(scratch, f"killed-{round_number}.jsonl"), arguments,
                                          arguments.prompts // 2)
            seconds["killed_at_half"].append(wall)
            same = same and rows == expected
            restart_lines.append(sum("starting the workers again" in line for line in stderr.splitlines()))
            print(f"round {round_number + 1}: killed_at_half {wall:6.1f} s ({restart_lines[-1]} restart line)",
                  file=sys.stderr, flush=True)
    base = statistics.median(seconds["uninterrupted"])
    print(f"\n{arguments.prompts} rows, batch {arguments.batch_size}, max {arguments.max_new_tokens} new tokens (mean "
          f"length {arguments.mean_length}), Llama {arguments.layers} layers x {arguments.hidden}, --world-size 2 "
          f"--data-parallel 2, one thread per process, {os.cpu_count()} cores; restart lines per killed job: "
          f"{restart_lines}; killed jobs wrote the same rows as uninterrupted ones: {same}\n")
    print("| job | wall s (median) | vs uninterrupted |")
    print("| --- | ---: | ---: |")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
