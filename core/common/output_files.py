"""Files the commands write (completions, bench results, tables, charts): checked before any work starts,
and written whole or not at all, so a mistake or a full disk never costs what was already there."""

from __future__ import annotations

import os
import stat
from typing import Callable

from accelgen.common.errors import UsageError, user_errors


def check_output_file(path: str, option: str, example: str, *, exists_ok: bool = True) -> None:
    """Raise UsageError, before any work, when ``option`` (e.g. "--output") names ``path`` that cannot be
    written as a regular file: a folder, a device or pipe, a missing or read-only folder, a read-only file,
    or (``exists_ok`` False) any existing file. ``example`` is a file name to suggest."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a folder: give a file name such as {example}.")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise UsageError(f"{option} {path!r} is not a regular file (a device or a pipe): give a file name such as {example}.")
    if not os.path.isdir(folder):
        raise UsageError(f"Cannot write {option} {path!r}: folder {folder!r} does not exist.")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"Cannot write {option} {path!r}: permission denied; choose another file.")
    if os.path.exists(path) and not exists_ok:
        raise UsageError(f"{option} {path!r} already exists: pass --overwrite to replace it, or another file name.")


def write_whole_file(path: str, option: str, write: Callable[[str], None]) -> None:
    """Call ``write(temporary path)``, then rename the temporary file onto ``path``: readers see the old
    file or the new one, never half of one. A failure (a full disk) leaves ``path`` as it was."""
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with user_errors(f"Cannot write {option} {path!r}", "free some space or choose another file; nothing was changed"):
            write(temporary)
            os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
