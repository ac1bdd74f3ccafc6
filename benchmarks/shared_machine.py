"""Dataset completion on a machine that other processes keep busy: each contender's throughput with the cores to
itself and with busy processes of this script's own competing for them, in one run.

Each measurement is its own process (``dataset_throughput.py --contenders NAME --rounds 1``): threads are then
chosen, or not, as in a user's run. Quiet and loaded measurements and the contenders are interleaved round by
round (machine noise hits all alike); medians are reported.

    accelgen_continuous          accelgen as it comes: the CPU plugin chooses its threads (the summary's phrase shown)
    accelgen_continuous_default  the same with OMP_NUM_THREADS set to the cores (torch's default, as before the choice)
    hf_generate_batch            Hugging Face generate_batch() with torch's default threads

    python benchmarks/shared_machine.py                       # 192 rows, batch 16, two busy processes, 3 rounds
    python benchmarks/shared_machine.py --prompts 64 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
CONTENDERS = ("accelgen_continuous", "accelgen_continuous_default", "hf_generate_batch")


def measure(name: str, arguments) -> tuple[float, str | None]:
    """Kept tokens/s of one round of ``name`` in a process of its own, and the threads accelgen chose (if it did)."""
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    environment.pop("OMP_NUM_THREADS", None)
    contender = name
    if name == "accelgen_continuous_default":
        environment["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
        contender = "accelgen_continuous"
    result = subprocess.run(
        [sys.executable, str(HERE / "dataset_throughput.py"), "--contenders", contender, "--rounds", "1", "--prompts",
         str(arguments.prompts), "--batch-size", str(arguments.batch_size)],
        env=environment, capture_output=True, text=True, check=True)
    [rate] = re.findall(rf"^\| {contender} \| (\d+) \|", result.stdout, re.MULTILINE)
    chose = re.findall(r"^accelgen continuous: device cpu \((.*)\)$", result.stdout, re.MULTILINE)
    return float(rate), (chose[0] if chose else None)


class BusyProcesses:
    """``count`` processes that each keep a core busy while the block runs."""

    def __init__(self, count: int):
        self.count, self.processes = count, []

    def __enter__(self):
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        time.sleep(0.5)  # running before the contender starts
        return self

    def __exit__(self, *failure):
        for process in self.processes:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--busy", type=int, default=2, help="busy processes competing for the cores")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    arguments = parser.parse_args()
    names = arguments.contenders.split(",")
    rates = {(name, loaded): [] for name in names for loaded in (False, True)}
    chosen = {}
    for _ in range(arguments.rounds):
        for loaded in (False, True):
            for name in names:
                with BusyProcesses(arguments.busy if loaded else 0):
                    rate, chose = measure(name, arguments)
                rates[name, loaded].append(rate)
                chosen[name, loaded] = chose
    median = {key: statistics.median(values) for key, values in rates.items()}
    print(f"{arguments.prompts} rows, batch {arguments.batch_size}, {len(os.sched_getaffinity(0))} cores, loaded: "
          f"{arguments.busy} busy processes; kept tokens/s, medians of {arguments.rounds} round(s)")
    print("| contender | quiet | loaded | loaded / quiet | threads chosen (quiet; loaded) |")
    print("|---|---:|---:|---:|---|")
    for name in names:
        quiet, loaded = median[name, False], median[name, True]
        threads = "" if chosen[name, False] is None else f"{chosen[name, False]}; {chosen[name, True]}"
        print(f"| {name} | {quiet:.0f} | {loaded:.0f} | {loaded / quiet:.2f}x | {threads} |")


if __name__ == "__main__":
    main()
