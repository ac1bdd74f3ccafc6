"""The CPU plugin's C++ kernels per instruction-set variant against torch's own operations on the same class of CPU:
the measurements behind ``accelgen_cpu.kernel_variants.OPERATORS_TAKEN`` and the int8 kernel rule
(``accelgen_cpu.int8_kernels.INT8_KERNEL_RULE``).

Each class of CPU is emulated on this machine by restricting torch to it in the worker's environment, so that
torch's side of each comparison is what such a CPU runs:

    avx512    torch as it is (AVX-512 here)
    avx2      ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2
    portable  ATEN_CPU_CAPABILITY=default, ONEDNN_MAX_CPU_ISA=SSE41

Two parts, every measurement a process of its own, the classes interleaved round by round, medians:

    operators  each operator of the variant's build against torch's operation (what the plugin runs without it), one
               call timed many times (the same data: from the cache), microseconds; and the int8 products' kernels
               at 1 to 64 rows
    jobs       cpu_peers.py's two jobs (the dataset job, batch 16, compiled step; the batch-1 decode job, eager) in
               float32 with the class's variant (ACCELGEN_CPU_KERNELS=<variant>) against torch's operations only
               (ACCELGEN_CPU_KERNELS=off)

    python benchmarks/cpu_kernel_variants.py --part operators --rounds 3
    python benchmarks/cpu_kernel_variants.py --part jobs --rounds 1
    python benchmarks/cpu_kernel_variants.py --part jobs --jobs decode --classes portable --rounds 3
    python benchmarks/cpu_kernel_variants.py --part decode-ab --rounds 5

``decode-ab``: the batch-1 decode job with and without the kernels in one process per class, timed in turn round by
round (a busy machine's load meets both alike; the jobs part's processes minutes apart met different loads).
"""

# ruff: noqa: B023  (each timed lambda is called before its loop variables change)

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLASSES = {
    "avx512": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
INT8_ROWS = (1, 4, 16, 32, 64)
INT8_SHAPES = ((2048, 5632), (5632, 2048))  # in -> out


def median_microseconds(call, repeats: int = 50) -> float:
    for _ in range(5):
        call()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return 1e6 * statistics.median(timings)


def operator_timings(variant: str) -> dict[str, float]:
    """``{"<operator> <case>": (ours, torch's)}`` in microseconds, in this process's torch restrictions."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401 (transformers' import cost)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from accelgen_cpu.decode_attention import decode_attention
    from accelgen_cpu.native_kernels import load_variant
    from accelgen_cpu.packed_linear import pack_float_panels

    ops = load_variant(variant).operators
    torch.manual_seed(0)
    figures = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for dtype in (torch.float32, torch.bfloat16):
        name = "f32" if dtype == torch.float32 else "bf16"
        # a decode step of the 0.5B model's attention: 16 rows, 32 heads over 4 key/value heads of 64, 256 positions,
        # each row seeing 72 of them (a continuous-batching job)
        rows, heads, key_heads, length, size = 16, 32, 4, 256, 64
        query = torch.randn(rows, heads, 1, size, dtype=dtype)
        key, value = (torch.randn(rows, key_heads, length, size, dtype=dtype) for _ in range(2))
        seen = torch.zeros(rows, 1, 1, length, dtype=torch.bool)
        seen[..., 100:172] = True
        mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
        figures[f"decode_attention {name}"] = (
            median_microseconds(lambda: ops.decode_attention(query, key, value, mask, 0.125)),
            median_microseconds(lambda: decode_attention(query, key, value, mask, 0.125)))
        # a prefill of 4 prompts of 64 tokens, causal
        prompt = torch.randn(4, heads, 64, size, dtype=dtype)
        prompt_keys, prompt_values = (torch.randn(4, key_heads, 64, size, dtype=dtype) for _ in range(2))
        causal = torch.zeros(4, 1, 64, 64, dtype=dtype).masked_fill(
            ~torch.ones(64, 64, dtype=torch.bool).tril(), torch.finfo(dtype).min)
        figures[f"prompt_attention {name}"] = (
            median_microseconds(lambda: ops.prompt_attention(prompt, prompt_keys, prompt_values, causal, 0.125), 20),
            median_microseconds(lambda: sdpa(prompt, prompt_keys, prompt_values, attn_mask=causal, scale=0.125,
                                             enable_gqa=True), 20))
        # the decode step's whole attention: rotation, cache writes, attention
        new_query, new_key, new_value = (torch.randn(rows, 1, count * size, dtype=dtype) for count in (heads, key_heads, key_heads))
        angles = torch.rand(rows, 1, size // 2)
        cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
        positions = torch.full((rows,), 171)

        def torch_self_attention():
            heads_of = lambda states: states.view(rows, 1, -1, size).transpose(1, 2)  # noqa: E731
            rotated_query, rotated_key = apply_rotary_pos_emb(heads_of(new_query), heads_of(new_key), cos, sin)
            key[torch.arange(rows), :, positions] = rotated_key[:, :, 0]
            value[torch.arange(rows), :, positions] = heads_of(new_value)[:, :, 0]
            return sdpa(rotated_query, key, value, attn_mask=mask, scale=0.125, enable_gqa=True)

        figures[f"decode_self_attention {name}"] = (
            median_microseconds(lambda: ops.decode_self_attention(new_query, new_key, new_value, cos, sin, key, value,
                                                                  positions, mask, 0.125)),
            median_microseconds(torch_self_attention))
        norm = LlamaRMSNorm(2048).to(dtype)
        hidden = torch.randn(16, 2048, dtype=dtype)
        with torch.no_grad():
            figures[f"rms_norm {name}"] = (
                median_microseconds(lambda: ops.rms_norm(hidden, norm.weight, norm.variance_epsilon)),
                median_microseconds(lambda: norm(hidden)))
    for rows in (1, 16):
        weight = torch.randn(2048, 2048)
        x = torch.randn(rows, 2048)
        panels = pack_float_panels(weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        plain = median_microseconds(lambda: torch.nn.functional.linear(x, weight))
        onednn = median_microseconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        figures[f"float_panels_linear {rows} row(s) 2048x2048"] = (
            median_microseconds(lambda: ops.float_panels_linear(x, panels, 2048, None)), min(plain, onednn))
    return figures


def int8_timings() -> dict[str, float]:
    """``{"<kernel> <rows> <in>x<out>": microseconds}`` of each int8 kernel this process runs."""
    import torch

    from accelgen.quantization.int8_layer import Int8Linear, quantize_rows
    from accelgen_cpu.int8_kernels import available_kernels, int8_product_on_cpu, use_int8_kernel

    torch.manual_seed(0)
    figures = {}
    for inputs, outputs in INT8_SHAPES:
        values, scales = quantize_rows(torch.randn(outputs, inputs))
        for kernel in available_kernels():
            layer = Int8Linear(values.clone(), scales, None, int8_product_on_cpu)
            use_int8_kernel(layer, kernel)
            for rows in INT8_ROWS:
                x = torch.randn(rows, inputs).bfloat16()
                figures[f"{kernel} {rows} {inputs}x{outputs}"] = median_microseconds(lambda: layer(x), 20)
    return figures


def worker(variant: str) -> dict:
    import torch

    torch.set_num_threads(1)
    with torch.no_grad():
        return {"operators": operator_timings(variant), "int8": int8_timings()}


def measure_operators(variant: str) -> dict:
    environment = dict(os.environ, OMP_NUM_THREADS="1", ACCELGEN_CPU_KERNELS=variant, **CLASSES[variant])
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", variant], env=environment,
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{variant} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def operators_part(arguments) -> None:
    from accelgen_cpu.kernel_variants import executable_variants

    variants = [variant for variant in CLASSES if variant in executable_variants()]
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(arguments.rounds):
        for variant in variants:
            runs[variant].append(measure_operators(variant))
    print("| operator, case | " + " | ".join(f"{v} ours | {v} torch" for v in variants) + " |")
    print("|---|" + "---:|" * (2 * len(variants)))
    for case in runs[variants[0]][0]["operators"]:
        cells = []
        for variant in variants:
            ours = statistics.median(run["operators"][case][0] for run in runs[variant])
            theirs = statistics.median(run["operators"][case][1] for run in runs[variant])
            cells += [f"**{ours:,.0f}**" if ours < theirs else f"{ours:,.0f}", f"{theirs:,.0f}"]
        print(f"| {case} | " + " | ".join(cells) + " |")
    print("\nint8 products, bfloat16 rows, microseconds:\n")
    for variant in variants:
        cases = runs[variant][0]["int8"]
        kernels = sorted({case.split()[0] for case in cases})
        print(f"{variant}:\n\n| rows, in x out | " + " | ".join(kernels) + " |\n|---|" + "---:|" * len(kernels))
        for rows in INT8_ROWS:
            for inputs, outputs in INT8_SHAPES:
                cells = [statistics.median(run["int8"][f"{kernel} {rows} {inputs}x{outputs}"] for run in runs[variant])
                         for kernel in kernels]
                best = min(cells)
                print(f"| {rows}, {inputs}x{outputs} | " + " | ".join(
                    f"**{cell:,.0f}**" if cell == best else f"{cell:,.0f}" for cell in cells) + " |")
        print()


def jobs_part(arguments) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import cpu_peers

    from accelgen_cpu.kernel_variants import executable_variants

    settings = argparse.Namespace(threads=arguments.threads, worker_timeout=900, mean_length=40, prompts=192,
                                  max_new_tokens=128, batch_size=16, decode_tokens=64)
    contenders = [(variant, kernels) for variant in arguments.classes.split(",") if variant in executable_variants()
                  for kernels in (variant, "off")]
    with tempfile.TemporaryDirectory() as scratch:
        for job in arguments.jobs.split(","):
            folder = cpu_peers.prepare(job, Path(scratch), settings)
            figures: dict[tuple[str, str], list[float]] = {contender: [] for contender in contenders}
            for _ in range(arguments.rounds):
                for variant, kernels in contenders:
                    saved = dict(os.environ)
                    os.environ.update(CLASSES[variant], ACCELGEN_CPU_KERNELS=kernels)
                    try:
                        if job == "dataset":
                            run = cpu_peers.measure("accelgen_float32", folder, settings)
                            figures[variant, kernels].append(run["kept_tokens"] / run["seconds"])
                        else:
                            whole = cpu_peers.measure("accelgen_float32", folder, settings)
                            first = cpu_peers.measure("accelgen_float32", folder, settings, new_tokens=1)
                            figures[variant, kernels].append(
                                1000 * (whole["seconds"] - first["seconds"]) / (whole["kept_tokens"] - 1))
                    finally:
                        os.environ.clear()
                        os.environ.update(saved)
            unit = "kept tokens/s" if job == "dataset" else "decode ms/token"
            print(f"\n{job} job, float32, {unit}, {arguments.threads} thread(s):\n")
            print("| class of CPU | its kernels | torch only | rounds (kernels : torch) |\n|---|---:|---:|---|")
            for variant in dict.fromkeys(variant for variant, _ in contenders):
                ours, theirs = (statistics.median(figures[variant, kernels]) for kernels in (variant, "off"))
                rounds = " / ".join(f"{a:,.1f} : {b:,.1f}" for a, b in zip(figures[variant, variant],
                                                                             figures[variant, "off"]))
                print(f"| {variant} | {ours:,.1f} | {theirs:,.1f} | {rounds} |")


def decode_ab_worker(folder: str, rounds: int) -> dict:
    """In one process (torch restricted to the class by the environment): the batch-1 decode job's model loaded twice,
    with this process's kernels and with none (as ACCELGEN_CPU_KERNELS=off loads it), the two timed in turn round by
    round, so that the machine's load meets both alike: decode ms per step of each round (the generator's own clock)."""
    import importlib
    import json as json_module

    import accelgen

    native_kernels = importlib.import_module("accelgen_cpu.native_kernels")  # the module (the package names a function so)

    work = json_module.loads((Path(folder) / "work.json").read_text())
    settings = dict(device="cpu", dtype="float32", batch_size=1, ignore_eos=True, do_sample=False)
    with_kernels = accelgen.load(folder, max_new_tokens=work["max_new_tokens"], **settings)
    loaded = native_kernels.loaded_kernels
    native_kernels.loaded_kernels = lambda: None  # the plugin's operators asked while this model loads: none
    try:
        without = accelgen.load(folder, max_new_tokens=work["max_new_tokens"], **settings)
    finally:
        native_kernels.loaded_kernels = loaded
    figures: dict[str, list[float]] = {"kernels": [], "off": []}
    for generator in (with_kernels, without):  # warm-up
        generator.generate_token_ids(work["prompts"])
    for _ in range(rounds):
        for name, generator in (("kernels", with_kernels), ("off", without)):
            seconds, steps = generator.stats.decode_seconds, generator.stats.decode_steps
            generator.generate_token_ids(work["prompts"])
            figures[name].append(1000 * (generator.stats.decode_seconds - seconds)
                                 / (generator.stats.decode_steps - steps))
    return figures


def decode_ab_part(arguments) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import cpu_peers

    settings = argparse.Namespace(decode_tokens=64)
    with tempfile.TemporaryDirectory() as scratch:
        folder = cpu_peers.prepare("decode", Path(scratch), settings)
        print("| class of CPU | its kernels | torch only | rounds (kernels : torch) |\n|---|---:|---:|---|")
        for variant in arguments.classes.split(","):
            environment = dict(os.environ, OMP_NUM_THREADS=str(arguments.threads), ACCELGEN_CPU_KERNELS=variant,
                               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **CLASSES[variant])
            result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--decode-ab-worker", str(folder),
                                     "--rounds", str(arguments.rounds)], env=environment, capture_output=True,
                                    text=True)
            if result.returncode:
                raise SystemExit(f"{variant} failed:\n{result.stderr[-3000:]}")
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            rounds = " / ".join(f"{a:.1f} : {b:.1f}" for a, b in zip(figures["kernels"], figures["off"]))
            print(f"| {variant} | {statistics.median(figures['kernels']):.1f} | {statistics.median(figures['off']):.1f} "
                  f"| {rounds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("operators", "jobs", "decode-ab"), default="operators")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--classes", default=",".join(CLASSES), help="jobs: the classes of CPU to run")
    parser.add_argument("--jobs", default="dataset,decode", help="jobs: dataset, decode or both")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--decode-ab-worker", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(worker(arguments.worker)))
    elif arguments.decode_ab_worker:
        print(json.dumps(decode_ab_worker(arguments.decode_ab_worker, arguments.rounds)))
    elif arguments.part == "decode-ab":
        decode_ab_part(arguments)
    elif arguments.part == "operators":
        operators_part(arguments)
    else:
        jobs_part(arguments)


if __name__ == "__main__":
    main()
