"""The CPU plugin's own C++ kernels (``kernels/*.cpp``): compiled once per machine and torch release, then loaded.

Each kernel registers torch operators under ``torch.ops.accelgen_cpu_kernels`` (a CPU kernel and a shape-only one,
so that compiled steps call them whole). They are built the way inductor builds its CPU code, with the system's
C++ compiler (``$CXX``, else ``c++``) against the running torch's headers and libraries, for this CPU's
instructions (``-march=native``), into torch's extensions folder (``TORCH_EXTENSIONS_DIR``, else under the user's
cache), in a folder named by a digest of all of that: another machine, torch release or
source gets a build of its own. The compiled library is written under a temporary name and renamed into place, so
processes that build at once each finish (the last rename wins, every one a whole library) and a build stopped
half-way leaves no lock and no half-written library for the next process to trip on.

Where no compiler works the kernels are missing and their callers keep their torch-only ways, after one warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from accelgen.common.errors import AccelgenWarning
from accelgen_cpu.extension_lock import extension_build_folder

SOURCES = Path(__file__).with_name("kernels")
#: the builds' folder under torch's extensions folder
KERNELS_FOLDER = "accelgen_cpu_kernels"
BUILD_TIMEOUT_SECONDS = 600


@functools.cache
def native_kernels() -> bool:
    """Whether the kernels are loaded (built first if this machine has no build yet); a warning when they cannot be."""
    try:
        torch.ops.load_library(str(_built_library()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        warnings.warn(AccelgenWarning(
            f"the CPU plugin's C++ kernels could not be built or loaded ({_first_line(error)}): the CPU runs torch's "
            f"own operations instead (attention over whole cache rows, the modules' own norms, the other int8 "
            f"kernels; slower); install a C++ compiler (g++ or clang++, or name one in CXX) to get them"), stacklevel=2)
        return False
    return True


def native_operator_built(name: str) -> bool:
    """Whether the kernels are loaded and define the operator ``name``: operators that need instructions the compiler's
    target lacks (AVX-512, VNNI) are left out of the build."""
    return native_kernels() and hasattr(torch.ops.accelgen_cpu_kernels, name)


def _built_library() -> Path:
    sources = sorted(SOURCES.glob("*.cpp"))
    command = _compile_command(sources)
    texts = [path.read_text() for path in [*sources, *sorted(SOURCES.glob("*.h"))]]  # the headers they include too
    digest = hashlib.sha256("\0".join([*command, torch.__version__, _cpu_identity(), *texts]).encode()).hexdigest()[:16]
    library = Path(extension_build_folder(KERNELS_FOLDER)) / digest / "kernels.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix="kernels-", suffix=".so.partial", dir=library.parent)
    os.close(handle)
    started = time.perf_counter()
    try:
        finished = subprocess.run([*command, "-o", partial], capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
        if finished.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {_first_line(finished.stderr) or finished.returncode}")
        os.replace(partial, library)
    finally:
        Path(partial).unlink(missing_ok=True)
    print(f"accelgen: compiled the CPU plugin's C++ kernels in {time.perf_counter() - started:.0f} s, once for this "
          f"machine ({library.parent})", file=sys.stderr)
    return library


def _compile_command(sources: list[Path]) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [os.environ.get("CXX", "c++"), *map(str, sources), "-shared", "-fPIC", "-std=c++17", "-O3", "-march=native",
            "-fopenmp", "-fno-math-errno", "-ffp-contract=off", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{path}" for path in include_paths()),
            *(f"-L{path}" for path in library_paths()), *(f"-Wl,-rpath,{path}" for path in library_paths()),
            "-lc10", "-ltorch_cpu"]


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the processor's model and instruction flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return "".join(dict.fromkeys(line for line in cpuinfo if line.startswith(("model name", "flags"))))
    except OSError:
        return platform.processor()


def _first_line(error: object) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or [type(error).__name__])[0].strip()
