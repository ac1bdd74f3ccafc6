"""How a decode step is replayed on the CPU, now and after ``torch.jit.trace``: the same step run as it is, traced into
TorchScript (what the CPU plugin does today for a job too short for a compile), and compiled ahead of time by
AOTInductor (``torch.export``, then ``aoti_compile_and_package``: the successor the plan in RESULTS-log.md, "The traced
step's successor", names), on one model, batch and cache length.

The step is transformers' own export recipe (``TorchExportableModuleWithStaticCache``: a Llama with a static cache whose
tensors are the module's buffers, one write position for the whole batch), not the core's ``DecodeStep`` with its C++
kernels (``aot_decode_step.py`` compiles that one, in a whole job). The same computation replayed three ways, so the
figures compare the replays, and price what a job pays before its first step: the trace's one run, AOTInductor's
compile (a first job) and its package's load (every later job, the package kept on disk).

Printed: seconds to make each (trace, export, compile, load) and ms per step (medians of --steps timed steps after
--warmup, the contenders taking turns), with the logits of the three compared (the largest difference).

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/step_replay.py                  # 4 layers x 256, batch 1 and 16
    OMP_NUM_THREADS=1 python benchmarks/step_replay.py --layers 8 --hidden 2048 --heads 32 --batch-sizes 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache


def decode_step(arguments, batch_size: int) -> torch.nn.Module:
    """The random Llama's decode step over a static cache of --cache-len positions, ``batch_size`` rows."""
    config = LlamaConfig(vocab_size=arguments.vocab, hidden_size=arguments.hidden,
                         intermediate_size=arguments.hidden * 8 // 3, num_hidden_layers=arguments.layers,
                         num_attention_heads=arguments.heads, num_key_value_heads=arguments.heads,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return TorchExportableModuleWithStaticCache(model, batch_size=batch_size, max_cache_len=arguments.cache_len).eval()


def seconds(make):
    start = time.perf_counter()
    made = make()
    return made, time.perf_counter() - start


def measure(arguments, batch_size: int, scratch: Path) -> None:
    step = _Positional(decode_step(arguments, batch_size))
    tokens = torch.randint(3, arguments.vocab, (batch_size, 1))
    position = torch.tensor([arguments.cache_len // 2])
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced, trace_s = seconds(lambda: torch.jit.trace(step, (tokens, position), check_trace=False))
        exported, export_s = seconds(lambda: torch.export.export(step, (tokens, position), strict=True))
        package, compile_s = seconds(lambda: torch._inductor.aoti_compile_and_package(
            exported, package_path=str(scratch / f"step-{batch_size}.pt2")))
        compiled, load_s = seconds(lambda: torch._inductor.aoti_load_package(package))

        contenders = {"as it is": lambda: step(tokens, position), "traced": lambda: traced(tokens, position),
                      "AOTInductor": lambda: compiled(tokens, position)}
        logits = {name: run().clone() for name, run in contenders.items()}
        reference = logits["as it is"]
        for _ in range(arguments.warmup):
            for run in contenders.values():
                run()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(arguments.steps):
            for name, run in contenders.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)

    print(f"\nbatch {batch_size}, cache {arguments.cache_len}, {arguments.layers} layers x {arguments.hidden}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"made in: trace {trace_s:.2f} s; export {export_s:.2f} s, AOTInductor compile {compile_s:.2f} s, "
          f"package load {load_s:.2f} s")
    print("| replay | ms per step (median) | largest logit difference from the step as it is |")
    print("| --- | ---: | ---: |")
    for name in contenders:
        difference = (logits[name] - reference).abs().max().item()
        print(f"| {name} | {statistics.median(times[name]):.3f} | {difference:.2e} |")


class _Positional(torch.nn.Module):
    """The recipe's step called with (input_ids, cache_position) alone: what trace and export take."""

    def __init__(self, step: torch.nn.Module):
        super().__init__()
        self.step = step

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.step(input_ids=input_ids, cache_position=cache_position)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for batch_size in (int(size) for size in arguments.batch_sizes.split(",")):
            measure(arguments, batch_size, Path(scratch))


if __name__ == "__main__":
    main()
