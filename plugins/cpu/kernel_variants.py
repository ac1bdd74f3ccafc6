"""Which build of the CPU plugin's C++ kernels this processor runs, and which of their operators it takes: a rule over
the instruction sets the processor has, asked when the kernels load (never the compiler's ``-march=native``, never a
timing), so that two runs on one machine always take the same kernels.

The kernels' sources are built once per variant (:mod:`accelgen_cpu.native_build`), each for one class of CPU:

- ``avx512``: x86-64-v4 (AVX-512 F/BW/DQ/VL/CD) with VNNI: Intel from Skylake-SP / Ice Lake with VNNI, AMD Zen 4 on;
- ``avx2``: x86-64-v3 (AVX2, FMA, F16C, BMI2): every x86-64 of the last decade;
- ``portable``: the target's baseline (x86-64's SSE2, aarch64's NEON), vectorized by the compiler: any other CPU.

The most capable variant the processor can execute is taken; ``ACCELGEN_CPU_KERNELS`` (``avx512``, ``avx2``,
``portable`` or ``off``) names another, refused in one line where the processor lacks an instruction set it needs.
Each variant takes only the operators that measured faster than torch's own operations on its class of CPU
(:data:`OPERATORS_TAKEN`); torch's operations do the rest.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys

from accelgen.common.errors import UsageError

OVERRIDE_VARIABLE = "ACCELGEN_CPU_KERNELS"
#: Instruction sets to take as this processor's (comma-separated, /proc/cpuinfo's names), in place of those it has:
#: runs and tests as on a smaller CPU (``avx2,fma,f16c,bmi2``: an AVX2 machine; empty: a baseline one)
PRETEND_VARIABLE = "ACCELGEN_CPU_INSTRUCTIONS"
#: the value of :data:`OVERRIDE_VARIABLE` that turns the kernels off (torch's operations only)
OFF = "off"

#: Each variant's compiler flags (for its target instruction sets; ``portable`` adds none on other architectures)
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "portable": ("-march=x86-64", "-mtune=generic") if platform.machine().lower() in ("x86_64", "amd64") else (),
}
#: The instruction sets (Linux's /proc/cpuinfo names, less underscores) a variant's code may use
VARIANT_NEEDS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vnni", "avx2", "fma",
                         "f16c", "bmi2"}),
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "portable": frozenset(),
}
#: Variants from the most capable down: the first the processor can execute is taken
PREFERENCE = ("avx512", "avx2", "portable")
#: What a variant is, in words
VARIANT_WORDS = {
    "avx512": "AVX-512 with VNNI",
    "avx2": "AVX2 and FMA",
    "portable": f"{platform.machine() or 'this architecture'}'s baseline instructions",
}

#: The operators each variant takes: those measured faster than torch's own operation on that class of CPU
#: (benchmarks/RESULTS-log.md, "The CPU kernels per instruction set", by benchmarks/cpu_kernel_variants.py). ``packed_linear``
#: calls oneDNN's own product (it spares a compiled step a call into Python), so every variant takes it.
OPERATORS_TAKEN: dict[str, frozenset[str]] = {
    "avx512": frozenset({"decode_attention", "prompt_attention", "decode_self_attention", "float_panels_linear",
                         "int8_panels_linear", "quantize_rows_unsigned", "rms_norm", "packed_linear", "draw_tokens"}),
    "avx2": frozenset({"decode_attention", "prompt_attention", "decode_self_attention", "float_panels_linear",
                       "int8_panels_linear", "quantize_rows_unsigned", "rms_norm", "packed_linear", "draw_tokens"}),
    "portable": frozenset({"decode_attention", "decode_self_attention", "rms_norm", "packed_linear", "draw_tokens"}),
}


def operators_namespace(variant: str) -> str:
    """The torch operator namespace of ``variant``'s build: ``torch.ops.accelgen_cpu_kernels_<variant>``."""
    return f"accelgen_cpu_kernels_{variant}"


def executable_variants() -> tuple[str, ...]:
    """The variants this machine can build and execute, most capable first."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("portable",)
    present = instruction_sets()
    return tuple(variant for variant in PREFERENCE if VARIANT_NEEDS[variant] <= present)


def missing_instructions(variant: str) -> frozenset[str]:
    """The instruction sets ``variant`` needs that this processor lacks (all of them off x86-64, but portable's)."""
    if variant != "portable" and platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset({"x86-64"})
    return VARIANT_NEEDS[variant] - instruction_sets()


def chosen_variant() -> str | None:
    """The variant this process takes: :data:`OVERRIDE_VARIABLE`'s (None for ``off``), else the most capable one the
    processor executes. Raises UsageError for an unknown name or one the processor cannot execute."""
    asked = os.environ.get(OVERRIDE_VARIABLE, "").strip().lower()
    if not asked:
        return executable_variants()[0]
    if asked == OFF:
        return None
    if asked not in VARIANT_FLAGS:
        raise UsageError(f"{OVERRIDE_VARIABLE}={asked!r} names no build of the CPU kernels: use one of "
                         f"{', '.join(PREFERENCE)} or {OFF}.")
    missing = missing_instructions(asked)
    if missing:
        raise UsageError(f"{OVERRIDE_VARIABLE}={asked}: this processor lacks {', '.join(sorted(missing))}, which that "
                         f"build of the CPU kernels needs; it runs {', '.join(executable_variants())} (or {OFF}).")
    return asked


@functools.cache
def instruction_sets() -> frozenset[str]:
    """This processor's instruction sets, by Linux's /proc/cpuinfo names less underscores (``avx512vnni``): from
    /proc/cpuinfo on Linux, ``sysctl`` on macOS, else what torch's CPU probe answers; :data:`PRETEND_VARIABLE`'s
    where it is set."""
    pretended = os.environ.get(PRETEND_VARIABLE)
    if pretended is not None:
        return frozenset(name.strip().replace("_", "").lower() for name in pretended.split(",") if name.strip())
    flags = _cpuinfo_flags() or _sysctl_flags()
    return flags if flags else _torch_probe()


def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(flag.replace("_", "").lower() for flag in line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _sysctl_flags() -> frozenset[str]:
    if sys.platform != "darwin":
        return frozenset()
    try:
        words = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                               capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    named = {word.replace("_", "").replace(".", "").lower() for word in words}
    return frozenset(named | ({"fma"} if "fma" in named or "fma3" in named else set()))


def _torch_probe() -> frozenset[str]:
    """What torch's CPU probe tells (only the instruction sets it asks about)."""
    import torch

    probe = torch.cpu
    found: set[str] = set()
    if getattr(probe, "_is_avx2_supported", lambda: False)():
        found |= VARIANT_NEEDS["avx2"]
    if getattr(probe, "_is_avx512_supported", lambda: False)():
        found |= {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
    if getattr(probe, "_is_vnni_supported", lambda: False)():
        found.add("avx512vnni")
    return frozenset(found)
