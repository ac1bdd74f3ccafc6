"""The lock torch takes while it compiles DeepSpeed's CPU all-reduce extension, checked before a tensor-parallel
job loads.

torch creates ``<extensions folder>/deepspeed_shm_comm/lock`` while one process compiles the extension, and
every other process waits, polling, until the file goes. A job stopped mid-compile (SIGTERM, SIGKILL) leaves
the file behind, and every later job then waits on it for ever, silently. A build in progress runs its
compiler (ninja) with the build folder as its working directory; a lock with no such process, older than
a build's start-up, was left by a stopped build and is removed.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

from accelgen.common.errors import AccelgenWarning

EXTENSION = "deepspeed_shm_comm"
#: A lock younger than this may belong to a build that has not started its compiler yet.
STALE_AFTER_SECONDS = 30


def check_extension_build_lock(local_rank: int) -> None:
    """On local rank 0: say which process a job waits for while the extension compiles, or remove a lock no
    process holds (one warning line), waiting at most :data:`STALE_AFTER_SECONDS` to tell the two apart."""
    folder = extension_build_folder(EXTENSION)
    lock = os.path.join(folder, "lock")
    if local_rank != 0 or not os.path.isdir("/proc"):
        return
    while os.path.exists(lock):
        builders = processes_working_in(folder)
        if builders:
            print(f"accelgen: waiting for process {', '.join(map(str, builders))}, compiling DeepSpeed's CPU all-reduce "
                  f"extension in {folder} (once per machine; a minute or two)", file=sys.stderr, flush=True)
            return
        try:
            age = time.time() - os.path.getmtime(lock)
        except FileNotFoundError:
            return
        if age < STALE_AFTER_SECONDS:
            time.sleep(1)
            continue
        try:
            os.remove(lock)
        except FileNotFoundError:
            return
        warnings.warn(AccelgenWarning(
            f"removed {lock}, left by a compile of DeepSpeed's CPU all-reduce extension that was stopped (no process is "
            f"compiling it); every tensor-parallel job would have waited on it for ever"
        ), stacklevel=2)


def extension_build_folder(name: str) -> str:
    """Where torch builds the extension ``name``: the folder torch.utils.cpp_extension chooses."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accelerator = "cu" + torch.version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, name)


def processes_working_in(folder: str) -> list[int]:
    """Process ids whose working directory is ``folder`` (Linux /proc; those we may read)."""
    folder = os.path.realpath(folder)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == folder:
                    found.append(int(entry))
            except OSError:
                continue
    return found
