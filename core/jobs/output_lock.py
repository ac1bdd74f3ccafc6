"""One writer per output file: an exclusive lock on ``<output>.lock`` held for the whole run.

The lock is the kernel's (``flock``), so a run that dies in any way (SIGKILL included) leaves no lock that
counts: its file stays behind, but the next run takes it over. The file names its holder (process id,
machine, start time) for the one line that refuses a second writer. A tensor-parallel job's launcher holds
the lock for its ranks: the ranks it starts inherit :data:`HELD_VARIABLE` and do not lock again.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import IO

from accelgen.common.errors import UsageError, user_errors

#: Set by the process holding an output's lock to the lock's path, for the processes it starts.
HELD_VARIABLE = "ACCELGEN_OUTPUT_LOCK_HELD"


class OutputLock:
    """The lock of ``output``; :meth:`acquire` raises UsageError when another live run holds it."""

    def __init__(self, output: str):
        self.output = output
        self.path = os.path.abspath(output) + ".lock"
        self._file: IO[str] | None = None

    @property
    def held_by_parent(self) -> bool:
        return os.environ.get(HELD_VARIABLE) == self.path

    def acquire(self) -> None:
        if self.held_by_parent:
            return
        while True:
            with user_errors(f"Cannot lock --output {self.output!r} (through {self.path!r})",
                             "choose an --output on a file system that supports locks (a local disk)", (OSError,)):
                file = open(self.path, "a+", encoding="utf-8")
                try:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    file.seek(0)
                    holder = file.read().strip() or "another process"
                    file.close()
                    raise UsageError(
                        f"--output {self.output!r} is being written by another accelgen run ({holder}): wait for it "
                        f"to end or stop it, or choose another --output (two writers would mix their rows)."
                    ) from None
            if _same_file(file, self.path):
                break
            file.close()  # the holder removed the file as we opened it: lock the one now there
        file.seek(0)
        file.truncate()
        file.write(f"process {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        file.flush()
        self._file = file
        os.environ[HELD_VARIABLE] = self.path

    def release(self) -> None:
        if self._file is None:
            return
        os.environ.pop(HELD_VARIABLE, None)
        try:
            os.unlink(self.path)  # while still locked: whoever opens the path next creates a new file
        except FileNotFoundError:
            pass
        self._file.close()
        self._file = None


def _same_file(file: IO[str], path: str) -> bool:
    try:
        return os.fstat(file.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
