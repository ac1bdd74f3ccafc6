"""Structured output (``--regex``, ``--json-schema``, ``--choice``, ``--schema-column``, a batch request's
``response_format``): structures that admit no text, or none the vocabulary can write, or that the grammar engine
cannot follow; schema files that raised tracebacks or ran unconstrained; completions marked "stop" that did not parse.

Each case runs the built-in model, or (the vocabulary cases) a tiny Llama whose tokenizer writes no "{" or "}", or
no "}" (``tests/structure_models.py``).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

from hostile_round6_cases.common import QUICK, accelgen, error_rows_note, rows_of

TESTS = Path(__file__).resolve().parents[2] / "tests"
PAIR = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3]}}, "required": ["a", "b"],
        "additionalProperties": False}
UNFOLLOWABLE = {"type": "string", "pattern": "^(x{1000}){1000}$"}
DEEP = '{"items":' * 5000 + "{}" + "}" * 5000


@functools.cache
def _model_without_braces() -> Path:
    root = Path(tempfile.mkdtemp(prefix="hostile-structures-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return _model_without(root, "{}")


def _model_without(folder: Path, characters: str) -> Path:
    """A tiny Llama under ``folder`` whose vocabulary writes none of ``characters``."""
    sys.path.insert(0, str(TESTS))
    from structure_models import model_without

    return model_without(folder / "model", characters)


def _file(folder: Path, name: str, text: str) -> Path:
    (folder / name).write_text(text)
    return folder / name


def _schema_rows(folder: Path, schemas: list) -> Path:
    return _file(folder, "rows.jsonl", "".join(json.dumps({"text": f"row {number}", "schema": schema if isinstance(
        schema, str) else json.dumps(schema)}) + "\n" for number, schema in enumerate(schemas)))


def _noted(outcome, output: Path):
    errors = [row["error"] if isinstance(row["error"], str) else row["error"]["message"]
              for row in rows_of(output) if row.get("error")]
    outcome.note = f"{error_rows_note(output)}" + "".join(f"; {error[:90]}" for error in errors)
    return outcome


def case_regex_admits_no_text(folder: Path):
    """--regex '[^\\s\\S]' (no text matches it): one line before the model loads, not a parser dump at row 0."""
    return accelgen(*QUICK, "--prompt", "x", "--regex", r"[^\s\S]")


def case_schema_ref_loops(folder: Path):
    """--json-schema {"$ref": "#"} (a $ref that only loops): one line before the model loads saying it admits no text."""
    return accelgen(*QUICK, "--prompt", "x", "--json-schema", str(_file(folder, "loop.json", '{"$ref": "#"}')))


def case_vocabulary_without_brace(folder: Path):
    """--json with a tokenizer that has no "{": one line before the model loads naming what the vocabulary cannot write."""
    return accelgen(*QUICK, "--model", str(_model_without_braces()), "--prompt", "x", "--json")


def case_ten_thousand_choices(folder: Path):
    """10,000 --choice texts (the engine's rule holds 2000): followed, the completion one of them."""
    choices = [f"choice {number}" for number in range(10000)]
    output = folder / "out.jsonl"
    outcome = accelgen(*QUICK, "--max-new-tokens", "12", "--prompt", "x", "--output", str(output),
                       *[argument for choice in choices for argument in ("--choice", choice)])
    rows = rows_of(output)
    outcome.note = f"completion {rows[0]['completion']!r}, one of them: {rows[0]['completion'] in choices}" if rows else ""
    return outcome


def case_regex_too_large(folder: Path):
    """--regex '(x{1000}){1000}' (too many expressions for the engine): one line before the model loads."""
    return accelgen(*QUICK, "--prompt", "x", "--regex", "(x{1000}){1000}")


def case_schema_column_skip_bad_rows(folder: Path):
    """--schema-column with a row's schema looping and another's pattern too large, --skip-bad-rows: two error rows, the job goes on."""
    output = folder / "out.jsonl"
    outcome = accelgen(*QUICK, "--max-new-tokens", "16", "--dataset", str(_schema_rows(
        folder, [PAIR, {"$ref": "#"}, UNFOLLOWABLE, PAIR])), "--schema-column", "schema", "--skip-bad-rows",
        "--output", str(output))
    return _noted(outcome, output)


def case_schema_column_vocabulary(folder: Path):
    """--schema-column with an object schema on a model that cannot write "{", --skip-bad-rows: that row an error row."""
    output = folder / "out.jsonl"
    outcome = accelgen(*QUICK, "--model", str(_model_without_braces()), "--dataset", str(_schema_rows(
        folder, [{"type": "object"}, {"enum": ["ada", "bob"]}])), "--schema-column", "schema", "--skip-bad-rows",
        "--output", str(output))
    return _noted(outcome, output)


def case_schema_column_character_further_in(folder: Path):
    """A row's schema needing "}" after "a" on a model that cannot write "}", --skip-bad-rows: that row an error row mid-run."""
    output = folder / "out.jsonl"
    outcome = accelgen(*QUICK, "--model", str(_model_without(folder, "}")), "--dataset", str(_schema_rows(
        folder, [{"type": "string", "pattern": "^a}$"}, {"enum": ["ada", "bob"]}])), "--schema-column", "schema",
        "--skip-bad-rows", "--output", str(output))
    return _noted(outcome, output)


def _request(number: int, schema: object, **body) -> str:
    body = {"prompt": f"request {number}", "max_tokens": 16, **body,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return json.dumps({"custom_id": f"r{number}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"


def case_batch_file_structures(folder: Path):
    """A batch file whose requests' schemas loop or are too large: their own error lines, the others answered."""
    requests = _file(folder, "requests.jsonl", "".join(
        _request(number, schema) for number, schema in enumerate([PAIR, {"$ref": "#"}, UNFOLLOWABLE, PAIR])))
    output = folder / "out.jsonl"
    return _noted(accelgen(*QUICK, "--max-new-tokens", "16", "--dataset", str(requests), "--output", str(output)), output)


def case_schema_file_nested_deep(folder: Path):
    """--json-schema FILE nested 5,000 levels deep: one line naming the limit (was a RecursionError)."""
    return accelgen(*QUICK, "--prompt", "x", "--json-schema", str(_file(folder, "deep.json", DEEP)))


def case_schema_column_nested_deep(folder: Path):
    """--schema-column holding a schema nested 5,000 levels deep: one line naming the row and the limit."""
    return accelgen(*QUICK, "--dataset", str(_schema_rows(folder, [DEEP])), "--schema-column", "schema",
                    "--output", str(folder / "out.jsonl"))


def case_schema_file_null(folder: Path):
    """--json-schema FILE holding null: refused in one line (ran unconstrained)."""
    return accelgen(*QUICK, "--prompt", "x", "--json-schema", str(_file(folder, "null.json", "null\n")))


def case_x_guidance_separator(folder: Path):
    """A schema whose x-guidance sets item_separator ";": refused in one line (wrote unparseable JSON marked "stop")."""
    schema = _file(folder, "schema.json", json.dumps({**PAIR, "x-guidance": {"item_separator": ";"}}))
    return accelgen(*QUICK, "--prompt", "x", "--json-schema", str(schema))


def case_stop_inside_schema(folder: Path):
    """--stop "," with --json-schema: refused in one line (a stop text cut the JSON, marked "stop")."""
    schema = _file(folder, "schema.json", json.dumps(PAIR))
    return accelgen(*QUICK, "--prompt", "x", "--json-schema", str(schema), "--stop", ",")


def case_batch_request_stop_and_schema(folder: Path):
    """A batch request with stop [","] and a response_format schema: its own error line, the other request answered."""
    requests = _file(folder, "requests.jsonl", _request(0, PAIR, stop=[","]) + _request(1, PAIR))
    output = folder / "out.jsonl"
    return _noted(accelgen(*QUICK, "--max-new-tokens", "16", "--dataset", str(requests), "--output", str(output)), output)
