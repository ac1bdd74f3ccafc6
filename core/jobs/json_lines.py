"""The rows of a local JSON file, read by us rather than by the datasets library: one object a line (JSON lines), or a
JSON array of objects. Each row is read as its own JSON, so that a line which does not parse, a value of another
type or a lone surrogate (a ``\\ud800`` escape without its pair, which no text holds) is that row's problem, never the
file's: the datasets library refuses a whole file for one such row, drops a lone surrogate without a word in a column
of mixed types, and reads a column of objects through one type merged over the rows (another row's key order, nulls
for the keys a row lacks). A row is a line that is not blank; a line ends at ``\\n``, ``\\r\\n`` or ``\\r``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Iterator, Sequence

from accelgen.common.errors import UsageError, first_line, user_errors
from accelgen.common.prompts import text_problem


@dataclasses.dataclass(frozen=True)
class UnreadableRow:
    """A row that cannot be read: its line (None in a JSON array), what is wrong as a clause, and the fix."""

    line: int | None
    what: str
    fix: str

    def where(self, row: int) -> str:
        """The row as a message names it: "line 3 (row 2)", or "row 2"."""
        return f"line {self.line} (row {row})" if self.line else f"row {row}"

    @property
    def problem(self) -> str:
        """What is wrong, as an error row says it ("line 3 is not valid JSON (...)")."""
        return f"line {self.line} {self.what}" if self.line else self.what


class JsonRows:
    """The rows of the JSON file ``path`` (``source``: as the user named it), read again from the file on each pass; a
    JSON array is read whole, once."""

    def __init__(self, source: str, path: str):
        self.source, self.path = source, path
        self._array: list | None = None
        with self._reading(), open(path, "rb") as file:
            self.is_array = file.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")

    def rows(self) -> Iterator[dict | UnreadableRow]:
        """Each row in file order: its object, or why it cannot be read."""
        if self.is_array:
            for value in self._array_values():
                yield value if isinstance(value, dict) else _not_an_object(None, value)
            return
        with self._reading(), open(self.path, "rb") as file:
            number, first = 0, True
            for chunk in file:
                lines = chunk.splitlines()
                for place, line in enumerate(lines, start=1):
                    number += 1
                    if line.strip():
                        torn = place == len(lines) and not chunk.endswith((b"\n", b"\r"))  # the file's last bytes
                        row = _read_line(line, number, torn)
                        if first and isinstance(row, UnreadableRow):
                            self._refuse_one_object()
                        first = False
                        yield row

    def _refuse_one_object(self) -> None:
        """Raise UsageError when the file is one JSON object written over several lines: a document, not rows."""
        try:
            with open(self.path, "rb") as file:
                value = json.loads(file.read().decode("utf-8-sig"))
        except (ValueError, RecursionError):
            return  # not one document: its first line is a bad row
        if isinstance(value, dict):
            raise UsageError(f"Dataset {self.source!r} is one JSON object over several lines, not rows: write one object "
                             f"a line (JSON lines), or a JSON array of objects.")

    def values(self, columns: Sequence[str | None]) -> Iterator[tuple | UnreadableRow]:
        """Each row's values of ``columns`` (None for a column not asked for, or that the row lacks)."""
        for row in self.rows():
            yield row if isinstance(row, UnreadableRow) else tuple(column and row.get(column) for column in columns)

    def column_types(self, most_rows: int | None = None) -> dict[str, set[str]]:
        """The keys of the rows (of the first ``most_rows``), in the order they first appear, each with the JSON types
        of its values ("string", "number", "array", ...; "null" where a row lacks it)."""
        types: dict[str, set[str]] = {}
        rows_holding: dict[str, int] = {}
        rows = 0
        for row in itertools.islice(self.rows(), most_rows):
            if isinstance(row, dict):
                rows += 1
                for name, value in row.items():
                    types.setdefault(name, set()).add(json_type(value))
                    rows_holding[name] = rows_holding.get(name, 0) + 1
        for name, found in types.items():
            if rows_holding[name] < rows:
                found.add("null")
        return types

    def _array_values(self) -> list:
        """The elements of the file's JSON array, read once; UsageError for a file that is not one array (no row can
        be told apart from the next in a document that does not parse)."""
        if self._array is None:
            with self._reading(), open(self.path, "rb") as file:
                data = file.read()
            fix = "fix the file, or write it as JSON lines (one object a line), whose bad lines are rows of their own"
            try:
                value = json.loads(data.decode("utf-8-sig"))
            except UnicodeDecodeError as error:
                raise UsageError(f"Dataset {self.source!r} is not UTF-8 text (byte 0x{data[error.start]:02x} at byte "
                                 f"{error.start}): convert it to UTF-8, e.g. with iconv -t UTF-8.") from None
            except RecursionError:
                raise UsageError(f"Dataset {self.source!r} {TOO_DEEP}: {fix}.") from None
            except ValueError as error:
                raise UsageError(f"Dataset {self.source!r} is not valid JSON ({first_line(error)}): {fix}.") from None
            if not isinstance(value, list):
                raise UsageError(f"Dataset {self.source!r} is not a JSON array of rows: {fix}.")
            self._array = value
        return self._array

    def _reading(self):
        return user_errors(f"Cannot read dataset {self.source!r}", "make it readable, or pass another --dataset")


#: What a value nested deeper than Python's JSON reader goes is, as a clause.
TOO_DEEP = "is nested too deep to read (arrays or objects nested thousands of levels deep)"


#: How the clause saying that a line does not parse starts.
NOT_JSON = "is not valid JSON"


def _read_line(line: bytes, number: int, torn: bool) -> dict | UnreadableRow:
    """The object a line holds, or why it cannot be a row."""
    value = _parsed_line(line, number, torn)
    return value if isinstance(value, (dict, UnreadableRow)) else _not_an_object(number, value)


def _parsed_line(line: bytes, number: int, torn: bool) -> object:
    """The JSON value line ``number`` holds (``torn``: the file's last bytes, with no line end), or an UnreadableRow
    saying why it cannot be read."""
    fix = "fix or remove that line"
    try:
        return json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))  # bytes would be taken for UTF-16 too
    except UnicodeDecodeError as error:
        return UnreadableRow(number, f"is not UTF-8 text (byte 0x{line[error.start]:02x} at byte {error.start})",
                             "convert the file to UTF-8, e.g. with iconv -t UTF-8")
    except RecursionError:
        return UnreadableRow(number, TOO_DEEP, fix)
    except ValueError as error:
        cut = " (a torn last line: the file is still being written, or was cut short)" if torn else ""
        return UnreadableRow(number, f"{NOT_JSON}{cut} ({first_line(error)})", fix)


def _not_an_object(number: int | None, value: object) -> UnreadableRow:
    return UnreadableRow(number, f"is a JSON {json_type(value)}, not an object of columns",
                         "make it one ({\"text\": ...}), or remove it")


#: The types json.loads gives, as JSON names them.
JSON_TYPES = {str: "string", int: "number", float: "number", bool: "boolean", list: "array", dict: "object",
              type(None): "null"}


def json_type(value: object) -> str:
    """A JSON value's type, as JSON names it ("string", "number", "boolean", "array", "object", "null")."""
    return JSON_TYPES[type(value)]


def surrogate_problem(value: object) -> str | None:
    """Why a value read from JSON (a text, a conversation, a schema) holds no text, as a clause with its fix: a string
    in it (key or value, at any depth: walked without recursion) holding a lone surrogate. None when there is none."""
    waiting = [value]
    while waiting:
        item = waiting.pop()
        if isinstance(item, str):
            problem = text_problem(item, escaped_bytes=False)
            if problem:
                return problem
        elif isinstance(item, dict):
            waiting += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            waiting += item
    return None


def first_bad_json_line(path: str) -> str | None:
    """Where a JSON-lines file first fails to parse, and the fix ("line 3 (row 2) is not valid JSON (...): fix or
    remove that line"), or None when every line parses (or the file is one JSON document over several lines)."""
    with open(path, "rb") as file:
        lines = [(number, line) for number, line in enumerate(file, start=1) if line.strip()]
    for row, (number, line) in enumerate(lines):
        value = _parsed_line(line, number, torn=row == len(lines) - 1 and not line.endswith(b"\n"))
        if isinstance(value, UnreadableRow):
            if row == 0 and value.what.startswith(NOT_JSON) and line.lstrip().startswith((b"[", b"{")) \
                    and not line.rstrip().endswith((b"]", b"}")):
                return None  # one JSON document over several lines, not JSON lines
            return f"{value.where(row)} {value.what}: {value.fix}"
    return None
