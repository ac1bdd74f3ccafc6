"""``accelgen run`` as a user types it: outputs, files, and one clear line for every mistake."""

import json
import shutil
import subprocess
import sys

import pytest
from transformers import GenerationConfig

import accelgen
from accelgen.cli import main
from accelgen.loading.model_files import DEFAULT_MODEL


def run_cli(*arguments):
    return main(["run", *arguments])


def test_run_prints_completions_and_writes_json_lines(tiny_model_folder, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    folder = str(tiny_model_folder("bloom"))
    status = run_cli("--device", "cpu", "--model", folder, "--prompt", "Hello", "--prompt", "DeepSpeed is",
                     "--max-new-tokens", "5", "--batch-size", "2", "--ignore-eos", "--output", str(output), "--details")
    assert status == 0
    shown = capsys.readouterr()
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1]
    assert [row["prompt"] for row in rows] == ["Hello", "DeepSpeed is"]
    assert all(len(row["completion_token_ids"]) == 5 for row in rows)
    expected = accelgen.generate(["Hello", "DeepSpeed is"], model=folder, device="cpu", max_new_tokens=5,
                                 batch_size=2, ignore_eos=True)
    assert [row["completion"] for row in rows] == [completion.completion for completion in expected]
    assert "Batch n°1" in shown.out and f"Output: {'Hello' + rows[0]['completion']!r}" in shown.out
    assert "10 new tokens" in shown.err and "graph captures: 0" in shown.err


def test_max_input_tokens_keeps_the_first_tokens(tiny_model_folder):
    generator = accelgen.load(tiny_model_folder("gpt2"), device="cpu", max_new_tokens=3, max_input_tokens=2)
    long_prompt = "The quick brown fox jumps over the lazy dog"
    [completion] = generator.generate([long_prompt])
    assert completion.prompt_token_count == 2
    first_two_tokens = generator.tokenizer.decode(generator.tokenizer(long_prompt)["input_ids"][:2])
    assert completion.prompt == first_two_tokens  # the prompt as the model saw it
    [same] = accelgen.generate([first_two_tokens], model=tiny_model_folder("gpt2"), device="cpu", max_new_tokens=3)
    assert completion.completion_token_ids == same.completion_token_ids


def test_seeded_sampling_is_reproducible_and_the_seed_matters(tiny_model_folder):
    settings = dict(model=tiny_model_folder("llama"), device="cpu", max_new_tokens=12, do_sample=True,
                    temperature=1.5, top_k=50, top_p=0.95, batch_size=2)
    first = accelgen.generate(["Hello", "DeepSpeed is"], seed=7, **settings)
    again = accelgen.generate(["Hello", "DeepSpeed is"], seed=7, **settings)
    other = accelgen.generate(["Hello", "DeepSpeed is"], seed=8, **settings)
    greedy = accelgen.generate(["Hello", "DeepSpeed is"], **{**settings, "do_sample": False})
    tokens = lambda completions: [completion.completion_token_ids for completion in completions]  # noqa: E731
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)
    assert tokens(first) != tokens(greedy)


def test_a_sampled_prompt_draws_the_same_in_any_batch(tiny_model_folder):
    """A row's draws depend on the seed and the prompt's number, not on its batch: a run resumed at any prompt,
    with any batch size, samples what the uninterrupted run did."""
    prompts = ["Hello", "DeepSpeed is", "The quick brown fox", "In the beginning", "Static shapes"]
    settings = dict(device="cpu", max_new_tokens=10, do_sample=True, temperature=1.3, top_p=0.95, seed=3)
    generator = accelgen.load(tiny_model_folder("llama"), batch_size=2, **settings)
    tokens = lambda completions: [completion.completion_token_ids for completion in completions]  # noqa: E731
    whole = tokens(generator.generate(prompts))
    resumed = accelgen.load(tiny_model_folder("llama"), batch_size=3, **settings)
    from_third = [completion for batch in resumed.generate_batches(prompts[3:], first_index=3) for completion in batch]
    assert tokens(from_third) == whole[3:]
    assert [completion.index for completion in from_third] == [3, 4]


def test_eos_ends_a_row_and_ignore_eos_runs_on(tiny_model_folder, tmp_path):
    prompts = ["DeepSpeed is", "Hello"]
    [reference, _] = accelgen.generate(prompts, model=tiny_model_folder("llama"), device="cpu", max_new_tokens=24,
                                       batch_size=2)
    assert reference.finish_reason == "length" and len(reference.completion_token_ids) == 24
    # a copy of the model whose end-of-sequence token is its first repeat-free greedy token after the start,
    # as a trained model's would be
    tokens = reference.completion_token_ids
    stop_at = next(index for index in range(1, len(tokens)) if tokens[index] not in tokens[:index])
    folder = shutil.copytree(tiny_model_folder("llama"), tmp_path / "stops")
    generation_config = GenerationConfig.from_pretrained(folder)
    generation_config.eos_token_id = tokens[stop_at]
    generation_config.save_pretrained(folder)

    for batch_size in (1, 2):
        [stopped, other] = accelgen.generate(prompts, model=folder, device="cpu", max_new_tokens=24, batch_size=batch_size)
        assert stopped.completion_token_ids == tokens[: stop_at + 1]
        assert stopped.finish_reason == "eos"
        assert other.finish_reason == "eos" or len(other.completion_token_ids) == 24

    [running_on, _] = accelgen.generate(prompts, model=folder, device="cpu", max_new_tokens=24, batch_size=2,
                                        ignore_eos=True)
    assert running_on.completion_token_ids == tokens and running_on.finish_reason == "length"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--device", "cpu"], "No prompts given: pass --prompt TEXT"),
        (["--device", "cpu", "--prompt", ""], "Prompt 0 is empty"),
        (["--device", "tpu", "--prompt", "a"], "No plugin provides --device 'tpu'. Known: "),
        (["--device", "cpu", "--model", "./no-such-model", "--prompt", "a"], "Model folder './no-such-model' does not exist"),
        (["--device", "cpu", "--prompt", "a", "--max-new-tokens", "0"], "argument --max-new-tokens: must be a whole number from 1 to 2147483647, got '0'"),
        (["--device", "cpu", "--prompt", "a", "--max-new-tokens", "-3"], "must be a whole number from 1 to 2147483647, got '-3'"),
        (["--device", "cpu", "--prompt", "a", "--batch-size", "0"], "argument --batch-size: must be a whole number from 1"),
        (["--device", "cpu", "--prompt", "a", "--dtype", "float16"], "--dtype float16 is not supported on cpu"),
        (["--device", "cpu", "--prompt", "a", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
        (["--device", "cpu", "--prompt", "a", "--top-p", "0"], "argument --top-p: must be a number above 0 and at most 1"),
        (["--device", "cpu", "--prompt", "a", "--buckets", "8,x"], "argument --buckets: must list numbers each a whole number from 1 to 2147483647, e.g. 32,64,128; got '8,x'"),
        (["--device", "cpu", "--prompt", "a", "--output", "/no/such/folder/out.jsonl"], "folder '/no/such/folder' does not exist"),
        (["--device", "cpu", "--prompt", "a b c d e f g h i j k l m n o p", "--buckets", "4"], "more than the largest bucket (4): pass --max-input-tokens"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(arguments, message, capsys):
    assert run_cli(*arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith("accelgen: error: ") and error.count("\n") == 1
    assert message in error


def test_unloadable_model_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    assert run_cli("--device", "cpu", "--model", str(tmp_path), "--prompt", "a") == 2
    error = capsys.readouterr().err
    assert error.startswith(f"accelgen: error: Cannot load model '{tmp_path}'") and error.count("\n") == 1


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tiny_model_folder, tmp_path, capsys):
    import shutil

    from accelgen.loading.model_files import DEFAULT_MODEL

    folder = tmp_path / "mismatch"
    shutil.copytree(tiny_model_folder("gpt2"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # 4096 tokens, for a 384-token model
        shutil.copy(DEFAULT_MODEL / name, folder / name)
    assert run_cli("--device", "cpu", "--model", str(folder), "--prompt", "In the beginning God created") == 2
    assert "outside the model's vocabulary of 384: the tokenizer does not belong to this model" in capsys.readouterr().err


def test_prompt_beyond_the_model_context_is_refused(tiny_model_folder, capsys):
    # the tiny GPT-2 has 256 positions
    assert run_cli("--device", "cpu", "--model", str(tiny_model_folder("gpt2")), "--prompt", "a " * 200,
                   "--max-new-tokens", "100") == 2
    assert "exceeds the model's context of 256 positions" in capsys.readouterr().err


def test_an_existing_output_file_survives_a_failed_start(tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    output.write_text("earlier work\n")
    assert run_cli("--device", "cpu", "--model", "./no-such-model", "--prompt", "a", "--output", str(output)) == 2
    assert output.read_text() == "earlier work\n"


def test_default_model_runs_from_the_installed_script(tmp_path, cli_environment):
    """The README's first command: no --model, the built-in model, through the real console script."""
    assert (DEFAULT_MODEL / "model.safetensors").is_file()
    output = tmp_path / "out.jsonl"
    result = subprocess.run(
        ["accelgen", "run", "--device", "cpu", "--prompt", "DeepSpeed is a machine learning framework",
         "--max-new-tokens", "12", "--output", str(output)],
        env=cli_environment, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    [row] = [json.loads(line) for line in output.read_text().splitlines()]
    assert row["completion"] and row["completion"] in result.stdout
    assert "Traceback" not in result.stderr


def test_bad_input_from_the_real_script_has_no_traceback(cli_environment):
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--prompt", "a", "--batch-size", "-1"],
        env=cli_environment, capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr == ("accelgen: error: argument --batch-size: must be a whole number from 1 to 2147483647, "
                             "got '-1' (see 'accelgen run --help')\n")


def test_help_never_cuts_a_folder_at_a_hyphen(monkeypatch, capsys):
    """A checkout in ``my-work/accel-gen``: the folder --help names is whole on its line, to be copied."""
    from accelgen.cli.command_options import COMMANDS

    folder = "/home/someone/my-work/accel-gen/core/default_model-with-a-long-name/and-a-deeper-folder"
    summary, options = COMMANDS["run"]
    monkeypatch.setitem(COMMANDS, "run", (summary, tuple(
        option.but(help=f"Hub id or local folder (default: the built-in demo model, the folder {folder})")
        if option.name == "model" else option for option in options)))
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert any(folder in line for line in capsys.readouterr().out.splitlines())


def test_help_names_the_built_in_models_folder(capsys):
    """A user can find the built-in model to shard or bench it: ``--help`` names its folder, a model by that path."""
    for command in ("run", "shard"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert str(DEFAULT_MODEL) in " ".join(capsys.readouterr().out.split())  # help wraps long lines
    assert run_cli("--device", "cpu", "--model", str(DEFAULT_MODEL), "--prompt", "In the beginning",
                   "--max-new-tokens", "2") == 0


def test_the_summary_is_short_and_the_details_are_asked_for_or_kept_in_the_run_record(tiny_model_folder, tmp_path,
                                                                                        capsys):
    """By default one line: rows, tokens, their rate, the load time, where the output went; --details adds what the
    run ran on (device, dtype, captures, memory per rank), which the run record keeps as last_run either way."""
    output = tmp_path / "out.jsonl"
    command = ["--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "Hello", "--prompt", "Hi",
               "--max-new-tokens", "3", "--ignore-eos", "--quiet", "--output", str(output)]
    assert run_cli(*command) == 0
    [summary] = capsys.readouterr().err.splitlines()
    assert summary.startswith("accelgen: 2 prompts, 6 new tokens in ") and summary.endswith(f"; written to {output}")
    assert len(summary) - len(str(output)) < 100 and "tokens/s); model loaded in " in summary
    last_run = json.loads((tmp_path / "out.jsonl.run.json").read_text())["last_run"]
    assert (last_run["rows"], last_run["new_tokens"], last_run["device"], last_run["graph_captures"]) == (2, 6, "cpu", 0)
    assert last_run["rank_memory"][0]["parameter_bytes"] > 0

    assert run_cli(*command, "--overwrite", "--details") == 0
    summary, details, memory = capsys.readouterr().err.splitlines()
    assert details.startswith("accelgen: device cpu (") and "dtype float32, world size 1, decode " in details
    assert "graph captures: 0, decode steps traced: 1; continuous batching, slot occupancy" in details
    assert memory.startswith("accelgen: parameter bytes per rank ")


def test_every_sample_of_a_prompt_is_shown(tiny_model_folder, capsys):
    assert run_cli("--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "Hello", "--do-sample",
                   "--num-samples", "3", "--max-new-tokens", "3") == 0
    shown = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in shown if line.startswith("Output")] == [
        "Output (sample 1/3)", "Output (sample 2/3)", "Output (sample 3/3)"]


def test_version_names_accelgen_torch_and_transformers(cli_environment):
    result = subprocess.run(["accelgen", "--version"], env=cli_environment, capture_output=True, text=True)
    from importlib import metadata

    import torch
    import transformers

    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith(f"accelgen {metadata.version('accelgen')} (torch {torch.__version__}, "
                                    f"transformers {transformers.__version__}, deepspeed ")
    assert result.stdout.count("\n") == 1
