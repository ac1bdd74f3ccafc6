"""Per-token decode latency: accelgen's static-shape pipeline against Hugging Face ``generate()``.

Same model (random weights, BLOOM-560m shape by default), same prompt, same number of new tokens,
side by side in one process, runs interleaved so machine noise hits both alike. Per-token latency
is measured the same way for every contender, from the outside:

    (time to generate N tokens - time to generate 1 token) / (N - 1)

so prefill cost cancels out. Run on an otherwise idle machine:

    python benchmarks/decode_latency.py                      # BLOOM-560m shape, 64 tokens, batch 1
    python benchmarks/decode_latency.py --graphs             # also accelgen with the compiled step
    python benchmarks/decode_latency.py --layers 4 --hidden 256 --vocab 4096   # quick look
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from random_bloom import add_shape_arguments, describe_shape, random_bloom

from accelgen.common.settings import RunSettings, World
from accelgen.generation.generator import Generator
from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer
from accelgen.model.loaded_model import LoadedModel
from accelgen.model.memory import parameter_bytes
from accelgen.plugin.manager import get_plugin_manager
from accelgen.plugin.registry import select_accelerator

PROMPT = "DeepSpeed is a machine learning framework"


def time_call(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def hugging_face_runner(model, input_ids):
    model.generation_config.eos_token_id = None  # never stop early: exactly N tokens, no extra processors
    model.generation_config.pad_token_id = 0

    def generate(new_tokens: int) -> None:
        with torch.no_grad():
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                           min_new_tokens=None, do_sample=False)

    return generate


def accelgen_runner(model, tokenizer, input_ids, arguments, use_graphs: bool):
    accelerator = select_accelerator(get_plugin_manager(), "cpu")
    generators = {}

    def generate(new_tokens: int) -> None:
        if new_tokens not in generators:  # one generator (and captured graph) per token count, as a user keeps
            run = RunSettings(dtype=arguments.dtype, max_new_tokens=new_tokens, ignore_eos=True, use_graphs=use_graphs,
                              batching="static")
            generators[new_tokens] = Generator(LoadedModel(model, tokenizer, accelerator, torch.device("cpu"), World(), parameter_bytes(model)), run)
        with torch.no_grad():
            generators[new_tokens].generate_token_ids([input_ids[0].tolist()])

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--graphs", action="store_true", help="also time accelgen with the torch.compile'd step")
    arguments = parser.parse_args()

    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    model = random_bloom(arguments).to(getattr(torch, arguments.dtype))
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    contenders = {
        "hf_generate": hugging_face_runner(model, input_ids),
        "accelgen": accelgen_runner(model, tokenizer, input_ids, arguments, use_graphs=False),
    }
    if arguments.graphs:
        contenders["accelgen_graphs"] = accelgen_runner(model, tokenizer, input_ids, arguments, use_graphs=True)

    parameters = sum(parameter.numel() for parameter in model.parameters())
    print(f"model: {describe_shape(arguments)}, {parameters / 1e6:.0f}M parameters, {arguments.dtype}; prompt {input_ids.shape[1]} tokens, "
          f"{arguments.new_tokens} new tokens, batch 1, {torch.get_num_threads()} threads")
    warmup_seconds = {}
    for name, generate in contenders.items():  # warm-up (and graph capture) not counted
        warmup_seconds[name] = time_call(lambda generate=generate: (generate(1), generate(arguments.new_tokens)))

    per_token = {name: [] for name in contenders}
    for _ in range(arguments.runs):
        for name, generate in contenders.items():
            one = time_call(lambda generate=generate: generate(1))
            many = time_call(lambda generate=generate: generate(arguments.new_tokens))
            per_token[name].append((many - one) / (arguments.new_tokens - 1))

    baseline = statistics.median(per_token["hf_generate"])
    print(f"{'contender':<16} {'ms/token (median)':>18} {'min':>8} {'max':>8} {'vs HF':>7} {'warm-up s':>10}")
    for name, samples in per_token.items():
        median = statistics.median(samples)
        print(f"{name:<16} {1000 * median:>18.2f} {1000 * min(samples):>8.2f} {1000 * max(samples):>8.2f} "
              f"{median / baseline:>6.2f}x {warmup_seconds[name]:>10.1f}")


if __name__ == "__main__":
    main()
