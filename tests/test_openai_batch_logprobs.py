"""Log-probabilities in OpenAI batch files, as the legacy /v1/completions API and vLLM give them: ``logprobs`` K gives
each generated token's; with ``echo`` the prompt's tokens come first (scored in the prefill, equal to Hugging Face's
forward within 1e-5) and ``text`` is the prompt and the completion; ``max_tokens`` 0 with echo scores the prompt alone.
A request that asks none has none, and a value they do not take is that request's error line."""

import json
import shutil

import pytest
import torch
from conftest import one_error_line
from test_conversations import TEMPLATE, hf_greedy
from test_openai_batch import CHAT, TEXT, request, schema_problems, write_requests
from test_scoring import HuggingFace
from transformers import AutoTokenizer

from accelgen.cli import main

PROMPT, SHORT = "Hello world, the quick brown fox", "Tokens and more"
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def chat_model(tiny_model_folder, tmp_path_factory):
    """The tiny Llama with a chat template (a file with a chat request needs one)."""
    folder = tmp_path_factory.mktemp("logprobs") / "chat-llama"
    shutil.copytree(tiny_model_folder("llama"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(chat_model):
    return HuggingFace(chat_model)


def best_alternatives(reference, ids, alternatives):
    """At each token after the first: {text: log-probability} of the ``alternatives`` most likely tokens there and of
    the token itself, as Hugging Face's forward gives them (float32)."""
    with torch.no_grad():
        log_softmax = torch.log_softmax(reference.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    tops = []
    for place, token in enumerate(ids[1:]):
        best = log_softmax[place].topk(alternatives)
        pairs = [(token, log_softmax[place, token].item()), *zip(best.indices.tolist(), best.values.tolist())]
        top = {}
        for pair_token, value in sorted(pairs, key=lambda pair: -pair[1]):
            top.setdefault(reference.tokenizer.decode([pair_token]), value)
        tops.append(top)
    return tops


def assert_close(got, expected, tolerance):
    assert len(got) == len(expected)
    assert max(abs(a - b) for a, b in zip(got, expected)) < tolerance, (got, expected)


def run_file(capsys, model, tmp_path, requests):
    dataset, output = write_requests(tmp_path / "requests.jsonl", requests), tmp_path / "out.jsonl"
    status = main(["run", "--device", "cpu", "--dtype", "float32", "--model", str(model), "--dataset", str(dataset),
                   "--output", str(output), "--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "3", "--quiet"])
    assert status == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [sent["custom_id"] for sent in requests]
    for line in lines:
        assert schema_problems(line) == [], line
    return {line["custom_id"]: line for line in lines}


def choices(line):
    return line["response"]["body"]["choices"]


def test_echo_and_logprobs_give_the_prompts_tokens_then_the_completions(chat_model, reference, tmp_path, capsys):
    requests = [
        request(0, TEXT, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0),
        request(1, TEXT, prompt=PROMPT, max_tokens=4, temperature=0),  # asks none: has none
        request(2, TEXT, prompt=SHORT, echo=True, logprobs=0, max_tokens=0),  # the prompt alone, scored
        request(3, TEXT, prompt=SHORT, logprobs=1, max_tokens=3, temperature=0),  # the completion's tokens only
        request(4, TEXT, prompt=SHORT, logprobs=3, n=2, temperature=1.0, seed=7, max_tokens=3),
        request(5, TEXT, prompt=SHORT, echo=True, max_tokens=2, temperature=0),  # echo alone: the text, no logprobs
        request(6, TEXT, prompt=SHORT, logprobs=-1), request(7, TEXT, prompt=SHORT, logprobs=50),
        request(8, TEXT, prompt=SHORT, logprobs=True), request(9, TEXT, prompt=SHORT, logprobs=2.5),
        request(10, TEXT, prompt=SHORT, echo="yes", logprobs=1), request(11, TEXT, prompt=SHORT, max_tokens=0),
        request(12, CHAT, logprobs=True),
    ]
    lines = run_file(capsys, chat_model, tmp_path, requests)
    tokenizer = reference.tokenizer

    # echo with logprobs 2: the prompt's tokens, scored as Hugging Face's forward scores them, then the completion's
    ids = tokenizer(PROMPT)["input_ids"]
    greedy = hf_greedy(chat_model, ids, 4)
    [echoed] = choices(lines["request-0"])
    [plain] = choices(lines["request-1"])
    assert plain["logprobs"] is None and echoed["text"] == PROMPT + plain["text"]
    logprobs, count = echoed["logprobs"], len(ids)
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == count + len(greedy) == count + lines["request-0"]["response"]["body"]["usage"]["completion_tokens"]
    assert logprobs["tokens"][:count] == [tokenizer.decode([token]) for token in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected, _ = reference.logprobs(ids + greedy)
    assert_close(logprobs["token_logprobs"][1:count], expected[: count - 1], 1e-5)
    for got, want in zip(logprobs["top_logprobs"][1:count], best_alternatives(reference, ids, 2), strict=True):
        assert set(got) == set(want) and 2 <= len(got) <= 3
        assert_close([got[text] for text in want], list(want.values()), 1e-5)
    assert_close(logprobs["token_logprobs"][count:], expected[count - 1:], 1e-4)  # each new token's, as it was drawn
    for text, logprob, top in zip(logprobs["tokens"][count:], logprobs["token_logprobs"][count:],
                                  logprobs["top_logprobs"][count:], strict=True):
        assert top == {text: logprob}  # a generated token's alternatives are not kept: its own alone
    offsets = [sum(map(len, logprobs["tokens"][:place])) for place in range(count)]
    assert logprobs["text_offset"][:count] == offsets and logprobs["text_offset"][count] == len(PROMPT)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])

    # max_tokens 0 with echo: the prompt alone, each token with its own log-probability (logprobs 0: no alternatives)
    short_ids = tokenizer(SHORT)["input_ids"]
    [alone] = choices(lines["request-2"])
    assert alone["text"] == SHORT and alone["finish_reason"] == "length"
    assert lines["request-2"]["response"]["body"]["usage"] == {"prompt_tokens": len(short_ids), "completion_tokens": 0,
                                                                "total_tokens": len(short_ids)}
    assert alone["logprobs"]["tokens"] == [tokenizer.decode([token]) for token in short_ids]
    assert_close(alone["logprobs"]["token_logprobs"][1:], reference.logprobs(short_ids)[0], 1e-5)
    assert [None if top is None else list(top) for top in alone["logprobs"]["top_logprobs"]] == \
        [None] + [[text] for text in alone["logprobs"]["tokens"][1:]]

    # logprobs without echo: the completion's tokens only, their offsets after the prompt
    [completed] = choices(lines["request-3"])
    short_greedy = hf_greedy(chat_model, short_ids, 3)
    assert completed["text"] == tokenizer.decode(short_ids + short_greedy)[len(SHORT):]
    assert len(completed["logprobs"]["tokens"]) == len(short_greedy)
    assert_close(completed["logprobs"]["token_logprobs"], reference.logprobs(short_ids + short_greedy)[0][len(short_ids) - 1:], 1e-4)
    assert completed["logprobs"]["text_offset"][0] == len(SHORT)

    # each sample its own
    samples = choices(lines["request-4"])
    assert len(samples) == 2 and samples[0]["text"] != samples[1]["text"]
    assert sum(len(sample["logprobs"]["tokens"]) for sample in samples) == \
        lines["request-4"]["response"]["body"]["usage"]["completion_tokens"]
    assert all(None not in sample["logprobs"]["token_logprobs"] for sample in samples)

    [echo_alone] = choices(lines["request-5"])
    assert echo_alone["text"].startswith(SHORT) and len(echo_alone["text"]) > len(SHORT) and echo_alone["logprobs"] is None

    errors = {custom_id: line["error"]["message"] for custom_id, line in lines.items() if line["error"]}
    assert set(errors) == {f"request-{number}" for number in range(6, 13)}
    for number, value in ((6, "-1"), (7, "50"), (8, "True"), (9, "2.5")):
        assert errors[f"request-{number}"] == f"logprobs must be a whole number from 0 to 20 (the alternatives given at " \
                                              f"each token) (got {value})"
    assert errors["request-10"] == "echo must be true or false (got 'yes')"
    assert errors["request-11"].startswith("max_tokens must be a whole number from 1") and "(or 0 with echo" in errors["request-11"]
    assert errors["request-12"].startswith("sets logprobs, which accelgen gives on /v1/completions only")


def test_echo_alone_and_logprobs_0_where_no_request_scores_its_prompt(chat_model, tmp_path, capsys):
    lines = run_file(capsys, chat_model, tmp_path, [request(0, TEXT, prompt=SHORT, echo=True, max_tokens=0),
                                                   request(1, TEXT, prompt=SHORT, logprobs=0, max_tokens=2)])
    [alone], [completed] = choices(lines["request-0"]), choices(lines["request-1"])
    assert alone == {"index": 0, "text": SHORT, "logprobs": None, "finish_reason": "length"}
    assert [list(top) for top in completed["logprobs"]["top_logprobs"]] == [[text] for text in completed["logprobs"]["tokens"]]


@pytest.mark.parametrize("flag", [["--logprobs"], ["--prompt-logprobs", "2"]])
def test_run_wide_logprobs_are_refused_for_a_batch_file(chat_model, tmp_path, capsys, flag):
    dataset = write_requests(tmp_path / "requests.jsonl", [request(0, TEXT, prompt=SHORT)])
    status = main(["run", "--device", "cpu", "--model", str(chat_model), "--dataset", str(dataset), "--output",
                   str(tmp_path / "out.jsonl"), *flag])
    assert status == 2 and f"{flag[0]} is not written into OpenAI batch output lines: each request asks for its own " \
                           f"(body.logprobs K, with echo for its prompt's)" in one_error_line(capsys)
