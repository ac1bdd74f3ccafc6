"""Load time, per-token decode latency and memory per rank at world size 1 and 2 (CPU, gloo).

Builds a random-weight BLOOM (BLOOM-560m shape by default), saves it like a Hub checkpoint, then runs
``accelgen run --world-size N`` on it exactly as a user would and reads the figures off the summary
lines. Two cores cannot show a speed-up: the figures show what the all-reduce path costs and how
much memory each rank saves.

    python benchmarks/tensor_parallel.py                 # BLOOM-560m shape, 32 new tokens, 3 runs each
    python benchmarks/tensor_parallel.py --layers 4 --hidden 256 --vocab 4096   # quick look
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from random_bloom import add_shape_arguments, describe_shape, random_bloom

from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer

PROMPT = "DeepSpeed is a machine learning framework"


def save_model(folder: Path, arguments) -> None:
    random_bloom(arguments).save_pretrained(folder, safe_serialization=True)
    load_tokenizer(str(DEFAULT_MODEL)).save_pretrained(folder)


def run_once(folder: Path, world_size: int, new_tokens: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", str(world_size),
         "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(new_tokens), "--ignore-eos", "--quiet",
         "--details"],
        capture_output=True, text=True, check=True,
    )
    summary = result.stderr
    shares = re.search(r"parameter bytes per rank ([\d, /]+) of ([\d,]+) unsharded", summary)
    peaks = re.search(r"peak_rss_bytes per rank ([\d, /]+)", summary)
    numbers = lambda text: [int(part.replace(",", "")) for part in text.split(" / ")]  # noqa: E731
    return {
        "load_s": float(re.search(r"model loaded in ([\d.]+) s", summary).group(1)),
        "decode_ms": float(re.search(r"decode ([\d.]+) ms/step", summary).group(1)),
        "parameter_bytes": numbers(shares.group(1)),
        "unsharded_bytes": int(shares.group(2).replace(",", "")),
        "peak_rss_bytes": numbers(peaks.group(1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    arguments = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder), arguments)
        print(f"{describe_shape(arguments)}, float32, "
              f"{arguments.new_tokens} new tokens, batch 1; {arguments.runs} runs per world size, interleaved")
        runs = {1: [], 2: []}
        for _ in range(arguments.runs):
            for world_size in runs:
                runs[world_size].append(run_once(Path(folder), world_size, arguments.new_tokens))

    gib = 2**30
    print(f"{'world':>5} {'load s':>8} {'decode ms/token':>16} {'params GiB/rank':>16} {'x unsharded':>12} "
          f"{'peak RSS GiB/rank':>18}")
    for world_size, samples in runs.items():
        last = samples[-1]
        print(f"{world_size:>5} {statistics.median(s['load_s'] for s in samples):>8.2f} "
              f"{statistics.median(s['decode_ms'] for s in samples):>16.2f} "
              f"{' / '.join(f'{b / gib:.2f}' for b in last['parameter_bytes']):>16} "
              f"{max(last['parameter_bytes']) / last['unsharded_bytes']:>11.2f}x "
              f"{' / '.join(f'{b / gib:.2f}' for b in last['peak_rss_bytes']):>18}")


if __name__ == "__main__":
    main()
