"""Dataset completion: any local source `datasets` reads, resumable output, progress, and bad input."""

import json
import subprocess
import sys

import datasets
import pytest
from killed_runs import kill_after_rows

import accelgen
from accelgen.cli import main

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

TEXTS = [
    "DeepSpeed is a machine learning framework",
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "Static shapes",
    "In the beginning",
]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def table():
    # the files written from it (to_json, to_csv) print no progress bar into the stderr a test reads, whether or not a
    # job (which turns them off) ran in this process first
    datasets.disable_progress_bars()
    return datasets.Dataset.from_dict({"content": TEXTS, "number": list(range(len(TEXTS)))})


@pytest.fixture(params=["jsonl", "json", "csv", "parquet", "saved", "folder"])
def dataset_source(request, table, tmp_path):
    """The same five rows, in each kind of local source; returns the --dataset argument."""
    kind = request.param
    if kind == "jsonl":
        table.to_json(tmp_path / "rows.jsonl")
        return str(tmp_path / "rows.jsonl")
    if kind == "json":
        (tmp_path / "rows.json").write_text(json.dumps([{"content": text, "number": i} for i, text in enumerate(TEXTS)]))
        return str(tmp_path / "rows.json")
    if kind == "csv":
        table.to_csv(tmp_path / "rows.csv", index=False)
        return str(tmp_path / "rows.csv")
    if kind == "parquet":
        table.to_parquet(tmp_path / "rows.parquet")
        return str(tmp_path / "rows.parquet")
    if kind == "saved":
        datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(tmp_path / "saved")
        return str(tmp_path / "saved")
    (tmp_path / "folder").mkdir()
    table.to_parquet(tmp_path / "folder" / "part-0.parquet")
    return str(tmp_path / "folder")


def complete(*arguments):
    return main(["run", "--device", "cpu", *arguments])


def rows_of(path):
    # lines end at \n only: str.splitlines() also splits at characters a completion may hold (U+0085, U+2028)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def test_every_local_source_completes_in_order_like_one_prompt_at_a_time(
    dataset_source, tiny_model_folder, tmp_path, capsys
):
    folder = str(tiny_model_folder("llama"))
    output = tmp_path / "out.jsonl"
    assert complete("--model", folder, "--dataset", dataset_source, "--column", "content", "--batch-size", "2",
                    "--max-new-tokens", str(NEW_TOKENS), "--output", str(output)) == 0
    rows = rows_of(output)
    assert [row["index"] for row in rows] == list(range(len(TEXTS)))
    assert [row["prompt"] for row in rows] == TEXTS
    # batched (last batch padded with a filler row, which is dropped) == one prompt at a time
    one_by_one = accelgen.load(folder, device="cpu", max_new_tokens=NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows] == [
        one_by_one.generate([text])[0].completion_token_ids for text in TEXTS
    ]
    shown = capsys.readouterr()
    assert "Batch n°3" in shown.out and f"Input: {TEXTS[4]!r}" in shown.out
    assert "accelgen: 5/5 rows" in shown.err  # plain progress lines when stderr is not a terminal


def test_limit_streaming_and_truncation(table, tiny_model_folder, tmp_path):
    table.to_json(tmp_path / "rows.jsonl")
    folder = str(tiny_model_folder("bloom"))
    outputs = {}
    for name, extra in {"loaded": [], "streamed": ["--streaming"]}.items():
        outputs[name] = tmp_path / f"{name}.jsonl"
        assert complete("--model", folder, "--dataset", str(tmp_path / "rows.jsonl"), "--column", "content",
                        "--limit", "3", "--max-input-tokens", "3", "--max-new-tokens", str(NEW_TOKENS), "--quiet",
                        "--output", str(outputs[name]), *extra) == 0
    loaded, streamed = rows_of(outputs["loaded"]), rows_of(outputs["streamed"])
    assert loaded == streamed and len(loaded) == 3
    generator = accelgen.load(folder, device="cpu")
    first_three_tokens = generator.tokenizer.decode(generator.tokenizer(TEXTS[2])["input_ids"][:3])
    assert loaded[2]["prompt"] == first_three_tokens and loaded[2]["prompt_token_count"] == 3


def test_a_different_run_on_an_existing_output_is_refused_unless_overwriting(table, tiny_model_folder, tmp_path, capsys):
    table.to_json(tmp_path / "rows.jsonl")
    output = tmp_path / "out.jsonl"
    common = ["--model", str(tiny_model_folder("gpt2")), "--dataset", str(tmp_path / "rows.jsonl"), "--column",
              "content", "--quiet", "--output", str(output)]
    assert complete(*common, "--max-new-tokens", "4") == 0
    first = output.read_text()
    assert complete(*common, "--max-new-tokens", "4") == 0  # same run: nothing left to do
    assert "all 5 rows are already in" in capsys.readouterr().err
    assert complete(*common, "--max-new-tokens", "5") == 2
    assert "holds completions of another run (different max_new_tokens)" in capsys.readouterr().err
    assert output.read_text() == first
    assert complete(*common, "--max-new-tokens", "5", "--overwrite") == 0
    expected = accelgen.generate(TEXTS, model=tiny_model_folder("gpt2"), device="cpu", max_new_tokens=5)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [c.completion_token_ids for c in expected]


@pytest.mark.slow
def test_a_killed_run_resumes_without_losing_or_repeating_a_row(tmp_path, cli_environment):
    """SIGKILL a real run mid-way, tear its last line, start it again: the file equals an uninterrupted run's."""
    rows = [{"text": f"Chapter {number}: And it came to pass that the king"} for number in range(16)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--dataset", str(tmp_path / "rows.jsonl"),
               "--batch-size", "2", "--max-new-tokens", "48", "--ignore-eos", "--quiet"]
    reference = tmp_path / "reference.jsonl"
    subprocess.run([*command, "--output", str(reference)], env=cli_environment, check=True, capture_output=True)

    output = tmp_path / "out.jsonl"
    kept = kill_after_rows([*command, "--output", str(output)], output, cli_environment)
    assert 5 <= kept < len(rows), "the run should have been killed mid-way"
    with output.open("a") as torn:  # as if killed in the middle of a write
        torn.write('{"index": 99, "prompt": "Chapter')

    resumed = subprocess.run([*command, "--output", str(output)], env=cli_environment, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {kept} rows already in" in resumed.stderr
    assert rows_of(output) == rows_of(reference)


def test_a_local_json_lines_job_runs_without_the_datasets_library(tmp_path, tiny_model_folder, cli_environment):
    # the file is read by accelgen's own reader: the datasets library (and pandas, pyarrow with it) is not imported on
    # the way to a job's first row; here it cannot be
    rows = [{"text": "A river runs"}, {"text": "The city at night"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = ("import sys; sys.modules['datasets'] = None; from accelgen.cli import main; "
           f"sys.exit(main(['run', '--model', {str(tiny_model_folder('llama'))!r}, '--dataset', "
           f"{str(tmp_path / 'rows.jsonl')!r}, '--output', {str(tmp_path / 'out.jsonl')!r}, '--max-new-tokens', '4', "
           "'--quiet']))")
    done = subprocess.run([sys.executable, "-c", job], env=cli_environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert [row["prompt"] for row in rows_of(tmp_path / "out.jsonl")] == ["A river runs", "The city at night"]


@pytest.mark.slow
def test_dataset_completion_with_two_ranks(table, tiny_model_folder, tmp_path, cli_environment):
    pytest.importorskip("deepspeed")
    table.to_json(tmp_path / "rows.jsonl")
    folder = str(tiny_model_folder("llama"))
    output = tmp_path / "out.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--model", folder,
         "--dataset", str(tmp_path / "rows.jsonl"), "--column", "content", "--batch-size", "2",
         "--max-new-tokens", str(NEW_TOKENS), "--output", str(output)],
        env=cli_environment, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    expected = accelgen.generate(TEXTS, model=folder, device="cpu", batch_size=2, max_new_tokens=NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [c.completion_token_ids for c in expected]
    assert result.stdout.count("Batch n°") == 3  # rank 0 alone prints


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--dataset", "{folder}/rows.jsonl", "--column", "nope"], "Column 'nope' is not in the dataset; its columns: content, number."),
        (["--dataset", "{folder}/rows.jsonl", "--column", "number"], "Column 'number' holds numbers, not text nor a conversation (text columns: content)."),
        (["--dataset", "{folder}/rows.jsonl", "--column", "content", "--split", "test"], "Unknown split 'test'; '{folder}/rows.jsonl' has: train."),
        (["--dataset", "{folder}/saved", "--column", "content", "--split", "validation"], "Unknown split 'validation'; '{folder}/saved' has: train, test."),
        (["--dataset", "{folder}/empty.csv", "--column", "content"], "has no rows to complete"),
        (["--dataset", "{folder}/rows.txt"], "use a file ending in .json, .jsonl, .csv, .parquet"),
        (["--dataset", "./no/such/rows.jsonl"], "Dataset path './no/such/rows.jsonl' does not exist."),
        (["--dataset", "{folder}/rows.jsonl", "--column", "content", "--limit", "0"], "argument --limit: must be a whole number from 1 to 2147483647, got '0'"),
        (["--dataset", "{folder}/rows.jsonl", "--prompt", "a"], "Pass --prompt or --dataset, not both."),
        (["--dataset", "{folder}/rows.jsonl", "--column", "content", "--output", "{folder}/missing/out.jsonl"], "does not exist"),
    ],
)
def test_bad_dataset_input_is_one_line(table, tmp_path, capsys, arguments, message):
    table.to_json(tmp_path / "rows.jsonl")
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(tmp_path / "saved")
    (tmp_path / "empty.csv").write_text("content,number\n")
    (tmp_path / "rows.txt").write_text("hello\n")
    arguments = [argument.replace("{folder}", str(tmp_path)) for argument in arguments]
    assert complete(*arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith("accelgen: error: ") and error.count("\n") == 1
    assert message.replace("{folder}", str(tmp_path)) in error


def test_configurations_of_a_dataset_folder(tmp_path, tiny_model_folder, capsys):
    """A folder whose README declares two configurations, as Hub datasets do."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    for name, text in (("first", "Hello"), ("second", "DeepSpeed is")):
        (folder / name).mkdir()
        (folder / name / "rows.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: first\n  data_files: first/*.jsonl\n"
        "- config_name: second\n  data_files: second/*.jsonl\n---\n"
    )
    assert complete("--dataset", str(folder)) == 2
    assert "has several configurations: pass --dataset-config (one of: first, second)." in capsys.readouterr().err
    assert complete("--dataset", str(folder), "--dataset-config", "third") == 2
    error = capsys.readouterr().err
    assert f"Unknown --dataset-config 'third' for '{folder}'; available: first, second." in error
    output = tmp_path / "out.jsonl"
    assert complete("--model", str(tiny_model_folder("gpt2")), "--dataset", str(folder), "--dataset-config",
                    "second", "--max-new-tokens", "3", "--output", str(output)) == 0
    assert [row["prompt"] for row in rows_of(output)] == ["DeepSpeed is"]


def test_progress_draws_a_bar_on_a_terminal():
    import io

    from accelgen.jobs.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    progress = Progress(total=4, done=1, stream=terminal)
    progress.update(3)
    progress.close()
    assert "4/4" in terminal.getvalue() and "row" in terminal.getvalue()


def test_progress_lines_in_a_log_say_the_last_count_once():
    """Off a terminal a line is printed every few seconds; one printed at the last row is not printed again."""
    import io

    from accelgen.jobs.progress import Progress

    log = io.StringIO()
    progress = Progress(total=12, stream=log, every_seconds=0)
    progress.update(5)
    progress.update(7)
    progress.close()
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == ["accelgen: 5/12 rows", "accelgen: 12/12 rows"]
    quiet = io.StringIO()
    progress = Progress(total=12, stream=quiet, every_seconds=3600)
    progress.update(12)
    progress.close()
    assert [line.split(",")[0] for line in quiet.getvalue().splitlines()] == ["accelgen: 12/12 rows"]


@pytest.mark.parametrize("on_a_terminal", [False, True])
def test_the_time_left_leaves_out_compiling_the_decode_step(monkeypatch, on_a_terminal):
    """A job whose decode step compiles for 300 s, then completes a row a second: the progress says it compiles,
    and promises the 9 rows left in about 9 s, not in the 2,700 s that a rate counting the compile would give."""
    import io

    import accelgen.jobs.progress
    from accelgen.jobs.progress import Progress

    now = [1000.0]
    monkeypatch.setattr(accelgen.jobs.progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("tqdm.std.time", lambda: now[0])

    class Stream(io.StringIO):
        def isatty(self):
            return on_a_terminal

    stream = Stream()
    progress = Progress(total=10, stream=stream, every_seconds=0)
    progress.announce("compiling the decode step before the first rows")
    now[0] += 301.0
    progress.update(1, paused_seconds=300.0)
    shown = stream.getvalue()
    assert "compiling the decode step before the first rows" in shown
    if on_a_terminal:
        assert "00:09" in shown.split("\r")[-1] and "1/10" in shown.split("\r")[-1], shown
    else:
        assert shown.splitlines()[-1] == "accelgen: 1/10 rows, 1.00 rows/s, ETA 9 s"
    progress.close()


def test_a_hub_dataset_that_cannot_be_reached_suggests_a_local_file(monkeypatch, capsys):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network here; fail at once
    assert complete("--dataset", "JulesBelveze/tldr_news", "--dataset-config", "all", "--split", "test") == 2
    error = capsys.readouterr().err
    assert "Dataset 'JulesBelveze/tldr_news' not found, or the Hub cannot be reached" in error
    assert "pass a local JSON, JSONL, CSV or Parquet file" in error and error.count("\n") == 1


def test_a_batch_larger_than_the_rows_left_runs_as_many_slots_as_they_need(tiny_model_folder, tmp_path, capsys):
    """--batch-size 5000 on 3 rows: 3 slots (said in one line), the rows of a run with --batch-size 3."""
    folder = str(tiny_model_folder("llama"))
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"Row {number} says"}) + "\n" for number in range(3)))
    outputs = {}
    for size in ("5000", "3"):
        outputs[size] = tmp_path / f"out{size}.jsonl"
        assert complete("--model", folder, "--dataset", str(dataset), "--max-new-tokens", "4", "--batch-size", size,
                        "--output", str(outputs[size]), "--quiet") == 0
        said = [line for line in capsys.readouterr().err.splitlines() if "--batch-size" in line]
        assert said == (["accelgen: warning: --batch-size 5,000 is more than the 3 slots the rows left to complete "
                         "need: running 3"] if size == "5000" else [])
    assert [row["completion_token_ids"] for row in rows_of(outputs["5000"])] == [
        row["completion_token_ids"] for row in rows_of(outputs["3"])]
