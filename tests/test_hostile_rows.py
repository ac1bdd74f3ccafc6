"""Dataset rows that cannot be read (issue 73, round 6): a JSON line that does not parse, a lone surrogate, a value of
the wrong type, a CSV row holding a byte that is not UTF-8, a schema nested thousands of levels deep. Under
``--skip-bad-rows`` each is an error row saying what is wrong with that row, the rows around it complete and a
re-run resumes; without it, one ``accelgen: error:`` line naming the row (or line) and the fix, exit status 2.
A schema column's rows are each read as their own JSON, never through one type merged over the rows.

Runs ``accelgen.cli.main`` in this process on the built-in model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import one_error_line_in

from accelgen.cli import main

QUICK = ["run", "--device", "cpu", "--max-new-tokens", "2", "--quiet"]
LONE = ("holds a lone surrogate (U+DC80 at character 0, half of a UTF-16 pair without its other half, which is no "
        "character)")
SKIP = "or pass --skip-bad-rows to write such rows as error rows and go on"


def run(capsys, dataset: Path, output: Path, *extra: str) -> tuple[int, str]:
    status = main([*QUICK, "--dataset", str(dataset), "--output", str(output), *extra])
    return status, capsys.readouterr().err


def rows_of(output: Path) -> list[dict]:
    return [json.loads(line) for line in output.read_text(encoding="utf-8").split("\n") if line]


def errors_of(output: Path) -> list[str | None]:
    return [row.get("error") for row in rows_of(output)]


def write_rows(path: Path, lines: list[str]) -> Path:
    """``lines`` (JSON texts of rows) as the file ``path``: JSON lines, or for a ``.json`` named ``*array*`` one JSON
    array of them."""
    if "array" in path.name:
        path.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    else:
        path.write_text("".join(line + "\n" for line in lines))
    return path


SURROGATE_ROWS = ['{"text": "a quick"}', '{"text": "\\udc80 fox"}', '{"text": "brown dog"}']


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows_array.json"])
@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_a_lone_surrogate_is_that_rows_error_and_the_job_goes_on(tmp_path, capsys, name, streaming):
    dataset, output = write_rows(tmp_path / name, SURROGATE_ROWS), tmp_path / "out.jsonl"
    status, error = run(capsys, dataset, output, "--skip-bad-rows", *streaming)
    assert status == 0, error
    rows = rows_of(output)
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert errors_of(output) == [None, LONE, None]
    assert [rows[0]["prompt"], rows[2]["prompt"]] == ["a quick", "brown dog"]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows_array.json"])
def test_without_the_flag_a_lone_surrogate_is_one_line_naming_the_row(tmp_path, capsys, name):
    dataset, output = write_rows(tmp_path / name, SURROGATE_ROWS), tmp_path / "out.jsonl"
    status, error = run(capsys, dataset, output)
    assert status == 2
    assert one_error_line_in(error) == (f"accelgen: error: Dataset '{dataset}' row 1, column 'text', {LONE}: remove it, "
                                        f"or give it its pair, {SKIP} (rows count from 0, as the output's \"index\").\n")
    assert not output.exists()


CUT_ROWS = ['{"text": "a quick"}', '{"text": "brown', '{"text": "brown dog"}']


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
@pytest.mark.parametrize("streaming", [[], ["--streaming"]])
def test_a_line_that_is_not_json_is_that_rows_error_and_the_job_goes_on(tmp_path, capsys, name, streaming):
    dataset, output = write_rows(tmp_path / name, CUT_ROWS), tmp_path / "out.jsonl"
    status, error = run(capsys, dataset, output, "--skip-bad-rows", *streaming)
    assert status == 0, error
    errors = errors_of(output)
    assert errors[0] is None and errors[2] is None
    assert errors[1].startswith("line 2 is not valid JSON (Unterminated string starting at"), errors[1]
    status, error = run(capsys, dataset, tmp_path / "again.jsonl")
    assert status == 2
    line = one_error_line_in(error)
    assert line.startswith(f"accelgen: error: Dataset '{dataset}' line 2 (row 1) is not valid JSON (Unterminated string")
    assert line.endswith(f"): fix or remove that line, {SKIP}.\n")


def test_rows_of_the_wrong_type_are_error_rows(tmp_path, capsys):
    dataset = write_rows(tmp_path / "rows.jsonl", ['{"text": "a quick"}', '{"text": 7}', '["a", "list"]', '"text"',
                                                  '{"text": {"a": 1}}', '{"other": "x"}', '{"text": "brown dog"}'])
    output = tmp_path / "out.jsonl"
    status, error = run(capsys, dataset, output, "--skip-bad-rows")
    assert status == 0, error
    assert errors_of(output) == [
        None, "holds int, not text", "line 3 is a JSON array, not an object of columns",
        "line 4 is a JSON string, not an object of columns", "holds dict, not text", "is null (no text)", None]


def test_a_re_run_resumes_after_its_error_rows(tmp_path, capsys):
    dataset = write_rows(tmp_path / "rows.jsonl", SURROGATE_ROWS + CUT_ROWS)
    output = tmp_path / "out.jsonl"
    assert run(capsys, dataset, output, "--skip-bad-rows", "--limit", "2")[0] == 0
    assert len(rows_of(output)) == 2
    status, error = run(capsys, dataset, output, "--skip-bad-rows")
    assert status == 0, error
    rows = rows_of(output)
    assert [row["index"] for row in rows] == list(range(6))
    assert [bool(error) for error in errors_of(output)] == [False, True, False, False, True, False]


BAD_CSV = "text,n\na quick,1\ncaf\xe9 fox,2\nbrown dog,3\n".encode("latin-1")


def test_a_csv_row_with_a_byte_that_is_not_utf8_is_that_rows_error(tmp_path, capsys):
    dataset, output = tmp_path / "rows.csv", tmp_path / "out.jsonl"
    dataset.write_bytes(BAD_CSV)
    for streaming in ([], ["--streaming"]):
        output.unlink(missing_ok=True)
        status, error = run(capsys, dataset, output, "--skip-bad-rows", *streaming)
        assert status == 0, error
        rows = rows_of(output)
        assert errors_of(output) == [None, "is not UTF-8 text (byte 0xe9 at character 3, line 3 of the file)", None]
        assert [rows[0]["prompt"], rows[2]["prompt"]] == ["a quick", "brown dog"]
    status, error = run(capsys, dataset, tmp_path / "again.jsonl")
    assert status == 2
    assert one_error_line_in(error) == (
        f"accelgen: error: Dataset '{dataset}' row 1, column 'text', is not UTF-8 text (byte 0xe9 at character 3, line 3 "
        f"of the file): convert it to UTF-8, e.g. with iconv -t UTF-8, {SKIP} (rows count from 0, as the output's "
        f"\"index\").\n")


def test_a_byte_that_is_not_utf8_in_a_csv_column_not_read_harms_no_row(tmp_path, capsys):
    dataset, output = tmp_path / "rows.csv", tmp_path / "out.jsonl"
    dataset.write_bytes("text,note\na quick,caf\xe9\nbrown dog,x\n".encode("latin-1"))
    status, error = run(capsys, dataset, output)
    assert status == 0, error
    assert [row["prompt"] for row in rows_of(output)] == ["a quick", "brown dog"]


# -- a schema column: each row's schema is its own JSON ------------------------------------------------------------

FIRST = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"const": None}}}
SECOND = {"properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "type": "object"}


def structures_of(dataset: Path) -> list[str | None]:
    from accelgen.jobs.dataset_rows import DatasetRequest, open_rows

    rows = open_rows(DatasetRequest(str(dataset), schema_column="schema"))
    return [getattr(getattr(text, "settings", None), "structure", None) and text.settings.structure.text
            for text in rows.texts]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows_array.json"])
def test_each_rows_schema_is_read_as_its_own_json(tmp_path, name):
    dataset = write_rows(tmp_path / name, [json.dumps({"text": "a", "schema": FIRST}),
                                           json.dumps({"text": "b", "schema": SECOND}),
                                           json.dumps({"text": "c", "schema": None})])
    compact = [json.dumps(schema, separators=(",", ":")) for schema in (FIRST, SECOND)]
    assert structures_of(dataset) == [*compact, None]


def test_a_column_of_schema_objects_merged_by_its_reader_is_refused(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    dataset = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "a", "schema": FIRST}, {"text": "b", "schema": SECOND}]), dataset)
    status, error = run(capsys, dataset, tmp_path / "out.jsonl", "--schema-column", "schema")
    assert status == 2
    line = one_error_line_in(error)
    assert line.startswith("accelgen: error: --schema-column 'schema' holds objects read through one type merged over"), line
    assert "store each schema as JSON text" in line


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.csv"])
@pytest.mark.parametrize("depth", [500, 5000])  # within what Python's JSON reader reads, and past it
def test_a_schema_nested_thousands_deep_is_that_rows_problem(tmp_path, capsys, name, depth):
    dataset, output = tmp_path / name, tmp_path / "out.jsonl"
    schemas = [json.dumps({"type": "object"}), '{"type": "object", "x": ' + "[" * depth + "]" * depth + "}", ""]
    if name.endswith(".csv"):
        dataset.write_text("text,schema\n" + "".join(f'{text},"{schema.replace(chr(34), 2 * chr(34))}"\n'
                                                      for text, schema in zip("abc", schemas)))
    else:
        dataset.write_text('{"text": "a", "schema": %s}\n{"text": "b", "schema": %s}\n{"text": "c"}\n'
                           % (schemas[0], schemas[1]))
    status, error = run(capsys, dataset, output, "--schema-column", "schema", "--skip-bad-rows")
    assert status == 0, error
    errors = errors_of(output)
    assert errors[0] is None and errors[2] is None and "deep" in errors[1], errors
    status, error = run(capsys, dataset, tmp_path / "again.jsonl", "--schema-column", "schema")
    assert status == 2
    line = one_error_line_in(error)
    assert "row 1" in line and "deep" in line and SKIP in line, line
    if depth == 500:  # read, then refused by the schema's own bound, naming the column
        assert "row 1, column 'schema', nests deeper than" in line
