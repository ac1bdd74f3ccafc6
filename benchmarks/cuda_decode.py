"""Decode speed on one NVIDIA GPU against the memory-bandwidth roofline, three contenders side by side.

The published BLOOMZ protocol: a BLOOMZ-7b1-shaped model (30 layers, hidden 4096, 32 heads, vocab
250880) with random weights in bfloat16, built directly on the GPU; the prompt "DeepSpeed is a machine
learning framework" repeated to fill the batch; greedy; 100 new tokens forced (no early EOS); batch
sizes 1, 8, 32, 128; warm-up runs (and any compilation or graph capture) not counted, then N timed runs.

Contenders:
    hf_eager         Hugging Face generate(), dynamic cache, eager
    hf_static_compile  generate() with cache_implementation="static" and model.forward compiled with
                     torch.compile(mode="reduce-overhead", fullgraph=True), as Hugging Face documents
    accelgen_graphs  accelgen's Generator on the cuda accelerator: static cache, CUDA-graph decode step

Per contender and batch size:
    ms/token     per decode step (the whole batch), (t(N tokens) - t(1 token)) / (N - 1), median of runs
    e2e s        time to generate N tokens, median
    tokens/s     batch * N / e2e
    % roofline   (weight bytes / bandwidth) / (ms/token): how close a decode step comes to reading every
                 weight once at full speed; against the copy bandwidth measured here (a large
                 device-to-device copy, bytes read + written over time) and against the datasheet peak.
A contender that runs out of GPU memory at a batch size shows "oom" there; the others go on.

    python benchmarks/cuda_decode.py                         # the protocol (7.07B parameters, 14.1 GB of weights)
    python benchmarks/cuda_decode.py --small --runs 2        # smoke test of the script, seconds
    python benchmarks/cuda_decode.py --batch-sizes 1,8 --contenders accelgen_graphs,hf_eager

The tokenizer is accelgen's built-in one (the prompt is 18 tokens; BLOOM's own gives 7): decode speed
depends on the cache length only through attention, which is small next to reading the weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch

from accelgen.accelerators import select_accelerator
from accelgen.errors import UsageError
from accelgen.generator import Generator
from accelgen.models import DEFAULT_MODEL, load_tokenizer
from accelgen.plugins import get_plugin_manager
from accelgen.settings import RunSettings, World
from random_bloom import add_shape_arguments, describe_shape, random_bloom

PROMPT = "DeepSpeed is a machine learning framework"
SMALL_SHAPE = dict(layers=2, hidden=256, heads=4, vocab=4096)
CONTENDERS = ("hf_eager", "hf_static_compile", "accelgen_graphs")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, default_shape="bloomz-7b1")
    parser.add_argument("--small", action="store_true", help="a tiny model (2 layers, hidden 256) to smoke-test the script")
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


def hugging_face_eager(model, input_ids: torch.Tensor) -> Callable[[int], None]:
    def generate(new_tokens: int) -> None:
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                       do_sample=False, disable_compile=True)

    return generate


def hugging_face_static_compiled(model, input_ids: torch.Tensor) -> Callable[[int], None]:
    """generate() with a static cache and the forward pass compiled the way Hugging Face documents; the
    compiled forward is set on the model only during the call, so the other contenders run eagerly."""
    compiled_forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def generate(new_tokens: int) -> None:
        model.forward = compiled_forward
        try:
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                           do_sample=False, cache_implementation="static", disable_compile=True)
        finally:
            del model.forward  # back to the class's eager forward

    return generate


def accelgen_with_graphs(model, tokenizer, input_ids: torch.Tensor, accelerator) -> Callable[[int], None]:
    device = accelerator.setup(World())
    prompts = input_ids.tolist()
    generators = {}

    def generate(new_tokens: int) -> None:
        if new_tokens not in generators:  # one generator (and captured graph) per token count, as a user keeps
            run = RunSettings(dtype="bfloat16", batch_size=len(prompts), max_new_tokens=new_tokens, ignore_eos=True,
                              use_graphs=True)
            generators[new_tokens] = Generator(model, tokenizer, accelerator, device, run, World())
        generators[new_tokens].generate_token_ids(prompts)

    return generate


# -- measuring ---------------------------------------------------------------------------------------


def timed(function: Callable[[], None]) -> float:
    """Seconds ``function`` takes, with the GPU idle before and finished after."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def copy_bandwidth_gbps(megabytes: int = 2048, repeats: int = 20) -> float:
    """Device memory bandwidth as a large device-to-device copy reaches it: (bytes read + written) / time, best run."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    best = min(timed(lambda: target.copy_(source)) for _ in range(repeats))
    return 2 * source.numel() / best / 1e9


def measure(generate: Callable[[int], None], new_tokens: int, warmup: int, runs: int) -> dict:
    """Median per-token decode latency and end-to-end time of ``generate`` over ``runs`` timed runs."""
    with torch.no_grad():
        for _ in range(warmup):
            generate(1)
            generate(new_tokens)
        per_token, end_to_end = [], []
        for _ in range(runs):
            one = timed(lambda: generate(1))
            many = timed(lambda: generate(new_tokens))
            per_token.append((many - one) / (new_tokens - 1))
            end_to_end.append(many)
    return {"per_token_s": statistics.median(per_token), "end_to_end_s": statistics.median(end_to_end)}


def contender(name: str, model, tokenizer, input_ids: torch.Tensor, accelerator) -> Callable[[int], None]:
    """generate(new_tokens) of the contender called ``name``, for the batch ``input_ids`` [B, T]."""
    if name == "hf_eager":
        return hugging_face_eager(model, input_ids)
    if name == "hf_static_compile":
        return hugging_face_static_compiled(model, input_ids)
    return accelgen_with_graphs(model, tokenizer, input_ids, accelerator)


def run_contender(name: str, model, tokenizer, input_ids: torch.Tensor, accelerator, arguments) -> dict | str:
    """The measurement of contender ``name`` on the batch ``input_ids`` [B, T], or "oom"."""
    try:
        generate = contender(name, model, tokenizer, input_ids, accelerator)
        return measure(generate, arguments.new_tokens, arguments.warmup, arguments.runs)
    except Exception as error:  # an allocation inside a library or compiled code may wrap the OOM error
        if accelerator.is_out_of_memory(error) or accelerator.is_out_of_memory(error.__cause__):
            return "oom"
        raise
    finally:
        generate = None  # frees this contender's caches and graphs before the next one runs
        if name == "hf_static_compile":
            torch._dynamo.reset()  # drops the compiled graphs of this batch size and their memory pools
        torch.cuda.empty_cache()


# -- reporting ---------------------------------------------------------------------------------------


def table_row(name: str, batch_size: int, result: dict | str, weight_bytes: int, bandwidths: dict, new_tokens: int) -> str:
    if result == "oom":
        return f"| {name} | {batch_size} | oom | oom | oom | oom | oom |"
    per_token = result["per_token_s"]
    roofline = [
        f"{100 * weight_bytes / (bandwidth * 1e9) / per_token:.1f}%" if bandwidth else "n/a"
        for bandwidth in (bandwidths["measured"], bandwidths["peak"])
    ]
    tokens_per_second = batch_size * new_tokens / result["end_to_end_s"]
    return (f"| {name} | {batch_size} | {1000 * per_token:.2f} | {result['end_to_end_s']:.2f} | "
            f"{tokens_per_second:.1f} | {roofline[0]} | {roofline[1]} |")


def print_header(model, arguments, input_ids, weight_bytes: int, bandwidths: dict, description: dict) -> None:
    import transformers

    parameters = sum(parameter.numel() for parameter in model.parameters())
    print(f"GPU: {description['device_name']} (driver {description['driver']}, CUDA {description['cuda_runtime']}), "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model: {describe_shape(arguments)}, {parameters / 1e9:.2f}B parameters, bfloat16, "
          f"{weight_bytes / 1e9:.2f} GB of weights; random weights")
    print(f"prompt: {input_ids.shape[1]} tokens, {arguments.new_tokens} new tokens forced, greedy; "
          f"{arguments.warmup} warm-up + {arguments.runs} timed runs per cell (medians)")
    peak = f"{bandwidths['peak']:.0f} GB/s" if bandwidths["peak"] else "unknown for this GPU"
    print(f"memory bandwidth: measured copy {bandwidths['measured']:.0f} GB/s, datasheet peak {peak}")
    print()
    print("| contender | batch | ms/token | e2e s | tokens/s | % roofline (measured BW) | % roofline (peak BW) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    try:
        accelerator = select_accelerator(get_plugin_manager(), "cuda")
    except UsageError as error:
        print(f"cuda_decode: error: {error}", file=sys.stderr)
        return 2
    accelerator.setup(World())

    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    model = random_bloom(arguments, device="cuda", dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None  # never stop early: exactly N tokens
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    weight_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    description = accelerator.describe()
    bandwidths = {"measured": copy_bandwidth_gbps(), "peak": description["peak_memory_bandwidth_gbps"]}
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    print_header(model, arguments, prompt_ids, weight_bytes, bandwidths, description)
    for batch_size in arguments.batch_sizes:
        input_ids = prompt_ids.repeat(batch_size, 1).to("cuda")
        for name in arguments.contenders:
            result = run_contender(name, model, tokenizer, input_ids, accelerator, arguments)
            print(table_row(name, batch_size, result, weight_bytes, bandwidths, arguments.new_tokens), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
