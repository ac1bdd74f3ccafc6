"""The CPU plugin's own C++ kernels (``kernels/*.cpp``), loaded for this processor: which variant
(:mod:`accelgen_cpu.kernel_variants`), built once per machine (:mod:`accelgen_cpu.native_build`), and which of its
operators the plugin takes.

Each build registers torch operators under its own namespace (``torch.ops.accelgen_cpu_kernels_<variant>``; a CPU
kernel and a shape-only one each, so that compiled steps call them whole), so that several variants can be loaded in
one process (the tests compare them). The plugin asks :func:`native_operator` for an operator: the chosen variant's,
where that variant takes it, else None, and its caller keeps torch's own way. Where no compiler works the kernels are
missing, after one warning.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import warnings
from pathlib import Path
from typing import Any

from accelgen.common.errors import AccelgenWarning, UsageError


@dataclasses.dataclass(frozen=True)
class LoadedKernels:
    """One variant's build, loaded: its operators (``torch.ops.<namespace>``) and those the plugin takes."""

    variant: str
    operators: Any
    taken: frozenset[str]

    def operator(self, name: str) -> Any | None:
        """The operator ``name`` where this variant defines and takes it, else None."""
        return getattr(self.operators, name) if name in self.taken and hasattr(self.operators, name) else None


@functools.cache
def load_variant(variant: str) -> LoadedKernels:
    """``variant``'s kernels, built first where this machine has no build yet, and loaded. Raises
    :class:`~accelgen_cpu.native_build.BuildFailure`."""
    import torch

    from accelgen_cpu.kernel_variants import OPERATORS_TAKEN, operators_namespace
    from accelgen_cpu.native_build import BuildFailure, built_library

    library = built_library(variant)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as error:
        raise BuildFailure(f"{library} could not be loaded: {_first_line(error)}",
                           f"remove {library.parent} to build it again") from None
    operators = getattr(torch.ops, operators_namespace(variant))
    if missing := sorted(name for name in OPERATORS_TAKEN[variant] if not hasattr(operators, name)):
        # another library in its place, its checksum written to match: loaded now (a process cannot load the same
        # path again), so removed for the next run to build anew
        shutil.rmtree(library.parent, ignore_errors=True)
        raise BuildFailure(f"{library} is not a build of them: it defines none of {', '.join(missing[:3])}"
                           f"{', ...' if len(missing) > 3 else ''}", "it was removed: the next run builds them again "
                           "(accelgen devices --prepare builds them now)")
    return LoadedKernels(variant, operators, OPERATORS_TAKEN[variant])


@functools.cache
def loaded_kernels() -> LoadedKernels | None:
    """This process's kernels (the variant :func:`~accelgen_cpu.kernel_variants.chosen_variant` names), or None where
    they are turned off or could not be built or loaded (one warning)."""
    from accelgen_cpu.kernel_variants import chosen_variant
    from accelgen_cpu.native_build import BuildFailure

    variant = chosen_variant()
    if variant is None:
        return None
    try:
        return load_variant(variant)
    except BuildFailure as failure:
        warnings.warn(AccelgenWarning(
            f"the CPU plugin's C++ kernels are missing ({failure.reason}): the CPU runs torch's own operations "
            f"instead (slower); {failure.fix}"), stacklevel=2)
        return None


def native_kernels() -> bool:
    """Whether this process runs the plugin's kernels (built first if this machine has none yet)."""
    return loaded_kernels() is not None


def native_operator(name: str) -> Any | None:
    """The operator ``name`` of this process's kernels where their variant takes it, else None (torch's way)."""
    kernels = loaded_kernels()
    return None if kernels is None else kernels.operator(name)


def kernels_status() -> str:
    """What ``accelgen devices`` says of the kernels, without building them: the variant, the instructions it uses,
    and whether it is built here."""
    from accelgen_cpu.kernel_variants import OVERRIDE_VARIABLE, VARIANT_WORDS, chosen_variant
    from accelgen_cpu.native_build import build_folder, remembered_failure, verified_library

    try:
        variant = chosen_variant()
    except UsageError as error:
        return str(error)
    if variant is None:
        return f"C++ kernels off ({OVERRIDE_VARIABLE}=off): torch's operations"
    folder = build_folder(variant)
    if verified_library(folder) is not None:
        state = _loaded_state(variant, folder)
    elif (failure := remembered_failure(folder)) is not None:
        state = f"failed to build ({failure[0]}; remove {folder} to try again)"
    else:
        state = "not built yet (the first job builds them, or accelgen devices --prepare)"
    return f"C++ kernels {variant} ({VARIANT_WORDS[variant]}): {state}"


def _loaded_state(variant: str, folder: Path) -> str:
    """What ``accelgen devices`` says of a build that matches its checksum: built, once its library is loaded and
    holds the kernels' operators (loading builds nothing)."""
    from accelgen_cpu.native_build import BuildFailure

    try:
        load_variant(variant)
    except BuildFailure as failure:
        return f"not usable ({failure.reason}; {failure.fix})"
    return f"built in {folder}"


def _first_line(error: object) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines or [type(error).__name__])[0]
