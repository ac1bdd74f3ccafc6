"""Weight-only int8 against float32 and bfloat16: decode speed on a 1B-parameter shape, and quality on a text we ship.

Speed (``--part speed``): a random-weight Llama of about 1B parameters (TinyLlama's widths, 16 layers) measured
with ``accelgen bench`` as a user would (greedy, forced new tokens, warm-up run not counted), at batch 1 and 16,
for float32, bfloat16 and int8 weights with bfloat16 activations; contenders interleaved round by round,
medians of the rounds' medians. Decoding reads every weight once per token, so int8 reads half of bfloat16's
bytes; the target is int8 at batch 1 within 0.5x of the faster of float32 and bfloat16.

Quality (``--part quality``): the built-in default model (a BLOOM trained on the King James Bible), and a copy of it
with an output head of its own (the CPU's int8 quantizes such a head too; the default model's is tied), on
``benchmarks/text/psalms.txt``: perplexity in float32, bfloat16 and int8 (bfloat16 activations), and the share
of greedy tokens over 100-token completions of each line's first words that int8 chooses as bfloat16 does
(position by position).

Load (``--part load``): seconds to load the same model from pre-sharded folders written by ``accelgen shard`` in
bfloat16 and with ``--quantize int8`` (target: int8 within 0.6x of bfloat16), from a cold page cache (dropped
before each load: run as root) and a warm one.

Products (``--part products``, not in ``all``): one int8 layer's product with each int8 kernel this machine runs
(``accelgen_cpu.int8_kernels.available_kernels``) against float32's product as a float32 run multiplies (the
plugin's panels where its kernels take them, else ``F.linear``), on the 0.5B model's widths and the dataset model's
(hidden 256, MLP 682, 32,000-token head), float32 rows, 1 thread, from the cache: microseconds, medians of
``--rounds`` x 20 calls (3 where a call takes over 10 ms), kernels interleaved within each round (``columns``, which
the rule never names, left out).

    python benchmarks/int8.py                      # speed, quality and load
    python benchmarks/int8.py --part quality       # seconds
    python benchmarks/int8.py --part speed --rounds 1 --layers 4
    python benchmarks/int8.py --part products --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig

import accelgen
import accelgen.loading.model_files
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
            # each batch size in a load of its own: the CPU lays int8 weights out for the run's batch size
            for (name, options), batch_size in itertools.product(SPEED_CONTENDERS.items(), (1, 16)):
                result = subprocess.run(
                    [sys.executable, "-m", "accelgen.cli", "bench", "--device", "cpu", "--random-weights", "--model-config",
                     str(config), *options, "--batch-sizes", str(batch_size), "--max-new-tokens", str(arguments.new_tokens),
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


def load_time(arguments) -> None:
    """Seconds to load pre-sharded folders (one rank) of the same random model written by ``accelgen shard`` in
    bfloat16 and with --quantize int8 (:data:`TIMED_LOAD`); interleaved, medians; each load from a cold page
    cache (dropped: needs root), then again warm."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(dir=arguments.scratch) as scratch:
        original = Path(scratch, "original")
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=arguments.layers,
                             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(original)
        accelgen.loading.model_files.load_tokenizer(str(DEFAULT_MODEL)).save_pretrained(original)
        folders = {"bfloat16": (Path(scratch, "bf16"), []), "int8": (Path(scratch, "int8"), ["--quantize", "int8"])}
        for folder, options in folders.values():
            subprocess.run([sys.executable, "-m", "accelgen.cli", "shard", "--device", "cpu", "--model", str(original),
                            "--world-size", "1", "--dtype", "bfloat16", *options, "--output", str(folder)],
                           check=True, capture_output=True)
        seconds: dict[tuple[str, str], list[float]] = {}
        for _ in range(arguments.rounds):
            for name, (folder, _) in folders.items():
                for cache in ("cold", "warm"):  # dropped first (as after a reboot), then as the cold load left it
                    if cache == "cold":
                        drop_page_cache()
                    result = subprocess.run([sys.executable, "-c", TIMED_LOAD, str(folder), "int8" if name == "int8" else ""],
                                            capture_output=True, text=True, check=True)
                    seconds.setdefault((name, cache), []).append(float(result.stdout.split()[-1]))
    print(f"\nLoading a pre-sharded folder (one rank, {arguments.layers}-layer Llama), median of {arguments.rounds}:")
    for cache in ("cold", "warm"):
        bf16, int8 = (statistics.median(seconds[name, cache]) for name in ("bfloat16", "int8"))
        print(f"page cache {cache}: bfloat16 {bf16:.2f} s, int8 {int8:.2f} s ({int8 / bf16:.2f}x; target <= 0.6x)")


#: Seconds ``accelgen.load`` of a folder takes in a fresh process, its modules (torch, transformers' model code)
#: imported first: a run's "model loaded in" also holds a second or so of imports, the same for every folder.
TIMED_LOAD = """
import sys, time
from accelgen.session.api import load_request
from accelgen.session.request import build_request
import transformers.models.llama.modeling_llama
request = build_request(sys.argv[1], device="cpu", dtype="bfloat16", quantize=sys.argv[2] or None)
started = time.perf_counter()
load_request(request)
print(time.perf_counter() - started)
"""


def drop_page_cache() -> None:
    """Empty the kernel's page cache, so the next load reads its files from the disk (needs root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as error:
        sys.exit(f"cannot drop the page cache ({error}): run the load part as root")


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


def perplexity_token_by_token(generator, lines: list[str]) -> float:
    """The same, with the model fed one token per forward pass (a key/value cache between them), as batch-1
    decoding runs it: on the CPU, int8 layers then quantize their one input row too (``int8_product_on_cpu``)."""
    from transformers import DynamicCache

    total, count = 0.0, 0
    for line in lines:
        ids = generator.tokenizer(line)["input_ids"]
        cache = DynamicCache()
        with torch.no_grad():
            for position in range(len(ids) - 1):
                logits = generator.model(torch.tensor([[ids[position]]]), past_key_values=cache, use_cache=True).logits
                total -= torch.log_softmax(logits[0, -1].float(), -1)[ids[position + 1]].item()
        count += len(ids) - 1
    return math.exp(total / count)


def quality(arguments) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        quality_of(DEFAULT_MODEL, "The default model")
        quality_of(untied_copy(Path(scratch)), "The default model with an output head of its own (int8 quantizes it)")


def untied_copy(folder: Path) -> Path:
    """The default model saved with its output head untied from the input embedding (the same values, a weight of
    its own): as in most larger models, where the CPU's int8 quantizes the head too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.get_output_embeddings().weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(folder)
    accelgen.loading.model_files.load_tokenizer(str(DEFAULT_MODEL)).save_pretrained(folder)
    return folder


def quality_of(folder: Path, title: str) -> None:
    lines = [line.strip() for line in TEXT.read_text().splitlines() if len(line.split()) >= 6]
    prompts = [" ".join(line.split()[:4]) for line in lines]
    results, stepwise, tokens = {}, {}, {}
    for name, settings in QUALITY_CONTENDERS.items():
        generator = accelgen.load(str(folder), device="cpu", max_new_tokens=100, ignore_eos=True,
                                  batch_size=8, **settings)
        results[name] = perplexity(generator, lines)
        stepwise[name] = perplexity_token_by_token(generator, lines)
        tokens[name] = [completion.completion_token_ids for completion in generator.generate(prompts)]
    total = sum(len(row) for row in tokens["bfloat16"])

    def agreement(name: str) -> int:
        return sum(a == b for ours, theirs in zip(tokens[name], tokens["bfloat16"]) for a, b in zip(ours, theirs))

    print(f"\n{title} on {TEXT.name} ({len(lines)} lines); greedy 100-token completions of {len(prompts)} "
          f"prompts (each line's first 4 words):\n")
    print("| weights | perplexity | vs bfloat16 | one token per pass | vs bfloat16 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} | {100 * (value / results['bfloat16'] - 1):+.2f}% | {stepwise[name]:.3f} | "
              f"{100 * (stepwise[name] / stepwise['bfloat16'] - 1):+.2f}% |")
    for name in ("int8", "float32"):
        print(f"{name} chose bfloat16's greedy token at {agreement(name)} of {total} positions "
              f"({100 * agreement(name) / total:.1f}%)")


#: (rows, inputs, outputs) of the products part: batch-1 decode and batch 16 on the 0.5B model's widths; the dataset
#: model's layers at 16 rows (a decode step), 64 and 155 (prefills' packed tokens)
PRODUCT_CASES = ((1, 2048, 5632), (1, 5632, 2048), (16, 2048, 5632), (16, 256, 682), (16, 682, 256), (16, 256, 256),
                 (16, 256, 32000), (64, 256, 682), (155, 256, 682))


def products(arguments) -> None:
    import time

    from accelgen.quantization.int8_layer import Int8Linear, quantize_rows
    from accelgen_cpu.int8_kernels import available_kernels, int8_product_on_cpu, use_int8_kernel
    from accelgen_cpu.native_kernels import native_operator
    from accelgen_cpu.packed_linear import pack_float_panels

    torch.set_num_threads(1)
    torch.manual_seed(0)
    panels_product = native_operator("float_panels_linear")
    kernels = tuple(kernel for kernel in available_kernels() if kernel != "columns")  # the rule never names it
    float_name = "float32 panels" if panels_product is not None else "float32 F.linear"
    print(f"| rows, in x out | {' | '.join(kernels)} | {float_name} |\n|---|" + "---:|" * (len(kernels) + 1))
    for rows, inputs, outputs in PRODUCT_CASES:
        weight, x = torch.randn(outputs, inputs), torch.randn(rows, inputs)
        values, scales = quantize_rows(weight)
        calls = {}
        for kernel in kernels:
            if kernel != "fused" and inputs % 16:
                continue  # _int_mm and oneDNN take rows of a multiple of 16 values: such a layer runs the plain product
            layer = Int8Linear(values.clone(), scales, None, int8_product_on_cpu)
            use_int8_kernel(layer, kernel)
            calls[kernel] = lambda layer=layer, x=x: layer(x)
        if panels_product is not None:
            panels = pack_float_panels(weight)
            calls[float_name] = lambda x=x, panels=panels, outputs=outputs: panels_product(x, panels, outputs, None)
        else:
            calls[float_name] = lambda x=x, weight=weight: torch.nn.functional.linear(x, weight)
        timings: dict[str, list[float]] = {name: [] for name in calls}
        with torch.no_grad():
            for _ in range(arguments.rounds):
                for name, call in calls.items():
                    started = time.perf_counter()
                    call()
                    repeats = 20 if time.perf_counter() - started < 0.01 else 3  # torch's _int_mm takes seconds here
                    started = time.perf_counter()
                    for _ in range(repeats):
                        call()
                    timings[name].append((time.perf_counter() - started) / repeats * 1e6)
        medians = {name: statistics.median(values) for name, values in timings.items()}
        best = min(medians.values())
        cells = [medians.get(name) for name in (*kernels, float_name)]
        print(f"| {rows}, {inputs}x{outputs} | " + " | ".join(
            "-" if cell is None else f"**{cell:,.0f}**" if cell == best else f"{cell:,.0f}" for cell in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["speed", "quality", "load", "products", "all"], default="all")
    parser.add_argument("--scratch", help="folder for the load part's checkpoints (default: the system's temporary folder)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    arguments = parser.parse_args()
    if arguments.part in ("quality", "all"):
        quality(arguments)
    if arguments.part in ("load", "all"):
        load_time(arguments)
    if arguments.part in ("speed", "all"):
        speed(arguments)
    if arguments.part == "products":
        products(arguments)


if __name__ == "__main__":
    main()
