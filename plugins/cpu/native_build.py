"""Builds one variant of the CPU plugin's C++ kernels (``kernels/*.cpp``) once per machine, compiler and torch
release, and checks a build before it is loaded.

A build is the system's C++ compiler (``$CXX``, which may hold arguments: ``CXX="ccache g++"``; else ``c++``) run on
each source in parallel against the running torch's headers, for the variant's instruction sets
(:data:`accelgen_cpu.kernel_variants.VARIANT_FLAGS`), then linked into ``kernels.so``, in torch's extensions folder
(``TORCH_EXTENSIONS_DIR``, else under the user's cache): ``accelgen_cpu_kernels/<variant>-<digest>/``. The digest
covers the compiler (its path and ``--version``), the flags, the sources and headers and torch's release: another
compiler, source or torch gets a build of its own.

- It says what it does before it starts (stderr), and builds under a lock (``build.lock``, ``flock``): one build per
  machine at a time; another process that needs it waits, saying for what, then loads what was built.
- The library's size and SHA-256 are written beside it (``kernels.so.sha256``); a library that does not match them
  (empty, cut short, replaced) is removed and built again, never loaded.
- A failed build is remembered with its reason (``failed.txt``, the compiler's first error line) until the compiler,
  the sources or torch change (a new digest): it is not tried again at every run.
- A build stopped (Ctrl-C, SIGTERM) stops its compilers (their own process group) and leaves nothing behind; what a
  process killed outright left (``.building-*``) is removed by the next build.
- Builds not loaded for :data:`UNUSED_DAYS` days (another torch or compiler's) are removed: each load stamps its own,
  so that two installs sharing a machine never remove each other's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

SOURCES = Path(__file__).with_name("kernels")
#: the builds' folder under torch's extensions folder
KERNELS_FOLDER = "accelgen_cpu_kernels"
LIBRARY = "kernels.so"
CHECKSUM = "kernels.so.sha256"
FAILED = "failed.txt"
LAST_USED = "last-used"
LOCK = "build.lock"
BUILD_TIMEOUT_SECONDS = 900
#: a build not loaded for this many days is removed by the next build
UNUSED_DAYS = 30
#: about how long one source takes to compile on one core (benchmarks/RESULTS.md, "Building the CPU kernels"): the
#: announcement's estimate
SECONDS_PER_SOURCE = 12
#: how often a process waiting for another's build says so again
REPEAT_SECONDS = 30


class BuildFailure(Exception):
    """The kernels could not be built or loaded: ``reason`` in one line, ``fix`` what the user can do."""

    def __init__(self, reason: str, fix: str):
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def compiler_command() -> list[str]:
    """``$CXX`` split as a shell would (``ccache g++``), else ``c++``."""
    return shlex.split(os.environ.get("CXX", "").strip() or "c++")


def kernels_root() -> Path:
    from accelgen_cpu.extension_lock import extension_build_folder

    return Path(extension_build_folder(KERNELS_FOLDER))


def build_folder(variant: str) -> Path:
    """Where ``variant``'s build for this compiler, these sources and this torch lives (built or not)."""
    return kernels_root() / f"{variant}-{_digest(variant)}"


def verified_library(folder: Path) -> Path | None:
    """``folder``'s library when it matches the size and SHA-256 written beside it when it was built; else None."""
    library = folder / LIBRARY
    try:
        size, digest = (folder / CHECKSUM).read_text().split()
        if library.stat().st_size != int(size):
            return None
        return library if _sha256(library) == digest else None
    except (OSError, ValueError):
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def remembered_failure(folder: Path) -> tuple[str, str] | None:
    """The reason and the fix of the failed build of ``folder``'s digest, when one failed."""
    try:
        reason, _, fix = (folder / FAILED).read_text().strip().partition("\n")
    except OSError:
        return None
    return reason or "the build failed", fix or "fix the compiler or name another in CXX"


def built_library(variant: str) -> Path:
    """``variant``'s library, checked; built first (under the lock, announced) when there is none or it is damaged.
    Raises BuildFailure (remembered for the next runs when the compiler failed)."""
    folder = build_folder(variant)
    if (library := _ready(folder)) is not None:
        return library
    with build_lock(folder.parent, variant):
        if (library := _ready(folder)) is not None:  # built by the process we waited for
            return library
        _remove_leftovers(folder.parent, keep=folder)
        if folder.exists():  # a library that does not match its checksum, or none: built anew
            damaged = (folder / LIBRARY).exists()
            shutil.rmtree(folder)
            if damaged:
                _say(f"the CPU kernels' library in {folder} is damaged (not the size and SHA-256 it was built with): "
                     f"building it again")
        compiler = compiler_command()[0]
        if shutil.which(compiler) is None:  # said before any announcement of a build
            _remember(folder, BuildFailure(f"cannot run the compiler {compiler!r}: not found",
                                           "install a C++ compiler (g++ or clang++), or name one in CXX"))
        _build(variant, folder)
        return folder / LIBRARY


def _remember(folder: Path, failure: BuildFailure) -> None:
    """Write ``failure``'s reason where the next runs find it (:data:`FAILED`), and raise it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILED).write_text(f"{failure.reason}\n{failure.fix}\n")
    raise failure


def _ready(folder: Path) -> Path | None:
    """The verified library (stamped as used), or None; raises the failure a build of this digest left."""
    if (failure := remembered_failure(folder)) is not None:
        reason, fix = failure
        raise BuildFailure(reason, f"{fix}; this failure is remembered in {folder / FAILED}: remove it to try again")
    library = verified_library(folder)
    if library is not None:
        _stamp_used(folder)
    return library


def _build(variant: str, folder: Path) -> None:
    from accelgen_cpu.kernel_variants import VARIANT_WORDS

    sources = sorted(SOURCES.glob("*.cpp"))
    parallel = max(1, min(len(sources), os.cpu_count() or 1))
    estimate = SECONDS_PER_SOURCE * -(-len(sources) // parallel)
    _say(f"building the CPU plugin's C++ kernels for {VARIANT_WORDS[variant]} ({variant}) in {folder}: once per "
         f"machine, compiler and torch release, about {estimate // 60} min {estimate % 60} s here; torch's own "
         f"operations would run slower without them (accelgen devices --prepare builds them ahead of a job)")
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        with _stop_on_sigterm():
            objects = _compile_all(variant, sources, staging, parallel)
            _run_compilers([[*_link_command(objects), "-o", str(staging / LIBRARY)]], parallel=1)
        size = (staging / LIBRARY).stat().st_size
        digest = _sha256(staging / LIBRARY)
        for path in objects:
            path.unlink()
        (staging / CHECKSUM).write_text(f"{size} {digest}\n")
        _stamp_used(staging)
        os.replace(staging, folder)
    except BuildFailure as failure:
        shutil.rmtree(staging, ignore_errors=True)
        _remember(folder, failure)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _say(f"built the CPU plugin's C++ kernels in {time.monotonic() - started:.0f} s ({folder})")


def _compile_all(variant: str, sources: list[Path], staging: Path, parallel: int) -> list[Path]:
    objects = [staging / f"{source.stem}.o" for source in sources]
    _run_compilers([[*_compile_command(variant), "-c", str(source), "-o", str(target)]
                    for source, target in zip(sources, objects)], parallel)
    return objects


def _run_compilers(commands: list[list[str]], parallel: int) -> None:
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
                                   f"{_first_error(errors.decode(errors='replace'))}",
                                   "fix the compiler or name another in CXX")
    finally:
        for process in running:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _compile_command(variant: str) -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths

    from accelgen_cpu.kernel_variants import VARIANT_FLAGS, operators_namespace

    openmp = ["-fopenmp"] if sys.platform != "darwin" else []  # Apple's clang has none: one thread an operator
    return [*compiler_command(), *VARIANT_FLAGS[variant], "-fPIC", "-std=c++17", "-O3", "-fno-math-errno",
            "-ffp-contract=off", "-fvisibility=hidden", "-fvisibility-inlines-hidden", *openmp,
            f"-DACCELGEN_KERNELS_NAMESPACE={operators_namespace(variant)}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{path}" for path in include_paths())]


def _link_command(objects: list[Path]) -> list[str]:
    from torch.utils.cpp_extension import library_paths

    openmp = ["-fopenmp"] if sys.platform != "darwin" else []
    return [*compiler_command(), *map(str, objects), "-shared", *openmp, *(f"-L{path}" for path in library_paths()),
            *(f"-Wl,-rpath,{path}" for path in library_paths()), "-lc10", "-ltorch_cpu"]


def _digest(variant: str) -> str:
    import torch

    sources = sorted([*SOURCES.glob("*.cpp"), *SOURCES.glob("*.h")])
    identity = {"variant": variant, "compile": _compile_command(variant), "link": _link_command([]),
                "compiler": _compiler_identity(), "torch": torch.__version__,
                "sources": {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sources}}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _compiler_identity() -> str:
    """The compiler's resolved path and ``--version`` (a compiler that does not run: its command as given)."""
    command = compiler_command()
    found = shutil.which(command[0])
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(found) if found else command[0]}\n{version}"


def _first_error(text: str) -> str:
    """The first line of a compiler's output that says ``error``, else its first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no message"])[0]


@contextlib.contextmanager
def build_lock(root: Path, variant: str) -> Iterator[None]:
    """Hold the machine's kernels build lock (``root/build.lock``); while another process holds it, wait, saying for
    which process, once at first and again every :data:`REPEAT_SECONDS`."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a+") as lock:
        waited_since, said_at = time.monotonic(), None
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if said_at is None or now - said_at >= REPEAT_SECONDS:
                    lock.seek(0)
                    holder = lock.read().strip() or "another process"
                    so_far = f" ({now - waited_since:.0f} s so far)" if said_at is not None else ""
                    _say(f"waiting for {holder} to finish building the CPU plugin's C++ kernels in {root}{so_far}")
                    said_at = now
                time.sleep(0.2)
        lock.seek(0)
        lock.truncate()
        lock.write(f"process {os.getpid()} ({shlex.join(sys.argv[:4])[:80]}, building {variant})")
        lock.flush()
        try:
            yield
        finally:
            lock.seek(0)
            lock.truncate()
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_leftovers(root: Path, keep: Path) -> None:
    """Under the lock: remove what killed builds left (``.building-*``) and builds unused for :data:`UNUSED_DAYS`."""
    oldest = time.time() - UNUSED_DAYS * 86400
    for entry in root.iterdir():
        if not entry.is_dir() or entry == keep:
            continue
        if entry.name.startswith(".building-"):
            shutil.rmtree(entry, ignore_errors=True)
            continue
        stamp = entry / LAST_USED
        try:
            used = stamp.stat().st_mtime if stamp.exists() else entry.stat().st_mtime
        except OSError:
            continue
        if used < oldest:
            shutil.rmtree(entry, ignore_errors=True)


def _stamp_used(folder: Path) -> None:
    """Mark ``folder``'s build as used now (at most once a day: a load writes nothing most runs)."""
    stamp = folder / LAST_USED
    with contextlib.suppress(OSError):
        if not stamp.exists() or time.time() - stamp.stat().st_mtime > 86400:
            stamp.touch()


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
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


def _say(line: str) -> None:
    print(f"accelgen: {line}", file=sys.stderr, flush=True)
