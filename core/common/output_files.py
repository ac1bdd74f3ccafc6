"""Files the commands write (completions, bench results, tables, charts): checked before any work starts,
and written whole or not at all, so a mistake or a full disk never costs what was already there.

An output is known by what it is, not by the name it was given: a symbolic link named as an output is
followed to the real file (so two names of one file are one output), while the files a command makes
beside it for itself (temporary files, locks, run records) are never written through a link.
"""

from __future__ import annotations

import os
import secrets
import stat
from typing import Callable

from accelgen.common.errors import UsageError, user_errors


def real_path(path: str) -> str:
    """The file ``path`` names once every symbolic link (and ``..``) on the way is followed: the one name
    of an output, whatever name it was given."""
    return os.path.realpath(path)


def holds_rows(path: str | None) -> bool:
    """Whether ``path`` names a completion file with something in it (what a stopped run may say it kept)."""
    return path is not None and os.path.isfile(path) and os.path.getsize(path) > 0


def check_output_file(path: str, option: str, example: str, *, exists_ok: bool = True) -> None:
    """Raise UsageError, before any work, when ``option`` (e.g. "--output") names ``path`` that cannot be
    written as a regular file: a folder, a device or pipe, a missing or read-only folder, a read-only file,
    or (``exists_ok`` False) any existing file. ``example`` is a file name to suggest."""
    folder = os.path.dirname(real_path(path))  # where the file is written: the link's target's folder
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


def is_same_file(first: str, second: str) -> bool:
    """Whether two names reach one file: the same real path, or (hard links) the same device and inode."""
    if real_path(first) == real_path(second):
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist (yet)
        return False


def refuse_link(path: str, what: str) -> None:
    """Raise UsageError when ``path``, a file accelgen makes for itself (``what`` says which), is a symbolic
    link: writing it would write the link's target, a file the run did not create."""
    if os.path.islink(path):
        raise UsageError(f"{what} {path!r} is a symbolic link (to {os.readlink(path)!r}); accelgen makes this file "
                         f"itself and never writes through a link: remove the link.")


def replace_whole(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(temporary path)``, then rename the temporary file onto ``path`` (a link there is replaced,
    its target never written): readers see the old file or the new one, never half of one; a failure (a full
    disk) leaves it as it was and raises. The temporary file is a new one beside it (never an existing file,
    nor a link)."""
    temporary = _new_file_beside(path)
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.remove(temporary)


def _new_file_beside(target: str) -> str:
    """An empty file of a new, unguessable name next to ``target``, made by this call (O_EXCL: a name that
    exists, a planted link included, is never opened)."""
    while True:
        temporary = f"{target}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
            return temporary
        except FileExistsError:
            continue


def write_whole_file(path: str, option: str, write: Callable[[str], None],
                     fix: str = "free some space or choose another file; nothing was changed") -> None:
    """:func:`replace_whole` of the real file ``path`` names (the user's link to it stays and shows the new
    file), with a failure as one line naming ``option`` (e.g. "--output") and ``fix``."""
    with user_errors(f"Cannot write {option} {path!r}", fix):
        replace_whole(real_path(path), write)
