"""The CPU plugin's two fast int8 kernels, side by side, by the rows of a product: the fused C++ kernel over panels
(``FusedInt8Product``) and oneDNN's product over its packed weight (``PackedInt8Product``, on AMX's int8 tiles where
the CPU has them), on the 0.5B Llama's layer shapes and a small model's. What ``int8_kernel_for``'s rule is drawn from.

One thread, medians of 5 runs of 20 products each; the figure is the fused kernel's time over the packed one's
(above 1: the packed product is faster).

    python benchmarks/int8_kernels_by_rows.py
    python benchmarks/int8_kernels_by_rows.py --rows 1,16,64,256,1024 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accelgen.quantization.int8_layer import quantize_rows
from accelgen_cpu.int8_kernels import FusedInt8Product, PackedInt8Product, available_kernels
from accelgen_cpu.kernel_variants import instruction_sets

#: (inputs, outputs): the 0.5B Llama's MLP up and down, attention output and key/value projections; a 256-wide model's
SHAPES = ((2048, 5632), (5632, 2048), (2048, 2048), (2048, 256), (256, 768))


def median_seconds(product, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, repeats: int = 20) -> float:
    product(x, values, scales)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            product(x, values, scales)
        runs.append((time.perf_counter() - started) / repeats)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    if not {"fused", "packed"} <= set(available_kernels()):
        raise SystemExit(f"this machine runs {', '.join(available_kernels())}: both fused and packed are needed")
    rows = [int(count) for count in arguments.rows.split(",")]
    print(f"AMX int8: {'amxint8' in instruction_sets()}; {arguments.threads} thread(s); fused time / packed time\n")
    print("| inputs -> outputs | " + " | ".join(f"{count} rows" for count in rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for inputs, outputs in SHAPES:
        values, scales = quantize_rows(torch.randn(outputs, inputs))
        packed, fused = PackedInt8Product(values, scales), FusedInt8Product(values, scales)
        ratios = []
        for count in rows:
            x = torch.randn(count, inputs)
            ratios.append(median_seconds(fused, x, values, scales) / median_seconds(packed, x, values, scales))
        print(f"| {inputs} -> {outputs} | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")


if __name__ == "__main__":
    main()
