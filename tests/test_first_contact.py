"""A new user's first commands, tried as they are written: the README's examples do what they say, a model that
cannot be reached or found says so promptly in one line with the way on, ``bench`` says what it is doing as it goes
and ``compare --plot`` says where it wrote the chart."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_error_line, one_error_line_in

from accelgen.cli import main
from accelgen.common.settings import DEFAULT_MODEL
from accelgen.loading.random_weights import built_in_config_name

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def shell_lines(text: str) -> list[list[str]]:
    """The words of each command line of the text's ``sh`` blocks, comments left out."""
    lines, in_block = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = line.strip() in ("```sh", "```shell", "```bash")
            continue
        if in_block and line.strip():
            lines.append(shlex.split(line, comments=True))
    return lines


def option(words: list[str], name: str, default: str | None = None) -> str | None:
    return words[words.index(name) + 1] if name in words else default


def rows_of_result_file(path: Path) -> set[tuple[str, int]]:
    """(model, batch size) of every measured row of a result file."""
    document = json.loads(path.read_text())
    return {(measurement["model"]["name"], row["batch_size"])
            for measurement in document["measurements"] for row in measurement["results"]}


def rows_of_bench_line(words: list[str]) -> set[tuple[str, int]]:
    """(model, batch size) of every row the ``accelgen bench`` line measures."""
    model = option(words, "--model-config") or option(words, "--model")
    model = built_in_config_name(model) or model
    return {(model, int(size)) for size in option(words, "--batch-sizes", "1").split(",")}


def test_the_readmes_compare_examples_compare_what_they_measure():
    lines = shell_lines(README.read_text())
    measured = {option(words, "--output"): rows_of_bench_line(words)
                for words in lines if words[:2] == ["accelgen", "bench"] and "--output" in words}
    compares = [words for words in lines if words[:2] == ["accelgen", "compare"]]
    assert compares  # the README shows compare
    # output files compared (their agreement): each written by a command shown, all of the same rows
    rows_of_output = {option(words, "--output"): option(words, "--dataset") for words in lines
                      if words[:2] in (["accelgen", "run"], ["accelgen", "score"]) and "--output" in words}
    for words in compares:
        outputs = [word for word in words[2:] if word.endswith(".jsonl")]
        if outputs:
            assert len(outputs) >= 2 and all(output in rows_of_output for output in outputs), words
            assert len({rows_of_output[output] for output in outputs}) == 1, words
            continue
        files = [word for word in words[2:] if word.endswith(".json")]
        assert len(files) >= 2, words  # a comparison of something with something
        rows = [measured[file] if file in measured else rows_of_result_file(ROOT / file) for file in files]
        for file, file_rows in zip(files[1:], rows[1:]):
            assert rows[0] & file_rows, f"{file} measures {sorted(file_rows)}, {files[0]} {sorted(rows[0])}: no cell"


# -- a Hub model without a network, a local folder that is not there -------------------------------------------------


def run_in_a_fresh_environment(tmp_path: Path, *arguments: str, **environment: str) -> subprocess.CompletedProcess:
    """``accelgen ARGUMENTS`` in its own process, with an empty Hugging Face cache and ``environment``."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), TRANSFORMERS_VERBOSITY="error", **environment)
    return subprocess.run([sys.executable, "-m", "accelgen.cli", *arguments], env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_hub_model_without_a_network_is_said_in_one_line_that_names_the_network(tmp_path):
    """The Hub's endpoint refuses connections (no network): one line saying so, with the two ways on; never a
    suggestion of --trust-remote-code, never huggingface_hub's retry chatter."""
    result = run_in_a_fresh_environment(tmp_path, "run", "--model", "bigscience/bloomz-560m", "--prompt", "hi",
                                        HF_ENDPOINT="http://127.0.0.1:9")
    assert result.returncode == 2
    error = one_error_line_in(result.stderr)
    assert error.startswith("accelgen: error: Cannot load model 'bigscience/bloomz-560m': cannot reach the Hugging "
                            "Face Hub at http://127.0.0.1:9 (Connection refused; no network?): pass a local folder, or "
                            "set HF_HUB_OFFLINE=1 with the model in the Hugging Face cache.")
    assert "trust-remote-code" not in error


def test_a_hub_model_config_for_random_weights_without_a_network_is_one_line(tmp_path):
    """``bench --model-config <Hub id> --random-weights`` asks the Hub for a config: without a network, the same line
    at once (it waited through huggingface_hub's retries)."""
    result = run_in_a_fresh_environment(tmp_path, "bench", "--device", "cpu", "--random-weights", "--model-config",
                                        "bigscience/bloomz-3b", HF_ENDPOINT="http://127.0.0.1:9")
    assert result.returncode == 2
    error = one_error_line_in(result.stderr)
    assert error.startswith("accelgen: error: Cannot load model config 'bigscience/bloomz-3b': cannot reach the Hugging "
                            "Face Hub at http://127.0.0.1:9 (Connection refused; no network?)")


def test_a_hub_model_not_in_the_cache_offline_says_so_in_one_line(tmp_path):
    result = run_in_a_fresh_environment(tmp_path, "run", "--model", "bigscience/bloomz-560m", "--prompt", "hi",
                                        HF_HUB_OFFLINE="1")
    assert result.returncode == 2
    error = one_error_line_in(result.stderr)
    assert "HF_HUB_OFFLINE is set and its files are not in the Hugging Face cache: pass a local folder, or unset " \
           "HF_HUB_OFFLINE" in error and "trust-remote-code" not in error


def test_a_local_model_folder_that_does_not_exist_points_to_the_built_in_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--model", "./my-model", "--prompt", "hi"]) == 2
    error = one_error_line(capsys)
    assert "Model folder './my-model' does not exist" in error
    assert f"omit --model to run the built-in model, whose folder is {DEFAULT_MODEL}" in error


# -- compare says where it wrote ------------------------------------------------------------------------------------

PUBLISHED = ROOT / "results" / "published" / "bloomz-7b1-gaudi2-a100-gaudi1.json"


def test_compare_says_where_it_wrote_the_chart_and_the_table(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(PUBLISHED), "--plot", "chart.png", "--markdown", "table.md"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert said == [f"accelgen: wrote the Markdown table to {tmp_path / 'table.md'}",
                    f"accelgen: wrote the chart to {tmp_path / 'chart.png'}"]
    assert (tmp_path / "chart.png").read_bytes().startswith(b"\x89PNG")


# -- bench says what it is doing as it goes ---------------------------------------------------------------------------


def test_bench_says_what_it_is_doing_as_it_goes_unless_quiet(capsys):
    command = ["bench", "--device", "cpu", "--max-new-tokens", "3", "--runs", "2", "--batch-sizes", "1,2"]
    assert main(command) == 0
    said = [line.split(": ", 2)[-1] if line.startswith("accelgen: bench: ") else line
            for line in capsys.readouterr().err.splitlines()]
    assert said[0] == "loading accelgen built-in default on cpu"
    assert said[1].startswith("loaded in ") and said[1].endswith(
        "; measuring batch sizes 1, 2: 1 warm-up and 2 timed runs of 3 new tokens each")
    for size, lines in ((1, said[2:6]), (2, said[6:10])):
        assert lines[0] == f"batch size {size}: warm-up run 1 of 1 (not timed; any graph capture happens here), 3 new tokens"
        assert lines[1].startswith(f"batch size {size}: timed run 1 of 2: ") and lines[1].endswith(" s")
        assert lines[2].startswith(f"batch size {size}: timed run 2 of 2: ")
        assert lines[3].startswith(f"accelgen: bench batch size {size}: ")  # its figures
    assert len(said) == 10

    assert main([*command, "--quiet"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1] for line in said] == [" bench batch size 1", " bench batch size 2"]
