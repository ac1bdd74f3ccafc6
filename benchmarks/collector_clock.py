"""What Python's garbage collector costs a job on the user's clock: the same ``accelgen run`` as the ``accelgen`` script
runs it (the collector kept off what the start builds: ``accelgen.common.collector``) and as ``accelgen.cli.main``
called from Python runs it (the collector as Python leaves it), interleaved, each job a process of its own timed from
its start to its exit, medians.

Reported per way: the job's seconds; the generation's own seconds (the run record's ``generate_seconds``); and the
rest, which is the process's start (imports, the model's load) and its exit.

    python benchmarks/collector_clock.py --model DIR --dataset DIR/rows.jsonl --column prompt --rounds 5 \\
        -- --batch-size 16 --max-new-tokens 128 --do-sample --seed 0

(cpu_user_clock.py's shapes make such folders; any model and dataset do.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: how each way starts the command line
WAYS = {"script": [str(Path(sys.executable).parent / "accelgen")],
        "main from Python": [sys.executable, "-c", "import sys; from accelgen.cli import main; sys.exit(main(sys.argv[1:]))"]}


def one_job(way: str, arguments, extra: list[str], output: Path) -> dict:
    command = [*WAYS[way], "run", "--device", "cpu", "--model", arguments.model, "--dataset", arguments.dataset,
               "--column", arguments.column, "--output", str(output), "--overwrite", "--quiet", *extra]
    environment = dict(os.environ, OMP_NUM_THREADS=str(arguments.threads), HF_HUB_OFFLINE="1")
    started = time.perf_counter()
    job = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=arguments.worker_timeout)
    seconds = time.perf_counter() - started
    if job.returncode:
        raise SystemExit(f"{way} failed (exit {job.returncode}):\n{job.stderr[-3000:]}")
    record = json.loads(Path(f"{output}.run.json").read_text())["last_run"]
    return {"seconds": seconds, "generate": record["generate_seconds"], "rest": seconds - record["generate_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--column", default="text")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker-timeout", type=float, default=1800)
    arguments, extra = parser.parse_known_args()
    extra = [argument for argument in extra if argument != "--"]
    runs = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_number in range(arguments.rounds):
            for way in WAYS:
                run = one_job(way, arguments, extra, Path(scratch) / "out.jsonl")
                runs[way].append(run)
                print(f"round {round_number + 1} {way}: {run['seconds']:.2f} s (generation {run['generate']:.2f} s)",
                      file=sys.stderr, flush=True)
    print(f"\n{arguments.model}, {arguments.threads} thread(s), medians of {arguments.rounds}")
    print("| way | job s | generation s | start and exit s |")
    print("|---|---:|---:|---:|")
    for way, done in runs.items():
        print(f"| {way} | " + " | ".join(f"{statistics.median(run[field] for run in done):.2f}"
                                        for field in ("seconds", "generate", "rest")) + " |")


if __name__ == "__main__":
    main()
