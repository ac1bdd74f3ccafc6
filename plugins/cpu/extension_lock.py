"""The folder and the lock torch uses while it compiles DeepSpeed's CPU all-reduce extension, checked before a
tensor-parallel job loads.

Each install of accelgen (a virtual environment: its torch, its DeepSpeed) builds the extension in a folder of its own
under torch's extensions folder (:func:`deepspeed_extensions_root`): torch's build file names the install's include
paths, so two installs sharing one folder would each rebuild the other's build on every alternate run, and a job
loading the library while the other install rewrote it would crash.

torch creates ``<extensions folder>/deepspeed_shm_comm/lock`` while one process compiles the extension, and
every other process waits, polling, until the file goes: silently, and for ever when the file was left by a
compile that was stopped (SIGTERM, SIGKILL). A compile in progress runs its build tool (ninja) and compilers
with the build folder as their working directory: a lock is attributed to such a process only, not to any
process that happens to work in the folder (a shell), and never by its modification time alone (which may
lie in the future). A lock with no compile at work for :data:`STALE_AFTER_SECONDS` is removed; every wait
says what it waits for within :data:`SAY_AFTER_SECONDS` (the compile, and the process that started it and holds
the lock), and again every :data:`REPEAT_SECONDS` with the time waited so far.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
import time
import warnings
from typing import Iterator

from accelgen.common.errors import AccelgenWarning, UsageError, reason

EXTENSION = "deepspeed_shm_comm"
#: A lock with no compile at work for this long (by its age, or as long as we watched it) was left by a stopped
#: compile: a compile that has not started its build tool yet (torch writes its build file first) is younger.
STALE_AFTER_SECONDS = 30
#: How long a wait goes on before it says what it waits for.
SAY_AFTER_SECONDS = 3
#: How often a wait says again what it waits for, with the time waited so far.
REPEAT_SECONDS = 30
#: The programs of a compile in progress: torch runs ninja in the build folder, ninja the compiler and linker.
BUILD_PROGRAMS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "clang", "clang++", "ld", "collect2", "as"})
WHAT = "DeepSpeed's CPU all-reduce extension"


@contextlib.contextmanager
def deepspeed_builds_in_its_folder() -> Iterator[None]:
    """Inside the block, torch builds and loads DeepSpeed's extensions in this install's folder
    (:func:`deepspeed_extensions_root`): TORCH_EXTENSIONS_DIR is set to it for this process, and put back after."""
    root = deepspeed_extensions_root()
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = root
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = before


def deepspeed_extensions_root() -> str:
    """This install's extensions folder for DeepSpeed's builds: ``accelgen-deepspeed-<key>`` under torch's (the user's
    TORCH_EXTENSIONS_DIR, else torch's default), the key a digest of what the build depends on: torch's release and
    folder (its headers and libraries), DeepSpeed's release and folder (its sources), and the compiler named in CXX."""
    import torch

    deepspeed = importlib.util.find_spec("deepspeed")
    try:
        deepspeed_release = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed_release = None
    depends_on = [torch.__version__, os.path.dirname(torch.__file__), str(deepspeed and deepspeed.origin),
                  str(deepspeed_release), os.environ.get("CXX", "")]
    key = hashlib.sha256("\0".join(depends_on).encode()).hexdigest()[:12]
    return os.path.join(torch_extensions_root(), f"accelgen-deepspeed-{key}")


def deepspeed_build_folder() -> str:
    """Where this install's build of DeepSpeed's CPU all-reduce extension lies (:func:`deepspeed_extensions_root`)."""
    return os.path.join(deepspeed_extensions_root(), EXTENSION)


def check_extension_build_lock(folder: str, local_rank: int) -> None:
    """Check that the extension's build ``folder`` (this install's: :func:`deepspeed_build_folder`) is writable (every
    rank: torch locks and builds there, even to load a compiled extension); on local rank 0, say so when the extension
    is not built yet (this job compiles it, once for this install), wait while another process compiles it, saying
    so, or remove a lock no compile holds (one warning line)."""
    check_build_folder_writable(folder)
    if local_rank != 0:
        return
    lock = os.path.join(folder, "lock")
    if not os.path.exists(os.path.join(folder, f"{EXTENSION}.so")) and not os.path.exists(lock):
        _say(f"compiling {WHAT} for this install, once (a minute or two; later jobs load it), in {folder}")
    if os.path.isdir("/proc"):
        wait_for_build_lock(lock, folder)


def check_build_folder_writable(folder: str) -> None:
    """Raise UsageError, naming the folder and the fix, when ``folder`` cannot be created or written."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        home = os.path.expanduser("~")
        where = (f" (by default under HOME, {home}, which is not writable here)"
                 if os.environ.get("TORCH_EXTENSIONS_DIR") is None and folder.startswith(home + os.sep) else "")
        raise UsageError(f"Cannot write {folder}, where torch builds {WHAT}: {reason(error)}: set TORCH_EXTENSIONS_DIR "
                         f"to a writable folder{where}.") from None


def wait_for_build_lock(lock: str, folder: str, repeat_seconds: float = REPEAT_SECONDS) -> None:
    """Return once ``lock`` is gone: removed by the compile holding it, or by us when no compile holds it. While it
    waits it says what for (the compile and the process holding the lock, or a lock no compile holds), once at
    first and again every ``repeat_seconds`` with the time waited so far: how long a compile takes depends on the
    machine, so no duration is promised. Ctrl-C (KeyboardInterrupt, or the signal that ends a rank) stops it at once."""
    watch_started = time.monotonic()
    last_build_seen: float | None = None
    said, said_at = None, 0.0
    while os.path.exists(lock):
        now = time.monotonic()
        builders = build_processes_in(folder)
        if builders:
            last_build_seen = now
            quiet = 0.0
        elif last_build_seen is not None:
            quiet = now - last_build_seen
        else:
            quiet = max(now - watch_started, _trusted_age(lock))
        if not builders and quiet >= STALE_AFTER_SECONDS:
            _remove_stale_lock(lock)
            return
        if builders or quiet >= SAY_AFTER_SECONDS:  # a line for each change (a compile seen, none seen), then repeated
            again = said == bool(builders)
            if not again or now - said_at >= repeat_seconds:
                said, said_at = bool(builders), now
                _say(_waiting_line(lock, folder, builders, quiet, now - watch_started if again else None))
        time.sleep(min(1.0, repeat_seconds))


def _waiting_line(lock: str, folder: str, builders: list[int], quiet: float, waited: float | None) -> str:
    """What a wait says: the compile and the process holding the lock, or a lock no compile holds; ``waited``: the
    seconds waited so far, in a line that repeats one said before (None in the first)."""
    still, so_far = ("still ", f" ({_duration(waited)} so far)") if waited is not None else ("", "")
    if builders:
        return (f"{still}waiting for {lock_holder(builders)} to finish compiling {WHAT} in {folder}" +
                (so_far or " (it holds the lock there; Ctrl-C stops this job)"))
    return (f"{still}waiting for {lock}{so_far}: no process is compiling {WHAT}; the lock goes in "
            f"{STALE_AFTER_SECONDS - quiet:.0f} s unless a compile starts")


def _duration(seconds: float) -> str:
    """``45 s``, ``7 min 22 s``."""
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _say(line: str) -> None:
    print(f"accelgen: {line}", file=sys.stderr, flush=True)


def _trusted_age(lock: str) -> float:
    """Seconds since ``lock`` was last written, or 0 when its time lies in the future (a clock moved back, a
    copied or touched file): such a lock is aged by watching it."""
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return 0.0
    return age if age >= 0 else 0.0


def _remove_stale_lock(lock: str) -> None:
    try:
        os.remove(lock)
    except FileNotFoundError:
        return
    except OSError as error:
        raise UsageError(f"Cannot remove {lock}, left by a stopped compile of {WHAT} (no process is compiling it): "
                         f"{reason(error)}: remove it by hand, or set TORCH_EXTENSIONS_DIR to a folder of your "
                         f"own.") from None
    warnings.warn(AccelgenWarning(
        f"removed {lock}, left by a compile of {WHAT} that was stopped (no process is compiling it); every "
        f"tensor-parallel job would have waited on it for ever"
    ), stacklevel=3)


def extension_build_folder(name: str) -> str:
    """Where torch builds the extension ``name``: the folder torch.utils.cpp_extension chooses."""
    return os.path.join(torch_extensions_root(), name)


def torch_extensions_root() -> str:
    """torch's extensions folder: TORCH_EXTENSIONS_DIR, else the one torch.utils.cpp_extension makes per Python and
    torch build under the user's cache (found as it finds it, without importing it: it imports setuptools)."""
    import torch
    from torch._appdirs import user_cache_dir

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accelerator = "cu" + torch.version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        user_cache = os.path.realpath(user_cache_dir(appname="torch_extensions"))  # as get_default_build_root() finds it
        root = os.path.join(user_cache, f"{python}_{accelerator}")
    return root


def build_processes_in(folder: str) -> list[int]:
    """Process ids of a compile working in ``folder`` (its build tool, compilers, linker; Linux /proc, those we
    may read): a process of another kind there (a shell) holds no build lock."""
    folder = os.path.realpath(folder)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd") != folder:
                    continue
            except OSError:
                continue
            if _program_of(int(entry)) in BUILD_PROGRAMS:
                found.append(int(entry))
    return found


def lock_holder(builders: list[int]) -> str:
    """The process holding the lock, as a message names it: the one that started the compile (torch takes the lock
    in the Python process that runs the build tool), with its command line; else the build processes themselves."""
    for pid in builders:
        parent = _parent_of(pid)
        while parent and _program_of(parent) in BUILD_PROGRAMS:  # a compiler's parent is the build tool
            parent = _parent_of(parent)
        command = _command_line_of(parent) if parent and parent != 1 else None
        if command:
            return f"process {parent} ({command})"
    return ", ".join(f"process {pid} ({_program_of(pid) or '?'})" for pid in builders)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode(errors="replace")
    except OSError:
        return None
    return int(text[text.rfind(")") + 2:].split()[1])  # the name, in parentheses, may hold spaces


def _program_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return None


def _command_line_of(pid: int, longest: int = 80) -> str | None:
    """A process's command line, shortened to ``longest`` characters; None when unreadable or empty."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    command = " ".join([os.path.basename(words[0]), *words[1:]]).strip()
    return (command if len(command) <= longest else command[:longest - 3] + "...") or None
