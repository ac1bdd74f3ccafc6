"""Dataset rows that cannot be read: a lone surrogate, a line that is not JSON, a value of the wrong type, a CSV byte
that is not UTF-8, a schema column's objects, a schema nested thousands of levels deep."""

from __future__ import annotations

import json
from pathlib import Path

from hostile_round6_cases.common import QUICK, Outcome, accelgen, error_rows_note, rows_of

SKIP = "--skip-bad-rows"


def _run(folder: Path, dataset: Path, *extra: str, output: str = "out.jsonl") -> Outcome:
    outcome = accelgen(*QUICK, "--dataset", str(dataset), "--output", str(folder / output), *extra)
    rows = rows_of(folder / output)
    errors = [row["error"][:70] for row in rows if row.get("error")]
    outcome.note = "; ".join(filter(None, [outcome.note, error_rows_note(folder / output) if rows else "",
                                           f"error: {errors[0]!r}" if errors else ""]))
    return outcome


def _surrogate_file(folder: Path, name: str) -> Path:
    rows = ['{"text": "a quick"}', '{"text": "\\udc80 fox"}', '{"text": "brown dog"}']
    path = folder / name
    path.write_text("[\n" + ",\n".join(rows) + "\n]\n" if "array" in name else "".join(row + "\n" for row in rows))
    return path


def case_lone_surrogate_jsonl_skip(folder: Path) -> Outcome:
    """A .jsonl row holding "\\udc80 fox", --skip-bad-rows: that row is an error row ("holds a lone surrogate"), exit 0."""
    return _run(folder, _surrogate_file(folder, "rows.jsonl"), SKIP)


def case_lone_surrogate_json_array_skip(folder: Path) -> Outcome:
    """The same rows as one JSON array (.json), --skip-bad-rows: the same error row, exit 0."""
    return _run(folder, _surrogate_file(folder, "rows_array.json"), SKIP)


def case_lone_surrogate_without_flag(folder: Path) -> Outcome:
    """The .jsonl row holding "\\udc80 fox" without the flag: one line naming row 1 and the fix, exit 2."""
    return _run(folder, _surrogate_file(folder, "rows.jsonl"))


def _cut_file(folder: Path, name: str = "rows.jsonl") -> Path:
    path = folder / name
    path.write_text('{"text": "a quick"}\n{"text": "brown\n{"text": "brown dog"}\n')
    return path


def case_bad_json_line_skip(folder: Path) -> Outcome:
    """A .jsonl whose line 2 is cut short, --skip-bad-rows: row 1 an error row ("line 2 is not valid JSON"), exit 0."""
    return _run(folder, _cut_file(folder), SKIP)


def case_bad_json_line_json_file_skip(folder: Path) -> Outcome:
    """The same lines in a .json file, --skip-bad-rows: the same error row, exit 0."""
    return _run(folder, _cut_file(folder, "rows.json"), SKIP)


def case_bad_json_line_without_flag(folder: Path) -> Outcome:
    """The cut line without the flag: one line naming line 2 (row 1), the fix and --skip-bad-rows, exit 2."""
    return _run(folder, _cut_file(folder))


def case_wrong_types_skip(folder: Path) -> Outcome:
    """Rows holding a number, an array line and an object, --skip-bad-rows: each an error row, the texts done, exit 0."""
    path = folder / "rows.jsonl"
    path.write_text('{"text": "a quick"}\n{"text": 7}\n["a", "list"]\n{"text": {"a": 1}}\n{"text": "brown dog"}\n')
    return _run(folder, path, SKIP)


def case_resume_after_error_rows(folder: Path) -> Outcome:
    """A run over bad rows stopped after 2 rows (--limit 2), then re-run: resumes, 6 rows in all, 2 error rows, exit 0."""
    path = folder / "rows.jsonl"
    path.write_text(_surrogate_file(folder, "a.jsonl").read_text() + _cut_file(folder, "b.jsonl").read_text())
    first = _run(folder, path, SKIP, "--limit", "2")
    if first.status != 0:
        return first
    return _run(folder, path, SKIP)


def _csv_file(folder: Path) -> Path:
    path = folder / "rows.csv"
    path.write_bytes("text,n\na quick,1\ncaf\xe9 fox,2\nbrown dog,3\n".encode("latin-1"))
    return path


def case_csv_byte_not_utf8_skip(folder: Path) -> Outcome:
    """A CSV row holding the byte 0xe9 (Latin-1), --skip-bad-rows: that row an error row ("is not UTF-8 text"), exit 0."""
    return _run(folder, _csv_file(folder), SKIP)


def case_csv_byte_not_utf8_without_flag(folder: Path) -> Outcome:
    """The same CSV without the flag: one line naming row 1, its line and the fix, exit 2."""
    return _run(folder, _csv_file(folder))


def case_schema_objects_merged_by_parquet(folder: Path) -> Outcome:
    """A Parquet --schema-column of objects (read through one merged type): refused in one line, exit 2."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schemas = [{"type": "object", "properties": {"a": {"type": "string"}, "b": {"const": None}}},
               {"properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "type": "object"}]
    path = folder / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": text, "schema": schema} for text, schema in zip("ab", schemas)]), path)
    return _run(folder, path, "--schema-column", "schema")


def case_schema_objects_in_jsonl(folder: Path) -> Outcome:
    """A .jsonl --schema-column whose rows order their properties differently (one holds {"const": null}): each row
    held to its own schema, exit 0."""
    schemas = [{"type": "object", "properties": {"a": {"type": "string"}, "b": {"const": None}}},
               {"properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "type": "object"}]
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": text, "schema": schema}) + "\n" for text, schema in zip("ab", schemas)))
    return _run(folder, path, "--schema-column", "schema", "--max-new-tokens", "8")


def _deep_schema_file(folder: Path, suffix: str) -> Path:
    deep = '{"type": "object", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    path = folder / f"rows{suffix}"
    if suffix == ".csv":
        path.write_text('text,schema\na,"{""type"": ""object""}"\nb,"' + deep.replace('"', '""') + '"\nc,\n')
    else:
        path.write_text('{"text": "a", "schema": {"type": "object"}}\n{"text": "b", "schema": %s}\n{"text": "c"}\n' % deep)
    return path


def case_schema_5000_deep_jsonl_skip(folder: Path) -> Outcome:
    """A .jsonl --schema-column value nested 5,000 deep, --skip-bad-rows: that row an error row, no RecursionError."""
    return _run(folder, _deep_schema_file(folder, ".jsonl"), "--schema-column", "schema", SKIP)


def case_schema_5000_deep_csv_without_flag(folder: Path) -> Outcome:
    """A CSV --schema-column text nested 5,000 deep, no flag: one line naming row 1 and the fix, exit 2."""
    return _run(folder, _deep_schema_file(folder, ".csv"), "--schema-column", "schema")
