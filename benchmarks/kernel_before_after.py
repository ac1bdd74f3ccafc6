"""The CPU plugin's float32 panels product (``plugins/cpu/kernels/float_panels_linear.cpp``) as the working tree has it
against the same file at an earlier commit: both built for one variant of the kernels, each under an operator namespace
of its own, loaded into one process and timed in turn (a busy or drifting machine meets both alike), medians.

The shapes are the dataset model's (hidden 256, MLP 682, its 32,000-token head) and the 0.5B model's MLP (2048 x 5632),
at a decode step's rows (1, 2, 16) and a prompt's (64 to 8,192: a prefill packs a batch's prompts into thousands of
rows). Both builds' outputs must be equal bit for bit (a row's sums are taken in one order whatever the tiling). Both
include the working tree's ``lanes.h``.

    python benchmarks/kernel_before_after.py --before HEAD~1 --threads 1
    python benchmarks/kernel_before_after.py --before HEAD~1 --threads 2 --variant avx2 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = "plugins/cpu/kernels/float_panels_linear.cpp"
SHAPES = ((256, 682), (682, 256), (256, 256), (256, 32000), (2048, 5632))  # inputs, outputs
ROWS = (1, 2, 16, 64, 512, 4096, 8192)
LARGEST_ROWS_OF_A_BIG_WEIGHT = 512  # the head and the 0.5B MLP: rows past this take too long to time


def build(source: Path, name: str, variant: str, folder: Path) -> Path:
    """``source`` compiled and linked as the plugin builds its kernels for ``variant``, under operator namespace
    ``name``; the library's path."""
    from accelgen_cpu.native_compile import compile_command, link_command

    command = [flag for flag in compile_command(variant) if not flag.startswith("-DACCELGEN_KERNELS_NAMESPACE")]
    (folder / "lanes.h").write_bytes((HERE.parent / "plugins/cpu/kernels/lanes.h").read_bytes())
    target = folder / f"{name}.o"
    subprocess.run([*command, f"-DACCELGEN_KERNELS_NAMESPACE={name}", "-c", str(source), "-o", str(target)], check=True,
                   stderr=subprocess.DEVNULL)
    library = folder / f"{name}.so"
    subprocess.run([*link_command([target]), "-o", str(library)], check=True)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit whose source is 'before' (git rev)")
    parser.add_argument("--variant", default="avx2", help="the kernels' variant both are built for (avx2, avx512...)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    arguments = parser.parse_args()

    import torch

    from accelgen_cpu.packed_linear import pack_float_panels

    folder = Path(tempfile.mkdtemp(prefix="kernel-before-after-"))
    before = folder / "before.cpp"
    before.write_bytes(subprocess.run(["git", "show", f"{arguments.before}:{SOURCE}"], cwd=HERE.parent, check=True,
                                      capture_output=True).stdout)
    builds = {"before": before, "after": HERE.parent / SOURCE}
    operators = {}
    for name, source in builds.items():
        torch.ops.load_library(str(build(source, f"kernel_{name}", arguments.variant, folder)))
        operators[name] = getattr(torch.ops, f"kernel_{name}").float_panels_linear
    torch.set_num_threads(arguments.threads)
    torch.manual_seed(0)
    print(f"float_panels_linear, {arguments.variant} build, {arguments.threads} thread(s), "
          f"medians of {arguments.rounds}; before = {arguments.before}")
    print("| inputs x outputs | rows | before us | after us | after / before | G multiply-adds/s before / after |")
    print("|---|---:|---:|---:|---:|---:|")
    for inputs, outputs in SHAPES:
        panels = pack_float_panels(torch.randn(outputs, inputs))
        big = inputs * outputs > 4_000_000
        for rows in (rows for rows in ROWS if not big or rows <= LARGEST_ROWS_OF_A_BIG_WEIGHT):
            x = torch.randn(rows, inputs)
            results = {name: operator(x, panels, outputs, None) for name, operator in operators.items()}
            assert torch.equal(results["before"], results["after"]), "the builds' outputs differ"
            calls = max(1, int(1e8 / (rows * inputs * outputs)))
            seconds = {name: [] for name in operators}
            for round_number in range(arguments.rounds):
                order = list(operators) if round_number % 2 == 0 else list(operators)[::-1]
                for name in order:
                    started = time.perf_counter()
                    for _ in range(calls):
                        operators[name](x, panels, outputs, None)
                    seconds[name].append((time.perf_counter() - started) / calls)
            median = {name: statistics.median(values) for name, values in seconds.items()}
            rate = {name: rows * inputs * outputs / value / 1e9 for name, value in median.items()}
            print(f"| {inputs} x {outputs} | {rows:,} | {median['before'] * 1e6:,.0f} | {median['after'] * 1e6:,.0f} | "
                  f"{median['after'] / median['before']:.2f} | {rate['before']:.1f} / {rate['after']:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
