"""Running the C++ compiler over the CPU kernels' sources for one variant: one compiler per source at once (as many
as there are cores), then the link, each in a process group of its own, so that a build stopped half-way (Ctrl-C,
SIGTERM, a compiler's failure) stops every compiler it started; and what a failing compiler said, in one line."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

BUILD_TIMEOUT_SECONDS = 900


class BuildFailure(Exception):
    """The kernels could not be built or loaded: ``reason`` in one line, ``fix`` what the user can do."""

    def __init__(self, reason: str, fix: str):
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def compiler_command() -> list[str]:
    """``$CXX`` split as a shell would (``ccache g++``), else ``c++``."""
    return shlex.split(os.environ.get("CXX", "").strip() or "c++")


def compile_all(variant: str, sources: list[Path], staging: Path, parallel: int) -> list[Path]:
    objects = [staging / f"{source.stem}.o" for source in sources]
    run_compilers([[*compile_command(variant), "-c", str(source), "-o", str(target)]
                    for source, target in zip(sources, objects)], parallel)
    return objects


def run_compilers(commands: list[list[str]], parallel: int) -> None:
    """Run ``commands``, ``parallel`` at a time, each in a process group of its own; on the first failure, or when this
    process is stopped, every one still running is killed (its group: the compiler's own children too)."""
    waiting, running = list(commands), []
    deadline = time.monotonic() + BUILD_TIMEOUT_SECONDS
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                command = waiting.pop(0)
                try:
                    running.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                    start_new_session=True))
                except OSError as error:
                    raise BuildFailure(f"cannot run the compiler {command[0]!r}: {error.strerror or error}",
                                       "install a C++ compiler (g++ or clang++), or name one in CXX") from None
            process = running[0]
            try:
                _, errors = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BuildFailure(f"the compiler ran past {BUILD_TIMEOUT_SECONDS} s", "build on a less busy machine "
                                   "(accelgen devices --prepare)") from None
            running.pop(0)
            if process.returncode != 0:
                raise BuildFailure(f"{shlex.join(process.args[:1])} failed (exit {process.returncode}): "
                                   f"{first_error(errors.decode(errors='replace'))}",
                                   "fix the compiler or name another in CXX")
    finally:
        for process in running:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def compile_command(variant: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [*compiler_command(), *compile_flags(variant), *(f"-I{path}" for path in include_paths())]


def compile_flags(variant: str) -> list[str]:
    """The compiler's flags for ``variant``, but the folders of torch's headers (which follow from torch's folder: a
    build's digest names that folder instead, without importing ``torch.utils.cpp_extension`` and setuptools with it, a
    tenth of a job's start)."""
    import torch

    from accelgen_cpu.kernel_variants import VARIANT_FLAGS, operators_namespace

    return [*VARIANT_FLAGS[variant], "-fPIC", "-std=c++17", "-O3", "-fno-math-errno", "-ffp-contract=off",
            "-fvisibility=hidden", "-fvisibility-inlines-hidden", *_openmp(),
            f"-DACCELGEN_KERNELS_NAMESPACE={operators_namespace(variant)}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def link_command(objects: list[Path]) -> list[str]:
    from torch.utils.cpp_extension import library_paths

    return [*compiler_command(), *map(str, objects), *link_flags(), *(f"-L{path}" for path in library_paths()),
            *(f"-Wl,-rpath,{path}" for path in library_paths()), *TORCH_LIBRARIES]


#: torch's libraries the kernels link with (found in torch's folder)
TORCH_LIBRARIES = ("-lc10", "-ltorch_cpu")


def link_flags() -> list[str]:
    """The linker's flags, but the folders of torch's libraries and the libraries themselves (:data:`TORCH_LIBRARIES`)."""
    return ["-shared", *_openmp()]


def _openmp() -> list[str]:
    return ["-fopenmp"] if sys.platform != "darwin" else []  # Apple's clang has none: one thread an operator


def compiler_identity() -> str:
    """The compiler's resolved path and ``--version`` (a compiler that does not run: its command as given)."""
    command = compiler_command()
    found = shutil.which(command[0])
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(found) if found else command[0]}\n{version}"


def first_error(text: str) -> str:
    """The first line of a compiler's output that says ``error``, else its first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no message"])[0]


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Where SIGTERM would end this process on the spot (its default), make it unwind as Ctrl-C does during the build,
    so that the compilers are stopped and the staging folder removed."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signal_number, frame):
        raise SystemExit(128 + signal_number)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _duration(seconds: float) -> str:
    """``45 s``, ``2 min 5 s``."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _say(line: str) -> None:
    print(f"accelgen: {line}", file=sys.stderr, flush=True)
