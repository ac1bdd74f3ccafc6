"""Start-to-ready time and each rank's peak host memory while loading, for the ways a model can load:
each rank reading its slices of a save_pretrained checkpoint, each rank reading its own files of a folder
``accelgen shard`` wrote, and (with --baseline-revision) an earlier accelgen, whose ranks loaded the whole
model before DeepSpeed split it. The floor is reading the checkpoint's bytes once, measured in the same run.

Builds a random-weight BLOOM of the given shape (default: about 3.2 GB in float32), saves it with
save_pretrained, then runs ``accelgen run --world-size N --max-new-tokens 1`` exactly as a user would and
reads the figures off the summary lines. What does not grow with the model (importing torch, transformers
and DeepSpeed, starting the ranks: seconds on a small machine) is measured the same way on a two-layer
BLOOM of hidden size 64, and taken off to give the part of each figure that the model's size makes.

    python benchmarks/load_time.py --baseline-revision 4d08fb5            # the issue's measurement
    python benchmarks/load_time.py --baseline-revision 4d08fb5 --cold     # from the disk (needs root)
    python benchmarks/load_time.py --layers 2 --hidden 256 --vocab 4096    # quick look

With --interleave, the ways' runs take turns (one of each, then again) and the table shows each way's medians: a
before/after of a small change on a shared machine, where load drifts more over minutes than the change moves it.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from random_bloom import add_shape_arguments, describe_shape

PROMPT = "DeepSpeed is a machine learning framework"

REPOSITORY = Path(__file__).resolve().parent.parent


def save_model(folder: Path, layers: int, hidden: int, heads: int, vocab: int) -> None:
    """The random BLOOM saved by another process: this one stays small, since a process it starts inherits
    its resident size as the start of its own peak where ``ru_maxrss`` is read (the earlier accelgen)."""
    code = ("import argparse, sys; from pathlib import Path; from tensor_parallel import save_model; "
            f"save_model(Path(sys.argv[1]), argparse.Namespace(layers={layers}, hidden={hidden}, heads={heads}, vocab={vocab}))")
    subprocess.run([sys.executable, "-c", code, str(folder)], cwd=Path(__file__).parent, check=True, capture_output=True)


def drop_page_cache() -> None:
    """Make the next reads come from the disk (Linux, as root): what a checkpoint larger than memory does."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError as error:
        raise SystemExit(f"--cold needs to drop the page cache, which this user cannot: {error}") from None


def read_once_seconds(folder: Path, cold: bool) -> float:
    """Time to read every weight file of ``folder`` once, 64 MiB at a time."""
    if cold:
        drop_page_cache()
    started = time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as file:
            while file.read(64 << 20):
                pass
    return time.perf_counter() - started


@functools.cache
def _run_help(pythonpath: str | None) -> str:
    return subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--help"], capture_output=True, text=True,
                          env=dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))).stdout


def details_flag(environment: dict) -> list[str]:
    """``--details`` where the accelgen of ``environment`` takes it (an earlier one prints its figures without it)."""
    return ["--details"] if "--details" in _run_help(environment.get("PYTHONPATH")) else []


def run_once(folder: Path, world_size: int, environment: dict, cold: bool) -> dict:
    """Wall time of the whole command, the load time it reports, and each rank's peak host memory."""
    if cold:
        drop_page_cache()
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", str(world_size),
         "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "1", "--quiet", *details_flag(environment)],
        capture_output=True, text=True, env=environment,
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"accelgen run failed:\n{result.stderr[-3000:]}")
    peaks = re.search(r"peak_rss_bytes per rank ([\d, /]+)", result.stderr).group(1)
    return {"wall_s": wall, "load_s": float(re.search(r"model loaded in ([\d.]+) s", result.stderr).group(1)),
            "peak_rss_bytes": [int(part.replace(",", "")) for part in peaks.split(" / ")]}


def shard_once(folder: Path, output: Path, world_size: int) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "accelgen.cli", "shard", "--device", "cpu", "--model", str(folder),
                    "--world-size", str(world_size), "--dtype", "float32", "--output", str(output)],
                   check=True, capture_output=True)
    return time.perf_counter() - started


def baseline_pythonpath(revision: str, workspace: Path) -> str:
    """A PYTHONPATH under which ``import accelgen`` (and its plugins) is ``revision`` of this repository."""
    tree = workspace / "tree"
    subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", "-f", str(tree), revision],
                   check=True, capture_output=True)
    path = workspace / "path"
    path.mkdir()
    (path / "accelgen").symlink_to(tree / "core")
    for plugin in ("cpu", "cuda", "hpu"):
        (path / f"accelgen_{plugin}").symlink_to(tree / "plugins" / plugin)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.set_defaults(layers=24, hidden=1280, heads=16)
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--runs", type=int, default=2, help="runs of each configuration (the table shows the best)")
    parser.add_argument("--baseline-revision", help="git revision of accelgen to measure as the earlier path")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each run and read (root only)")
    parser.add_argument("--interleave", action="store_true", help="the ways' runs in turns; the table shows medians")
    arguments = parser.parse_args()
    world_sizes = [int(size) for size in arguments.world_sizes.split(",")]

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        checkpoint, tiny = scratch / "model", scratch / "tiny"
        save_model(checkpoint, arguments.layers, arguments.hidden, arguments.heads, arguments.vocab)
        save_model(tiny, 2, 64, 16, arguments.vocab)
        size = sum(path.stat().st_size for path in checkpoint.glob("*.safetensors"))
        environment = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
        ways = {"slices (meta device)": ("", environment)}
        if arguments.baseline_revision:
            workspace = scratch / "baseline"
            workspace.mkdir()
            baseline_environment = dict(environment, PYTHONPATH=baseline_pythonpath(arguments.baseline_revision, workspace))
            ways = {f"whole model ({arguments.baseline_revision})": ("", baseline_environment), **ways}
        summary = f"medians of {arguments.runs} interleaved runs" if arguments.interleave else f"best of {arguments.runs} runs"
        print(f"{describe_shape(arguments)}, float32 safetensors of {size / 2**30:.2f} GiB; {summary}"
              + ("; page cache dropped before each run" if arguments.cold else "; page cache warm"))
        floor = min(read_once_seconds(checkpoint, arguments.cold) for _ in range(3))
        print(f"floor: reading the checkpoint once: {floor:.2f} s")
        print("| world size | loading | start to ready (s) | load reported (s) | of it, the model's (s) | "
              "peak host memory per rank (GiB) | of it, the model's (x checkpoint) |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for world_size in world_sizes:
            shard_seconds = shard_once(checkpoint, scratch / f"tp{world_size}", world_size)
            shard_once(tiny, scratch / f"tiny-tp{world_size}", world_size)
            subprocess.run(["sync"], check=True)  # no write-back of the new files during the runs
            rows = {**ways, f"pre-sharded (accelgen shard: {shard_seconds:.1f} s, once)": ("tp", environment)}
            folders = {way: (scratch / f"tp{world_size}" if prefix else checkpoint,
                             scratch / f"tiny-tp{world_size}" if prefix else tiny) for way, (prefix, _) in rows.items()}
            samples = {(way, folder): [] for way in rows for folder in folders[way]}
            for _ in range(arguments.runs if arguments.interleave else 1):
                for (way, folder), taken in samples.items():
                    runs = 1 if arguments.interleave else arguments.runs
                    taken.extend(run_once(folder, world_size, rows[way][1], arguments.cold) for _ in range(runs))
            summarized = median_of if arguments.interleave else best_of
            for way in rows:
                best, base = (summarized(samples[way, folder]) for folder in folders[way])
                model_memory = max(peak - base_peak for peak, base_peak in zip(best["peak_rss_bytes"], base["peak_rss_bytes"]))
                print(f"| {world_size} | {way} | {best['wall_s']:.1f} | {best['load_s']:.2f} | "
                      f"{best['load_s'] - base['load_s']:.2f} | "
                      f"{' / '.join(f'{b / 2**30:.2f}' for b in best['peak_rss_bytes'])} | {model_memory / size:.2f} |",
                      flush=True)
        if arguments.baseline_revision:
            subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(scratch / "baseline" / "tree")],
                           capture_output=True)


def best_of(samples: list[dict]) -> dict:
    """The run with the shortest load of ``samples``, with the highest peak memory any of them had per rank."""
    best = min(samples, key=lambda sample: sample["load_s"])
    return dict(best, peak_rss_bytes=[max(peaks) for peaks in zip(*(sample["peak_rss_bytes"] for sample in samples))])


def median_of(samples: list[dict]) -> dict:
    """Each figure's median over ``samples`` (per rank for the peak memory)."""
    return {"wall_s": statistics.median(sample["wall_s"] for sample in samples),
            "load_s": statistics.median(sample["load_s"] for sample in samples),
            "peak_rss_bytes": [int(statistics.median(peaks)) for peaks in zip(*(sample["peak_rss_bytes"] for sample in samples))]}


if __name__ == "__main__":
    main()
