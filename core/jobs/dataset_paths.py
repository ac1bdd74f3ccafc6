"""Which local paths can be a dataset, checked before ``datasets`` reads them: a file in a format it reads, or a
folder read whole (of one format, or written by ``save_to_disk``); a named pipe, a link that leads nowhere or a
folder of mixed files is refused in one line naming what it is."""

from __future__ import annotations

import os
import re
import stat

from accelgen.common.errors import UsageError, reason, user_errors

#: Local file suffixes and the ``datasets`` builder that reads them.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def check_local_path(given: str, source: str) -> None:
    """Refuse a local ``source`` that cannot be read as a dataset, before ``datasets`` tries (a named pipe would
    block it, a link that leads nowhere would send it to the Hub, a folder of mixed files is read in part)."""
    if os.path.lexists(source) and not os.path.exists(source):
        with user_errors("", "", explain=lambda error: f"Dataset path {given!r} is a symbolic link that leads nowhere "
                         f"({reason(error)}): point it at a dataset file, or pass the file itself."):
            os.stat(source)
    if not os.path.exists(source):
        if source.startswith((".", "/", "~")):
            raise UsageError(f"Dataset path {source!r} does not exist.")
        return  # a Hub dataset
    if os.path.isdir(source):
        names = folder_files(source)
        odd = next((name for name in names if not os.path.isfile(os.path.join(source, name))), None)
        if odd:
            raise UsageError(f"Dataset folder {given!r} holds {odd!r}, which is {_file_kind(os.path.join(source, odd))}: "
                             f"move it out of the folder.")
        if not saved_with_save_to_disk(source):
            _check_folder_files(given, names)
        return
    if not os.path.isfile(source):
        raise UsageError(f"Dataset path {given!r} is {_file_kind(source)}, not a file: pass a JSON, JSONL, CSV or Parquet "
                         f"file, or a folder of them.")
    if os.path.splitext(source)[1].lower() not in FILE_BUILDERS:
        raise UsageError(f"Cannot read {source!r}: use a file ending in {', '.join(FILE_BUILDERS)}, or a dataset folder.")
    with user_errors(f"Cannot read dataset {given!r}", "make it readable (chmod u+r), or pass another --dataset"):
        open(source, "rb").close()


def _file_kind(path: str) -> str:
    """What ``path``, which is not a regular file or a folder, is: "a named pipe", ..."""
    if not os.path.exists(path):
        return "a symbolic link that leads nowhere"
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


#: How many file names of one kind an error about a folder lists.
NAMES_LISTED = 3


def _check_folder_files(folder: str, names: list[str]) -> None:
    """A folder of data files (``names``, from :func:`folder_files`) is read whole: refuse one holding files of
    several formats (``datasets`` would read only the commonest), or files that are not rows at all. Hidden files
    and the dataset card are not rows; a card that names its data files (``configs:``) decides alone."""
    if "README.md" in names and _card_names_data_files(os.path.join(os.path.expanduser(folder), "README.md")):
        return
    by_format: dict[str, list[str]] = {}
    for name in names:
        if name != "README.md":
            builder = FILE_BUILDERS.get(os.path.splitext(name)[1].lower())
            by_format.setdefault(builder.upper() if builder else "other", []).append(name)
    if set(by_format) <= {"other"}:
        others = f" (only {_some_names(by_format['other'])})" if by_format else ""
        raise UsageError(f"Dataset folder {folder!r} holds no JSON, JSONL, CSV or Parquet file{others}: put the rows in "
                         f"such files there, or pass a file as --dataset.")
    held = "; ".join(f"{kind}: {_some_names(found)}" for kind, found in by_format.items())
    if len(by_format) > 1:
        raise UsageError(f"Dataset folder {folder!r} would be read only in part (it holds {held}): keep files of one "
                         f"format (JSON or JSONL, CSV, Parquet) in it, or pass one file as --dataset.")


def _some_names(names: list[str]) -> str:
    more = f" and {len(names) - NAMES_LISTED} more" if len(names) > NAMES_LISTED else ""
    return ", ".join(names[:NAMES_LISTED]) + more


def folder_files(folder: str) -> list[str]:
    """The files of a dataset folder that ``datasets`` looks at, as sorted paths relative to it: every file in it
    and its sub-folders, hidden ones (and those in hidden folders) aside."""
    def refuse(error: OSError) -> None:
        raise error

    names = []
    with user_errors(f"Cannot read dataset folder {folder!r}", "make it readable (chmod -R u+rX), or pass another --dataset"):
        for parent, folders, files in os.walk(folder, onerror=refuse):
            folders[:] = [name for name in folders if not name.startswith(".")]
            names += [os.path.relpath(os.path.join(parent, name), folder) for name in files if not name.startswith(".")]
    return sorted(names)


def _card_names_data_files(card: str) -> bool:
    """Whether a dataset card's YAML header lists configurations (each naming its data files)."""
    with open(card, encoding="utf-8", errors="replace") as file:
        text = file.read()
    header = re.match(r"---\n(.*?)\n---", text, re.DOTALL)
    return bool(header and re.search(r"^configs:", header.group(1), re.MULTILINE))


def saved_with_save_to_disk(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in ("dataset_dict.json", "state.json"))
