"""Scoring (``accelgen score``, ``Generator.score``, ``--prompt-logprobs``): each prompt token's log-probability given
the tokens before it, computed in the engine's prefill, equal to ``log_softmax`` of Hugging Face's forward (float32)
within 1e-5 on every family, one row at a time and eight at once, packed in one row and padded to a bucket; a
continuation's log-likelihood and whether it is the greedy one; choices ranked as that forward ranks them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from family_models import FAMILY_SETTINGS, skip_unless_installed
from test_parity import _new_dtype_keyword
from transformers import AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.cli import main
from accelgen.common.prompts import ScoreRequest

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

#: Rows of different lengths (some longer than a sliding window of the family models).
TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog again and again", "DeepSpeed is",
         "one two three four five six seven eight nine ten eleven twelve", "a", "Tokens and more tokens",
         "Short one", "the model reads every word of this row before the last"]
FAMILIES = ("bloom", "gpt2", "llama", "opt", "falcon", *(family for family in FAMILY_SETTINGS if family != "llama"))


class HuggingFace:
    """The reference: Hugging Face's model (float32), one forward per sequence, ``log_softmax`` of its logits."""

    def __init__(self, folder):
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        keyword = "dtype" if _new_dtype_keyword() else "torch_dtype"
        self.model = AutoModelForCausalLM.from_pretrained(folder, **{keyword: torch.float32}).eval()

    def logprobs(self, ids: list[int]) -> tuple[list[float], list[bool]]:
        """Each token's log-probability after the first, and whether it is the argmax there."""
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, :-1].float()
        targets = torch.tensor(ids[1:])
        return (torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0].tolist(),
                (logits.argmax(-1) == targets).tolist())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch_size", [1, 8])
def test_scores_equal_hugging_faces_forward(tiny_model_folder, family, batch_size):
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    reference = HuggingFace(folder)
    generator = accelgen.load(folder, device="cpu", dtype="float32", batch_size=batch_size)
    scored = generator.score(TEXTS, alternatives=3)
    for text, completion in zip(TEXTS, scored, strict=True):
        ids = reference.tokenizer(text)["input_ids"]
        scores = completion.prompt_scores
        assert scores.token_ids == ids and completion.prompt_token_count == len(ids)
        expected, greedy = reference.logprobs(ids)
        assert scores.logprobs[0] is None and scores.logprobs[1:] == pytest.approx(expected, abs=1e-5)
        for top, logprob in zip(scores.top[1:], expected):
            assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)
            assert top[0][1] >= logprob - 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_continuations_scored_alone_are_the_forwards_and_greedy_as_its_argmax(tiny_model_folder, family):
    """A continuation scored without its text's tokens (lm-evaluation-harness's requests): the head runs on its
    positions alone, with the same log-probabilities; each token greedy where the forward's argmax is it."""
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    reference = HuggingFace(folder)
    generator = accelgen.load(folder, device="cpu", dtype="float32", batch_size=4)
    pairs = [reference.tokenizer(text)["input_ids"] for text in TEXTS[:4]]
    requests = [ScoreRequest(tuple(ids[:1]), (tuple(ids[1:]),), text_scores=False) for ids in pairs if len(ids) > 1]
    for ids, completion in zip([ids for ids in pairs if len(ids) > 1], generator.score(requests), strict=True):
        expected, greedy = reference.logprobs(ids)
        [continuation] = completion.continuations
        assert completion.prompt_scores is None and continuation.tokens == len(ids) - 1
        assert continuation.token_logprobs == pytest.approx(expected, abs=1e-5)
        assert continuation.greedy == all(greedy)
    context = reference.tokenizer("The quick brown fox")["input_ids"]
    [greedy_ids] = generator.generate_token_ids([context])[:1]
    [completion] = generator.score([ScoreRequest(tuple(context), (tuple(greedy_ids[0][:4]),), text_scores=False)])
    assert completion.continuations[0].greedy


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_packed_and_padded_prefills_score_the_same(tiny_model_folder, packed):
    """Llama packs prompts in one row where prefills run as they are; a prefill chunk shorter than the rows makes
    them run padded to their bucket, in passes."""
    folder = tiny_model_folder("llama")
    reference = HuggingFace(folder)
    generator = accelgen.load(folder, device="cpu", dtype="float32", batch_size=4,
                              prefill_chunk=0 if packed else 8)
    for text, completion in zip(TEXTS, generator.score(TEXTS), strict=True):
        expected, _ = reference.logprobs(reference.tokenizer(text)["input_ids"])
        assert completion.prompt_scores.logprobs[1:] == pytest.approx(expected, abs=1e-5)


def test_a_continuations_likelihood_and_whether_it_is_greedy(tiny_model_folder):
    folder = tiny_model_folder("llama")
    reference = HuggingFace(folder)
    generator = accelgen.load(folder, device="cpu", dtype="float32", batch_size=2, max_new_tokens=6, ignore_eos=True)
    context = "The quick brown fox"
    [greedy_completion] = generator.generate([context])
    greedy_ids = tuple(greedy_completion.completion_token_ids)  # as token ids: a random model's text may not tokenize back
    requests = [ScoreRequest(context + " ", ("jumps over",)),  # its space goes on to the continuation
                ScoreRequest(tuple(reference.tokenizer(context)["input_ids"]), (greedy_ids,))]
    first, second = generator.score(requests)
    whole = reference.tokenizer(context + " jumps over")["input_ids"]
    context_ids = reference.tokenizer(context)["input_ids"]
    expected, greedy = reference.logprobs(whole)
    [continuation] = first.continuations
    assert continuation.tokens == len(whole) - len(context_ids)
    assert continuation.logprob == pytest.approx(sum(expected[len(context_ids) - 1:]), abs=1e-4)
    assert continuation.greedy == all(greedy[len(context_ids) - 1:])
    assert first.prompt_scores.token_ids == context_ids
    assert second.continuations[0].greedy  # the model's own greedy completion is its greedy continuation


def test_choices_are_ranked_as_hugging_faces_forward_ranks_them(tiny_model_folder):
    folder = tiny_model_folder("gpt2")
    reference = HuggingFace(folder)
    generator = accelgen.load(folder, device="cpu", dtype="float32", batch_size=3)
    context, choices = "The capital of the land is", (" Paris", " a big city", " Rome", " the")
    [completion] = generator.score([ScoreRequest(context, choices, choices=True)])
    context_ids = reference.tokenizer(context)["input_ids"]
    sums = []
    for choice in choices:
        expected, _ = reference.logprobs(reference.tokenizer(context + choice)["input_ids"])
        sums.append(sum(expected[len(context_ids) - 1:]))
    assert [choice.logprob for choice in completion.continuations] == pytest.approx(sums, abs=1e-4)
    assert max(range(len(sums)), key=sums.__getitem__) == max(
        range(len(sums)), key=lambda place: completion.continuations[place].logprob)


# -- accelgen score: lines, resumes, error rows, ranks ------------------------------------------------------------


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line]


def write_rows(path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


CHOICE_ROWS = [{"text": "The capital of the land is", "choices": [" Paris", " a big city", " Rome"]},
               {"text": "Hello there", "choices": [" friend", " x"]},
               {"text": "one two three", "choices": [" four", " five six", " seven"]},
               {"text": "The quick brown fox", "choices": [" jumps", " sleeps"]}]


def test_score_lines_hold_what_the_forward_gives(tiny_model_folder, tmp_path):
    folder = tiny_model_folder("llama")
    reference = HuggingFace(folder)
    rows = write_rows(tmp_path / "rows.jsonl", CHOICE_ROWS)
    output = tmp_path / "scores.jsonl"
    assert main(["score", "--device", "cpu", "--dtype", "float32", "--model", str(folder), "--dataset", str(rows),
                 "--choices-column", "choices", "--token-logprobs", "2", "--batch-size", "4", "--output", str(output),
                 "--quiet"]) == 0
    for row, line in zip(CHOICE_ROWS, rows_of(output), strict=True):
        ids = reference.tokenizer(row["text"])["input_ids"]
        expected, _ = reference.logprobs(ids)
        assert line["tokens"] == ids and line["prompt_tokens"] == len(ids)
        assert line["token_logprobs"][0] is None and line["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
        assert line["prompt_logprob"] == pytest.approx(sum(expected), abs=1e-4)
        assert line["perplexity"] == pytest.approx(math.exp(-sum(expected) / (len(ids) - 1)), rel=1e-4)
        assert [len(top) for top in line["top_logprobs"][1:]] == [2] * (len(ids) - 1)
        sums = []
        for choice in row["choices"]:
            whole, _ = reference.logprobs(reference.tokenizer(row["text"] + choice)["input_ids"])
            sums.append(sum(whole[len(ids) - 1:]))
        assert line["choices"] == row["choices"] and line["choice_logprobs"] == pytest.approx(sums, abs=1e-4)
        assert line["best_choice"] == max(range(len(sums)), key=sums.__getitem__)
        assert line["choice_bytes"] == [len(choice.encode()) for choice in row["choices"]]


def test_a_stopped_score_run_resumes_into_the_same_lines(tiny_model_folder, tmp_path):
    folder = str(tiny_model_folder("gpt2"))
    rows = write_rows(tmp_path / "rows.jsonl", CHOICE_ROWS)
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    common = ["score", "--device", "cpu", "--model", folder, "--dataset", str(rows), "--choices-column", "choices",
              "--quiet"]
    assert main([*common, "--output", str(whole)]) == 0
    assert main([*common, "--output", str(resumed)]) == 0
    lines = resumed.read_text().split("\n")
    resumed.write_text("\n".join(lines[:2]) + "\n")  # a run stopped after two rows
    assert main([*common, "--output", str(resumed)]) == 0
    assert rows_of(resumed) == rows_of(whole)


def test_rows_that_cannot_be_scored_are_error_rows_or_one_line(tiny_model_folder, tmp_path, capsys):
    folder = str(tiny_model_folder("llama"))
    rows = write_rows(tmp_path / "rows.jsonl", [{"text": "Hello", "cont": " there"}, {"text": "Hi", "cont": ""},
                                                {"text": "", "cont": " x"}, {"text": "Fine", "cont": 3}])
    output = tmp_path / "out.jsonl"
    common = ["score", "--device", "cpu", "--model", folder, "--dataset", str(rows), "--continuation-column", "cont",
              "--quiet"]
    assert main(common) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "row 1" in error and "'cont'" in error and "--skip-bad-rows" in error
    assert main([*common, "--skip-bad-rows", "--output", str(output)]) == 0
    lines = rows_of(output)
    assert [line["finish_reason"] for line in lines] == ["scored", "error", "error", "error"]
    assert lines[0]["continuation_tokens"] >= 1 and isinstance(lines[0]["continuation_greedy"], bool)
    assert all(line["prompt_logprob"] is None and line["error"] for line in lines[1:])


def test_a_conversation_is_scored_as_its_chat_template_renders_it(tmp_path):
    """The built-in model's tokenizer has a chat template: a row of messages is scored as the tokens it renders."""
    from accelgen.loading.model_files import DEFAULT_MODEL

    reference = HuggingFace(DEFAULT_MODEL)
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    rows = write_rows(tmp_path / "rows.jsonl", [{"messages": messages}])
    output = tmp_path / "out.jsonl"
    assert main(["score", "--device", "cpu", "--dtype", "float32", "--dataset", str(rows), "--column", "messages",
                 "--token-logprobs", "--output", str(output), "--quiet"]) == 0
    [line] = rows_of(output)
    ids = list(reference.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                        continue_final_message=True)["input_ids"])
    expected, _ = reference.logprobs(ids)
    assert line["tokens"] == ids and line["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
