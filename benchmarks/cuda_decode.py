"""Decode speed on one NVIDIA GPU against the memory-bandwidth roofline, the contenders side by side, in one process.

The published BLOOMZ protocol: a BLOOMZ-7b1-shaped model (30 layers, hidden 4096, 32 heads, vocab
250880) with random weights in bfloat16, built directly on the device; the prompt "DeepSpeed is a machine
learning framework" repeated to fill the batch; greedy; 100 new tokens forced (no early EOS); batch
sizes 1, 8, 32, 128; warm-up runs (and any compilation or graph capture) not counted, then N timed runs.

Contenders (one model, shared; each contender's graphs and compiled code are dropped before the next runs):
    hf_eager           Hugging Face generate(), dynamic cache, eager
    hf_static          generate(cache_implementation="static"): Hugging Face's documented route, which on a GPU
                       compiles the forward pass itself (torch.compile, CUDA graphs)
    accelgen_graphs    accelgen's Generator on the device's accelerator: static cache, the whole decode step
                       (forward, token choice, bookkeeping) captured as one graph
    accelgen_compiled  the same, the step compiled by inductor inside the graph (ACCELGEN_CUDA_COMPILE=1; cuda only)

Per contender and batch size:
    ms/token     per decode step (the whole batch), (t(N tokens) - t(1 token)) / (N - 1), median of runs
    e2e s        time to generate N tokens, median
    tokens/s     batch * N / e2e
    % roofline   (bytes a step must read / bandwidth) / (ms/token): the weights, and the keys and values of the
                 positions each row attends to (the prompt and, on average, half the new tokens); against the
                 copy bandwidth measured here (a large device-to-device copy) and against the datasheet peak
A cell that runs out of device memory shows "oom"; one that fails otherwise shows "failed" (its traceback
goes to stderr); the others go on.

    python benchmarks/cuda_decode.py                         # the protocol (7.07B parameters, 14.1 GB of weights)
    python benchmarks/cuda_decode.py --small --runs 2        # smoke test of the script, seconds
    python benchmarks/cuda_decode.py --small --device cpu --batch-sizes 1,2 --contenders hf_eager,accelgen_graphs

The tokenizer is accelgen's built-in one (the prompt is 18 tokens; BLOOM's own gives 7): decode speed
depends on the cache length only through attention, which is small next to reading the weights.
accelgen's BLOOM ALiBi bias is built from slopes kept on the device (accelgen.model.transformers_adapter.alibi): once the first
accelgen contender has run, Hugging Face's contenders use that too (same values).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import torch
from random_bloom import add_shape_arguments, describe_shape, random_bloom

from accelgen.common.errors import UsageError
from accelgen.common.settings import RunSettings, World
from accelgen.generation.generator import Generator
from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer
from accelgen.model.loaded_model import LoadedModel
from accelgen.model.memory import kv_cache_bytes_per_position, parameter_bytes
from accelgen.plugin.manager import get_plugin_manager
from accelgen.plugin.registry import select_accelerator

PROMPT = "DeepSpeed is a machine learning framework"
SMALL_SHAPE = dict(layers=2, hidden=256, heads=4, vocab=4096)
CONTENDERS = ("hf_eager", "hf_static", "accelgen_graphs", "accelgen_compiled")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, default_shape="bloomz-7b1")
    parser.add_argument("--small", action="store_true", help="a tiny model (2 layers, hidden 256) to smoke-test the script")
    parser.add_argument("--device", default="cuda", help="accelgen device to run on (default cuda; cpu for a smoke test)")
    parser.add_argument("--batch-sizes", default="1,8,32,128", help="comma-separated (default: 1,8,32,128)")
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per contender and batch size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (compilation, capture)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {', '.join(CONTENDERS)}")
    arguments = parser.parse_args(argv)
    if arguments.small:
        vars(arguments).update(SMALL_SHAPE)
    arguments.batch_sizes = [int(size) for size in arguments.batch_sizes.split(",")]
    arguments.contenders = arguments.contenders.split(",")
    unknown = set(arguments.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {', '.join(sorted(unknown))}; choose from {', '.join(CONTENDERS)}")
    if arguments.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (per-token latency is the difference between N and 1 tokens)")
    return arguments


# -- the contenders: each returns generate(new_tokens), which runs one batch to completion -------------


def hugging_face(model, input_ids: torch.Tensor, **generate_options) -> Callable[[int], None]:
    def generate(new_tokens: int) -> None:
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                       do_sample=False, **generate_options)

    return generate


def accelgen_generator(model, tokenizer, input_ids: torch.Tensor, accelerator, device) -> Callable[[int], None]:
    prompts = input_ids.tolist()
    generators = {}

    def generate(new_tokens: int) -> None:
        if new_tokens not in generators:  # one generator (and captured graph) per token count, as a user keeps
            run = RunSettings(dtype="bfloat16", batch_size=len(prompts), max_new_tokens=new_tokens, ignore_eos=True,
                              use_graphs=True, batching="static")
            generators[new_tokens] = Generator(LoadedModel(model, tokenizer, accelerator, device, World(), parameter_bytes(model)), run)
        generators[new_tokens].generate_token_ids(prompts)
        failure = generators[new_tokens].capture_failure
        if failure:
            raise RuntimeError(f"the decode step was not captured: {failure}")

    return generate


def contender(name: str, model, tokenizer, input_ids: torch.Tensor, accelerator, device) -> Callable[[int], None]:
    """generate(new_tokens) of the contender called ``name``, for the batch ``input_ids`` [B, T]."""
    if name == "hf_eager":
        return hugging_face(model, input_ids, disable_compile=True)
    if name == "hf_static":
        return hugging_face(model, input_ids, cache_implementation="static")
    return accelgen_generator(model, tokenizer, input_ids, accelerator, device)


# -- measuring ---------------------------------------------------------------------------------------


def timed(function: Callable[[], None], accelerator) -> float:
    """Seconds ``function`` takes, with the device idle before and finished after."""
    accelerator.synchronize()
    started = time.perf_counter()
    function()
    accelerator.synchronize()
    return time.perf_counter() - started


def copy_bandwidth_gbps(accelerator, device, megabytes: int = 2048, repeats: int = 20) -> float:
    """Memory bandwidth as a large copy on the device reaches it: (bytes read + written) / time, best run."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    best = min(timed(lambda: target.copy_(source), accelerator) for _ in range(repeats))
    return 2 * source.numel() / best / 1e9


def measure(generate: Callable[[int], None], accelerator, new_tokens: int, warmup: int, runs: int) -> dict:
    """Median per-token decode latency and end-to-end time of ``generate`` over ``runs`` timed runs."""
    with torch.no_grad():
        for _ in range(warmup):
            generate(1)
            generate(new_tokens)
        per_token, end_to_end = [], []
        for _ in range(runs):
            one = timed(lambda: generate(1), accelerator)
            many = timed(lambda: generate(new_tokens), accelerator)
            per_token.append((many - one) / (new_tokens - 1))
            end_to_end.append(many)
    return {"per_token_s": statistics.median(per_token), "end_to_end_s": statistics.median(end_to_end)}


def run_contender(name: str, model, tokenizer, input_ids: torch.Tensor, accelerator, device, arguments) -> dict | str:
    """The measurement of contender ``name`` on the batch ``input_ids`` [B, T], "oom", or "failed"."""
    compile_setting = os.environ.get("ACCELGEN_CUDA_COMPILE")
    if name == "accelgen_compiled":
        os.environ["ACCELGEN_CUDA_COMPILE"] = "1"
        accelerator.setup(World())  # the plugin reads the setting in setup
    generate = None
    try:
        generate = contender(name, model, tokenizer, input_ids, accelerator, device)
        return measure(generate, accelerator, arguments.new_tokens, arguments.warmup, arguments.runs)
    except Exception as error:  # noqa: BLE001 - one cell fails, the table goes on; the traceback is shown
        if accelerator.is_out_of_memory(error) or accelerator.is_out_of_memory(error.__cause__):
            return "oom"
        traceback.print_exc(file=sys.stderr)
        return "failed"
    finally:
        if compile_setting is None:
            os.environ.pop("ACCELGEN_CUDA_COMPILE", None)
        else:
            os.environ["ACCELGEN_CUDA_COMPILE"] = compile_setting
        accelerator.setup(World())
        del generate  # frees this contender's caches and graphs before the next one runs
        torch._dynamo.reset()  # and its compiled code (hf_static, accelgen_compiled; a no-op for the others)
        if device.type == "cuda":
            torch.cuda.empty_cache()


# -- reporting ---------------------------------------------------------------------------------------


def step_bytes(model, batch_size: int, prompt_tokens: int, new_tokens: int) -> float:
    """Bytes a decode step must read: the weights once, and each row's keys and values of the positions it
    attends to (the prompt and, on average over the steps, half the new tokens)."""
    weights = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    cache = kv_cache_bytes_per_position(model.config, "bfloat16", 1) * batch_size * (prompt_tokens + new_tokens / 2)
    return weights + cache


def table_row(name: str, batch_size: int, result: dict | str, bytes_per_step: float, bandwidths: dict, new_tokens: int) -> str:
    if isinstance(result, str):
        return f"| {name} | {batch_size} | {result} | {result} | {result} | {result} | {result} |"
    per_token = result["per_token_s"]
    roofline = [
        f"{100 * bytes_per_step / (bandwidth * 1e9) / per_token:.1f}%" if bandwidth else "n/a"
        for bandwidth in (bandwidths["measured"], bandwidths["peak"])
    ]
    tokens_per_second = batch_size * new_tokens / result["end_to_end_s"]
    return (f"| {name} | {batch_size} | {1000 * per_token:.2f} | {result['end_to_end_s']:.2f} | "
            f"{tokens_per_second:.1f} | {roofline[0]} | {roofline[1]} |")


def print_header(model, arguments, prompt_tokens: int, bandwidths: dict, description: dict) -> None:
    import transformers

    parameters = sum(parameter.numel() for parameter in model.parameters())
    weight_bytes = step_bytes(model, 0, 0, 0)
    print(f"device: {description['device_name']} (driver {description.get('driver')}, CUDA "
          f"{description.get('cuda_runtime')}), torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model: {describe_shape(arguments)}, {parameters / 1e9:.2f}B parameters, bfloat16, "
          f"{weight_bytes / 1e9:.2f} GB of weights; random weights")
    print(f"prompt: {prompt_tokens} tokens, {arguments.new_tokens} new tokens forced, greedy; "
          f"{arguments.warmup} warm-up + {arguments.runs} timed runs per cell (medians)")
    peak = f"{bandwidths['peak']:.0f} GB/s" if bandwidths["peak"] else "unknown for this device"
    print(f"memory bandwidth: measured copy {bandwidths['measured']:.0f} GB/s, datasheet peak {peak}")
    print()
    print("| contender | batch | ms/token | e2e s | tokens/s | % roofline (measured BW) | % roofline (peak BW) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    try:
        accelerator = select_accelerator(get_plugin_manager(), arguments.device)
    except UsageError as error:
        print(f"cuda_decode: error: {error}", file=sys.stderr)
        return 2
    device = accelerator.setup(World())

    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    model = random_bloom(arguments, device=device, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None  # never stop early: exactly N tokens
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    description = accelerator.describe()
    bandwidths = {"measured": copy_bandwidth_gbps(accelerator, device), "peak": description["peak_memory_bandwidth_gbps"]}
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    prompt_tokens = prompt_ids.shape[1]

    print_header(model, arguments, prompt_tokens, bandwidths, description)
    for batch_size in arguments.batch_sizes:
        input_ids = prompt_ids.repeat(batch_size, 1).to(device)
        bytes_per_step = step_bytes(model, batch_size, prompt_tokens, arguments.new_tokens)
        for name in arguments.contenders:
            result = run_contender(name, model, tokenizer, input_ids, accelerator, device, arguments)
            print(table_row(name, batch_size, result, bytes_per_step, bandwidths, arguments.new_tokens), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
