"""``accelgen bench`` and ``accelgen compare`` as a user runs them: result files, tables, charts, "oom"."""

import functools
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerators import CapturingCpu, plugin_manager_with

from accelgen.bench.protocol import PUBLISHED_PROMPT
from accelgen.bench.result_file import SCHEMA, SCHEMA_VERSION
from accelgen.cli import main
from accelgen.generation.decoding import DecodeState
from accelgen.loading.random_weights import resolve_model_config
from accelgen.model.empty_model import empty_model
from accelgen_cpu import CpuAccelerator

REPOSITORY = Path(__file__).resolve().parent.parent
PUBLISHED = sorted(str(path) for path in (REPOSITORY / "results" / "published").glob("*.json"))
NEW_TOKENS = 6


def bench(folder, output, *extra, plugin_manager=None):
    return main(["bench", "--device", "cpu", "--model", str(folder), "--max-new-tokens", str(NEW_TOKENS),
                 "--runs", "2", "--output", str(output), *extra], plugin_manager=plugin_manager)


@pytest.fixture(scope="module")
def bench_file(tiny_model_folder, tmp_path_factory):
    """A real result file: the tiny BLOOM measured at batch sizes 1 and 2."""
    output = tmp_path_factory.mktemp("results") / "cpu.json"
    assert bench(tiny_model_folder("bloom"), output, "--batch-sizes", "2,1", "--label", "laptop") == 0
    return output


def test_bench_writes_a_result_file_with_every_figure(bench_file):
    document = json.loads(bench_file.read_text())
    assert (document["schema"], document["schema_version"], document["source"]) == (SCHEMA, SCHEMA_VERSION, "measured")
    [measurement] = document["measurements"]
    assert measurement["label"] == "laptop"
    assert (measurement["accelerator"], measurement["world_size"], measurement["dtype"]) == ("cpu", 1, "float32")
    assert measurement["hardware"]["device_count"] == 1 and "device_name" in measurement["hardware"]
    protocol = measurement["protocol"]
    assert protocol["prompt"] == PUBLISHED_PROMPT and protocol["max_new_tokens"] == NEW_TOKENS
    assert (protocol["decoding"], protocol["ignore_eos"], protocol["runs"], protocol["warmup_runs"]) == ("greedy", True, 2, 1)
    assert protocol["prompt_tokens"] > 0
    model = measurement["model"]
    assert model["architecture"] == "bloom" and model["parameters"] * 4 == model["parameter_bytes"] > 0
    environment = measurement["environment"]
    assert environment["torch"] == torch.__version__ and environment["transformers"] and "git_revision" in environment
    assert measurement["load_seconds"] > 0

    rows = measurement["results"]
    assert [row["batch_size"] for row in rows] == [1, 2]  # swept small to large
    for row in rows:
        assert row["status"] == "ok"
        end_to_end = row["end_to_end_s"]["median"]
        assert 0 < end_to_end <= row["end_to_end_s"]["p90"]
        assert row["decode_ms_per_token"]["median"] <= row["decode_ms_per_token"]["p90"]
        assert row["first_token_ms"] > 0
        assert row["graph_captures"] == 0  # graphs are off by default on cpu
        assert row["roofline_percent"] is None  # the CPU's peak bandwidth is unknown
        assert row["memory"]["peak_rss_bytes"] > 0


class FakeClock:
    """Stands in for time.perf_counter: time passes only when the device below works."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class ClockedCpu(CapturingCpu):
    """A device on which a prefill takes exactly 50 ms and each decode step ``step_seconds`` (10 ms), by the fake
    clock; its peak memory bandwidth is ``peak_memory_bandwidth_gbps`` (unknown when None)."""

    def __init__(self, clock, step_seconds=0.010, peak_memory_bandwidth_gbps=None):
        self.clock, self.step_seconds, self.peak_memory_bandwidth_gbps = clock, step_seconds, peak_memory_bandwidth_gbps

    def describe(self):
        return {**super().describe(), "peak_memory_bandwidth_gbps": self.peak_memory_bandwidth_gbps}

    def prepare_model(self, model, device, run, world):
        forward = model.forward

        @functools.wraps(forward)
        def timed_forward(*args, **kwargs):
            tokens = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
            if tokens.shape[1] > 1:  # a prompt: the prefill (a decode step may give embeddings: zero_unseen_rows)
                self.clock.now += 0.050
            return forward(*args, **kwargs)

        model.forward = timed_forward
        return model

    def capture(self, step, example_inputs, run):
        def replay(*inputs):
            if len(inputs) == len(DecodeState._fields):  # the decode step (a captured prefill is timed as a prefill)
                self.clock.now += self.step_seconds
            return step(*inputs)

        return replay


def test_bench_figures_are_the_device_times_of_the_protocol(tiny_model_folder, tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    assert bench(tiny_model_folder("bloom"), tmp_path / "r.json", "--batch-sizes", "1,4",
                 plugin_manager=plugin_manager_with(ClockedCpu(clock))) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["measurements"][0]["results"]
    end_to_end = 0.050 + 0.010 * (NEW_TOKENS - 1)  # the prefill gives the first token, each step one more
    for row, batch_size in zip(rows, (1, 4)):
        assert row["first_token_ms"] == pytest.approx(50.0)
        assert row["decode_ms_per_token"] == {"median": pytest.approx(10.0), "p90": pytest.approx(10.0)}
        assert row["end_to_end_s"] == {"median": pytest.approx(end_to_end), "p90": pytest.approx(end_to_end)}
        assert row["tokens_per_second"] == pytest.approx(batch_size * NEW_TOKENS / end_to_end)
        assert row["ms_per_token_per_sequence"] == pytest.approx(1000 * end_to_end / (batch_size * NEW_TOKENS))


def test_bench_json_prints_the_document_and_graphs_are_captured_once_per_size(tiny_model_folder, tmp_path, capsys):
    status = bench(tiny_model_folder("llama"), tmp_path / "r.json", "--json", "--graphs", "--batch-sizes", "1",
                   "--warmup-runs", "1")
    assert status == 0
    shown = capsys.readouterr()
    document = json.loads(shown.out)
    assert document == json.loads((tmp_path / "r.json").read_text())
    [row] = document["measurements"][0]["results"]
    assert row["graph_captures"] == 1 and row["capture_seconds"] > 0  # in the warm-up, reused by timed runs
    assert "accelgen: bench batch size 1:" in shown.err


def test_roofline_is_100_percent_when_a_step_takes_as_long_as_reading_its_bytes_at_peak_bandwidth(
    tiny_model_folder, tmp_path, monkeypatch
):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    def measurement(step_seconds, peak_memory_bandwidth_gbps):
        device = ClockedCpu(clock, step_seconds, peak_memory_bandwidth_gbps)
        output = tmp_path / f"{step_seconds}-{peak_memory_bandwidth_gbps}.json"
        assert bench(tiny_model_folder("bloom"), output, "--batch-sizes", "1,3", plugin_manager=plugin_manager_with(device)) == 0
        return json.loads(output.read_text())["measurements"][0]

    unknown_peak = measurement(0.010, None)
    assert [row["roofline_percent"] for row in unknown_peak["results"]] == [None, None]
    one_row, three_rows = (row["decode_step_bytes"] for row in unknown_peak["results"])
    # a step reads every weight once, and each row its own keys and values: three rows read three times one row's
    weights = unknown_peak["model"]["parameter_bytes_per_rank"]
    assert weights < one_row < three_rows
    assert three_rows - weights == pytest.approx(3 * (one_row - weights), abs=2)

    # a peak at which reading one row's step bytes takes exactly the 10 ms a step takes
    peak_gbps = one_row / 0.010 / 1e9
    at_peak = measurement(0.010, peak_gbps)
    assert [row["decode_step_bytes"] for row in at_peak["results"]] == [one_row, three_rows]  # the same work
    assert at_peak["results"][0]["roofline_percent"] == pytest.approx(100)
    assert at_peak["results"][1]["roofline_percent"] > at_peak["results"][0]["roofline_percent"]  # more bytes, same 10 ms

    twice_as_slow = measurement(0.020, peak_gbps)
    for fast, slow in zip(at_peak["results"], twice_as_slow["results"]):
        assert slow["roofline_percent"] == pytest.approx(fast["roofline_percent"] / 2)


class SmallMemoryCpu(CapturingCpu):
    """A CPU standing in for a device whose memory holds decode graphs of at most two rows: capturing a
    larger one raises the out-of-memory error torch raises on GPUs."""

    def capture(self, step, example_inputs, run):
        if run.batch_size > 2:
            raise torch.OutOfMemoryError("out of memory: tried to allocate 2.00 GiB (test device of small memory)")
        return step


def test_out_of_memory_at_one_batch_size_is_recorded_and_the_sweep_goes_on(tiny_model_folder, tmp_path, capsys):
    output = tmp_path / "r.json"
    status = bench(tiny_model_folder("bloom"), output, "--batch-sizes", "1,4,2,8",
                   plugin_manager=plugin_manager_with(SmallMemoryCpu()))
    assert status == 0
    rows = json.loads(output.read_text())["measurements"][0]["results"]
    assert [(row["batch_size"], row["status"]) for row in rows] == [(1, "ok"), (2, "ok"), (4, "oom"), (8, "oom")]
    assert "tried to allocate" in rows[2]["error"]
    assert "bench batch size 4: out of memory (recorded as oom); going on" in capsys.readouterr().err


def test_other_errors_during_a_sweep_are_not_taken_for_out_of_memory(tiny_model_folder, tmp_path):
    class BrokenCpu(CpuAccelerator):
        def mark_step(self):  # called after each forward pass: the device fails while generating
            raise RuntimeError("a kernel failed")

    with pytest.raises(RuntimeError, match="a kernel failed"):
        bench(tiny_model_folder("bloom"), tmp_path / "r.json", plugin_manager=plugin_manager_with(BrokenCpu()))
    assert not (tmp_path / "r.json").exists()


def test_built_in_configs_have_the_published_models_sizes():
    for name, billions in (("bloomz-7b1", 7.069), ("bigscience/bloom", 176.247), ("bloomz", 176.247)):
        _, config = resolve_model_config(name)
        model = empty_model(config, "bfloat16")
        assert sum(parameter.numel() for parameter in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.001)
    assert resolve_model_config("bloomz-7b1")[0] == "bigscience/bloomz-7b1"


def test_random_weights_from_a_config_file_or_a_folder(tiny_model_folder, tmp_path):
    """A folder (config.json and tokenizer, no weights) uses its tokenizer; a lone config.json the built-in one."""
    folder = tmp_path / "shape"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_folder("llama") / name, folder / name)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "alone.json").write_text(json.dumps({**config, "vocab_size": 4096}))  # the built-in tokenizer's size
    for model_config, tokenizer in ((folder, str(folder)), (tmp_path / "alone.json", "accelgen built-in default")):
        output = tmp_path / "r.json"
        status = main(["bench", "--device", "cpu", "--model-config", str(model_config), "--random-weights",
                       "--max-new-tokens", "4", "--runs", "1", "--output", str(output), "--overwrite"])
        assert status == 0
        model = json.loads(output.read_text())["measurements"][0]["model"]
        assert model["random_weights"] is True and model["architecture"] == "llama"
        assert model["tokenizer"] == tokenizer


@pytest.mark.parametrize("arguments, message", [
    (["--model-config", "bloomz-7b1"], "--model-config builds the model from its config alone: add --random-weights"),
    (["--runs", "0"], "argument --runs: must be a whole number from 1 to 2147483647, got '0'"),
    (["--batch-sizes", "0,8"], "argument --batch-sizes: must list numbers each a whole number from 1 to 2147483647"),
    (["--batch-sizes", "one"], "argument --batch-sizes: must list numbers each a whole number from 1"),
    (["--model-config", "./no/such.json", "--random-weights"], "--model-config './no/such.json' does not exist"),
    (["--model", "x", "--model-config", "bloom", "--random-weights"], "Pass --model or --model-config, not both."),
])
def test_bad_bench_arguments_are_one_line(arguments, message, capsys):
    assert main(["bench", "--device", "cpu", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error


def test_bench_refuses_to_overwrite_a_result_file(tiny_model_folder, tmp_path, capsys):
    output = tmp_path / "r.json"
    output.write_text("earlier results\n")
    assert bench(tiny_model_folder("bloom"), output) == 2
    assert "already exists: pass --overwrite" in capsys.readouterr().err
    assert output.read_text() == "earlier results\n"


# -- compare -------------------------------------------------------------------------------------


def edited_copy(source: Path, destination: Path, label: str, scale: float, **protocol) -> Path:
    """``source`` as if measured on other hardware: another label, every time multiplied by ``scale``."""
    document = json.loads(source.read_text())
    measurement = document["measurements"][0]
    measurement["label"] = measurement["hardware"]["device_name"] = label
    measurement["protocol"].update(protocol)
    for row in measurement["results"]:
        for name in ("end_to_end_s", "decode_ms_per_token"):
            row[name] = {key: value * scale for key, value in row[name].items()}
        row["first_token_ms"] *= scale
        row["ms_per_token_per_sequence"] *= scale
        row["tokens_per_second"] /= scale
    destination.write_text(json.dumps(document))
    return destination


def test_compare_three_machines_gives_the_table_and_a_chart(bench_file, tmp_path, capsys):
    fast = edited_copy(bench_file, tmp_path / "fast.json", "Fast GPU", 0.25)
    slow = edited_copy(bench_file, tmp_path / "slow.json", "Old card", 2.0)
    report, chart = tmp_path / "report.md", tmp_path / "report.png"
    status = main(["compare", str(bench_file), str(fast), str(slow), "--baseline", "laptop",
                   "--markdown", str(report), "--plot", str(chart)])
    assert status == 0
    terminal = capsys.readouterr().out
    rows = json.loads(bench_file.read_text())["measurements"][0]["results"]
    markdown = report.read_text()
    assert "| model | world size | batch | laptop | Fast GPU | Old card |" in markdown
    for row in rows:
        seconds = row["end_to_end_s"]["median"]
        expected = (f"| 1 | {row['batch_size']} | {seconds:.3f} s (1.00x) | {seconds * 0.25:.3f} s (4.00x) | "
                    f"{seconds * 2:.3f} s (0.50x) |")
        assert expected in markdown
        assert f"{seconds * 0.25:.3f} s (4.00x)" in terminal
    assert "speed relative to laptop" in terminal

    from matplotlib import image

    pixels = image.imread(str(chart))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


@pytest.mark.parametrize("span, scale", [(100.0, "log"), (2.0, "linear")])
def test_a_chart_of_machines_100x_apart_uses_a_log_axis_and_shows_every_bar(bench_file, tmp_path, span, scale):
    from accelgen.bench.compare import METRICS, chart_figure, comparison_table, load_measurements

    # the measured rows' own spread (batch sizes on a busy machine) must not decide the axis: fix it at 1.5x
    document = json.loads(bench_file.read_text())
    for index, row in enumerate(document["measurements"][0]["results"]):
        row["end_to_end_s"] = {"median": 0.2 * (1 + 0.5 * index / max(len(document["measurements"][0]["results"]) - 1, 1)),
                               "p90": 0.3}
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(document))
    slow = edited_copy(fast, tmp_path / "slow.json", "2-core CPU", span)
    table = comparison_table(load_measurements([str(fast), str(slow)]), METRICS["end-to-end"])
    figure = chart_figure(table)
    [axes] = figure.axes
    assert axes.get_yscale() == scale
    floor, ceiling = axes.get_ylim()
    bars = [bar for container in axes.containers for bar in container]
    assert len(bars) == 2 * len(table.rows)
    assert all(floor < bar.get_height() < ceiling for bar in bars)  # none flattened to nothing, none cut off
    labels = {text.get_text() for text in axes.texts}
    for _, cells in table.rows:
        fast_seconds = cells["laptop"]
        assert f"{fast_seconds:.3f} s\n(1.00x)" in labels
        assert f"{fast_seconds * span:.3f} s\n({1 / span:.2f}x)" in labels


def test_files_of_one_hardware_share_a_column_unless_they_measure_the_same_rows(bench_file, tmp_path, capsys):
    document = json.loads(bench_file.read_text())
    document["measurements"][0]["model"]["name"] = "another model"
    (tmp_path / "other-model.json").write_text(json.dumps(document))
    (tmp_path / "again.json").write_text(bench_file.read_text())
    assert main(["compare", str(bench_file), str(tmp_path / "other-model.json")]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.split() == ["model", "world", "size", "batch", "laptop"]  # one column: they fill different rows
    assert main(["compare", str(bench_file), str(tmp_path / "other-model.json"), str(tmp_path / "again.json")]) == 0
    terminal = capsys.readouterr().out
    header = terminal.splitlines()[1]
    # two runs of the same rows on one label: every file of that label named, none left to be told apart by its absence
    names = [f"laptop ({bench_file.name})", "laptop (other-model.json)", "laptop (again.json)"]
    assert all(name in header for name in names), header
    assert (f"{', '.join(names)}: files of one label, 'laptop', measuring the same rows, told apart by their files "
            f"(accelgen bench --label names a run).") in terminal
    assert main(["compare", str(bench_file), str(tmp_path / "again.json"), "--baseline", "laptop"]) == 2
    assert (f"--baseline 'laptop' labels 2 columns (laptop ({bench_file.name}), laptop (again.json)): pass one of "
            f"them.") in capsys.readouterr().err


def test_compare_flags_files_of_another_protocol(bench_file, tmp_path, capsys):
    other = edited_copy(bench_file, tmp_path / "other.json", "Other", 1.0, max_new_tokens=32)
    assert main(["compare", str(bench_file), str(other), "--metric", "decode"]) == 0
    terminal = capsys.readouterr().out
    assert "Other *" in terminal
    assert f"* Other: max_new_tokens 32 (baseline {NEW_TOKENS}); not comparable with laptop." in terminal


def test_compare_reads_the_published_results_like_any_other(bench_file, capsys):
    assert PUBLISHED, "results/published/ holds the published Gaudi2 / A100 / Gaudi1 figures"
    assert main(["compare", *PUBLISHED, str(bench_file)]) == 0
    terminal = capsys.readouterr().out
    bloomz_row = next(line for line in terminal.splitlines() if line.startswith("bigscience/bloomz-7b1"))
    assert "1.066 s (1.00x)" in bloomz_row and "2.119 s (0.50x)" in bloomz_row and "2.865 s (0.37x)" in bloomz_row
    assert "published figures (" in terminal and "not measured by accelgen" in terminal


def test_compare_mistakes_are_one_line(bench_file, tmp_path, capsys):
    newer = json.loads(bench_file.read_text())
    newer["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    (tmp_path / "broken.json").write_text("{")
    cases = [
        ([str(tmp_path / "newer.json")], f"has result schema version {SCHEMA_VERSION + 1}, this accelgen reads version"),
        ([str(tmp_path / "notes.json")], "is not an accelgen bench result"),
        ([str(tmp_path / "broken.json")], "is not readable JSON"),
        ([str(tmp_path / "missing.json")], "does not exist"),
        ([str(bench_file), "--baseline", "H100"], "--baseline 'H100' is not among the hardware labels: laptop"),
        ([str(bench_file), "--plot", str(tmp_path / "no" / "chart.png")], "does not exist"),
    ]
    for arguments, message in cases:
        assert main(["compare", *arguments]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, (arguments, error)


@pytest.mark.slow
def test_bench_over_two_ranks_records_the_world_size(tiny_model_folder, tmp_path, cli_environment):
    output = tmp_path / "tp.json"
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "bench", "--device", "cpu", "--world-size", "2", "--model",
         str(tiny_model_folder("bloom")), "--max-new-tokens", "4", "--runs", "1", "--output", str(output)],
        env=cli_environment, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    measurement = json.loads(output.read_text())["measurements"][0]
    assert measurement["world_size"] == 2
    assert measurement["model"]["parameter_bytes_per_rank"] < 0.6 * measurement["model"]["parameter_bytes"]
    assert result.stderr.count("accelgen: bench batch size 1:") == 1  # rank 0 alone reports


def test_run_out_of_memory_says_which_batch_size_would_fit(tiny_model_folder, capsys):
    """`accelgen run` on a device that runs out of memory: one line, with a batch size estimated to fit."""
    from accelgen.loading.model_files import load_config
    from accelgen.model.memory import USABLE_SHARE, bytes_per_sequence

    folder = tiny_model_folder("bloom")
    config = load_config(str(folder))
    weight_bytes = sum(parameter.numel() for parameter in empty_model(config, "float32").parameters()) * 4
    cache_length = 32 + 5  # the first bucket holds these prompts, plus 5 new tokens
    per_sequence = bytes_per_sequence(config, cache_length, "float32", 1)

    class ThreeRowsCpu(SmallMemoryCpu):
        def memory_stats(self):
            return {**super().memory_stats(), "total_bytes": int((weight_bytes + 3.5 * per_sequence) / USABLE_SHARE)}

    capsys.readouterr()  # what building the model printed
    status = main(["run", "--device", "cpu", "--model", str(folder), "--batch-size", "4", "--max-new-tokens", "5",
                   *[argument for prompt in ("Hello", "DeepSpeed is", "Hi", "It") for argument in ("--prompt", prompt)]],
                  plugin_manager=plugin_manager_with(ThreeRowsCpu()))  # four rows: the four slots are kept
    assert status == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "Out of memory on cpu with --batch-size 4 and --world-size 1:" in error
    assert "so --batch-size 3 should fit; or --offload disk --max-device-memory " in error
    # the cap offered leaves room for the four rows' caches: the weights that stay are those less half a row
    kept = float(re.search(r"keeps about ([\d.]+) KiB of the weights on the device and the rest in files", error).group(1))
    assert kept * 1024 == pytest.approx(weight_bytes - 0.5 * per_sequence, abs=10)
