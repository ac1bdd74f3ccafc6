"""The rows of a local CSV file that hold bytes which are not UTF-8, found by us: the datasets library's CSV reader
refuses the whole file for one such byte. The file is then read with each such byte replaced (U+FFFD), and the rows
found here, whose columns in use held one, are that row's problem, never read as text."""

from __future__ import annotations

import codecs
import csv
import io
from typing import Sequence

from accelgen.common.errors import user_errors

#: Bytes read at a time while looking for a byte that is not UTF-8.
CHUNK_BYTES = 1 << 20


def holds_bytes_not_utf8(path: str) -> bool:
    """Whether the file ``path`` holds a byte that is not (part of) UTF-8 text, read in chunks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with user_errors(f"Cannot read dataset {path!r}", "make it readable, or pass another --dataset"):
        with open(path, "rb") as file:
            try:
                while chunk := file.read(CHUNK_BYTES):
                    decoder.decode(chunk)
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                return True
    return False


def rows_not_utf8(path: str, columns: Sequence[str]) -> dict[int, tuple[str, str]]:
    """The rows (counted from 0 after the header, blank lines aside, as the CSV reader counts them) whose value in one
    of ``columns`` holds a byte that is not UTF-8: the column, and the problem as a clause with its fix."""
    with open(path, "rb") as file:
        text = file.read().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    reader = csv.reader(io.StringIO(text, newline=""))
    header, found, row, last_line = None, {}, 0, 0
    for record in reader:
        first_line, last_line = last_line + 1, reader.line_num
        if not record:
            continue  # a blank line: not a row
        if header is None:
            header = record
            continue
        for name, value in zip(header, record):
            at = next((place for place, character in enumerate(value) if "\udc80" <= character <= "\udcff"), None)
            if name in columns and at is not None:
                found[row] = (name, f"is not UTF-8 text (byte 0x{ord(value[at]) & 0xFF:02x} at character {at}, line "
                                    f"{first_line} of the file): convert it to UTF-8, e.g. with iconv -t UTF-8")
                break
        row += 1
    return found
