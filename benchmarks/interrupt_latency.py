"""How long Ctrl-C takes to end an ``accelgen run``, in several tries in a row, and whether any of its processes
outlive it (a loop measured here, not a timed test: this machine is shared and noisy).

Each try starts ``accelgen run --world-size N`` on the built-in model with enough work to keep decoding, waits
until rank 0 has written its first row (or, with ``--at SECONDS``, that long after the start: the command's start-up,
its imports and model loading), sends SIGINT to the launcher (what Ctrl-C in a terminal does: torch's launcher
forwards it to each rank's process group), and times until the launcher exits.

    python benchmarks/interrupt_latency.py --tries 5                       # --world-size 2, mid-run
    python benchmarks/interrupt_latency.py --world-size 1 --at 0.5,1,2,3,4,6 # one process, during start-up
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["In the beginning", "And God said", "Let there be light"] * 40


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def one_try(folder: Path, number: int, world_size: int, at: float | None) -> tuple[float, int, int]:
    """(seconds from SIGINT to the launcher's exit, its exit status, processes left after 1 s)."""
    output = folder / f"try{number}.jsonl"
    job = subprocess.Popen(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", str(world_size), "--max-new-tokens",
         "200", "--ignore-eos", "--quiet", *[part for prompt in PROMPTS for part in ("--prompt", prompt)],
         "--output", str(output)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    if at is not None:
        time.sleep(at)
    while at is None and not (output.exists() and output.stat().st_size):
        if job.poll() is not None:
            raise SystemExit(f"try {number}: the job ended (status {job.returncode}) before it could be interrupted")
        time.sleep(0.05)
    started = time.monotonic()
    job.send_signal(signal.SIGINT)
    status = job.wait()
    seconds = time.monotonic() - started
    time.sleep(1)
    return seconds, status, len(processes_with(str(output)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--at", help="seconds after the start to interrupt, comma-separated, one try each (default: "
                                     "when the first row is written, --tries times)")
    arguments = parser.parse_args()
    moments = [float(at) for at in arguments.at.split(",")] if arguments.at else [None] * arguments.tries
    arguments.tries = len(moments)
    with tempfile.TemporaryDirectory() as folder:
        results = [one_try(Path(folder), number, arguments.world_size, at) for number, at in enumerate(moments)]
    for number, ((seconds, status, left), at) in enumerate(zip(results, moments), start=1):
        when = "at the first row" if at is None else f"{at:g} s after the start"
        print(f"try {number} ({when}): ended in {seconds:.2f} s, exit status {status}, processes left {left}")
    print(f"slowest {max(seconds for seconds, _, _ in results):.2f} s of {arguments.tries} tries; "
          f"all exit 130: {all(status == 130 for _, status, _ in results)}; "
          f"none left: {all(left == 0 for _, _, left in results)}")


if __name__ == "__main__":
    main()
