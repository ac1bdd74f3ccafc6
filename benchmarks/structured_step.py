"""What structured output adds to one decode step, on ``dataset_throughput.py``'s model (random Llama, 4 layers x 256,
the built-in 4,096-token tokenizer): 16 slots, every row decoding all ``--max-new-tokens`` tokens (``--ignore-eos``, as
``accelgen bench`` runs), sampled, three contenders in one process, interleaved round by round, medians:

    plain        a run without structure: its steps take no mask (what every run did before structured output)
    open_mask    a run set for rows with structures, given none: every step applies a mask allowing every token,
                 and the host follows no row (what a row without a structure pays beside rows with one)
    schemas      every row held to one of the four extraction schemas (row n: schema n % 4): the mask applied, the
                 host following every row's tokens and filling its next mask at every step (a row whose grammar is
                 complete goes on under its end-only mask)

    python benchmarks/structured_step.py
    python benchmarks/structured_step.py --graphs    # the compiled decode step (inductor, on the CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path

import torch
from dataset_throughput import build_workload, structured_rows

import accelgen
from accelgen.generation.generator import Generator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--graphs", action="store_true")
    arguments = parser.parse_args()
    workload = argparse.Namespace(hidden=256, layers=4, heads=8, workload="varied", mean_length=40, prompts=16,
                                  prefix_tokens=0, long_tokens=0)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        prompts = build_workload(workload, folder)[0](0)
        plain = accelgen.load(str(folder), device="cpu", batch_size=16, max_new_tokens=arguments.max_new_tokens,
                              do_sample=True, ignore_eos=True, graphs=arguments.graphs)
        set_for_rows = Generator(plain.loaded, dataclasses.replace(plain.run, structured_rows=True))
        contenders = {"plain": (plain, prompts), "open_mask": (set_for_rows, prompts),
                      "schemas": (set_for_rows, structured_rows(prompts))}
        figures = {name: [] for name in contenders}
        for round_number in range(arguments.rounds + 1):  # the first warms up (and compiles)
            for name, (generator, rows) in contenders.items():
                stats = generator.stats
                before = (stats.decode_seconds, stats.decode_steps, stats.mask_seconds)
                generator.generate(rows)
                seconds, steps, mask_seconds = (now - then for now, then in zip(
                    (stats.decode_seconds, stats.decode_steps, stats.mask_seconds), before))
                if round_number:
                    figures[name].append((1000 * seconds / steps, mask_seconds / seconds))
    print(f"16 slots, {arguments.max_new_tokens} new tokens each, sampled, Llama 4 x 256, vocabulary 4,096, "
          f"{'compiled' if arguments.graphs else 'eager'} step, {torch.get_num_threads()} thread(s); medians of "
          f"{arguments.rounds} rounds")
    print("| contender | decode step ms | vs plain | host's mask work, share of decode time |")
    print("|---|---:|---:|---:|")
    base = statistics.median(step for step, _ in figures["plain"])
    for name, rounds in figures.items():
        step = statistics.median(one for one, _ in rounds)
        share = statistics.median(one for _, one in rounds)
        print(f"| {name} | {step:.2f} | {step / base:.2f}x | {100 * share:.1f}% |")


if __name__ == "__main__":
    main()
