"""One writer per output file: an exclusive lock on ``<output>.lock`` held for the whole run.

The lock is the kernel's (``flock``), so a run that dies in any way (SIGKILL included) leaves no lock that
counts: its file stays behind, but the next run takes it over. The file names its holder (process id,
machine, start time) for the one line that refuses a second writer. A tensor-parallel job's launcher holds
the lock for its ranks: the ranks it starts inherit :data:`HELD_VARIABLE` and do not lock again.

The lock goes by the file, not by the name given: the lock file lies beside the output's real path (two
symbolic links to one output take one lock), and an output that exists is locked itself too (two hard links
to it take one lock). The lock file is accelgen's own: one that is a link, has other names, or holds
someone else's text is refused, never written.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time

from accelgen.common.errors import UsageError, reason, user_errors
from accelgen.common.output_files import real_path

#: Set by the process holding an output's lock to the lock's path, for the processes it starts.
HELD_VARIABLE = "ACCELGEN_OUTPUT_LOCK_HELD"

#: How a lock file's text begins (see :meth:`OutputLock._write_holder`): an existing file that begins
#: otherwise is not a lock left by an earlier run.
HOLDER_PREFIX = "process "


class OutputLock:
    """The lock of ``output``; :meth:`acquire` raises UsageError when another live run holds it."""

    def __init__(self, output: str):
        self.output = output
        self.path = real_path(output) + ".lock"
        self._descriptor: int | None = None
        self._output_descriptor: int | None = None  # the output itself, when it exists (hard links)

    @property
    def held_by_parent(self) -> bool:
        return os.environ.get(HELD_VARIABLE) == self.path

    def acquire(self) -> None:
        if self.held_by_parent:
            return
        while True:
            with user_errors(f"Cannot lock --output {self.output!r} (through {self.path!r})",
                             "choose an --output on a file system that supports locks (a local disk)", (OSError,)):
                descriptor = self._open_lock_file()
                try:
                    self._check_lock_file(descriptor)
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read(descriptor).strip() or "another process"
                    os.close(descriptor)
                    raise self._in_use(holder) from None
                except BaseException:
                    os.close(descriptor)  # not ours to remove
                    raise
            if _same_file(descriptor, self.path):
                break
            os.close(descriptor)  # the holder removed the file as we opened it: lock the one now there
        self._descriptor = descriptor  # accelgen's lock file, held: removed again by release()
        try:
            self._lock_output_file()
            self._write_holder(descriptor)
        except BaseException:
            self.release()
            raise
        os.environ[HELD_VARIABLE] = self.path

    def _open_lock_file(self) -> int:
        """The lock file, opened or made; a symbolic link in its place is refused, its target never opened."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UsageError(
                    f"Lock file {self.path!r} (of --output {self.output!r}) is a symbolic link (to "
                    f"{os.readlink(self.path)!r}); accelgen makes this file itself and never writes through a link: "
                    f"remove the link.") from None
            if error.errno == errno.EISDIR:
                raise self._not_ours("a folder") from None
            raise

    def _check_lock_file(self, descriptor: int) -> None:
        """Refuse a lock file that is not accelgen's to rewrite: not a regular file, a file with other names
        (a hard link: rewriting it would rewrite them), or one holding other text than a holder line."""
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise self._not_ours("not a regular file")
        if status.st_nlink > 1:
            raise self._not_ours(f"a file with {status.st_nlink - 1} other name(s) (a hard link)")
        text = _read(descriptor)
        if text and not text.startswith(HOLDER_PREFIX):
            raise self._not_ours("a file that accelgen did not write")

    def _not_ours(self, kind: str) -> UsageError:
        return UsageError(f"Lock file {self.path!r} (of --output {self.output!r}) is {kind}; accelgen makes this "
                          f"file itself: move it away, or choose another --output.")

    def _lock_output_file(self) -> None:
        """Lock the output itself when it exists: a run reaching it by another name (a hard link, whose lock
        file is another) is refused too."""
        try:
            descriptor = os.open(self.output, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as error:
            raise UsageError(f"Cannot open --output {self.output!r}: {reason(error)}: choose another file.") from None
        self._output_descriptor = descriptor
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._in_use("through another name of the same file") from None
        except OSError:
            pass  # a file system without locks on this file: the lock file alone (already held) decides

    def _write_holder(self, descriptor: int) -> None:
        """Put this process's name in the lock file, for the line that refuses a second writer; a full disk
        refuses the run now, before anything is loaded or written."""
        holder = f"{HOLDER_PREFIX}{os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        with user_errors(f"Cannot write lock file {self.path!r} of --output {self.output!r}",
                         "free some space (the disk may be full) and run the command again; nothing else was written",
                         (OSError,)):
            os.ftruncate(descriptor, 0)
            data = holder.encode()
            written = 0
            while written < len(data):
                written += os.pwrite(descriptor, data[written:], written)

    def _in_use(self, holder: str) -> UsageError:
        return UsageError(
            f"--output {self.output!r} is being written by another accelgen run ({holder}): wait for it "
            f"to end or stop it, or choose another --output (two writers would mix their rows)."
        )

    def release(self) -> None:
        if self._descriptor is None:
            return
        os.environ.pop(HELD_VARIABLE, None)
        try:
            os.unlink(self.path)  # while still locked: whoever opens the path next creates a new file
        except FileNotFoundError:
            pass
        os.close(self._descriptor)
        self._descriptor = None
        if self._output_descriptor is not None:
            os.close(self._output_descriptor)
            self._output_descriptor = None


def _read(descriptor: int) -> str:
    """The start of an open lock file's text."""
    return os.pread(descriptor, 4096, 0).decode("utf-8", "replace")


def _same_file(descriptor: int, path: str) -> bool:
    try:
        opened, named = os.fstat(descriptor), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)
