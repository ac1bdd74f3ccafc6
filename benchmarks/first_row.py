"""Seconds from a dataset job's start to its first row, on the user's clock: ``accelgen run --dataset rows.jsonl
--output out.jsonl`` started as a user starts it (a fresh process: imports, the model's load, the first prefill and
decode steps), the output file watched until its first line is whole, then the job waited for to its exit.

Each round runs the job once; the figures are medians. The command's own fixed cost is split out with ``-X
importtime``'s sum in one more run, off the figures (its module imports, the largest packages named), so that a
change of the start can be told from a change of the decoding.

    python benchmarks/first_row.py                              # the built-in model, 5 rounds
    python benchmarks/first_row.py --model /tmp/m05 --quantize int8 --rounds 3
    python benchmarks/first_row.py --accelgen /other/venv/bin/accelgen   # another install (one without test extras)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["The history of the printing press", "Write a short poem about rain", "Explain what a compiler does",
           "List three uses of copper", "Describe a quiet morning in a small town"] * 8
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)")


def job_command(accelgen: str, model: str | None, rows: Path, output: Path, extra: list[str]) -> list[str]:
    command = [accelgen, "run", "--dataset", str(rows), "--column", "prompt", "--output", str(output),
               "--max-new-tokens", "16", "--quiet"]
    return command + (["--model", model] if model else []) + extra


def one_job(command: list[str], output: Path) -> tuple[float, float]:
    """(seconds to the first whole row of ``output``, seconds to the job's exit)."""
    output.unlink(missing_ok=True)
    start = time.perf_counter()
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_row = None
    while first_row is None and job.poll() is None:
        if output.exists() and b"\n" in output.read_bytes():
            first_row = time.perf_counter() - start
        else:
            time.sleep(0.005)
    errors = job.communicate()[1]
    exited = time.perf_counter() - start
    if job.returncode != 0:
        sys.exit(f"the job failed (exit {job.returncode}): {errors.strip().splitlines()[-1:]}")
    return (exited if first_row is None else first_row), exited


def imports_by_package(command: list[str], output: Path) -> tuple[float, list[tuple[str, float]]]:
    """The job's module imports, in seconds: their sum, and the five largest top-level packages' own shares."""
    output.unlink(missing_ok=True)
    python = Path(command[0]).with_name("python")
    run = subprocess.run([str(python), "-X", "importtime", "-m", "accelgen.cli", *command[1:]],
                         capture_output=True, text=True, check=True)
    by_package: collections.Counter[str] = collections.Counter()
    for line in run.stderr.splitlines():
        found = IMPORT_LINE.match(line)
        if found:
            by_package[found[2].split(".")[0]] += int(found[1]) / 1e6
    return sum(by_package.values()), by_package.most_common(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelgen", default=str(Path(sys.executable).with_name("accelgen")),
                        help="the accelgen command to time (default: this Python's)")
    parser.add_argument("--model", help="a model folder or Hub id (default: the built-in model)")
    parser.add_argument("--quantize", choices=["int8"], help="pass --quantize int8")
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        rows = Path(scratch, "rows.jsonl")
        rows.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
        output = Path(scratch, "out.jsonl")
        extra = ["--overwrite"] + (["--quantize", arguments.quantize] if arguments.quantize else [])
        command = job_command(arguments.accelgen, arguments.model, rows, output, extra)
        one_job(command, output)  # a first job fills the caches a user's second job finds (bytecode, kernels)
        timings = [one_job(command, output) for _ in range(arguments.rounds)]
        imported, largest = imports_by_package(command, output)

    first_rows, exits = zip(*timings)
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; command: {' '.join(command[1:])}")
    print(f"first row: median {statistics.median(first_rows):.2f} s (each: "
          f"{', '.join(f'{seconds:.2f}' for seconds in first_rows)})")
    print(f"exit: median {statistics.median(exits):.2f} s")
    print(f"imports (one more run, -X importtime): {imported:.2f} s, the largest: "
          + ", ".join(f"{package} {seconds:.2f}" for package, seconds in largest))


if __name__ == "__main__":
    main()
