"""Broken result files and unwritable outputs for ``accelgen compare`` and ``accelgen bench --output``: one
``accelgen: error:`` line naming the file (and the field), exit status 2, no traceback, nothing changed."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
from conftest import one_error_line

from accelgen.cli import main

PUBLISHED = Path(__file__).parent.parent / "results" / "published" / "bloomz-7b1-gaudi2-a100-gaudi1.json"
MEASURED = Path(__file__).parent.parent / "results" / "measured" / "cpu-bloom-560m.json"


def broken(change):
    def build(document: dict) -> dict:
        document = copy.deepcopy(document)
        change(document)
        return document
    return build


def set_in(path: list, value):
    def change(document: dict) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def remove(path: list):
    def change(document: dict) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return change


@pytest.mark.parametrize("build, message", [
    (broken(remove(["measurements"])), "field measurements is missing"),
    (broken(set_in(["measurements"], [])), "field measurements should be a non-empty list"),
    (broken(set_in(["measurements"], {"a": 1})), "field measurements should be a non-empty list, not dict"),
    (broken(remove(["measurements", 0, "label"])), "field measurements[0].label is missing"),
    (broken(remove(["measurements", 1, "results", 0, "batch_size"])), "field measurements[1].results[0].batch_size is missing"),
    (broken(set_in(["measurements", 0, "results", 0, "batch_size"], "1")),
     "field measurements[0].results[0].batch_size should be a whole number, not str"),
    (broken(set_in(["measurements", 0, "results", 0, "tokens_per_second"], "fast")),
     "field measurements[0].results[0].tokens_per_second should be a number, not str"),
    (broken(set_in(["measurements", 0, "results", 0, "end_to_end_s"], {"median": "1 s"})),
     "field measurements[0].results[0].end_to_end_s.median should be a number, not str"),
    (broken(set_in(["measurements", 0, "model"], "bloomz")), "field measurements[0].model should be an object, not str"),
    (broken(set_in(["measurements", 0, "world_size"], True)), "field measurements[0].world_size should be a whole number, not bool"),
    (broken(set_in(["measurements", 0, "results"], [])), "field measurements[0].results should be a non-empty list"),
])
def test_a_result_file_with_a_missing_or_mistyped_field_is_named(tmp_path, capsys, build, message):
    result = tmp_path / "result.json"
    result.write_text(json.dumps(build(json.loads(PUBLISHED.read_text()))))
    assert main(["compare", str(PUBLISHED), str(result)]) == 2
    error = one_error_line(capsys)
    assert error == f"accelgen: error: Result file '{result}': {message}: pass files written by 'accelgen bench'.\n"


def test_published_and_measured_files_pass_the_check(capsys):
    assert main(["compare", str(PUBLISHED), str(MEASURED)]) == 0
    assert "bigscience/bloomz-7b1" in capsys.readouterr().out


def test_a_result_file_cut_short_is_not_readable_json(tmp_path, capsys):
    result = tmp_path / "torn.json"
    result.write_text(PUBLISHED.read_text()[:40])
    assert main(["compare", str(result)]) == 2
    line = one_error_line(capsys)
    # accelgen's own words around the reason, which is the json module's wording, not ours to pin
    problem, fix = f"accelgen: error: Result file '{result}' is not readable JSON: ", ": pass files written by 'accelgen bench'\n"
    assert line.startswith(problem) and line.endswith(fix) and len(line) > len(problem) + len(fix), line


@pytest.mark.parametrize("option", ["--markdown", "--plot"])
def test_unwritable_table_and_chart_paths_are_refused_before_any_work(tmp_path, capsys, option):
    pytest.importorskip("matplotlib")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for path, message in [
        (tmp_path, f"{option} '{tmp_path}' is a folder: give a file name"),
        (pipe, f"{option} '{pipe}' is not a regular file (a device or a pipe)"),
        (tmp_path / "missing" / "out", f"Cannot write {option} '{tmp_path / 'missing' / 'out'}': folder"),
    ]:
        assert main(["compare", str(PUBLISHED), option, str(path)]) == 2
        assert message in one_error_line(capsys)


@pytest.mark.parametrize("option", ["--markdown", "--plot"])
def test_a_failed_write_leaves_the_earlier_file_as_it_was(tmp_path, capsys, monkeypatch, option):
    """A full disk (or any failed write) while writing the table or chart: one line, the old file intact."""
    pytest.importorskip("matplotlib")
    existing = tmp_path / "existing"
    existing.write_bytes(b"the table of yesterday\n")

    def full_disk(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    assert main(["compare", str(PUBLISHED), option, str(existing)]) == 2
    error = one_error_line(capsys)
    assert f"Cannot write {option} '{existing}': No space left on device: free some space or choose another file" in error
    assert existing.read_bytes() == b"the table of yesterday\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["existing"]  # no temporary file left


def test_bench_output_that_is_a_device_or_pipe_is_refused_and_left_alone(tmp_path, capsys):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for path in (pipe, Path(os.devnull)):
        status = main(["bench", "--device", "cpu", "--max-new-tokens", "2", "--runs", "1", "--output", str(path),
                       "--overwrite"])
        assert status == 2
        assert f"--output '{path}' is not a regular file (a device or a pipe)" in one_error_line(capsys)
    assert Path(os.devnull).is_char_device() and pipe.is_fifo()
