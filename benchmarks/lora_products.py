"""Two ways of adding each row's own LoRA adapter to a linear layer's output inside static shapes, timed on one layer
at a decode step's shapes (rows of a batch, adapters spread over them):

    masked    every resident adapter's product, each row keeping its own adapter's columns (``accelgen.adapters.
              lora_layer``; vLLM's Gaudi backend): y + ((x @ A_all^T) * mask) @ B_all^T, C = adapters x rank columns
    gathered  each row's own matrices gathered, then batched products (punica's and S-LoRA's way in torch's terms):
              y + bmm(bmm(x, A[index]^T), B[index]^T)

Both with torch's products; ``masked`` also with the device's own product over its layout of the stacked buffers
(``Accelerator.linear_layout``; the CPU plugin's panels). Medians of ``--repeats`` timings of ``--calls`` calls.

    python benchmarks/lora_products.py                       # the dataset benchmark's layer shapes, 4 adapters of rank 16
    python benchmarks/lora_products.py --hidden 4096 --intermediate 11008 --adapters 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accelgen.plugin.manager import get_plugin_manager
from accelgen.plugin.registry import select_accelerator


def timed(call, calls: int, repeats: int) -> float:
    """Median microseconds per call."""
    for _ in range(20):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(times)


def contenders(rows: int, inputs: int, outputs: int, adapters: int, rank: int, accelerator) -> dict:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, inputs, generator=generator), torch.randn(rows, outputs, generator=generator)
    a = torch.randn(adapters * rank, inputs, generator=generator)  # [C, in]
    b = torch.randn(outputs, adapters * rank, generator=generator)  # [out, C]
    slots = torch.arange(rows) % (adapters + 1)  # the base model's rows (0) among them
    mask = (slots[:, None] == torch.arange(1, adapters + 1).repeat_interleave(rank)).float()
    a_stacked = torch.cat([torch.zeros(1, rank, inputs), a.view(adapters, rank, inputs)])  # [adapters + 1, r, in]
    b_stacked = torch.cat([torch.zeros(1, outputs, rank), b.view(outputs, adapters, rank).permute(1, 0, 2)])
    found = {
        "masked": lambda: torch.addmm(y, torch.mm(x, a.t()).mul_(mask), b.t()),
        "gathered": lambda: y + torch.bmm(torch.bmm(x[:, None], a_stacked[slots].transpose(1, 2)),
                                          b_stacked[slots].transpose(1, 2))[:, 0],
    }
    layout_a, layout_b = accelerator.linear_layout(a), accelerator.linear_layout(b)
    if layout_a is not None and layout_b is not None:
        found["masked, device layout"] = lambda: y + layout_b.product(layout_a.product(x).mul_(mask))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="1,16,64", help="rows of the decode step, comma-separated")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=682)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    arguments = parser.parse_args()
    accelerator = select_accelerator(get_plugin_manager(), arguments.device)
    accelerator.setup(None)
    shapes = {"attention (hidden -> hidden)": (arguments.hidden, arguments.hidden),
              "MLP up (hidden -> intermediate)": (arguments.hidden, arguments.intermediate),
              "MLP down (intermediate -> hidden)": (arguments.intermediate, arguments.hidden)}
    print(f"{arguments.adapters} adapters of rank {arguments.rank} (C = {arguments.adapters * arguments.rank} columns), "
          f"float32, {torch.get_num_threads()} thread(s); microseconds per layer call, medians of {arguments.repeats}")
    print("| layer | rows | " + " | ".join(contenders(1, 8, 8, 1, 1, accelerator)) + " |")
    print("|---|---:|" + "---:|" * len(contenders(1, 8, 8, 1, 1, accelerator)))
    for name, (inputs, outputs) in shapes.items():
        for rows in map(int, arguments.rows.split(",")):
            found = contenders(rows, inputs, outputs, arguments.adapters, arguments.rank, accelerator)
            times = [timed(call, arguments.calls, arguments.repeats) for call in found.values()]
            print(f"| {name} | {rows} | " + " | ".join(f"{value:.1f}" for value in times) + " |")


if __name__ == "__main__":
    main()
