"""Dataset completion rows/s with one model copy against two (``--data-parallel 2``), one thread per process.

The workload is dataset_throughput.py's (random-weight Llama, prompts of 3 to 40 words, sampled completions
whose lengths spread geometrically around ``--mean-length``), written as a JSON-lines dataset and completed
with ``accelgen run`` exactly as a user would. Every process runs one thread (OMP_NUM_THREADS=1), so on a
machine of 2 cores two processes can at best do twice the work of one. Contenders, interleaved round by
round (machine noise hits all alike), medians reported:

    one_process      --world-size 1                       one copy, one thread
    tensor_parallel  --world-size 2                       one copy split over 2 ranks (R = 1)
    data_parallel    --world-size 2 --data-parallel 2     two copies, each on its own rows (R = 2)

rows/s is rows over the run's generation seconds (loading excluded: the summary's "in T s"); the ideal of
data_parallel is twice one_process. Every contender writes the same text (same seed): checked.

    python benchmarks/data_parallel.py                     # 128 prompts, batch 8, 64-token cap, 3 rounds
    python benchmarks/data_parallel.py --prompts 32 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dataset_throughput import build_workload, output_rows

CONTENDERS = {
    "one_process": ["--world-size", "1"],
    "tensor_parallel": ["--world-size", "2"],
    "data_parallel": ["--world-size", "2", "--data-parallel", "2"],
}


def run_once(folder: Path, dataset: Path, output: Path, arguments, contender: str) -> tuple[float, list[list[int]]]:
    """rows/s of one ``accelgen run``, and the token ids it wrote."""
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", *CONTENDERS[contender], "--model", str(folder),
         "--dataset", str(dataset), "--batch-size", str(arguments.batch_size), "--max-new-tokens",
         str(arguments.max_new_tokens), "--do-sample", "--seed", "0", "--output", str(output), "--overwrite", "--quiet"],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
    )
    if result.returncode:
        sys.exit(f"{contender} failed:\n{result.stderr}")
    seconds = float(re.search(r"new tokens in ([\d.]+) s", result.stderr)[1])
    rows = [row["completion_token_ids"] for row in output_rows(output)]
    return len(rows) / seconds, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mean-length", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.set_defaults(workload="varied")  # dataset_throughput's default workload
    arguments = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        folder, dataset, output = Path(scratch, "model"), Path(scratch, "rows.jsonl"), Path(scratch, "out.jsonl")
        prompts_of, _ = build_workload(arguments, folder)
        prompts = prompts_of(0)
        dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in prompts))
        rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        texts = {}
        for round_number in range(arguments.rounds):
            for contender in CONTENDERS:
                rate, texts[contender] = run_once(folder, dataset, output, arguments, contender)
                rates[contender].append(rate)
                print(f"round {round_number + 1}: {contender:<16} {rate:7.2f} rows/s", file=sys.stderr, flush=True)
    same = all(rows == texts["one_process"] for rows in texts.values())
    print(f"\n{arguments.prompts} prompts, batch {arguments.batch_size}, max {arguments.max_new_tokens} new tokens "
          f"(mean length {arguments.mean_length}), Llama {arguments.layers} layers x {arguments.hidden}, one thread per "
          f"process, {os.cpu_count()} cores; every contender wrote the same rows: {same}\n")
    base = statistics.median(rates["one_process"])
    print("| contender | rows/s (median) | vs one process | ideal |")
    print("| --- | ---: | ---: | ---: |")
    for contender, values in rates.items():
        ideal = {"one_process": "1.00x", "tensor_parallel": "-", "data_parallel": "2.00x"}[contender]
        median = statistics.median(values)
        print(f"| {contender} | {median:.2f} | {median / base:.2f}x | {ideal} |")


if __name__ == "__main__":
    main()
