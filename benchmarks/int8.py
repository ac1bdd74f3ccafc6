"""Weight-only int8 against float32 and bfloat16: decode speed on a 1B-parameter shape, and quality on a text we ship.

Speed (``--part speed``): a random-weight Llama of about 1B parameters (TinyLlama's widths, 16 layers) measured
with ``accelgen bench`` as a user would (greedy, forced new tokens, warm-up run not counted), at batch 1 and 16,
for float32, bfloat16 and int8 weights with bfloat16 activations; contenders interleaved round by round,
medians of the rounds' medians. Decoding reads every weight once per token, so int8 reads half of bfloat16's
bytes; the target is int8 at batch 1 within 0.5x of the faster of float32 and bfloat16.

Quality (``--part quality``): the built-in default model (a BLOOM trained on the King James Bible) on
``benchmarks/text/psalms.txt``: perplexity in float32, bfloat16 and int8 (bfloat16 activations), and the share
of greedy tokens over 100-token completions of each line's first words that int8 chooses as bfloat16 does
(position by position).

    python benchmarks/int8.py                      # both parts
    python benchmarks/int8.py --part quality       # seconds
    python benchmarks/int8.py --part speed --rounds 1 --layers 4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig

import accelgen
from accelgen.loading.model_files import DEFAULT_MODEL

TEXT = Path(__file__).parent / "text" / "psalms.txt"
SPEED_CONTENDERS = {"float32": ["--dtype", "float32"], "bfloat16": ["--dtype", "bfloat16"],
                    "int8": ["--dtype", "bfloat16", "--quantize", "int8"]}
QUALITY_CONTENDERS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
                      "int8": dict(dtype="bfloat16", quantize="int8")}


def speed(arguments) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch, "config.json")
        LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=arguments.layers,
                    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048).to_json_file(config)
        figures: dict[tuple[str, int], list[float]] = {}
        parameters = None
        for round_number in range(arguments.rounds):
            for name, options in SPEED_CONTENDERS.items():
                result = subprocess.run(
                    [sys.executable, "-m", "accelgen.cli", "bench", "--device", "cpu", "--random-weights", "--model-config",
                     str(config), *options, "--batch-sizes", "1,16", "--max-new-tokens", str(arguments.new_tokens),
                     "--runs", "3", "--json"], capture_output=True, text=True)
                if result.returncode:
                    sys.exit(f"{name} failed:\n{result.stderr}")
                [record] = json.loads(result.stdout)["measurements"]
                parameters = record["model"]["parameters"]
                for row in record["results"]:
                    value = row["decode_ms_per_token"]["median"]
                    figures.setdefault((name, row["batch_size"]), []).append(value)
                    print(f"round {round_number + 1}: {name:<9} batch {row['batch_size']:>2}: {value:8.2f} ms/token "
                          f"(parameter bytes per rank {record['model']['parameter_bytes_per_rank']:,})",
                          file=sys.stderr, flush=True)
    print(f"\nDecode ms/token, Llama {parameters / 1e9:.2f}B parameters ({arguments.layers} layers x 2048), "
          f"{arguments.new_tokens} new tokens, median of {arguments.rounds} round(s):\n")
    print("| weights | batch 1 | batch 16 |")
    print("| --- | ---: | ---: |")
    for name in SPEED_CONTENDERS:
        print(f"| {name} | {statistics.median(figures[name, 1]):.1f} | {statistics.median(figures[name, 16]):.1f} |")
    fastest = min(statistics.median(figures[name, 1]) for name in ("float32", "bfloat16"))
    print(f"\nint8 at batch 1 / the faster of float32 and bfloat16: {statistics.median(figures['int8', 1]) / fastest:.2f}x "
          f"(target <= 0.5x)")


def perplexity(generator, lines: list[str]) -> float:
    """exp of the mean negative log-likelihood of every token after the first, line by line."""
    total, count = 0.0, 0
    for line in lines:
        ids = torch.tensor([generator.tokenizer(line)["input_ids"]])
        with torch.no_grad():
            logits = generator.model(ids).logits.float()
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        total, count = total + losses.item(), count + ids.shape[1] - 1
    return math.exp(total / count)


def quality(arguments) -> None:
    lines = [line.strip() for line in TEXT.read_text().splitlines() if len(line.split()) >= 6]
    prompts = [" ".join(line.split()[:4]) for line in lines]
    results, tokens = {}, {}
    for name, settings in QUALITY_CONTENDERS.items():
        generator = accelgen.load(str(DEFAULT_MODEL), device="cpu", max_new_tokens=100, ignore_eos=True,
                                  batch_size=8, **settings)
        results[name] = perplexity(generator, lines)
        tokens[name] = [completion.completion_token_ids for completion in generator.generate(prompts)]
    total = sum(len(row) for row in tokens["bfloat16"])

    def agreement(name: str) -> int:
        return sum(a == b for ours, theirs in zip(tokens[name], tokens["bfloat16"]) for a, b in zip(ours, theirs))

    print(f"\nThe default model on {TEXT.name} ({len(lines)} lines); greedy 100-token completions of {len(prompts)} "
          f"prompts (each line's first 4 words):\n")
    print("| weights | perplexity | vs bfloat16 |")
    print("| --- | ---: | ---: |")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} | {100 * (value / results['bfloat16'] - 1):+.2f}% |")
    for name in ("int8", "float32"):
        print(f"{name} chose bfloat16's greedy token at {agreement(name)} of {total} positions "
              f"({100 * agreement(name) / total:.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["speed", "quality", "both"], default="both")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    arguments = parser.parse_args()
    if arguments.part in ("quality", "both"):
        quality(arguments)
    if arguments.part in ("speed", "both"):
        speed(arguments)


if __name__ == "__main__":
    main()
