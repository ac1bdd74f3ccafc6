"""What the datasets library does not say of a local JSON-lines file, read line by line ourselves: the first line that
does not parse, and the rows whose text holds a lone surrogate (a ``\\ud800`` escape without its pair, which no text
holds: the library refuses the file, or in a column of mixed types drops the character without a word, so that
``"\\ud800"`` reads as an empty row and ``"a\\ud800b"`` as ``"ab"``). A row is a line that is not blank."""

from __future__ import annotations

import json
import re

from accelgen.common.errors import first_line
from accelgen.common.prompts import text_problem

#: A JSON escape of a UTF-16 surrogate: only the lines holding one are parsed to look for a lone one.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def first_bad_json_line(path: str) -> str | None:
    """Where a JSON-lines file first fails to parse, and the fix ("line 3 (row 2) is not valid JSON (...): fix or
    remove that line"), or None when every line parses (or the file is one JSON document over several lines)."""
    with open(path, "rb") as file:
        lines = [(number, line) for number, line in enumerate(file, start=1) if line.strip()]
    for row, (number, line) in enumerate(lines):
        try:
            json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))  # bytes would be taken for UTF-16 too
        except UnicodeDecodeError as error:
            return (f"line {number} (row {row}) is not UTF-8 text (byte 0x{line[error.start]:02x} at byte {error.start}): "
                    f"convert the file to UTF-8, e.g. with iconv -t UTF-8")
        except ValueError as error:
            if row == 0 and line.lstrip().startswith((b"[", b"{")) and not line.rstrip().endswith((b"]", b"}")):
                return None  # one JSON document over several lines, not JSON lines
            last_unended = row == len(lines) - 1 and not line.endswith(b"\n")
            torn = " (a torn last line: the file is still being written, or was cut short)" if last_unended else ""
            return f"line {number} (row {row}) is not valid JSON{torn} ({first_line(error)}): fix or remove that line"
    return None


def lone_surrogate_rows(path: str, column: str) -> dict[int, str]:
    """The rows of the JSON-lines file ``path`` whose ``column`` holds a lone surrogate (in its text, or in a message
    of a conversation), each with the problem as a clause ("holds a lone surrogate (U+D800 at character 0, ...): ...")."""
    found = {}
    with open(path, "rb") as file:
        rows = (line for line in file if line.strip())
        for row, line in enumerate(rows):
            if not SURROGATE_ESCAPE.search(line):
                continue
            try:
                value = json.loads(line).get(column)
            except (ValueError, AttributeError):
                continue  # not a JSON object: said where the line is read
            problem = next(filter(None, map(text_problem, _texts_in(value))), None)
            if problem:
                found[row] = problem
    return found


def _texts_in(value: object) -> list[str]:
    """The texts of a row's value: itself, or the strings of its messages."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [text for message in value if isinstance(message, dict) for text in message.values() if isinstance(text, str)]
    return []
