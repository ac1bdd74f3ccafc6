"""Structured output as a job meets it: the flags and the schema column, an OpenAI batch file's ``response_format``,
a reasoning model's thinking written apart, the run record, a killed run resumed, several ranks and replicas, and
every bad input as one line before the model loads."""

import json
import os
import sys

import pytest
import torch
from conftest import one_error_line_in as one_error_line
from killed_runs import killed_then_resumed_and_whole
from test_openai_batch import CHAT, TEXT, chat_model, request, schema_problems, write_requests  # noqa: F401 (a fixture)
from test_structured import PERSON, SCHEMAS, valid
from test_tensor_parallel import accelgen_command, rows_of
from tiny_models import build_model, tiny_configs
from transformers import AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.cli import main

pytest.importorskip("llguidance")

#: Renders a conversation and opens the model's thinking for it, or (enable_thinking false) closes it at once.
THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
                     "assistant:{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>"
                     "{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def llama(tiny_model_folder):
    return tiny_model_folder("llama")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tiny_model_folder):
    """The tiny Llama with ``<think>`` and ``</think>`` tokens and a template that opens the thinking; its head makes
    ``</think>`` twice as likely as the token its greedy thinking takes fourth, so that it thinks a few tokens, then
    answers."""
    folder = tmp_path_factory.mktemp("thinking") / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder("llama"))
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    tokenizer.chat_template = THINKING_TEMPLATE
    build_model(folder, tiny_configs(len(tokenizer))["llama"])
    tokenizer.save_pretrained(folder)
    thought, = accelgen.generate([conversation(0)], model=folder, device="cpu", max_new_tokens=4)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[tokenizer.convert_tokens_to_ids("</think>")] = 2 * head[thought.completion_token_ids[3]]
    model.save_pretrained(folder)
    return folder


def conversation(number):
    return [{"role": "user", "content": f"Describe person {number}"}]


def run(capsys, model, *arguments):
    status = main(["run", "--device", "cpu", "--model", str(model), "--quiet", *map(str, arguments)])
    return status, capsys.readouterr().err


# -- a reasoning model --------------------------------------------------------------------------------------------


def test_a_thinking_models_rows_keep_their_thinking_apart_and_validate_after_it(thinking_model, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": conversation(number)}) + "\n" for number in range(4)))
    output = tmp_path / "out.jsonl"
    status, error = run(capsys, thinking_model, "--dataset", rows, "--column", "messages", "--json-schema",
                        write_schema(tmp_path, PERSON), "--max-new-tokens", 48, "--batch-size", 2, "--output", output)
    assert status == 0, error
    close = AutoTokenizer.from_pretrained(thinking_model).convert_tokens_to_ids("</think>")
    for line in map(json.loads, output.read_text().splitlines()):
        assert line["finish_reason"] == "stop" and valid(line["completion"], PERSON)
        thought = line["completion_token_ids"].index(close)
        assert thought >= 1 and line["reasoning"]  # it thought, then answered in JSON from the first token on
        assert line["messages"][-1] == {"role": "assistant", "content": line["completion"]}


def test_with_thinking_turned_off_by_a_template_variable_the_answer_is_json_at_once(thinking_model, capsys):
    completions = accelgen.generate([conversation(number) for number in range(3)], model=thinking_model, device="cpu",
                                    max_new_tokens=48, json_schema=PERSON, chat_template_kwargs={"enable_thinking": False})
    for completion in completions:
        assert completion.prompt.endswith("assistant:<think></think>") and completion.reasoning is None
        assert completion.finish_reason == "stop" and valid(completion.completion, PERSON)


def test_a_batch_chat_answer_holds_its_thinking_in_reasoning_content(thinking_model, tmp_path, capsys):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    dataset = write_requests(tmp_path / "requests.jsonl", [request(number, response_format=schema, temperature=0)
                                                          for number in range(3)])
    status, error = run(capsys, thinking_model, "--dataset", dataset, "--output", tmp_path / "out.jsonl",
                        "--max-new-tokens", 96)
    assert status == 0, error
    for line in rows_of(tmp_path / "out.jsonl"):
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["reasoning_content"]
        assert valid(choice["message"]["content"], PERSON)


# -- OpenAI batch files ---------------------------------------------------------------------------------------------


def test_batch_requests_bring_their_own_response_format(chat_model, tmp_path, capsys):  # noqa: F811 (the fixture)
    formats = [{"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
               {"type": "json_object"}, {"type": "text"}, None,
               {"type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMAS[2]}},
               {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"not": {"type": "string"}}}},
               {"type": "json_schema", "json_schema": {"name": "no schema"}}, {"type": "xml"}]
    requests = [request(number, CHAT if number % 2 else TEXT, **({} if form is None else {"response_format": form}))
                for number, form in enumerate(formats)]
    requests.append(request(8, response_format=formats[0], max_tokens=1))  # ends with its first token, among others
    output = tmp_path / "out.jsonl"
    status, error = run(capsys, chat_model, "--dataset", write_requests(tmp_path / "requests.jsonl", requests), "--output",
                        output, "--max-new-tokens", 48, "--batch-size", 3)
    assert status == 0, error
    lines = rows_of(output)
    assert all(schema_problems(line) == [] for line in lines)
    choices = [None if line["error"] else line["response"]["body"]["choices"][0] for line in lines]
    texts = [None if choice is None else choice.get("text", choice.get("message", {}).get("content")) for choice in choices]
    assert valid(texts[0], PERSON) and valid(texts[4], SCHEMAS[2])
    assert texts[1].startswith("{") and (choices[1]["finish_reason"] == "length" or isinstance(json.loads(texts[1]), dict))
    plain = accelgen.generate([requests[2]["body"]["prompt"]], model=chat_model, device="cpu", max_new_tokens=48)
    assert texts[2] == plain[0].completion  # a request without a structure completes as it would without any
    assert "Unimplemented keys" in lines[5]["error"]["message"] and "schema" in lines[6]["error"]["message"]
    assert "response_format {'type': 'xml'} is not served" in lines[7]["error"]["message"]
    assert choices[8]["finish_reason"] == "length" and texts[8] == "{"


# -- the run record, a resume, several processes ----------------------------------------------------------------------


def write_schema(folder, schema, name="schema.json"):
    path = folder / name
    path.write_text(json.dumps(schema))
    return path


def test_the_run_record_pins_the_structure_and_a_resume_with_another_is_refused(llama, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    command = ["--prompt", "Hello", "--max-new-tokens", 40, "--output", output]
    assert run(capsys, llama, *command, "--json-schema", write_schema(tmp_path, PERSON))[0] == 0
    assert json.loads((tmp_path / "out.jsonl.run.json").read_text())["structure"]["kind"] == "json_schema"
    status, error = run(capsys, llama, *command, "--regex", "[a-z]+")
    assert status == 2 and "different structure" in one_error_line(error)


@pytest.mark.slow
def test_a_killed_structured_run_resumes_to_the_uninterrupted_file(llama, tmp_path, cli_environment):
    """One slot, as in test_samples' killed run: the same shapes in both runs, so the files are equal bit for bit; each
    row's grammar starts afresh with it."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"Row {number} of many", "schema": SCHEMAS[number % len(SCHEMAS)]})
                               + "\n" for number in range(60)))
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(llama), "--dataset",
               str(dataset), "--schema-column", "schema", "--max-new-tokens", "40", "--do-sample", "--seed", "5",
               "--batch-size", "1", "--quiet"]
    resumed, whole, written = killed_then_resumed_and_whole(command, tmp_path, cli_environment)
    assert 5 <= written < 60
    assert resumed.read_text() == whole.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [["--world-size", "2"], ["--world-size", "2", "--data-parallel", "2"]])
def test_two_ranks_or_two_replicas_give_the_single_process_rows(llama, tmp_path, job_environment, parallel):
    import subprocess

    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    prompts = [f"Row {number} holds" + " words" * (number % 3) for number in range(12)]
    schemas = [SCHEMAS[number % 5] if number % 4 else None for number in range(12)]
    dataset.write_text("".join(json.dumps({"text": prompt, "schema": schema}) + "\n" for prompt, schema in zip(prompts, schemas)))
    options = ["--max-new-tokens", "40", "--batch-size", "4", "--do-sample", "--seed", "3", "--schema-column", "schema"]
    single = tmp_path / "single.jsonl"
    assert main(["run", "--device", "cpu", "--model", str(llama), "--dataset", str(dataset), *options, "--output",
                 str(single), "--quiet"]) == 0
    result = subprocess.run(accelgen_command("run", "--device", "cpu", "--model", str(llama), "--dataset", str(dataset),
                                             *options, "--output", str(output), "--quiet", *parallel),
                            env=job_environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    fields = ("completion", "completion_token_ids", "finish_reason")
    assert [[row[field] for field in fields] for row in rows_of(output)] == [[row[field] for field in fields]
                                                                          for row in rows_of(single)]
    assert any(row["finish_reason"] == "stop" for row in rows_of(single))


# -- bad input: one line, exit status 2, before the model loads --------------------------------------------------------


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a model is loaded."""
    def refuse(*arguments, **keywords):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("accelgen.jobs.completion_job.load_request", refuse)


def bad_dataset(folder, schema):
    path = folder / "rows.jsonl"
    path.write_text(json.dumps({"text": "Good row", "schema": json.dumps(PERSON)}) + "\n"
                    + json.dumps({"text": "Bad row", "schema": schema}) + "\n")
    return path


@pytest.mark.parametrize(("arguments", "said"), [
    (["--json-schema", "{folder}/not-json.json"], "--json-schema '{folder}/not-json.json' is not JSON"),
    (["--json-schema", "{folder}/list.json"], "--json-schema is a list, not a JSON Schema"),
    (["--json-schema", "{folder}/unsupported.json"], "--json-schema is not a schema the grammar engine supports "
                                                     "(Unimplemented keys: [\"not\"])"),
    (["--json-schema", "{folder}/missing.json"], "Cannot read --json-schema '{folder}/missing.json'"),
    (["--json-schema", "{folder}/fifo"], "--json-schema '{folder}/fifo' is a FIFO (named pipe), not a regular file"),
    (["--json-schema", "/dev/zero"], "--json-schema '/dev/zero' is a device, not a regular file"),
    (["--regex", "[a-"], "--regex does not compile (unclosed character class)"),
    (["--regex", ""], "--regex is empty"),
    (["--choice", ""], "--choice has '', which is not a text of at least one character"),
    (["--choice", "a", "--regex", "b"], "--regex and --choice each hold the completion to a structure"),
    (["--json", "--json-schema", "{folder}/list.json"], "--json-schema and --json each hold the completion"),
    (["--schema-column", "schema"], "--schema-column names a column of --dataset"),
    (["--chat-template-kwargs", "{x"], "--chat-template-kwargs is not JSON"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
    (["--chat-template-kwargs", '{"tokenize": true}'], "--chat-template-kwargs names tokenize, which accelgen sets"),
])
def test_a_bad_flag_is_one_line(llama, tmp_path, capsys, no_model_loads, arguments, said):
    (tmp_path / "not-json.json").write_text("{\"type\": ")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "unsupported.json").write_text(json.dumps({"not": {"type": "string"}}))
    os.mkfifo(tmp_path / "fifo")  # would block a read until something writes into it
    arguments = [argument.replace("{folder}", str(tmp_path)) for argument in arguments]
    status, error = run(capsys, llama, "--prompt", "Hello", *arguments)
    assert status == 2 and said.replace("{folder}", str(tmp_path)) in one_error_line(error)


@pytest.mark.parametrize(("schema", "said"), [
    ("{\"type\": ", "is not JSON (Expecting value"),
    (42, "is a number, not a JSON Schema"),
    (json.dumps({"type": "objectx"}), "is not a schema the grammar engine supports (Invalid type: objectx)"),
    ({"type": "string", "pattern": "(("}, "is not a schema the grammar engine supports"),
])
def test_a_rows_bad_schema_is_one_line_naming_the_row_and_its_column(llama, tmp_path, capsys, no_model_loads, schema, said):
    dataset = bad_dataset(tmp_path, schema)
    status, error = run(capsys, llama, "--dataset", dataset, "--schema-column", "schema")
    assert status == 2 and f"row 1, column 'schema', {said}" in one_error_line(error)


def test_with_skip_bad_rows_a_bad_schema_is_an_error_row_and_the_job_goes_on(llama, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    status, error = run(capsys, llama, "--dataset", bad_dataset(tmp_path, {"not": {}}), "--schema-column", "schema",
                        "--skip-bad-rows", "--max-new-tokens", 40, "--output", output)
    assert status == 0, error
    good, bad = map(json.loads, output.read_text().splitlines())
    assert good["finish_reason"] == "stop" and valid(good["completion"], PERSON)
    assert bad["finish_reason"] == "error"
    assert bad["error"] == "its schema (column 'schema') is not a schema the grammar engine supports (Unimplemented keys: [\"not\"])"


def test_a_schema_column_and_a_schema_for_every_row_are_one_line(llama, tmp_path, capsys, no_model_loads):
    status, error = run(capsys, llama, "--dataset", bad_dataset(tmp_path, None), "--schema-column", "schema", "--json")
    assert status == 2 and "--schema-column and --json both say what a row's completion is held to" in one_error_line(error)
    status, error = run(capsys, llama, "--dataset", bad_dataset(tmp_path, None), "--schema-column", "nope")
    assert status == 2 and "--schema-column 'nope' is not in the dataset; its columns: text, schema" in one_error_line(error)


def test_without_the_engine_a_structure_is_one_line_naming_the_extra(llama, capsys, monkeypatch, no_model_loads):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    from accelgen.generation.grammars import structure_problem

    structure_problem.cache_clear()
    status, error = run(capsys, llama, "--prompt", "Hello", "--regex", "[a-z]+")
    assert status == 2 and 'pip install "accelgen[structured]"' in one_error_line(error)



def test_bench_records_the_rows_constrained_the_compile_time_and_the_masks_share(llama, tmp_path, capsys):
    result = tmp_path / "bench.json"
    status = main(["bench", "--device", "cpu", "--model", str(llama), "--batch-sizes", "2", "--max-new-tokens", "24",
                   "--runs", "1", "--warmup-runs", "1", "--json-schema", str(write_schema(tmp_path, PERSON)),
                   "--output", str(result)])
    error = capsys.readouterr().err
    assert status == 0, error
    measurement = json.loads(result.read_text())["measurements"][0]
    row = measurement["results"][0]
    assert measurement["structure"]["kind"] == "json_schema" and row["constrained_rows"] == 2
    assert row["grammar_compile_seconds"] > 0 and 0 < row["mask_share"] < 1
    assert "masks" in error and "2 rows constrained" in error
