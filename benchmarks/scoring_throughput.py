"""Scoring rows: ``accelgen score`` against Hugging Face's batched forward, each token's log-probability of every row.

    A  accelgen score --dataset rows.jsonl --output a.jsonl --batch-size B --quiet      (a process of its own)
    B  a Python script: AutoModelForCausalLM, batches of B rows padded to their longest, ``model(...).logits``,
       ``log_softmax`` in float32, the log-probability of each next token gathered; one JSON line per row
       (the way a user scores rows with transformers; lm-evaluation-harness's ``hf`` model does the same per batch)

Both on one thread (``OMP_NUM_THREADS=1``), float32, the same model: a random-weight Llama-shaped model (hidden 256,
4 layers, a vocabulary of 32,000, the built-in model's tokenizer) written by the script, and the same ``--rows`` rows of
text whose lengths follow a long-tailed law (most short, some of several hundred tokens, as prompts of a real dataset
are). Each contender is timed from its start to its exit (the user's clock: imports, loading, writing included);
they alternate A, B, A, B... for ``--rounds`` rounds, medians reported, ratio of rows/s. The warm figures (a loaded
model, the rows scored in the process) are measured the same way, interleaved, beside them. Every row's sum of
log-probabilities must agree between A and B within 1e-3 (else the script fails).

``--sorted`` also times B with its rows sorted by length first (fewer padded positions: what lm-evaluation-harness
does), reported as a third contender.

    python benchmarks/scoring_throughput.py                        # 1,000 rows, batch 8, 3 rounds
    python benchmarks/scoring_throughput.py --rows 50 --rounds 1   # a check that it works
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the river city light morning engine paper garden winter market window story music number silver forest "
         "question machine answer travel letter mountain kitchen village summer friend history island doctor bridge "
         "always quickly never slowly often under over between across before after because while though").split()

HUGGING_FACE = r'''
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, rows_path, output, batch_size, in_order = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
texts = [json.loads(line)["text"] for line in open(rows_path)]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
order = list(range(len(texts))) if in_order == "given" else sorted(range(len(texts)), key=lambda i: -len(texts[i]))
sums = {}
with torch.no_grad():
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        encoded = tokenizer([texts[i] for i in batch], return_tensors="pt", padding=True)
        logits = model(**encoded).logits[:, :-1].float()
        targets = encoded["input_ids"][:, 1:]
        logprobs = torch.log_softmax(logits, -1).gather(2, targets[..., None])[..., 0] * encoded["attention_mask"][:, 1:]
        for place, i in enumerate(batch):
            sums[i] = logprobs[place].sum().item()
with open(output, "w") as file:
    for i in range(len(texts)):
        file.write(json.dumps({"index": i, "prompt_logprob": sums[i]}) + "\n")
'''


def build_model(folder: Path) -> None:
    """A random-weight Llama-shaped model (float32) with the built-in model's tokenizer (right padding)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32_000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "core" / "default_model")
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(folder)


def write_rows(path: Path, rows: int) -> None:
    """``rows`` JSON lines of text, each of a long-tailed number of words (lognormal: median 40, a few near 600)."""
    draw = random.Random(0)
    with path.open("w") as file:
        for _ in range(rows):
            words = min(600, max(3, int(draw.lognormvariate(3.7, 0.9))))
            file.write(json.dumps({"text": " ".join(draw.choice(WORDS) for _ in range(words))}) + "\n")


def timed(command: list[str], environment: dict) -> float:
    started = time.perf_counter()
    subprocess.run(command, env=environment, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def sums_of(path: Path) -> list[float]:
    return [json.loads(line)["prompt_logprob"] for line in path.read_text().splitlines()]


def warm_figures(folder: Path, rows_path: Path, batch_size: int, rounds: int) -> dict[str, float]:
    """Seconds to score the rows with a loaded model, each contender ``rounds`` times, interleaved (medians)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import accelgen

    torch.set_num_threads(1)
    texts = [json.loads(line)["text"] for line in rows_path.read_text().splitlines()]
    generator = accelgen.load(str(folder), device="cpu", dtype="float32", batch_size=batch_size)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def hugging_face() -> None:
        with torch.no_grad():
            for first in range(0, len(texts), batch_size):
                encoded = tokenizer(texts[first:first + batch_size], return_tensors="pt", padding=True)
                logits = model(**encoded).logits[:, :-1].float()
                torch.log_softmax(logits, -1).gather(2, encoded["input_ids"][:, 1:, None])

    seconds: dict[str, list[float]] = {"accelgen": [], "hugging_face": []}
    for _ in range(rounds):
        for name, run in (("accelgen", lambda: generator.score(texts)), ("hugging_face", hugging_face)):
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sorted", action="store_true", help="also time Hugging Face with its rows sorted by length")
    arguments = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    environment = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    work = Path(tempfile.mkdtemp(prefix="scoring-bench-"))
    try:
        folder, rows_path = work / "model", work / "rows.jsonl"
        build_model(folder)
        write_rows(rows_path, arguments.rows)
        script = work / "hugging_face.py"
        script.write_text(HUGGING_FACE)
        batch = str(arguments.batch_size)
        contenders = {
            "accelgen score": [sys.executable, "-m", "accelgen.cli", "score", "--device", "cpu", "--dtype", "float32",
                               "--model", str(folder), "--dataset", str(rows_path), "--output", str(work / "a.jsonl"),
                               "--batch-size", batch, "--quiet", "--overwrite"],
            "Hugging Face, batched forward": [sys.executable, str(script), str(folder), str(rows_path),
                                              str(work / "b.jsonl"), batch, "given"],
        }
        if arguments.sorted:
            contenders["Hugging Face, rows sorted by length"] = [sys.executable, str(script), str(folder), str(rows_path),
                                                                 str(work / "c.jsonl"), batch, "sorted"]
        seconds: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(arguments.rounds):
            for name, command in contenders.items():
                seconds[name].append(timed(command, environment))
        ours, theirs = sums_of(work / "a.jsonl"), sums_of(work / "b.jsonl")
        worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
        if worst > 1e-3:
            sys.exit(f"the scores differ: by up to {worst} between accelgen and Hugging Face")
        warm = warm_figures(folder, rows_path, arguments.batch_size, arguments.rounds)
        tokens = sum(len(json.loads(line)["text"].split()) for line in rows_path.read_text().splitlines())
        baseline = statistics.median(seconds["accelgen score"])
        print(f"{arguments.rows} rows ({tokens:,} words), batch {arguments.batch_size}, 1 thread, float32, "
              f"{arguments.rounds} rounds interleaved (medians); scores agree within {worst:.1e}\n")
        print("| contender | user's clock (s) | rows/s | accelgen's speed-up |")
        print("| --- | ---: | ---: | ---: |")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"| {name} | {median:.1f} | {arguments.rows / median:.1f} | {median / baseline:.2f}x |")
        print(f"\nwarm (model loaded, rows scored in the process): accelgen {warm['accelgen']:.1f} s, Hugging Face "
              f"{warm['hugging_face']:.1f} s: {warm['hugging_face'] / warm['accelgen']:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
