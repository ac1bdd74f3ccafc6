"""OpenAI Batch files (``--dataset requests.jsonl``): each request's sampling fields honoured as its row's own
settings (slot state on the device, read by the captured step), OpenAI batch output lines written, checked here
against the batch output schema, resumable after a SIGKILL like every accelgen output."""

import json
import shutil
import sys

import pytest
from conftest import one_error_line
from killed_runs import killed_then_resumed_and_whole
from test_conversations import TEMPLATE, hf_greedy, template_ids
from transformers import AutoTokenizer

from accelgen.cli import main

RUN_MAX_NEW_TOKENS = 12
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def chat_model(tiny_model_folder, tmp_path_factory):
    """The tiny Llama with a chat template in its tokenizer."""
    folder = tmp_path_factory.mktemp("batch") / "chat-llama"
    shutil.copytree(tiny_model_folder("llama"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def request(number, url=CHAT, **body):
    if "messages" not in body and "prompt" not in body:
        text = f"Request {number} asks" + " more" * (number % 4)
        body = {**body, **({"messages": [{"role": "user", "content": text}]} if url == CHAT else {"prompt": text})}
    return {"custom_id": f"request-{number}", "method": "POST", "url": url, "body": body}


def twenty_requests(model):
    """A mix of max_tokens, temperature, stop and n, chat and completions, and four requests that cannot be served."""
    requests = []
    for number in range(16):
        fields = {"model": model} if number % 3 == 0 else {}
        if number % 4 == 0:
            fields["temperature"] = 0  # greedy, whatever the run's --do-sample
        if number % 4 == 1:
            fields.update(temperature=0.7, top_p=0.9, seed=number)
        if number % 5 == 2:
            fields["max_tokens" if number % 2 else "max_completion_tokens"] = 3 + number % 4
        if number % 6 == 3:
            fields.update(n=3, temperature=1.2)
        requests.append(request(number, CHAT if number % 2 == 0 else TEXT, **fields))
    requests += [request(16, model="gpt-4o-mini"), request(17, logit_bias={"5": 10}),
                 request(18, max_tokens=RUN_MAX_NEW_TOKENS + 1), request(19, messages=[{"role": "user"}])]
    return requests


def write_requests(path, requests):
    path.write_text("".join(json.dumps(line) + "\n" for line in requests))
    return path


def run_batch(capsys, model, dataset, output, *arguments):
    status = main(["run", "--device", "cpu", "--model", str(model), "--dataset", str(dataset), "--output", str(output),
                   "--max-new-tokens", str(RUN_MAX_NEW_TOKENS), "--do-sample", "--seed", "3", "--quiet",
                   *map(str, arguments)])
    error = capsys.readouterr().err
    assert status == 0, error
    return [json.loads(line) for line in output.read_text().splitlines()]


def schema_problems(line) -> list[str]:
    """Where ``line`` departs from OpenAI's batch output schema (the request output object, the chat completion
    and completion objects): an empty list when it conforms."""
    problems = []

    def need(condition, what):
        if not condition:
            problems.append(what)

    need(isinstance(line, dict) and set(line) == {"id", "custom_id", "response", "error"}, "fields")
    need(isinstance(line["id"], str) and isinstance(line["custom_id"], str), "ids")
    if line["error"] is not None:
        need(line["response"] is None, "an error line has no response")
        need(set(line["error"]) == {"code", "message"} and all(isinstance(v, str) for v in line["error"].values()), "error")
        return problems
    response = line["response"]
    need(set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200, "response")
    body = response["body"]
    need({"id", "object", "created", "model", "choices", "usage"} <= set(body), "body fields")
    need(body["object"] in ("chat.completion", "text_completion") and isinstance(body["created"], int), "object")
    chat = body["object"] == "chat.completion"
    for index, choice in enumerate(body["choices"]):
        need(choice["index"] == index and choice["finish_reason"] in ("stop", "length"), "choice")
        if chat:
            need(choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), "message")
        else:
            need(isinstance(choice["text"], str) and "message" not in choice, "text")
    usage = body["usage"]
    need(set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}, "usage fields")
    need(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], "usage total")
    return problems


def prompt_ids(folder, body):
    if "messages" in body:
        return template_ids(folder, body["messages"])
    return AutoTokenizer.from_pretrained(folder)(body["prompt"])["input_ids"]


def test_a_request_file_gives_schema_valid_lines_each_with_its_own_settings(chat_model, tmp_path, capsys):
    requests = twenty_requests(chat_model.name)
    lines = run_batch(capsys, chat_model, write_requests(tmp_path / "requests.jsonl", requests), tmp_path / "out.jsonl",
                      "--batch-size", "4")
    assert [line["custom_id"] for line in lines] == [line["custom_id"] for line in requests]
    for line in lines:
        assert schema_problems(line) == [], line
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    for number, (line, sent) in enumerate(zip(lines[:16], requests[:16])):
        body = line["response"]["body"]
        ids = prompt_ids(chat_model, sent["body"])
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["object"] == ("chat.completion" if sent["url"] == CHAT else "text_completion")
        assert len(body["choices"]) == sent["body"].get("n", 1)
        budget = sent["body"].get("max_tokens", sent["body"].get("max_completion_tokens", RUN_MAX_NEW_TOKENS))
        texts = [choice["message"]["content"] if "message" in choice else choice["text"] for choice in body["choices"]]
        assert 0 < body["usage"]["completion_tokens"] <= budget * len(texts)
        if sent["body"].get("temperature") == 0:  # greedy rows are Hugging Face's, at the row's own max_tokens
            greedy = hf_greedy(chat_model, ids, budget)
            assert texts == [tokenizer.decode(ids + greedy, skip_special_tokens=True)[len(tokenizer.decode(ids, skip_special_tokens=True)):]]
            assert body["usage"]["completion_tokens"] == len(greedy)
        if all(choice["finish_reason"] == "length" for choice in body["choices"]):
            assert body["usage"]["completion_tokens"] == budget * len(body["choices"])
        if len(body["choices"]) > 1:
            assert len(set(texts)) > 1, number  # the samples of one request differ
    errors = {line["custom_id"]: line["error"]["message"] for line in lines[16:]}
    assert "asks for model 'gpt-4o-mini'" in errors["request-16"]
    assert "sets logit_bias, which accelgen does not honour" in errors["request-17"]
    assert f"max_tokens {RUN_MAX_NEW_TOKENS + 1} is over this run's --max-new-tokens" in errors["request-18"]
    assert "body.messages" in errors["request-19"]


def without_created(lines):
    """Output lines less the time each was written."""
    for line in lines:
        if line["response"]:
            line["response"]["body"].pop("created")
    return lines


def test_each_requests_lines_are_the_same_at_batch_sizes_1_and_5(chat_model, tmp_path, capsys):
    """Samples of one request share its prefill (its cache rows copied) in a wide batch, and not in a batch of one."""
    dataset = write_requests(tmp_path / "requests.jsonl", twenty_requests(chat_model.name))
    one, five = (without_created(run_batch(capsys, chat_model, dataset, tmp_path / f"out{size}.jsonl", "--batch-size", size))
                 for size in (1, 5))
    assert one == five


def test_a_requests_sampling_fields_draw_what_the_same_options_draw(chat_model, tmp_path, capsys):
    """A request's temperature, top_p, seed and max_tokens give the text the run-wide options give to the same row."""
    prompts = [f"Row {number} is here" + " again" * number for number in range(4)]
    fields = dict(temperature=0.8, top_p=0.7, seed=11, max_tokens=6)
    requests = [request(number, TEXT, prompt=text, **(fields if number == 2 else {"temperature": 0}))
                for number, text in enumerate(prompts)]
    lines = run_batch(capsys, chat_model, write_requests(tmp_path / "requests.jsonl", requests), tmp_path / "out.jsonl",
                      "--batch-size", "2")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": text}) + "\n" for text in prompts))
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(texts), "--output",
                   str(tmp_path / "plain.jsonl"), "--do-sample", "--temperature", "0.8", "--top-p", "0.7", "--seed", "11",
                   "--max-new-tokens", "6", "--quiet"])
    assert status == 0, capsys.readouterr().err
    plain = [json.loads(line) for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    assert lines[2]["response"]["body"]["choices"][0]["text"] == plain[2]["completion"]
    assert lines[2]["response"]["body"]["usage"]["completion_tokens"] == len(plain[2]["completion_token_ids"])


def test_a_requests_stop_ends_its_text_right_before_it(chat_model, tmp_path, capsys):
    text = "Tell me a story about"
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    ids = tokenizer(text)["input_ids"]
    greedy = tokenizer.decode(ids + hf_greedy(chat_model, ids, RUN_MAX_NEW_TOKENS), skip_special_tokens=True)[len(text):]
    stop = greedy.strip()[4:7]
    assert len(stop) == 3 and stop in greedy
    requests = [request(0, TEXT, prompt=text, temperature=0, stop=[stop, "never-there"]), request(1, TEXT, prompt=text, temperature=0)]
    lines = run_batch(capsys, chat_model, write_requests(tmp_path / "requests.jsonl", requests), tmp_path / "out.jsonl")
    stopped, whole = (line["response"]["body"]["choices"][0] for line in lines)
    assert stopped["finish_reason"] == "stop" and stopped["text"] == greedy[: greedy.find(stop)]
    assert whole["text"] == greedy  # the other row's stop is its own


def test_a_batch_file_written_for_another_service_is_served_under_the_name_given(chat_model, tmp_path, capsys):
    """Every request names "gpt-4o-mini": without --served-model-name, each is an error line, the terminal shows each
    as the request it is, and one error line says what serves them (exit 3); with it, each is served, and the responses
    name the first name given (vLLM's run-batch convention)."""
    requests = [request(number, CHAT if number % 2 else TEXT, model="gpt-4o-mini") for number in range(4)]
    dataset, output = write_requests(tmp_path / "requests.jsonl", requests), tmp_path / "out.jsonl"
    command = ["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--output", str(output),
               "--max-new-tokens", "4"]
    assert main(command) == 3
    shown = capsys.readouterr()
    assert "Input: ''" not in shown.out and "Output: ''" not in shown.out
    assert shown.out.count("Error: request 'request-") == 4
    [error] = [line for line in shown.err.splitlines() if line.startswith("accelgen: error:")]
    assert error.startswith(f"accelgen: error: none of the 4 requests could be served: each output line in {output} "
                            f"holds its error (response null, error.message says why); the first, request 'request-0': "
                            f"asks for model 'gpt-4o-mini', and this run serves {str(chat_model)!r}: pass "
                            f"--served-model-name 'gpt-4o-mini'")
    assert 'finish_reason "error"' not in shown.err and "Traceback" not in shown.err
    assert all(line["response"] is None for line in map(json.loads, output.read_text().splitlines()))

    assert main([*command, "--overwrite", "--served-model-name", "gpt-4o-mini", "--served-model-name", "mine"]) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["error"] for line in lines] == [None] * 4
    assert {line["response"]["body"]["model"] for line in lines} == {"gpt-4o-mini"}
    assert json.loads((tmp_path / "out.jsonl.run.json").read_text())["served_model_names"] == ["gpt-4o-mini", "mine"]


def test_requests_that_cannot_be_served_are_counted_in_batch_terms(chat_model, tmp_path, capsys):
    requests = [request(0), request(1, model="gpt-4o-mini"), request(2, logit_bias={"5": 10})]
    output = tmp_path / "out.jsonl"
    assert main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset",
                 str(write_requests(tmp_path / "requests.jsonl", requests)), "--output", str(output),
                 "--max-new-tokens", "4", "--served-model-name", "mine"]) == 0
    shown = capsys.readouterr()
    assert (f"accelgen: 2 of 3 requests could not be served: their output lines in {output} hold the error (response "
            f"null, error.message says why)") in shown.err
    assert "finish_reason" not in shown.err
    assert "Error: request 'request-1': asks for model 'gpt-4o-mini', and this run serves 'mine' (--served-model-name): " \
           "add --served-model-name 'gpt-4o-mini' to serve it" in shown.out


def test_served_model_names_are_for_batch_files_and_pinned_by_the_output(chat_model, tmp_path, capsys):
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--prompt", "Hi", "--served-model-name", "x"])
    assert status == 2 and "--served-model-name names the model an OpenAI batch file's requests ask for" in \
        one_error_line(capsys)
    dataset, output = write_requests(tmp_path / "requests.jsonl", [request(0), request(1)]), tmp_path / "out.jsonl"
    command = ["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--output", str(output),
               "--max-new-tokens", "4", "--limit", "1"]
    assert main([*command, "--served-model-name", "x"]) == 0
    capsys.readouterr()
    assert main(command[:-2]) == 2  # the responses would name another model
    assert "holds completions of another run (different served_model_names)" in one_error_line(capsys)


def test_a_batch_file_with_logprobs_is_one_line(chat_model, tmp_path, capsys):
    dataset = write_requests(tmp_path / "requests.jsonl", [request(0)])
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--output",
                   str(tmp_path / "out.jsonl"), "--logprobs"])
    assert status == 2 and "--logprobs is not written into OpenAI batch output lines" in one_error_line(capsys)


def test_a_batch_file_with_a_custom_id_twice_is_refused_naming_both_lines_before_the_model_loads(
        chat_model, tmp_path, capsys, monkeypatch):
    import accelgen.jobs.completion_job

    requests = [request(number) for number in range(4)]
    requests[3]["custom_id"] = requests[1]["custom_id"]
    dataset, output = tmp_path / "requests.jsonl", tmp_path / "out.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" + ("\n" if number == 1 else "")  # a blank line: lines, not rows
                               for number, line in enumerate(requests)))
    monkeypatch.setattr(accelgen.jobs.completion_job, "load_request", lambda request: pytest.fail("the model was loaded"))
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--output",
                   str(output), "--limit", "2"])  # the file is refused whole, as OpenAI refuses it
    assert status == 2 and one_error_line(capsys) == (
        f"accelgen: error: Batch file '{dataset}' has custom_id 'request-1' on line 2 and again on line 5: each request "
        f"needs its own custom_id (its result is found by it); rename one of them.\n")
    assert not output.exists()


def test_a_changed_request_file_is_not_resumed(chat_model, tmp_path, capsys):
    requests = [request(number, temperature=0) for number in range(4)]
    dataset, output = write_requests(tmp_path / "requests.jsonl", requests), tmp_path / "out.jsonl"
    run_batch(capsys, chat_model, dataset, output, "--limit", "2")
    requests[1]["custom_id"] = "renamed"
    write_requests(dataset, requests)
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--output",
                   str(output), "--max-new-tokens", str(RUN_MAX_NEW_TOKENS), "--do-sample", "--seed", "3", "--limit", "2"])
    assert status == 2 and "row 1 was 'request-1', now 'renamed'" in one_error_line(capsys)


@pytest.mark.slow
def test_a_killed_batch_resumes_to_the_uninterrupted_output(chat_model, tmp_path, cli_environment):
    """One slot (--batch-size 1): every request is computed in the same shapes in both runs, so the outputs are
    equal bit for bit. With more slots a row's logits can differ in the last bits with the rows it shares a step
    with, which flips a draw where two tokens nearly tie (docs/run.md, "Choosing tokens")."""
    requests = [request(number, CHAT if number % 2 else TEXT,
                        **({"n": 2, "temperature": 0.9} if number % 3 == 0 else {"max_tokens": 4 + number % 8}))
                for number in range(60)]
    dataset = write_requests(tmp_path / "requests.jsonl", requests)
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(chat_model), "--dataset",
               str(dataset), "--max-new-tokens", "40", "--do-sample", "--seed", "5", "--batch-size", "1", "--quiet"]
    resumed, whole, written = killed_then_resumed_and_whole(command, tmp_path, cli_environment)
    assert 5 <= written < 60
    lines = [without_created([json.loads(line) for line in path.read_text().splitlines()]) for path in (resumed, whole)]
    assert lines[0] == lines[1] and len(lines[1]) == 60


def test_a_request_line_nested_thousands_deep_is_one_line_before_the_model_loads(chat_model, tmp_path, capsys):
    """A request whose response_format nests 5,000 arrays (valid JSON that Python's reader cannot recurse through) is
    named by its line, where it was a RecursionError traceback."""
    dataset = tmp_path / "requests.jsonl"
    line = json.dumps(request(1))[:-2] + ', "response_format": ' + "[" * 5000 + "]" * 5000 + "}}"
    dataset.write_text(json.dumps(request(0)) + "\n" + line + "\n")
    assert main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--output",
                 str(tmp_path / "out.jsonl"), "--quiet"]) == 2
    error = one_error_line(capsys)
    assert "line 2 (row 1) is nested too deep" in error and "fix or remove that line" in error
    assert not (tmp_path / "out.jsonl").exists()
