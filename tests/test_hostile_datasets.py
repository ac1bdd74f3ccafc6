"""Hostile datasets and the run record that pins them: each refusal is one ``accelgen: error:`` line, exit status
2, no traceback, and the output and its run record are left byte for byte as they were.

Runs ``accelgen.cli.main`` in this process on the built-in model; the cases about the environment (a datasets
cache that cannot be written) run the ``accelgen`` module in a subprocess, since ``datasets`` reads it at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_error_line_in

from accelgen.cli import main

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

ROWS = ["In the beginning", "And God said", "Let there be light", "And it was so"]
QUICK = ["run", "--device", "cpu", "--max-new-tokens", "2", "--quiet"]


def jsonl(texts) -> str:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts)


def run_fails(capsys, *arguments: str) -> str:
    assert main([*QUICK, *arguments]) == 2
    return one_error_line_in(capsys.readouterr().err)


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` and its bytes."""
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def stopped_run(tmp_path, capsys):
    """(dataset, output): a run over four rows stopped after its first two (as --limit 2 leaves it)."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(jsonl(ROWS))
    output = tmp_path / "out.jsonl"
    assert main([*QUICK, "--dataset", str(dataset), "--output", str(output), "--limit", "2"]) == 0
    capsys.readouterr()
    return dataset, output


def resume(dataset: Path, output: Path, *extra: str) -> int:
    return main([*QUICK, "--dataset", str(dataset), "--output", str(output), *extra])


def prompts_of(output: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in output.read_text().splitlines()]


# -- case 1: the dataset edited between a stopped run and its resume -------------------------------

@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("edit, message", [
    (lambda texts: ["A new first row", *texts], "row 0 was 'In the beginning', now 'A new first row'"),
    (lambda texts: [texts[0], "And Moses said", *texts[2:]], "row 1 was 'And God said', now 'And Moses said'"),
    (lambda texts: texts[1:], "row 0 was 'In the beginning', now 'And God said'"),
])
def test_a_dataset_whose_completed_rows_changed_is_refused(stopped_run, capsys, edit, message, streaming):
    dataset, output = stopped_run
    dataset.write_text(jsonl(edit(ROWS)))
    before = snapshot(output.parent)
    error = run_fails(capsys, "--dataset", str(dataset), "--output", str(output), *(["--streaming"] if streaming else []))
    assert f"Dataset '{dataset}' changed since the rows in --output '{output}' were completed" in error
    assert message in error and "pass --overwrite to complete it again, or a new --output." in error
    assert snapshot(output.parent) == before
    assert resume(dataset, output, "--overwrite") == 0  # the fix it names
    assert prompts_of(output) == edit(ROWS)


def test_a_dataset_edited_past_the_completed_rows_resumes(stopped_run, capsys):
    """Rows appended at the end, and a row not yet done fixed: the rows done are the dataset's first rows still."""
    dataset, output = stopped_run
    texts = [*ROWS[:2], "Let there be more light", ROWS[3], "And the evening and the morning"]
    dataset.write_text(jsonl(texts))
    assert resume(dataset, output) == 0
    assert "resuming: 2 rows already in" in capsys.readouterr().err
    assert prompts_of(output) == texts
    dataset.write_text(jsonl([*texts[:4], "And it was good"]))  # then a row completed after the append is edited
    error = run_fails(capsys, "--dataset", str(dataset), "--output", str(output))
    assert "row 4 was 'And the evening and the morning', now 'And it was good'" in error


def test_an_output_reached_through_a_link_resumes_an_appended_dataset_as_its_real_name_does(stopped_run, capsys):
    """The run record lies beside the output's real file: the rows done are compared there, whatever name the
    output is given."""
    dataset, output = stopped_run
    link = output.parent / "link.jsonl"
    link.symlink_to(output)
    texts = [*ROWS, "And the evening and the morning"]
    dataset.write_text(jsonl(texts))
    assert resume(dataset, link) == 0
    assert "resuming: 2 rows already in" in capsys.readouterr().err
    assert prompts_of(output) == texts


def test_rows_cut_to_max_input_tokens_resume_only_on_an_unchanged_dataset(tmp_path, capsys):
    """The output holds such a row as the model saw it (cut), which cannot be compared with the dataset's row."""
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text(jsonl(ROWS))
    cut = ["--max-input-tokens", "2"]
    assert resume(dataset, output, "--limit", "2", *cut) == 0
    assert resume(dataset, output, "--limit", "3", *cut) == 0  # unchanged: resumes
    assert "resuming: 2 rows already in" in capsys.readouterr().err
    dataset.write_text(jsonl([*ROWS, "And the evening"]))
    before = snapshot(tmp_path)
    error = run_fails(capsys, "--dataset", str(dataset), "--output", str(output), *cut)
    assert "row 0 was 'In the', now 'In the beginning', the output holding each row as cut to --max-input-tokens" in error
    assert snapshot(tmp_path) == before


def test_a_saved_dataset_folder_is_pinned_too(tmp_path, capsys):
    import datasets

    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(tmp_path / "saved")
    output = tmp_path / "out.jsonl"
    assert resume(tmp_path / "saved", output, "--limit", "2") == 0
    capsys.readouterr()
    datasets.Dataset.from_dict({"text": ["Inserted", *ROWS]}).save_to_disk(tmp_path / "saved2")
    before = snapshot(tmp_path)
    error = run_fails(capsys, "--dataset", str(tmp_path / "saved2"), "--output", str(output))
    assert "holds completions of another run (different dataset, dataset_content)" in error  # another path
    for name in os.listdir(tmp_path / "saved2"):  # the same path, other rows
        os.replace(tmp_path / "saved2" / name, tmp_path / "saved" / name)
    before = snapshot(tmp_path)
    error = run_fails(capsys, "--dataset", str(tmp_path / "saved"), "--output", str(output))
    assert "row 0 was 'In the beginning', now 'Inserted'" in error
    assert snapshot(tmp_path) == before


def test_a_run_record_written_before_datasets_were_pinned_still_resumes(stopped_run, capsys):
    dataset, output = stopped_run
    record_file = Path(f"{output}.run.json")
    record = json.loads(record_file.read_text())
    assert record["dataset_content"]["bytes"] == dataset.stat().st_size
    del record["dataset_content"]
    record_file.write_text(json.dumps(record))
    assert resume(dataset, output) == 0
    assert "resuming: 2 rows already in" in capsys.readouterr().err
    assert prompts_of(output) == ROWS
    assert "dataset_content" not in json.loads(record_file.read_text())


# -- case 2: a folder of mixed files ---------------------------------------------------------------

@pytest.mark.parametrize("files, message", [
    ({"a.json": json.dumps([{"text": "one"}]), "b.csv": "text\ntwo\n", "notes.txt": "notes\n"},
     "would be read only in part (it holds JSON: a.json; CSV: b.csv; other: notes.txt): keep files of one format"),
    ({"a.jsonl": jsonl(["one"]), "b.csv": "text\ntwo\n", "c.csv": "text\nthree\n"},
     "would be read only in part (it holds JSON: a.jsonl; CSV: b.csv, c.csv)"),
    ({"a.txt": "one\n"}, "holds no JSON, JSONL, CSV or Parquet file (only a.txt): put the rows in such files there"),
    ({}, "holds no JSON, JSONL, CSV or Parquet file: put the rows in such files there, or pass a file as --dataset."),
    ({"README.md": "# rows\n"}, "holds no JSON, JSONL, CSV or Parquet file: put the rows"),
])
def test_a_folder_is_read_whole_or_refused(tmp_path, capsys, files, message):
    folder = tmp_path / "rows"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    error = run_fails(capsys, "--dataset", str(folder))
    assert f"Dataset folder '{folder}' {message}" in error


def test_a_folder_of_one_format_with_a_card_and_hidden_files_is_read_whole(tmp_path, capsys):
    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "README.md").write_text("# rows, without a YAML header\n")
    (folder / ".notes.txt").write_text("hidden\n")
    (folder / "a.jsonl").write_text(jsonl(ROWS[:2]))
    (folder / "b.json").write_text(jsonl(ROWS[2:]))
    output = tmp_path / "out.jsonl"
    assert resume(folder, output) == 0
    assert "Repo card" not in capsys.readouterr().err  # the card parser's "metadata block was not found"
    assert prompts_of(output) == ROWS


@pytest.mark.parametrize("streaming", [False, True])
def test_an_unknown_split_of_a_folder_names_the_splits(tmp_path, capsys, streaming):
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.jsonl").write_text(jsonl(ROWS))
    error = run_fails(capsys, "--dataset", str(tmp_path / "rows"), "--split", "test", *(["--streaming"] if streaming else []))
    assert f"Unknown split 'test'; '{tmp_path / 'rows'}' has: train." in error


# -- case 3: an over-long prompt names its row -----------------------------------------------------

@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_an_over_long_row_is_named_with_its_dataset(tmp_path, capsys, batching):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(jsonl([ROWS[0], "word " * 3000]))
    error = run_fails(capsys, "--dataset", str(dataset), "--batching", batching, "--batch-size", "2")
    assert f"Dataset '{dataset}' row 1 (column 'text'): A prompt has 3002 tokens, more than the largest bucket" in error


# -- case 4: files that are not what they seem -----------------------------------------------------

def test_a_named_pipe_is_refused_without_blocking(tmp_path, capsys):
    os.mkfifo(tmp_path / "rows.jsonl")
    error = run_fails(capsys, "--dataset", str(tmp_path / "rows.jsonl"))
    assert f"Dataset path '{tmp_path / 'rows.jsonl'}' is a named pipe, not a file" in error
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text(jsonl(ROWS))
    os.mkfifo(tmp_path / "folder" / "b.jsonl")
    error = run_fails(capsys, "--dataset", str(tmp_path / "folder"))
    assert "holds 'b.jsonl', which is a named pipe: move it out of the folder." in error
    error = run_fails(capsys, "--dataset", "/dev/zero")  # read whole, it would never end
    assert "Dataset path '/dev/zero' is a character device, not a file" in error


def test_a_symbolic_link_loop_is_named(tmp_path, capsys):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    error = run_fails(capsys, "--dataset", str(tmp_path / "a.jsonl"))
    # the reason in brackets is the system's wording (ELOOP), not ours to pin
    assert f"Dataset path '{tmp_path / 'a.jsonl'}' is a symbolic link that leads nowhere (" in error
    assert error.endswith("): point it at a dataset file, or pass the file itself.\n")
    os.chdir(tmp_path)  # a relative name, which would otherwise be looked for on the Hub
    error = run_fails(capsys, "--dataset", "a.jsonl")
    assert "Dataset path 'a.jsonl' is a symbolic link that leads nowhere" in error


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_a_dataset_without_read_permission_is_named(tmp_path, capsys):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(jsonl(ROWS))
    dataset.chmod(0)
    error = run_fails(capsys, "--dataset", str(dataset))
    assert f"Cannot read dataset '{dataset}': Permission denied: make it readable" in error


@pytest.mark.parametrize("name, content, message", [
    ("utf16.jsonl", jsonl(ROWS).encode("utf-16"), "line 1 (row 0) is not UTF-8 text (byte 0xff at byte 0)"),
    ("latin1.csv", "text\ncafé\n".encode("latin-1"), "is not UTF-8 text ("),
    ("empty.json", b"[]", "(split 'train') has no rows to complete."),
    ("nulls.jsonl", b'{"text": null}\n{"text": null}\n', "row 0, column 'text', is null (no text): fill it in"),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_text_that_is_not_rows_is_named(tmp_path, capsys, name, content, message, streaming):
    dataset = tmp_path / name
    dataset.write_bytes(content)
    error = run_fails(capsys, "--dataset", str(dataset), *(["--streaming"] if streaming else []))
    assert message in error and "torn" not in error


def test_a_parquet_column_of_numbers_or_missing_texts_is_named(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "numbers.parquet")
    error = run_fails(capsys, "--dataset", str(tmp_path / "numbers.parquet"))
    assert "Column 'text' holds int64, not text nor a conversation (the dataset has no text column)." in error
    pq.write_table(pa.table({"text": ["a", None, ""]}), tmp_path / "gaps.parquet")
    error = run_fails(capsys, "--dataset", str(tmp_path / "gaps.parquet"))
    assert "row 1, column 'text', is null (no text)" in error


def test_a_bom_and_mixed_line_endings_are_read(tmp_path, capsys):
    dataset = tmp_path / "rows.jsonl"
    lines = [json.dumps({"text": text}) for text in ROWS]
    dataset.write_bytes(b"\xef\xbb\xbf" + f"{lines[0]}\r\n{lines[1]}\n{lines[2]}\r{lines[3]}".encode())
    output = tmp_path / "out.jsonl"
    assert resume(dataset, output) == 0
    assert prompts_of(output) == ROWS


@pytest.mark.parametrize("variable, value", [
    ("HF_DATASETS_CACHE", "{file}/cache"), ("HF_HOME", "{file}"), ("HF_DATASETS_CACHE", "{file}"),
])
def test_a_datasets_cache_that_cannot_be_written_is_its_own_line(tmp_path, cli_environment, variable, value):
    """A read-only HOME, as root can meet it too: the cache folder lies under a file (a CSV file: the datasets library
    reads it through its cache; a JSON file is read by accelgen)."""
    (tmp_path / "a_file").write_text("")
    dataset = tmp_path / "rows.csv"
    dataset.write_text("text\n" + "\n".join(ROWS) + "\n")
    environment = {**cli_environment, variable: value.format(file=tmp_path / "a_file")}
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", *QUICK, "--dataset", str(dataset)],
                            env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    error = one_error_line_in(result.stderr)
    assert "The datasets cache folder '" + str(tmp_path / "a_file") in error
    assert "set HF_DATASETS_CACHE (or HF_HOME) to a writable folder." in error


# -- a lone surrogate: half of a UTF-16 pair, which no text holds ---------------------------------------------------

LONE = "holds a lone surrogate (U+D800 at character {}, half of a UTF-16 pair without its other half, which is no character)"


def test_a_lone_surrogate_in_a_column_of_mixed_types_is_said_not_read_as_empty_or_dropped(tmp_path, capsys):
    """datasets reads such a column as JSON values and drops the surrogate without a word: "\\ud800" became an empty
    row, "a\\ud800b" the row "ab"."""
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text('{"text": "In the beginning"}\n{"text": 7}\n{"text": "\\ud800"}\n{"text": "a\\ud800b"}\n'
                       '{"text": "\\ud83d\\ude00 is a pair"}\n')
    assert main([*QUICK, "--dataset", str(dataset), "--output", str(output), "--skip-bad-rows"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row.get("error") for row in rows] == [None, "holds int, not text", LONE.format(0), LONE.format(1), None]
    assert rows[4]["prompt"] == "\U0001F600 is a pair"


def test_a_lone_surrogate_in_a_text_column_is_named_with_its_row(tmp_path, capsys):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"text": "In the beginning"}\n\n{"text": "And God \\ud800 said"}\n')
    assert run_fails(capsys, "--dataset", str(dataset)) == (
        f"accelgen: error: Dataset '{dataset}' row 1, column 'text', {LONE.format(8)}: remove it, or give it its "
        f"pair, or pass --skip-bad-rows to write such rows as error rows and go on (rows count from 0, as the "
        f"output's \"index\").\n")
