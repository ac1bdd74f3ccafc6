"""Several samples of each prompt (``--num-samples N``): the prompt prefilled once and its cache rows copied into
its samples' slots; sample k of row r draws from its own stream (seed, row, sample, step), so a sample's text
does not depend on the slot or the batch it ran in; one output line per prompt, with ``completions``."""

import json
import subprocess
import sys

import pytest
from conftest import one_error_line
from killed_runs import kill_after_rows, killed_then_resumed_and_whole

import accelgen
from accelgen.cli import main

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

PROMPTS = [f"Row {number} says" + " hello" * (number % 3) for number in range(6)]
SETTINGS = dict(device="cpu", max_new_tokens=10, do_sample=True, seed=5, top_k=50)
SAMPLES = 4


def samples_of(generator) -> list[list[list[int]]]:
    return [[sample["completion_token_ids"] for sample in completion.completions]
            for completion in generator.generate(PROMPTS)]


@pytest.fixture(scope="module")
def llama(tiny_model_folder):
    return tiny_model_folder("llama")


def test_each_prompt_is_prefilled_once_for_all_its_samples(llama):
    generator = accelgen.load(llama, num_samples=SAMPLES, batch_size=16, **SETTINGS)
    completions = generator.generate(PROMPTS)
    assert [len(completion.completions) for completion in completions] == [SAMPLES] * len(PROMPTS)
    assert generator.stats.prefill_rows < len(PROMPTS) * SAMPLES  # prefill shapes of prompts, not of samples
    assert generator.stats.prefill_rows <= 8  # 6 prompts: shapes of 4 and 2 (powers of two)
    for completion in completions:  # the samples of one prompt differ
        assert len({tuple(sample["completion_token_ids"]) for sample in completion.completions}) > 1
        assert completion.completion_token_ids == completion.completions[0]["completion_token_ids"]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_samples_that_do_not_fit_the_free_slots_wait_without_a_second_prefill(llama, batch_size):
    """Continuous batching starts the samples that fit; the others keep the first tokens drawn from the one
    prefill and start from their prompt's cache row as slots free."""
    generator = accelgen.load(llama, num_samples=SAMPLES, batch_size=batch_size, **SETTINGS)
    generator.generate(PROMPTS)
    assert generator.stats.prefill_rows == len(PROMPTS)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_samples_text_is_the_same_at_batch_sizes_1_3_4_and_16(llama, batching):
    by_batch = [samples_of(accelgen.load(llama, num_samples=SAMPLES, batch_size=batch_size, batching=batching,
                                         **SETTINGS)) for batch_size in (1, 3, 4, 16)]
    assert by_batch[0] == by_batch[1] == by_batch[2] == by_batch[3]


def test_sample_zero_draws_what_one_sample_draws(llama):
    [one] = [[completion.completion_token_ids for completion in accelgen.generate(PROMPTS, model=llama, **SETTINGS)]]
    many = samples_of(accelgen.load(llama, num_samples=SAMPLES, batch_size=8, **SETTINGS))
    assert [samples[0] for samples in many] == one


def test_greedy_samples_are_one_line(llama, capsys):
    status = main(["run", "--device", "cpu", "--model", str(llama), "--prompt", "Hello", "--num-samples", "3"])
    assert status == 2 and "--num-samples 3 with greedy decoding gives 3 equal completions" in one_error_line(capsys)


@pytest.mark.slow
def test_a_killed_run_with_samples_resumes_to_the_uninterrupted_file(llama, tmp_path, cli_environment):
    """One slot, as in test_openai_batch's killed batch: the same shapes in both runs, so the files are equal bit for
    bit; the samples of each prompt still wait for the slot in turn (parked)."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"Line {number} of many" + " more" * (number % 4)}) + "\n"
                               for number in range(60)))
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(llama), "--dataset",
               str(dataset), "--max-new-tokens", "40", "--do-sample", "--seed", "5", "--num-samples", "3",
               "--batch-size", "1", "--quiet"]
    resumed, whole, written = killed_then_resumed_and_whole(command, tmp_path, cli_environment)
    assert 5 <= written < 60
    assert resumed.read_text() == whole.read_text()
    assert all(len(json.loads(line)["completions"]) == 3 for line in whole.read_text().splitlines())


@pytest.mark.parametrize("batch_size, batching, edited", [(1, "continuous", False), (4, "static", False),
                                                         (1, "continuous", True)],
                         ids=["one slot", "fixed batches", "the row edited before the resume"])
def test_a_run_killed_inside_a_rows_samples_keeps_the_finished_ones_and_resumes_to_the_uninterrupted_file(
        llama, tmp_path, cli_environment, batch_size, batching, edited):
    """Resume is by row, but a row of many samples is long: its finished samples are kept beside the output
    (``<output>.samples``) as they come, and a resumed run makes only the others; a row edited meanwhile (it was not
    written: it may be) is made anew."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"text": "Once upon a time"}) + "\n" + json.dumps({"text": "The sea"}) + "\n")
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(llama), "--dataset",
               str(dataset), "--max-new-tokens", "8", "--do-sample", "--seed", "5", "--num-samples", "400",
               "--batch-size", str(batch_size), "--batching", batching, "--quiet"]
    resumed, whole = tmp_path / "resumed.jsonl", tmp_path / "whole.jsonl"
    kept = tmp_path / "resumed.jsonl.samples"
    assert kill_after_rows([*command, "--output", str(resumed)], resumed, cli_environment, rows=40, watched=kept) == 0
    samples_kept = kept.read_text().count("\n")  # row 0's first samples: its line is not written
    assert 40 <= samples_kept < 400
    if edited:
        dataset.write_text(json.dumps({"text": "Once upon a tide"}) + "\n" + json.dumps({"text": "The sea"}) + "\n")
    again = subprocess.run([*command, "--output", str(resumed)], env=cli_environment, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    said = f"and {samples_kept} samples of row 0"
    assert (said not in again.stderr) if edited else (
        f"accelgen: resuming: 0 rows already in {resumed}, {said}\n" in again.stderr), again.stderr
    assert not kept.exists()  # gone once the row's line is written
    result = subprocess.run([*command, "--output", str(whole)], env=cli_environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert resumed.read_text() == whole.read_text()
    assert [len(json.loads(line)["completions"]) for line in whole.read_text().splitlines()] == [400, 400]


def test_progress_counts_samples_while_a_row_is_made(llama, tmp_path, capsys, monkeypatch):
    import accelgen.jobs.progress

    monkeypatch.setattr(accelgen.jobs.progress, "LINE_EVERY_SECONDS", 0)  # a line at every look
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"text": "Once upon a time"}) + "\n")
    assert main(["run", "--device", "cpu", "--model", str(llama), "--dataset", str(dataset), "--max-new-tokens", "4",
                 "--do-sample", "--num-samples", "64", "--batch-size", "8", "--quiet"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if " rows, " in line]
    within_the_row = [line for line in lines if line.startswith("accelgen: 0/1 rows, ")]
    assert within_the_row and all(" samples, " in line and "/64 samples" in line for line in lines), lines
    assert lines[-1].startswith("accelgen: 1/1 rows, 64/64 samples, ")
