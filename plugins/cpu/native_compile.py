"""Running the C++ compiler over the CPU kernels' sources for one variant: one compiler per source at once (as many
as there are cores), then the link, each in a process group of its own, so that a build stopped half-way (Ctrl-C,
SIGTERM, a compiler's failure) stops every compiler it started, and tied to the process building (:data:`TIE`), so
that one killed outright (SIGKILL) leaves none running; and what a failing compiler said, in one line."""

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
                    running.append(subprocess.Popen(_tied(command), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                    start_new_session=True))
                except OSError as error:
                    _cannot_run(command, error.strerror or str(error))
            process = running[0]
            try:
                _, errors = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BuildFailure(f"the compiler ran past {BUILD_TIMEOUT_SECONDS} s", "build on a less busy machine "
                                   "(accelgen devices --prepare)") from None
            running.pop(0)
            if process.returncode == CANNOT_RUN and errors.startswith(CANNOT_RUN_MARK):
                _cannot_run(command_of(process), errors[len(CANNOT_RUN_MARK):].decode(errors="replace").strip())
            if process.returncode != 0:
                raise BuildFailure(f"{shlex.join(command_of(process)[:1])} failed (exit {process.returncode}): "
                                   f"{first_error(errors.decode(errors='replace'))}",
                                   "fix the compiler or name another in CXX")
    finally:
        for process in running:
            with contextlib.suppress(OSError):
                if command_of(process) is process.args:  # not tied: the compiler leads its own group
                    os.killpg(process.pid, signal.SIGKILL)
                else:  # its tie kills the compiler's group and reaps it
                    process.terminate()
            process.wait()


def _cannot_run(command: list[str], why: str) -> None:
    raise BuildFailure(f"cannot run the compiler {command[0]!r}: {why}",
                       "install a C++ compiler (g++ or clang++), or name one in CXX")


#: The tie's exit status, and the start of what it says, when it cannot start the compiler
CANNOT_RUN, CANNOT_RUN_MARK = 127, b"accelgen-tie: "

#: A compiler's tie: a small process that starts the compiler in a process group of its own and, told to stop (SIGTERM:
#: by the build stopped, or by Linux when the process that started the build dies outright, SIGKILL or a crash: the
#: parent-death signal), kills that group, the compiler's own children (``cc1plus``, ``as``) with it, reaps the
#: compiler and ends. Arguments: the builder's process id, then the compiler's command.
TIE = """
import ctypes, os, signal, subprocess, sys
compiler = None
def stop(*_):
    if compiler is not None:
        os.killpg(compiler.pid, signal.SIGKILL)
        try:
            os.waitpid(compiler.pid, 0)  # not compiler.wait(): the main thread's holds its lock
        except ChildProcessError:
            pass
    os._exit(128 + signal.SIGTERM)
def own_group():
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
signal.signal(signal.SIGTERM, stop)
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the builder died before the signal was armed
    stop()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no stop between the compiler's start and its name
try:
    compiler = subprocess.Popen(sys.argv[2:], preexec_fn=own_group)
except OSError as error:
    sys.stderr.write("accelgen-tie: " + (error.strerror or str(error)))
    sys.exit(127)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
sys.exit(compiler.wait())
"""


def _tied(command: list[str]) -> list[str]:
    """``command`` run under its tie (:data:`TIE`), on Linux; as it is elsewhere (no parent-death signal)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", TIE, str(os.getpid()), *command]


def command_of(process: subprocess.Popen) -> list[str]:
    """The compiler's command that ``process`` runs (under its tie or not)."""
    arguments = process.args
    return arguments[6:] if arguments[:5] == [sys.executable, "-I", "-S", "-c", TIE] else arguments


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
