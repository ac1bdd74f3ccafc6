"""Stop strings (``--stop TEXT``): a completion ends at the first occurrence of any of them, the stop text not
kept, ``finish_reason`` "stop"; found from the tokens alone, so the text is the same however often the host
looks, in fixed or continuous batches, on one rank or two, in one replica or two."""

import json

import pytest
from conftest import one_error_line
from test_tensor_parallel import accelgen_command, rows_of

import accelgen
from accelgen.cli import main
from accelgen.generation import scheduler

PROMPTS = [f"Row {number} says" + " hello" * (number % 4) for number in range(10)]
MAX_NEW_TOKENS = 24
SETTINGS = dict(device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=4, do_sample=True, seed=3)


def plain_completions(folder):
    return accelgen.generate(PROMPTS, model=folder, **SETTINGS)


def stops_for(completions) -> list[str]:
    """Two texts that occur in the middle of some of the completions, not at their start."""
    middles = [completion.completion[4:7] for completion in completions if len(completion.completion) > 10]
    return [middles[0], middles[len(middles) // 2]]


def cut_at_first(text: str, stops: list[str]) -> str:
    found = [position for stop in stops if (position := text.find(stop)) >= 0]
    return text[: min(found)] if found else text


@pytest.fixture(scope="module")
def llama(tiny_model_folder):
    return tiny_model_folder("llama")


def test_a_completion_ends_right_before_its_first_stop_text(llama):
    plain = plain_completions(llama)
    stops = stops_for(plain)
    stopped = accelgen.generate(PROMPTS, model=llama, stop=stops, **SETTINGS)
    assert any(completion.finish_reason == "stop" for completion in stopped)
    for before, after in zip(plain, stopped, strict=True):
        assert after.completion == cut_at_first(before.completion, stops)
        assert before.completion_token_ids[: len(after.completion_token_ids)] == after.completion_token_ids
        if after.finish_reason == "stop":
            assert not any(stop in after.completion for stop in stops)
            assert len(after.completion_token_ids) < len(before.completion_token_ids)
        else:
            assert after.completion_token_ids == before.completion_token_ids


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_text_is_the_same_when_the_host_looks_every_step(llama, monkeypatch, batching):
    stops = stops_for(plain_completions(llama))
    at_default = accelgen.generate(PROMPTS, model=llama, stop=stops, batching=batching, **SETTINGS)
    monkeypatch.setitem(scheduler.LOOK_INTERVAL, batching, 1)
    every_step = accelgen.generate(PROMPTS, model=llama, stop=stops, batching=batching, **SETTINGS)
    assert [(c.completion, c.finish_reason) for c in every_step] == [(c.completion, c.finish_reason) for c in at_default]


def test_static_and_continuous_batches_stop_alike(llama):
    stops = stops_for(plain_completions(llama))
    static, continuous = (accelgen.generate(PROMPTS, model=llama, stop=stops, batching=batching, **SETTINGS)
                          for batching in ("static", "continuous"))
    assert [(c.completion, c.completion_token_ids) for c in static] == [(c.completion, c.completion_token_ids)
                                                                       for c in continuous]


def test_stop_texts_are_in_the_run_record_and_a_resume_with_others_is_refused(llama, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    command = ["run", "--device", "cpu", "--model", str(llama), "--prompt", "Hello", "--max-new-tokens", "4",
               "--output", str(output), "--quiet"]
    assert main([*command, "--stop", "ab"]) == 0
    assert json.loads((tmp_path / "out.jsonl.run.json").read_text())["stop"] == ["ab"]
    capsys.readouterr()
    assert main([*command, "--stop", "cd"]) == 2
    assert "different stop" in one_error_line(capsys)


@pytest.mark.parametrize("typed, meant", [
    ("\\n\\n", "\n\n"),  # --stop "\n\n", as a shell passes it: a backslash and an n, twice
    ("\n\n", "\n\n"),  # --stop $'\n\n': the shell made the new lines
    ("###\\t", "###\t"),
    ("a\\\\nb", "a\\nb"),  # an escaped backslash: a backslash followed by n
    ("C:\\data", "C:\\data"),  # another backslash is itself
])
def test_stop_texts_read_new_lines_tabs_and_backslashes_as_typed_in_a_shell(llama, tmp_path, typed, meant):
    output = tmp_path / "out.jsonl"
    assert main(["run", "--device", "cpu", "--model", str(llama), "--prompt", "Hello", "--max-new-tokens", "4",
                 "--output", str(output), "--quiet", "--stop", typed]) == 0
    assert json.loads((tmp_path / "out.jsonl.run.json").read_text())["stop"] == [meant]


def test_an_empty_stop_text_is_one_line(llama, capsys):
    status = main(["run", "--device", "cpu", "--model", str(llama), "--prompt", "Hello", "--stop", ""])
    assert status == 2 and "--stop '' is not a text to stop at" in one_error_line(capsys)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [["--world-size", "2"], ["--world-size", "2", "--data-parallel", "2"]])
def test_two_ranks_or_two_replicas_stop_where_one_process_does(llama, tmp_path, job_environment, parallel):
    import subprocess

    stops = stops_for(plain_completions(llama))
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in PROMPTS))
    options = ["--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "4", "--do-sample", "--seed", "3"]
    result = subprocess.run(
        accelgen_command("run", "--device", "cpu", "--model", str(llama), "--dataset", str(dataset), *options,
                         *(argument for stop in stops for argument in ("--stop", stop)), "--output", str(output),
                         "--quiet", *parallel),
        env=job_environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    expected = accelgen.generate(PROMPTS, model=llama, stop=stops, **SETTINGS)
    assert [(row["completion"], row["finish_reason"]) for row in rows_of(output)] == [
        (completion.completion, completion.finish_reason) for completion in expected]


def test_a_row_that_reaches_a_stop_text_frees_its_slot(llama):
    """With --ignore-eos only stop texts end rows early: the stopped rows' slots take the next rows at once, so
    the run decodes fewer steps than without them."""
    settings = dict(SETTINGS, ignore_eos=True)
    plain = accelgen.load(llama, **settings)
    completions = plain.generate(PROMPTS)
    stops = stops_for(completions)
    stopping = accelgen.load(llama, stop=stops, **settings)
    stopped = stopping.generate(PROMPTS)
    assert sum(completion.finish_reason == "stop" for completion in stopped) >= 2
    assert stopping.stats.decode_steps < plain.stats.decode_steps
