"""How long Ctrl-C takes to end a ``--world-size 2`` job, in several tries in a row, and whether any of its
processes outlive it (a loop measured here, not a timed test: this machine is shared and noisy).

Each try starts ``accelgen run --world-size 2`` on the built-in model with enough work to keep decoding,
waits until rank 0 has written its first row, sends SIGINT to the launcher (what Ctrl-C in a terminal
does: torch's launcher forwards it to each rank's process group), and times until the launcher exits.

    python benchmarks/interrupt_latency.py --tries 5
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


def one_try(folder: Path, number: int) -> tuple[float, int, int]:
    """(seconds from SIGINT to the launcher's exit, its exit status, processes left after 1 s)."""
    output = folder / f"try{number}.jsonl"
    job = subprocess.Popen(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--max-new-tokens",
         "200", "--ignore-eos", "--quiet", *[part for prompt in PROMPTS for part in ("--prompt", prompt)],
         "--output", str(output)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    while not (output.exists() and output.stat().st_size):
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
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = [one_try(Path(folder), number) for number in range(arguments.tries)]
    for number, (seconds, status, left) in enumerate(results, start=1):
        print(f"try {number}: ended in {seconds:.2f} s, exit status {status}, processes left {left}")
    print(f"slowest {max(seconds for seconds, _, _ in results):.2f} s of {arguments.tries} tries; "
          f"all exit 130: {all(status == 130 for _, status, _ in results)}; "
          f"none left: {all(left == 0 for _, _, left in results)}")


if __name__ == "__main__":
    main()
