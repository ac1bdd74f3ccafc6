"""Log-probabilities (``--logprobs``): each chosen token's log-probability under the model's own distribution,
recorded inside the decode step (no read per token), equal to ``log_softmax`` of Hugging Face's logits at the
chosen tokens."""

import json

import pytest
import torch
from conftest import PROMPTS
from test_parity import _new_dtype_keyword
from transformers import AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.cli import main

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

MAX_NEW_TOKENS = 12


def hugging_face_logprobs(folder, prompt: str, new_tokens: list[int]) -> list[float]:
    """log_softmax of Hugging Face's logits (float32, one forward over prompt + new tokens) at each new token."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, **{"dtype" if _new_dtype_keyword() else "torch_dtype": torch.float32})
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = torch.tensor([prompt_ids + new_tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(new_tokens)[:, None]).squeeze(1).tolist()


@pytest.mark.parametrize("architecture", ["llama", "bloom"])
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_logprobs_equal_hugging_faces_at_the_chosen_tokens(tiny_model_folder, architecture, batching):
    folder = tiny_model_folder(architecture)
    completions = accelgen.generate(PROMPTS, model=folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS,
                                    logprobs=True, batch_size=2, batching=batching, dtype="float32")
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert len(completion.logprobs) == len(completion.completion_token_ids)
        expected = hugging_face_logprobs(folder, prompt, completion.completion_token_ids)
        assert completion.logprobs == pytest.approx(expected, abs=1e-4)


def test_sampled_logprobs_are_the_models_before_temperature(tiny_model_folder):
    folder = tiny_model_folder("llama")
    [completion] = accelgen.generate(["Hello"], model=folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, logprobs=True,
                                     do_sample=True, temperature=0.5, top_k=5, seed=1, dtype="float32")
    expected = hugging_face_logprobs(folder, "Hello", completion.completion_token_ids)
    assert completion.logprobs == pytest.approx(expected, abs=1e-4)


def test_the_command_line_writes_logprobs_only_when_asked(tiny_model_folder, tmp_path, capsys):
    folder, with_, without = tiny_model_folder("llama"), tmp_path / "with.jsonl", tmp_path / "without.jsonl"
    for output, flags in ((with_, ["--logprobs"]), (without, [])):
        assert main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "Hello", "--max-new-tokens", "5",
                     "--output", str(output), "--quiet", *flags]) == 0
    [row] = [json.loads(line) for line in with_.read_text().splitlines()]
    [plain] = [json.loads(line) for line in without.read_text().splitlines()]
    assert len(row["logprobs"]) == len(row["completion_token_ids"]) and all(value <= 0 for value in row["logprobs"])
    assert "logprobs" not in plain and plain["completion_token_ids"] == row["completion_token_ids"]
