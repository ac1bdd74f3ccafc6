"""Hostile structures (issue 73, round 6): a structure that admits no text, or none the model's vocabulary can write,
or that the grammar engine cannot follow, is refused in one line before the model loads (a job's flag) or is its row's
error row (a schema column under --skip-bad-rows, a batch request); a schema nested too deep or holding null is one
line; a completion marked "stop" always parses against its schema (no x-guidance that writes other JSON, no stop text
cutting a structure).

Runs ``accelgen.cli.main`` in this process on the built-in model (a tiny Llama where a tokenizer of its own is needed).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import one_error_line_in
from structure_models import model_without

from accelgen.cli import main

pytest.importorskip("llguidance")

QUICK = ["run", "--device", "cpu", "--max-new-tokens", "8", "--quiet"]
PAIR = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3]}}, "required": ["a", "b"],
        "additionalProperties": False}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading a model fails the test: what is refused must be refused before."""
    def load(request):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("accelgen.jobs.completion_job.load_request", load)


def refused(capsys, *arguments: str) -> str:
    assert main([*QUICK, *map(str, arguments)]) == 2
    return one_error_line_in(capsys.readouterr().err)


def completed(capsys, *arguments: str) -> str:
    status = main([*QUICK, *map(str, arguments)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return captured.out


def write_json(path, value):
    path.write_text(json.dumps(value))
    return path


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_without_braces(tmp_path_factory):
    """A tiny Llama whose tokenizer has no token writing "{" or "}": it can write JSON strings, never an object."""
    return model_without(tmp_path_factory.mktemp("no-braces"), "{}")


# -- structures that admit no text -------------------------------------------------------------------------------

def test_a_regex_that_admits_no_text_is_refused_before_the_model_loads(capsys, no_model_loads):
    line = refused(capsys, "--prompt", "x", "--regex", r"[^\s\S]")
    assert "--regex '[^\\\\s\\\\S]' admits no text" in line or "--regex admits no text" in line, line
    assert "Parser Error" not in line and "<state>" not in line


def test_a_schema_whose_ref_loops_on_itself_is_refused_before_the_model_loads(capsys, tmp_path, no_model_loads):
    for schema in ({"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}):
        line = refused(capsys, "--prompt", "x", "--json-schema", write_json(tmp_path / "loop.json", schema))
        assert "--json-schema" in line and "admits no text" in line, line


def test_a_schema_the_vocabulary_cannot_write_is_refused_before_the_model_loads(capsys, model_without_braces,
                                                                                no_model_loads):
    line = refused(capsys, "--model", model_without_braces, "--prompt", "x", "--json")
    assert "--json" in line and "vocabulary" in line and "'{'" in line, line


def test_a_character_the_vocabulary_cannot_write_further_in_stops_the_row_in_one_line(capsys, tmp_path):
    line = refused(capsys, "--model", model_without(tmp_path / "no-brace", "}"), "--prompt", "x", "--regex", "a}")
    assert "Prompt 0: its regex 'a}' needs a character next that no token of this model's vocabulary writes" in line


def test_under_skip_bad_rows_a_row_that_reaches_such_a_character_is_an_error_row(capsys, tmp_path):
    dataset = tmp_path / "rows.jsonl"
    schemas = [{"type": "string", "pattern": "^a}$"}, {"enum": ["ada", "bob"]}]
    dataset.write_text("".join(json.dumps({"text": f"row {number}", "schema": json.dumps(schema)}) + "\n"
                               for number, schema in enumerate(schemas)))
    output = tmp_path / "out.jsonl"
    completed(capsys, "--model", model_without(tmp_path / "no-brace", "}"), "--dataset", dataset, "--schema-column",
              "schema", "--skip-bad-rows", "--output", output)
    first, second = rows_of(output)
    assert first["finish_reason"] == "error" and "needs a character next that no token" in first["error"], first
    assert not second.get("error") and json.loads(second["completion"]) in ("ada", "bob"), second


# -- structures the engine cannot follow -------------------------------------------------------------------------

def test_ten_thousand_choices_are_followed(capsys, tmp_path):
    choices = [f"choice {number}" for number in range(10000)]
    completed(capsys, "--max-new-tokens", "12", "--prompt", "x", "--output", tmp_path / "out.jsonl",
              *[argument for choice in choices for argument in ("--choice", choice)])
    row, = rows_of(tmp_path / "out.jsonl")
    assert row["finish_reason"] == "stop" and row["completion"] in choices, row


def test_a_regex_the_engine_cannot_follow_is_refused_before_the_model_loads(capsys, no_model_loads):
    line = refused(capsys, "--prompt", "x", "--regex", "(x{1000}){1000}")
    assert "--regex" in line and "grammar engine cannot follow" in line and "too many expressions" in line, line
    assert "<state>" not in line


def test_row_schemas_that_cannot_be_followed_are_error_rows(capsys, tmp_path):
    schemas = [PAIR, {"$ref": "#"}, {"type": "string", "pattern": "^(x{1000}){1000}$"}, PAIR]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"row {number}", "schema": json.dumps(schema)}) + "\n"
                               for number, schema in enumerate(schemas)))
    output = tmp_path / "out.jsonl"
    completed(capsys, "--max-new-tokens", "16", "--dataset", dataset, "--schema-column", "schema", "--skip-bad-rows",
              "--output", output)
    rows = rows_of(output)
    assert [bool(row.get("error")) for row in rows] == [False, True, True, False]
    assert "admits no text" in rows[1]["error"] and "cannot follow" in rows[2]["error"]
    for row in (rows[0], rows[3]):
        if row["finish_reason"] == "stop":
            jsonschema.validate(json.loads(row["completion"]), PAIR)


def test_without_skip_bad_rows_a_row_schema_that_cannot_be_followed_names_its_row(capsys, tmp_path, no_model_loads):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"text": "row 0", "schema": json.dumps({"$ref": "#"})}) + "\n")
    line = refused(capsys, "--dataset", dataset, "--schema-column", "schema", "--output", tmp_path / "out.jsonl")
    assert "row 0" in line and "admits no text" in line, line


def test_row_schemas_this_vocabulary_cannot_write_are_error_rows(capsys, tmp_path, model_without_braces):
    schemas = [{"type": "object"}, {"enum": ["ada", "bob"]}]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"row {number}", "schema": json.dumps(schema)}) + "\n"
                               for number, schema in enumerate(schemas)))
    output = tmp_path / "out.jsonl"
    completed(capsys, "--model", model_without_braces, "--dataset", dataset, "--schema-column", "schema",
              "--skip-bad-rows", "--output", output)
    first, second = rows_of(output)
    assert "vocabulary" in first["error"] and "'{'" in first["error"], first
    assert not second.get("error") and json.loads(second["completion"]) in ("ada", "bob"), second


def test_batch_requests_whose_structure_cannot_be_followed_are_error_lines(capsys, tmp_path):
    def request(number, schema):
        body = {"prompt": f"request {number}", "max_tokens": 16,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        return {"custom_id": f"r{number}", "method": "POST", "url": "/v1/completions", "body": body}

    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(request(number, schema)) + "\n" for number, schema in enumerate(
        [PAIR, {"$ref": "#"}, {"type": "string", "pattern": "^(x{1000}){1000}$"}, PAIR])))
    output = tmp_path / "out.jsonl"
    completed(capsys, "--max-new-tokens", "16", "--dataset", requests, "--output", output)
    lines = rows_of(output)
    assert [line["error"] is not None for line in lines] == [False, True, True, False]
    assert "admits no text" in lines[1]["error"]["message"] and "cannot follow" in lines[2]["error"]["message"]


# -- files that would raise tracebacks ---------------------------------------------------------------------------

def test_a_schema_nested_too_deep_is_one_line(capsys, tmp_path, no_model_loads):
    deep = '{"items":' * 5000 + "{}" + "}" * 5000
    (tmp_path / "deep.json").write_text(deep)
    line = refused(capsys, "--prompt", "x", "--json-schema", tmp_path / "deep.json")
    assert "--json-schema" in line and "nests deeper than 100 levels" in line, line
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"text": "row 0", "schema": deep}) + "\n")
    line = refused(capsys, "--dataset", dataset, "--schema-column", "schema", "--output", tmp_path / "out.jsonl")
    assert "row 0" in line and "nests deeper than 100 levels" in line, line


def test_a_schema_nested_to_the_limit_runs(capsys, tmp_path):
    schema = tmp_path / "deep.json"
    schema.write_text('{"type":"array","maxItems":1,"items":' * 49 + '{"type":"integer"}' + "}" * 49)
    completed(capsys, "--prompt", "x", "--json-schema", schema)


# -- other silent wrong outputs ----------------------------------------------------------------------------------

def test_a_schema_file_holding_null_is_refused(capsys, tmp_path, no_model_loads):
    (tmp_path / "null.json").write_text("null\n")
    line = refused(capsys, "--prompt", "x", "--json-schema", tmp_path / "null.json")
    assert "--json-schema" in line and "null" in line, line


def test_x_guidance_options_that_write_other_json_are_refused(capsys, tmp_path, no_model_loads):
    for options, word in (({"item_separator": ";"}, "item_separator"), ({"key_separator": "="}, "key_separator"),
                          ({"whitespace_pattern": "x*"}, "whitespace_pattern"), ({"lenient": True}, "lenient"),
                          ({"coerce_one_of": True}, "coerce_one_of")):
        schema = write_json(tmp_path / "schema.json", {**PAIR, "x-guidance": options})
        line = refused(capsys, "--prompt", "x", "--json-schema", schema)
        assert "x-guidance" in line and word in line, line


def test_x_guidance_options_that_keep_json_give_completions_that_parse(capsys, tmp_path):
    schema = write_json(tmp_path / "schema.json", {**PAIR, "x-guidance": {"item_separator": ", ",
                                                                           "key_separator": ": "}})
    output = tmp_path / "out.jsonl"
    completed(capsys, "--max-new-tokens", "24", "--prompt", "a", "--prompt", "b", "--json-schema", schema,
              "--output", output)
    rows = rows_of(output)
    assert all(row["finish_reason"] == "stop" for row in rows), rows
    for row in rows:
        jsonschema.validate(json.loads(row["completion"]), PAIR)
        assert ", " in row["completion"]


def test_stop_texts_with_a_structure_are_refused(capsys, tmp_path, no_model_loads):
    schema = write_json(tmp_path / "schema.json", PAIR)
    line = refused(capsys, "--prompt", "x", "--json-schema", schema, "--stop", ",")
    assert "--stop" in line and "--json-schema" in line, line
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"text": "row 0", "schema": json.dumps(PAIR)}) + "\n")
    line = refused(capsys, "--dataset", dataset, "--schema-column", "schema", "--stop", ",", "--output",
                   tmp_path / "out.jsonl")
    assert "--stop" in line and "--schema-column" in line, line


def test_a_batch_request_with_stop_texts_and_a_structure_is_an_error_line(capsys, tmp_path):
    body = {"prompt": "request", "max_tokens": 16, "stop": [","],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PAIR}}}
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "r0", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
                        + json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/completions",
                                      "body": {key: value for key, value in body.items() if key != "stop"}}) + "\n")
    output = tmp_path / "out.jsonl"
    completed(capsys, "--max-new-tokens", "16", "--dataset", requests, "--output", output)
    stopped, free = rows_of(output)
    assert "stop" in stopped["error"]["message"], stopped
    assert free["error"] is None
    choice = free["response"]["body"]["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), PAIR)
