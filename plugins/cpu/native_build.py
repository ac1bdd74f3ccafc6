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
- A folder that cannot be written (read-only, full) fails the build in one line: the run goes on with torch's
  operations.
- Builds not loaded for :data:`UNUSED_DAYS` days (another torch or compiler's) are removed: each load stamps its own,
  so that two installs sharing a machine never remove each other's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from accelgen.common.errors import reason
from accelgen_cpu.native_build_lock import LOCK, build_lock, duration, say
from accelgen_cpu.native_compile import (
    TORCH_LIBRARIES,
    BuildFailure,
    compile_all,
    compile_flags,
    compiler_command,
    compiler_identity,
    link_command,
    link_flags,
    run_compilers,
    stop_on_sigterm,
)

__all__ = ["LOCK", "BuildFailure", "build_folder", "built_library", "kernels_root", "remembered_failure",
           "verified_library"]

SOURCES = Path(__file__).with_name("kernels")
#: the builds' folder under torch's extensions folder
KERNELS_FOLDER = "accelgen_cpu_kernels"
LIBRARY = "kernels.so"
CHECKSUM = "kernels.so.sha256"
FAILED = "failed.txt"
LAST_USED = "last-used"
#: a build not loaded for this many days is removed by the next build
UNUSED_DAYS = 30
#: about how long one source takes to compile on one core (benchmarks/RESULTS-log.md, "Building them"): the
#: announcement's estimate
SECONDS_PER_SOURCE = 12


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
    try:
        return _built_under_the_lock(variant, folder)
    except OSError as error:  # a read-only or full extensions folder: nothing can be built, nor remembered
        raise BuildFailure(f"cannot write {folder.parent}, where they are built: {reason(error)}",
                           "set TORCH_EXTENSIONS_DIR to a writable folder") from None


def _built_under_the_lock(variant: str, folder: Path) -> Path:
    with build_lock(folder.parent, variant):
        if (library := _ready(folder)) is not None:  # built by the process we waited for
            return library
        _remove_leftovers(folder.parent, keep=folder)
        if folder.exists():  # a library that does not match its checksum, or none: built anew
            damaged = (folder / LIBRARY).exists()
            shutil.rmtree(folder)
            if damaged:
                say(f"the CPU kernels' library in {folder} is damaged (not the size and SHA-256 it was built with): "
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
    say(f"building the CPU plugin's C++ kernels for {VARIANT_WORDS[variant]} ({variant}) in {folder}: once per "
         f"machine, compiler and torch release, about {duration(estimate)} here; torch's own "
         f"operations would run slower without them (accelgen devices --prepare builds them ahead of a job)")
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        with stop_on_sigterm():
            objects = compile_all(variant, sources, staging, parallel)
            run_compilers([[*link_command(objects), "-o", str(staging / LIBRARY)]], parallel=1)
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
    say(f"built the CPU plugin's C++ kernels in {duration(time.monotonic() - started)} ({folder})")


def _digest(variant: str) -> str:
    import torch

    sources = sorted([*SOURCES.glob("*.cpp"), *SOURCES.glob("*.h")])
    identity = {"variant": variant, "compile": [*compiler_command(), *compile_flags(variant)],
                "link": [*link_flags(), *TORCH_LIBRARIES], "compiler": compiler_identity(), "torch": torch.__version__,
                "torch_folder": os.path.realpath(os.path.dirname(torch.__file__)),  # its headers' and libraries'
                "sources": {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sources}}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _remove_leftovers(root: Path, keep: Path) -> None:
    """Under the lock: remove what killed builds left (``.building-*``) and builds of ours (``<variant>-<digest>``)
    unused for :data:`UNUSED_DAYS`; anything else in the folder is not ours to judge."""
    from accelgen_cpu.kernel_variants import VARIANT_FLAGS

    oldest = time.time() - UNUSED_DAYS * 86400
    for entry in root.iterdir():
        variant, _, digest = entry.name.rpartition("-")
        ours = variant in VARIANT_FLAGS and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)
        if not entry.is_dir() or entry == keep or not (ours or entry.name.startswith(".building-")):
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


