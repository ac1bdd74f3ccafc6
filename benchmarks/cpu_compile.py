"""What compiling the decode step costs on the CPU, what it saves per step, and so after how many steps it pays.

The dataset workload of dataset_throughput.py (a random Llama, --layers / --hidden; prompts of 3 to 40 words,
sampled completions of about --mean-length tokens, batch --batch-size), in three kinds of process, interleaved
round by round, medians:

    eager      --no-graphs
    cold       --graphs, inductor's cache empty (a folder of its own, made for the run): the first run of a model
    warm       --graphs, the cache the cold run filled: every later run of the same model and shapes

Each process loads the model, runs the whole dataset once to warm up (the compile of every slot shape the run meets
happens there: the slots grow with the longest prompt met) and then once more on the clock. Printed: the capture
seconds, decode ms per step (the decode steps' own clock), the job's kept tokens per second, and where compiling pays:
capture seconds / ms saved per step.

    python benchmarks/cpu_compile.py                    # 4 layers, hidden 256, 1 thread, 3 rounds
    python benchmarks/cpu_compile.py --layers 8 --hidden 512 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = ("eager", "cold", "warm")


def run_worker(folder: Path, graphs: bool, batch_size: int, max_new_tokens: int) -> dict:
    import time

    import accelgen
    from accelgen.generation.stats import GenerationStats

    prompts = json.loads((folder / "prompts.json").read_text())
    generator = accelgen.load(str(folder), device="cpu", dtype="float32", batch_size=batch_size,
                              max_new_tokens=max_new_tokens, do_sample=True, seed=0, graphs=graphs)
    generator.generate(prompts)
    capture_seconds = generator.stats.capture_seconds
    generator.stats = generator.runner.stats = GenerationStats()
    started = time.perf_counter()
    completions = generator.generate(prompts)
    seconds = time.perf_counter() - started
    stats = generator.stats
    return {"capture_seconds": capture_seconds, "step_ms": 1000 * stats.decode_seconds / stats.decode_steps,
            "steps": stats.decode_steps, "tokens_per_second": sum(len(c.completion_token_ids) for c in completions) / seconds}


def measure(kind: str, folder: Path, cache: Path, arguments) -> dict:
    if kind == "cold" and cache.exists():
        import shutil

        shutil.rmtree(cache)
    environment = dict(os.environ, OMP_NUM_THREADS=str(arguments.threads), TORCHINDUCTOR_CACHE_DIR=str(cache),
                       TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--folder", str(folder),
               "--batch-size", str(arguments.batch_size), "--max-new-tokens", str(arguments.max_new_tokens)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{kind} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--mean-length", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(run_worker(Path(arguments.folder), arguments.worker != "eager", arguments.batch_size,
                                    arguments.max_new_tokens)))
        return
    from dataset_throughput import build_workload

    with tempfile.TemporaryDirectory() as scratch:
        folder, cache = Path(scratch) / "model", Path(scratch) / "inductor-cache"
        workload = argparse.Namespace(hidden=arguments.hidden, layers=arguments.layers, heads=arguments.heads,
                                      workload="varied", mean_length=arguments.mean_length, prompts=arguments.prompts,
                                      prefix_tokens=0, long_tokens=0)
        prompts_of, _ = build_workload(workload, folder)
        (folder / "prompts.json").write_text(json.dumps(prompts_of(0)))
        runs = {kind: [] for kind in KINDS}
        for _ in range(arguments.rounds):
            for kind in KINDS:
                runs[kind].append(measure(kind, folder, cache, arguments))
    median = {kind: {field: statistics.median(run[field] for run in rows) for field in rows[0]} for kind, rows in runs.items()}
    print(f"\n{arguments.layers} layers, hidden {arguments.hidden}, batch {arguments.batch_size}, "
          f"{arguments.threads} thread(s), {arguments.prompts} rows; medians of {arguments.rounds}")
    print("| run | capture s | decode ms/step | kept tokens/s |\n|---|---:|---:|---:|")
    for kind in KINDS:
        row = median[kind]
        print(f"| {kind} | {row['capture_seconds']:.1f} | {row['step_ms']:.2f} | {row['tokens_per_second']:,.0f} |")
    saved = median["eager"]["step_ms"] - statistics.median(median[kind]["step_ms"] for kind in ("cold", "warm"))
    if saved <= 0:
        print("the compiled step saved nothing per step: compiling never pays on this shape")
        return
    for kind in ("cold", "warm"):
        print(f"{kind}: pays after {1000 * median[kind]['capture_seconds'] / saved:,.0f} decode steps "
              f"({saved:.2f} ms saved per step)")


if __name__ == "__main__":
    main()
