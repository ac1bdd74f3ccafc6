"""Small text files the user names for a run (a chat template), read whole only when they are what they are said to
be: a regular file of bounded size. A FIFO would block the run without a word until something writes into it, a
device such as /dev/zero never ends (read whole, it fills the memory), a folder holds no text.
"""

from __future__ import annotations

import os
import stat

from accelgen.common.errors import UsageError, user_errors


def read_small_text_file(path: str, option: str, most_bytes: int, fix: str) -> str:
    """The UTF-8 text of the regular file ``path``, given as ``option`` (e.g. "--chat-template"); UsageError in one line
    ending with ``fix`` for anything else: a missing or unreadable file, a folder, a FIFO, socket or device (opened
    without waiting for a writer, and never read), a file of more than ``most_bytes`` bytes, bytes that are not UTF-8."""
    with user_errors(f"Cannot read {option} {path!r}", fix):
        # a FIFO's open waits for a writer unless it is non-blocking; a regular file's read is the same either way
        descriptor = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NONBLOCK)
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            os.close(descriptor)
            raise UsageError(f"{option} {path!r} is {_file_kind(mode)}, not a regular file: {fix}.")
        with os.fdopen(descriptor, "rb") as file:
            data = file.read(most_bytes + 1)
    if len(data) > most_bytes:
        raise UsageError(f"{option} {path!r} holds more than {most_bytes // 1024:,} KiB, more than a file of its kind "
                         f"does: {fix}.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{option} {path!r} is not UTF-8 text (byte 0x{data[error.start]:02x} at byte {error.start}): "
                         f"{fix}.") from None


def _file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words ("a FIFO (named pipe)")."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"
