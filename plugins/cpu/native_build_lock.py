"""The machine's one lock on building the CPU kernels (``build.lock`` in the builds' folder, ``flock``): a process
that needs a build while another makes it waits, saying for which process, then finds it built."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Iterator

LOCK = "build.lock"
#: how often a process waiting for another's build says so again
REPEAT_SECONDS = 30


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
                    so_far = f" ({duration(now - waited_since)} so far)" if said_at is not None else ""
                    say(f"waiting for {holder} to finish building the CPU plugin's C++ kernels in {root}{so_far}")
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



def duration(seconds: float) -> str:
    """``45 s``, ``2 min 5 s``."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def say(line: str) -> None:
    print(f"accelgen: {line}", file=sys.stderr, flush=True)
