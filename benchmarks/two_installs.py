"""Two installs of accelgen on one machine (two virtual environments, each with its own torch and DeepSpeed), sharing
one torch extensions folder as two users' venvs share ``~/.cache/torch_extensions``: their first tensor-parallel runs
at once, then runs alternating between them. Each run is ``accelgen run --world-size 2`` of the built-in model, as a
user types it; its wall time and whether it compiled DeepSpeed's CPU all-reduce extension (its "compiling ..." line)
are reported.

What it checks: both first runs succeed, each install compiles once, and no later run compiles again (before the
build folder per install, each alternate run rebuilt the other install's build, 96-120 s, and a run loading it while
the other rebuilt it died of SIGSEGV).

    python benchmarks/two_installs.py --python /path/to/venv-a/bin/python --python /path/to/venv-b/bin/python
    python benchmarks/two_installs.py --python A --python B --alternations 3 --extensions-folder /tmp/shared-ext
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

COMPILING = "compiling DeepSpeed's CPU all-reduce extension"


def start(python: str, environment: dict) -> tuple[subprocess.Popen, float]:
    command = [python, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--max-new-tokens", "4",
               "--quiet", "--prompt", "DeepSpeed is"]
    return subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True), time.perf_counter()


def finish(process: subprocess.Popen, started: float) -> tuple[int, float, bool, str]:
    """Exit status, wall seconds, whether it compiled the extension, its last stderr line."""
    stderr = process.communicate()[1]
    lines = stderr.strip().splitlines()
    return process.returncode, time.perf_counter() - started, COMPILING in stderr, lines[-1] if lines else ""


def report(label: str, python: str, outcome: tuple[int, float, bool, str]) -> None:
    status, seconds, compiled, last = outcome
    print(f"| {label} | {python} | {status} | {seconds:.1f} | {'yes' if compiled else 'no'} |"
          + ("" if status == 0 else f" {last}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True, help="an install's interpreter (give two)")
    parser.add_argument("--alternations", type=int, default=2, help="rounds of one run of each install, in turn")
    parser.add_argument("--extensions-folder", help="the shared TORCH_EXTENSIONS_DIR (default: a new empty folder)")
    arguments = parser.parse_args()
    if len(arguments.python) != 2:
        parser.error("give --python twice: the two installs")
    folder = arguments.extensions_folder or tempfile.mkdtemp(prefix="two-installs-")
    environment = dict(os.environ, TORCH_EXTENSIONS_DIR=folder, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    print(f"shared extensions folder: {folder}\n")
    print("| run | install | exit | seconds | compiled the extension |\n|---|---|---:|---:|---|")
    first = [start(python, environment) for python in arguments.python]  # at once
    for python, (process, started) in zip(arguments.python, first):
        report("first, at once", python, finish(process, started))
    for round_number in range(arguments.alternations):
        for python in arguments.python:
            report(f"alternating, round {round_number + 1}", python, finish(*start(python, environment)))
    print("\nbuild folders:", ", ".join(sorted(name for name in os.listdir(folder) if name.startswith("accelgen-deepspeed"))))


if __name__ == "__main__":
    main()
