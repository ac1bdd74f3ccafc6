"""Output files are known by what they are: links planted beside an output are never written through, two names
of one output take one lock, a full disk is one line with nothing lost, a bench sweep keeps what it measured,
compare refuses figures that are not measurements, and a closed standard output ends a command quietly.

Cases needing a real process (a file size limit standing in for a full disk, an abort, a closed pipe, a run
held open while another starts) run the ``accelgen`` module in a subprocess; the rest call
``accelgen.cli.main`` in this process.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import one_error_line

from accelgen.cli import main

QUICK = ["--device", "cpu", "--max-new-tokens", "3", "--quiet"]
PROMPTS = [argument for text in ("In the beginning", "And God said", "Let there be light", "And it was so")
           for argument in ("--prompt", text)]
MEASURED = Path(__file__).parent.parent / "results" / "measured" / "cpu-bloom-560m.json"
ACCELGEN = [sys.executable, "-m", "accelgen.cli"]


def _limit_file_size(limit: int):
    def apply() -> None:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


# -- links and other names beside an output ------------------------------------------------------

def _link_to(victim: Path):
    return lambda path: path.symlink_to(victim)


def _hard_link_to(victim: Path):
    return lambda path: os.link(victim, path)


@pytest.mark.parametrize("suffix, plant, message", [
    (".lock", "link", "Lock file '{real}.lock' (of --output '{output}') is a symbolic link (to '{victim}'); accelgen "
                      "makes this file itself and never writes through a link: remove the link."),
    (".lock", "hard link", "Lock file '{real}.lock' (of --output '{output}') is a file with 1 other name(s) (a hard "
                           "link); accelgen makes this file itself: move it away, or choose another --output."),
    (".lock", "foreign", "Lock file '{real}.lock' (of --output '{output}') is a file that accelgen did not write"),
    (".lock", "folder", "Lock file '{real}.lock' (of --output '{output}') is a folder"),
    (".run.json", "link", "Run record '{real}.run.json' is a symbolic link (to '{victim}'); accelgen makes this file "
                          "itself and never writes through a link: remove the link."),
    (".samples", "link", "Kept samples file '{real}.samples' is a symbolic link (to '{victim}'); accelgen makes this "
                         "file itself and never writes through a link: remove the link."),
    (".samples", "hard link", "Kept samples file '{real}.samples' (beside --output '{output}') is not a file accelgen "
                              "wrote (a hard link): move it away."),
])
def test_a_file_planted_where_accelgen_writes_its_own_is_refused_and_never_written(tmp_path, capsys, suffix, plant, message):
    victim = tmp_path / "precious.txt"
    victim.write_text("not to be overwritten\n")
    output = tmp_path / "out.jsonl"
    planted = Path(str(output) + suffix)
    if plant == "link":
        planted.symlink_to(victim)
    elif plant == "hard link":
        os.link(victim, planted)
    elif plant == "foreign":
        planted.write_text("my notes\n")
    else:
        planted.mkdir()
    before = sorted(path.name for path in tmp_path.iterdir())
    assert main(["run", *QUICK, "--prompt", "Hello", "--output", str(output)]) == 2
    error = one_error_line(capsys)
    assert message.format(real=output, output=output, victim=victim) in error
    assert victim.read_text() == "not to be overwritten\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == before  # the plant kept, nothing made


@pytest.mark.parametrize("companion", [".run.json", ".lock", ".samples"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["", "overwrite"])
def test_an_outputs_companion_file_is_never_an_output(tmp_path, capsys, companion, overwrite):
    """Another output's run record or lock named as --output: refused, so the first output still resumes."""
    first = tmp_path / "out.jsonl"
    assert main(["run", *QUICK, "--prompt", "Hello", "--output", str(first)]) == 0
    capsys.readouterr()
    kept = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert main(["run", *QUICK, "--prompt", "Other", "--output", f"{first}{companion}", *overwrite]) == 2
    assert "has the name of the files accelgen keeps beside an output" in one_error_line(capsys)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == kept
    assert main(["run", *QUICK, "--prompt", "Hello", "--output", str(first)]) == 0  # resumes: nothing to do
    assert "all 1 rows are already in" in capsys.readouterr().err


def test_a_temporary_file_name_planted_as_a_link_is_never_opened(tmp_path, capsys):
    """The run record and bench/compare outputs go through a temporary file: a new name each time (the old
    ``<file>.tmp`` and ``<file>.tmp<pid>`` names were predictable, and opened through a planted link)."""
    victim = tmp_path / "precious.txt"
    victim.write_text("not to be overwritten\n")
    table = tmp_path / "table.md"
    for name in ("table.md.tmp", *(f"table.md.tmp{pid}" for pid in range(os.getpid() - 5, os.getpid() + 5))):
        (tmp_path / name).symlink_to(victim)
    assert main(["compare", str(MEASURED), "--markdown", str(table)]) == 0
    assert table.read_text().startswith("End-to-end latency")
    assert victim.read_text() == "not to be overwritten\n"
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp") and not path.is_symlink()]


HELD_RUN = """
import os, sys, time
import accelgen.jobs.completion_job as completion_job

started, release = sys.argv.pop(1), sys.argv.pop(1)
original = completion_job.complete

def held(*arguments, **keywords):  # the output is open and locked: say so, wait for the test, then go on
    open(started, "w").close()
    while not os.path.exists(release):
        time.sleep(0.02)
    return original(*arguments, **keywords)

completion_job.complete = held
from accelgen.cli import main
sys.exit(main())
"""


def test_two_names_of_one_output_take_one_lock_and_one_run_record(tmp_path, capsys, cli_environment):
    real = tmp_path / "real.jsonl"
    real.touch()  # an existing (empty) output: its other names are a symbolic link and a hard link
    (tmp_path / "a.jsonl").symlink_to(real)
    (tmp_path / "b.jsonl").symlink_to(real)
    os.link(real, tmp_path / "hard.jsonl")
    script = tmp_path / "held_run.py"
    script.write_text(HELD_RUN)
    started, release = tmp_path / "started", tmp_path / "release"
    first = subprocess.Popen([sys.executable, str(script), str(started), str(release), "run", *QUICK, *PROMPTS,
                              "--output", str(tmp_path / "a.jsonl")], env=cli_environment, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert started.exists(), first.stderr.read() if first.poll() is not None else "the held run did not start"
        for other_name in ("b.jsonl", "hard.jsonl"):
            assert main(["run", *QUICK, *PROMPTS, "--output", str(tmp_path / other_name), "--overwrite"]) == 2
            error = one_error_line(capsys)
            assert f"--output '{tmp_path / other_name}' is being written by another accelgen run (" in error
        release.touch()
        assert first.wait(timeout=120) == 0, first.stderr.read()
    finally:
        first.kill()
        first.wait()
    rows = real.read_bytes()
    assert len(rows.splitlines()) == 4
    assert sorted(path.name for path in tmp_path.iterdir() if "real" in path.name) == ["real.jsonl", "real.jsonl.run.json"]
    assert main(["run", *QUICK, *PROMPTS, "--output", str(tmp_path / "b.jsonl")]) == 0  # the record by the real file
    assert "all 4 rows are already in" in capsys.readouterr().err
    assert real.read_bytes() == rows


# -- a full disk ---------------------------------------------------------------------------------

@pytest.mark.parametrize("existing", [False, True])
def test_a_disk_full_when_the_run_starts_is_one_line_and_nothing_is_lost(tmp_path, cli_environment, existing):
    output = tmp_path / "out.jsonl"
    command = [*ACCELGEN, "run", *QUICK, *PROMPTS, "--output", str(output)]
    if existing:  # a stopped run's rows, to be resumed
        subprocess.run(command, env=cli_environment, check=True, capture_output=True, timeout=120)
        output.write_bytes(b"".join(output.read_bytes().splitlines(keepends=True)[:2]))
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    full = subprocess.run(command, env=cli_environment, capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_file_size(10))  # not even the lock's one line fits
    assert full.returncode == 2, full.stderr
    assert full.stderr == (f"accelgen: error: Cannot write lock file '{output}.lock' of --output '{output}': File too "
                           f"large: free some space (the disk may be full) and run the command again; nothing else was "
                           f"written\n")
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_a_bench_result_on_a_full_disk_is_printed_instead_of_lost(tmp_path, cli_environment):
    result = tmp_path / "r.json"
    bench = subprocess.run([*ACCELGEN, "bench", "--device", "cpu", "--max-new-tokens", "2", "--runs", "1",
                            "--output", str(result)], env=cli_environment, capture_output=True, text=True, timeout=120,
                           preexec_fn=_limit_file_size(500))  # a result file is a few kilobytes
    assert bench.returncode == 2
    error = bench.stderr.splitlines()[-1]
    assert error == (f"accelgen: error: Cannot write --output '{result}': File too large: the measurement is printed on "
                     f"standard output instead (save it to a file once there is room); the file was left as it was")
    assert "Traceback" not in bench.stderr
    document = json.loads(bench.stdout)
    assert [row["batch_size"] for row in document["measurements"][0]["results"]] == [1]
    assert list(tmp_path.iterdir()) == []  # no result, no temporary file left


# -- a sweep that aborts -------------------------------------------------------------------------

ABORTED_SWEEP = """
import os, signal, sys
import accelgen.bench.measure as measure

original = measure.measure_batch_size

def killed_at_two(generator, batch_size, *rest):  # as the kernel's out-of-memory killer ends a process
    if batch_size == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(generator, batch_size, *rest)

measure.measure_batch_size = killed_at_two
from accelgen.cli import main
sys.exit(main())
"""


def test_a_sweep_killed_at_its_second_batch_size_keeps_the_first_in_the_result_file(tmp_path, cli_environment, capsys):
    script, result = tmp_path / "sweep.py", tmp_path / "r.json"
    script.write_text(ABORTED_SWEEP)
    sweep = subprocess.run([sys.executable, str(script), "bench", "--device", "cpu", "--max-new-tokens", "2", "--runs",
                            "1", "--batch-sizes", "4,1,2", "--output", str(result)], env=cli_environment,
                           capture_output=True, text=True, timeout=120)
    assert sweep.returncode == -9
    assert "accelgen: bench batch size 1: " in sweep.stderr and f"; kept in {result} (1 of 3 batch sizes)" in sweep.stderr
    document = json.loads(result.read_text())  # a whole file
    assert [row["batch_size"] for row in document["measurements"][0]["results"]] == [1]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.json", "sweep.py"]
    assert main(["compare", str(result)]) == 0  # and compare reads it like any result


# -- compare: figures that are not measurements, and many columns --------------------------------

def _result_with(tmp_path: Path, change, name: str = "edited.json") -> Path:
    document = json.loads(MEASURED.read_text())
    change(document)
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


def _set_row(field: str, value, index: int = 0):
    def change(document: dict) -> None:
        row = document["measurements"][0]["results"][index]
        if isinstance(row[field], dict):
            row[field]["median"] = value
        else:
            row[field] = value
    return change


@pytest.mark.parametrize("field, value, where, shown", [
    ("end_to_end_s", 1e308, "end_to_end_s.median", "1e+308"),
    ("end_to_end_s", float("nan"), "end_to_end_s.median", "nan"),
    ("first_token_ms", float("inf"), "first_token_ms", "inf"),
    ("decode_ms_per_token", -0.5, "decode_ms_per_token.median", "-0.5"),
    ("tokens_per_second", -3, "tokens_per_second", "-3"),
    ("roofline_percent", 1e-300, "roofline_percent", "1e-300"),
])
@pytest.mark.parametrize("plot", [False, True])
def test_a_figure_that_is_not_a_measurement_is_refused_naming_the_file_and_field(tmp_path, capsys, field, value, where,
                                                                                  shown, plot):
    path = _result_with(tmp_path, _set_row(field, value))
    chart = tmp_path / "chart.png"
    assert main(["compare", str(path), *(["--plot", str(chart)] if plot else [])]) == 2
    error = one_error_line(capsys)
    assert error == (f"accelgen: error: Result file '{path}': field measurements[0].results[0].{where} should be 0 or a "
                     f"number from 1e-09 to 1e+15, not {shown}: pass files written by 'accelgen bench'.\n")
    assert not chart.exists()


def test_a_batch_size_below_one_is_refused(tmp_path, capsys):
    path = _result_with(tmp_path, _set_row("batch_size", 0, index=1))
    assert main(["compare", str(path)]) == 2
    assert "field measurements[0].results[1].batch_size should be a whole number of at least 1, not 0" in one_error_line(capsys)


def _columns(count: int):
    def change(document: dict) -> None:
        [measurement] = document["measurements"]
        document["measurements"] = []
        for index in range(count):
            column = copy.deepcopy(measurement)
            column["label"] = f"Machine number {index} with a rather long name"
            for row in column["results"]:
                row["end_to_end_s"]["median"] *= 1 + index / 10
            document["measurements"].append(column)
    return change


def test_more_columns_than_a_chart_can_show_are_refused_before_anything_is_written(tmp_path, capsys):
    path = _result_with(tmp_path, _columns(50))
    chart, table = tmp_path / "chart.png", tmp_path / "table.md"
    assert main(["compare", str(path), "--plot", str(chart), "--markdown", str(table)]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("accelgen: error: --plot draws at most 16 hardware columns and the files give 50: chart "
                            "fewer files at a time, or leave out --plot (the table shows them all).\n")
    assert captured.out == "" and not chart.exists() and not table.exists()
    assert main(["compare", str(path)]) == 0  # the table alone shows them all
    assert "Machine number 49 with a rather long name" in capsys.readouterr().out


@pytest.mark.parametrize("count", [3, 16])
def test_the_chart_legend_is_whole_inside_the_image(tmp_path, capsys, monkeypatch, count):
    from matplotlib.figure import Figure

    drawn = []
    original = Figure.savefig

    def save(figure, *arguments, **keywords):  # where the legend was drawn, in the saved image
        original(figure, *arguments, **keywords)
        [legend] = figure.legends
        drawn.append((legend.get_window_extent(), figure.bbox, [text.get_text() for text in legend.get_texts()]))

    monkeypatch.setattr(Figure, "savefig", save)
    path = _result_with(tmp_path, _columns(count))
    assert main(["compare", str(path), "--plot", str(tmp_path / "chart.png")]) == 0
    [(box, image, labels)] = drawn
    assert image.x0 <= box.x0 and box.x1 <= image.x1 and image.y0 <= box.y0 and box.y1 <= image.y1
    assert labels == [f"Machine number {index} with a rather long name" for index in range(count)]


@pytest.mark.parametrize("outputs", [
    lambda result, folder: ["--markdown", str(result)],
    lambda result, folder: ["--plot", str(folder / "link.json")],
    lambda result, folder: ["--markdown", str(folder / "same.md"), "--plot", str(folder / "same.md")],
])
def test_compare_never_writes_over_a_file_it_reads_or_its_other_output(tmp_path, capsys, outputs):
    pytest.importorskip("matplotlib")
    result = _result_with(tmp_path, lambda document: None, "r.json")
    (tmp_path / "link.json").symlink_to(result)
    before = result.read_bytes()
    assert main(["compare", str(result), *outputs(result, tmp_path)]) == 2
    error = one_error_line(capsys)
    assert " is the result file " in error or " is the other output " in error
    assert error.rstrip().endswith("write the table and the chart to files of their own.")
    assert result.read_bytes() == before and not (tmp_path / "same.md").exists()


# -- a closed standard output --------------------------------------------------------------------

def _with_stdout_closed(command: list[str], environment: dict) -> subprocess.CompletedProcess:
    """Run ``command`` with a standard output whose reader is gone before it writes (``| head -0``)."""
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    error = process.stderr.read()
    return subprocess.CompletedProcess(command, process.wait(timeout=120), None, error)


@pytest.mark.slow
def test_a_run_whose_reader_goes_away_ends_quietly_and_keeps_its_rows(tmp_path, cli_environment):
    command = [*ACCELGEN, "run", "--device", "cpu", "--max-new-tokens", "3", "--batch-size", "1", *PROMPTS]
    reference = tmp_path / "reference.jsonl"
    subprocess.run([*command, "--quiet", "--output", str(reference)], env=cli_environment, check=True,
                   capture_output=True, timeout=120)
    output = tmp_path / "out.jsonl"
    closed = _with_stdout_closed([*command, "--output", str(output)], cli_environment)
    assert closed.returncode == 141 and closed.stderr == ""
    kept = output.read_bytes()
    assert kept and kept.endswith(b"\n") and reference.read_bytes().startswith(kept)  # whole rows, the first ones
    assert not Path(f"{output}.lock").exists()
    subprocess.run([*command, "--quiet", "--output", str(output)], env=cli_environment, check=True, capture_output=True,
                   timeout=120)
    assert output.read_bytes() == reference.read_bytes()


@pytest.mark.parametrize("arguments", [["devices"], ["compare", str(MEASURED)]])
def test_devices_and_compare_whose_reader_goes_away_end_quietly(cli_environment, arguments):
    closed = _with_stdout_closed([*ACCELGEN, *arguments], cli_environment)
    assert (closed.returncode, closed.stderr) == (141, "")


@pytest.mark.slow
def test_a_tensor_parallel_run_whose_reader_goes_away_ends_quietly(tmp_path, cli_environment):
    """Rank 0 prints; its reader gone, it ends with 141 and the launcher ends the job with 141, saying nothing
    (no rank failure reported, no logging traceback from a library writing to the closed output)."""
    output = tmp_path / "out.jsonl"
    closed = _with_stdout_closed([*ACCELGEN, "run", "--device", "cpu", "--world-size", "2", "--max-new-tokens", "3",
                                  *PROMPTS, "--output", str(output)], cli_environment)
    assert closed.returncode == 141, closed.stderr
    assert "Traceback" not in closed.stderr and "error" not in closed.stderr, closed.stderr
    assert not Path(f"{output}.lock").exists()
