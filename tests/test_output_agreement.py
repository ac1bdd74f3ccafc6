"""``accelgen compare`` of output files: do two machines (dtypes, quantizations, world sizes) give the same answers?"""

import hashlib
import importlib.util
import json
import sys

import pytest

from accelgen.bench.output_agreement import (
    are_output_files,
    compare_files,
    compare_outputs,
    is_output_file,
)
from accelgen.bench.result_file import SCHEMA, SCHEMA_VERSION
from accelgen.cli import main
from accelgen.common.errors import UsageError


def run_line(index, tokens, logprobs=None, finish_reason="length", **fields):
    """One line as ``accelgen run --output`` writes it."""
    prompt = f"prompt {index}"
    line = {"index": index, "prompt": prompt, "completion": " ".join(map(str, tokens)), "completion_token_ids": tokens,
            "prompt_token_count": 3, "finish_reason": finish_reason}
    if logprobs is not None:
        line["logprobs"] = logprobs
    line["prompt_sha256"] = hashlib.sha256(prompt.encode()).hexdigest()
    return {**line, **fields}


def score_line(index, prompt_logprob, **fields):
    """One line as ``accelgen score --output`` writes it."""
    return {"index": index, "prompt_tokens": 4, "prompt_logprob": prompt_logprob, "perplexity": 2.0,
            "prompt_sha256": hashlib.sha256(f"prompt {index}".encode()).hexdigest(), **fields}


def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def ten_rows(changed=None):
    """Ten run rows of four tokens each, with log-probabilities; ``changed[index]`` replaces a row's tokens."""
    changed = changed or {}
    return [run_line(index, changed.get(index, [index, 7, 8, 9]), [-1.0, -2.0, -0.5, -0.25]) for index in range(10)]


def test_identical_files_agree_on_every_row(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", ten_rows())
    second = write_lines(tmp_path / "b.jsonl", ten_rows())
    assert is_output_file(first) and are_output_files([first, second])
    [pair] = compare_files([first, second]).pairs
    assert pair.agreeing == len(pair.rows) == 10 and not pair.differing
    assert pair.drift("token_drift").largest == 0 and pair.drift("token_drift").count == 40
    text = compare_outputs([first, second])
    assert "10 of 10 rows agree (100.0%)" in text and "b.jsonl" in text


def test_one_token_planted_is_found_at_its_position(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", ten_rows())
    second = write_lines(tmp_path / "b.jsonl", ten_rows({4: [4, 7, 99, 9]}))
    [pair] = compare_files([first, second]).pairs
    [row] = pair.differing
    assert (row.index, row.first_difference, row.sample) == (4, 2, None)
    assert row.difference == "token 2 is 99, baseline 8"
    assert row.token_drift.count == 2  # the tokens before the first difference only
    text = compare_outputs([first, second])
    assert "9 of 10 rows agree" in text and "row 4: token 2 is 99, baseline 8" in text


def test_a_shorter_answer_differs_where_it_ends(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", [run_line(0, [1, 2, 3])])
    second = write_lines(tmp_path / "b.jsonl", [run_line(0, [1, 2], finish_reason="eos")])
    [row] = compare_files([first, second]).pairs[0].rows
    assert not row.agree and row.first_difference == 2 and row.difference == "token 2 is end, baseline 3"


def test_logprob_drift_mean_and_max(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", [run_line(0, [1, 2, 3], [-1.0, -2.0, -3.0]), run_line(1, [4, 5], [-1.0, -1.0])])
    second = write_lines(tmp_path / "b.jsonl", [run_line(0, [1, 2, 9], [-0.9, -2.0, -9.0]),
                                                run_line(1, [4, 5], [-1.0, -1.4])])
    [pair] = compare_files([first, second]).pairs
    first_row, second_row = pair.rows
    # row 0: tokens 0 and 1 shared (token 2 differs: its log-probability is not compared)
    assert first_row.token_drift.count == 2 and first_row.token_drift.mean == pytest.approx(0.05)
    assert first_row.token_drift.largest == pytest.approx(0.1)
    assert second_row.agree and second_row.token_drift.mean == pytest.approx(0.2)
    together = pair.drift("token_drift")
    assert together.count == 4 and together.mean == pytest.approx(0.5 / 4) and together.largest == pytest.approx(0.4)
    assert "1.2e-01 / 4.0e-01" in compare_outputs([first, second])


def test_samples_are_compared_one_by_one(tmp_path):
    samples = [{"completion": "a", "completion_token_ids": [1, 2], "finish_reason": "length"},
               {"completion": "b", "completion_token_ids": [3, 4], "finish_reason": "length"}]
    changed = [samples[0], {**samples[1], "completion_token_ids": [3, 5]}]
    first = write_lines(tmp_path / "a.jsonl", [run_line(0, [1, 2], completions=samples)])
    second = write_lines(tmp_path / "b.jsonl", [run_line(0, [1, 2], completions=changed)])
    [row] = compare_files([first, second]).pairs[0].rows
    assert (row.sample, row.first_difference, row.difference) == (1, 1, "sample 1 token 1 is 5, baseline 4")


def test_choice_and_continuation_disagreements_are_found(tmp_path):
    base = [score_line(0, -10.0, choice_logprobs=[-3.0, -1.0], best_choice=1),
            score_line(1, -10.0, choice_logprobs=[-3.0, -1.0], best_choice=1),
            score_line(2, -12.0, continuation_logprob=-2.0, continuation_tokens=1, continuation_greedy=True)]
    other = [score_line(0, -10.5, choice_logprobs=[-3.0, -1.5], best_choice=1),  # drifted, same choice: agrees
             score_line(1, -10.0, choice_logprobs=[-1.0, -3.0], best_choice=0),
             score_line(2, -12.0, continuation_logprob=-2.5, continuation_tokens=1, continuation_greedy=False)]
    first, second = write_lines(tmp_path / "a.jsonl", base), write_lines(tmp_path / "b.jsonl", other)
    [pair] = compare_files([first, second]).pairs
    assert [row.agree for row in pair.rows] == [True, False, False]
    assert pair.rows[1].difference == "best_choice 0, baseline 1"
    assert pair.rows[2].difference == "continuation_greedy False, baseline True"
    assert pair.drift("sum_drift").largest == pytest.approx(0.5)
    assert "1 of 3 rows agree" in compare_outputs([first, second])


def test_plain_scores_agree_within_the_tolerance(tmp_path):
    tokens = {"tokens": [5, 6, 7], "token_logprobs": [None, -2.0, -3.0]}
    base = [score_line(0, -100.0, **tokens), score_line(1, -0.5, **tokens), score_line(2, -0.5, **tokens)]
    other = [score_line(0, -100.05, tokens=[5, 6, 8], token_logprobs=[None, -2.25, -9.0]),  # 5e-4 relative: agrees
             score_line(1, -0.502, **tokens),  # 2e-3 absolute below 1 nat: differs
             score_line(2, -0.5008, **tokens)]  # 8e-4 absolute below 1 nat: agrees
    first, second = write_lines(tmp_path / "a.jsonl", base), write_lines(tmp_path / "b.jsonl", other)
    [pair] = compare_files([first, second]).pairs
    assert [row.agree for row in pair.rows] == [True, False, True]
    assert pair.rows[1].difference == "prompt_logprob -0.502, baseline -0.5"
    assert pair.rows[0].first_difference == 2 and pair.rows[0].prompt_drift.largest == pytest.approx(0.25)
    assert pair.rows[0].prompt_drift.count == 1  # the first token has no log-probability, the third differs
    assert [row.agree for row in compare_files([first, second], tolerance=1e-2).pairs[0].rows] == [True, True, True]


def test_rows_matched_by_index_error_rows_and_other_prompts_apart(tmp_path):
    base = ten_rows()[:8]
    other = ten_rows()[2:]
    other[1] = run_line(3, [], finish_reason="error", error="is empty")
    other[2] = {**other[2], "prompt_sha256": "0" * 64}
    first, second = write_lines(tmp_path / "a.jsonl", base), write_lines(tmp_path / "b.jsonl", list(reversed(other)))
    [pair] = compare_files([first, second]).pairs
    assert (pair.only_in_baseline, pair.only_in_other, pair.error_rows, pair.other_prompts) == ([0, 1], [8, 9], [3], [4])
    assert [row.index for row in pair.rows] == [2, 5, 6, 7] and pair.agreeing == 4
    text = compare_outputs([first, second])
    assert "4 of 4 rows agree" in text and "2 only in a.jsonl, 2 only in b.jsonl" in text
    assert "1 error rows not compared (rows 3)" in text and "1 rows of another prompt not compared (rows 4)" in text


def test_labels_come_from_the_run_records_and_the_baseline_is_chosen(tmp_path):
    paths = [write_lines(tmp_path / f"{name}.jsonl", ten_rows()) for name in ("a", "b", "c")]
    assert [pair.other.label for pair in compare_files(paths).pairs] == ["b.jsonl", "c.jsonl"]  # no run records
    for path, device, dtype in zip(paths, ("cpu", "cuda", "cuda"), ("float32", "bfloat16", "float16")):
        (tmp_path / f"{path}.run.json").write_text(json.dumps({"model": "m", "dtype": dtype, "max_new_tokens": 4 + len(dtype) % 2,
                                                               "last_run": {"device": device, "dtype": dtype, "world_size": 1}}))
    agreement = compare_files(paths, baseline="cuda bfloat16")
    assert agreement.baseline.label == "cuda bfloat16"
    assert [pair.other.label for pair in agreement.pairs] == ["cpu float32", "cuda float16"]
    assert [pair.other.label for pair in compare_files(paths, labels=["x", "y", "z"]).pairs] == ["y", "z"]
    text = compare_outputs(paths)
    assert "cuda bfloat16: run with other settings than the baseline, max_new_tokens 4 (baseline 5)" in text
    assert "cuda float16: run with" not in text
    with pytest.raises(UsageError, match="--baseline 'tpu' is none of the files' labels: cpu float32, cuda bfloat16"):
        compare_files(paths, baseline="tpu")


def bench_result(path):
    path.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "measurements": []}, indent=2))
    return str(path)


def test_mistakes_are_one_line(tmp_path, capsys):
    output = write_lines(tmp_path / "a.jsonl", ten_rows())
    result = bench_result(tmp_path / "bench.json")
    (tmp_path / "rows.csv").write_text("prompt\nHello\n")
    (tmp_path / "cut.jsonl").write_text(json.dumps(run_line(0, [1])) + "\n" + '{"index": 1, "prom')
    score = write_lines(tmp_path / "score.jsonl", [score_line(0, -1.0)])
    assert not is_output_file(result) and not is_output_file(str(tmp_path / "rows.csv"))
    assert are_output_files([result]) is False
    cases = [
        (lambda: are_output_files([output, result]), "is an output file and"),
        (lambda: are_output_files([output, str(tmp_path / "rows.csv")]), "is not an accelgen output (JSON lines with"),
        (lambda: compare_outputs([output, str(tmp_path / "rows.csv")]), "rows.csv' is not an accelgen output"),
        (lambda: compare_outputs([output, str(tmp_path / "cut.jsonl")]), "line 2 is not JSON"),
        (lambda: compare_outputs([output, str(tmp_path / "missing.jsonl")]), "does not exist"),
        (lambda: compare_outputs([output, score]), "holds accelgen run outputs and"),
        (lambda: compare_outputs([output]), "takes two or more files"),
        (lambda: compare_outputs([output, output], markdown=output), "is the output file"),
        (lambda: compare_outputs([output, output], tolerance=-1), "--tolerance -1 is not a number from 0 up"),
    ]
    for call, message in cases:
        with pytest.raises(UsageError, match=None) as raised:
            call()
        assert message in str(raised.value) and "\n" not in str(raised.value), (message, raised.value)


def test_markdown_written(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", ten_rows())
    second = write_lines(tmp_path / "b.jsonl", ten_rows({4: [4, 7, 99, 9]}))
    markdown = tmp_path / "agreement.md"
    compare_outputs([first, second], markdown=str(markdown))
    lines = markdown.read_text().splitlines()
    assert lines[2].startswith("| file | agreement | token logprob drift mean / max |")
    assert lines[4].startswith("| b.jsonl | 9 of 10 rows agree (90.0%) |") and "row 4: token 2 is 99, baseline 8" in lines[4]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_chart_written(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", ten_rows())
    second = write_lines(tmp_path / "b.jsonl", ten_rows({4: [4, 7, 99, 9]}))
    lines = ten_rows()
    lines[0]["logprobs"] = [-1.5, -2.0, -0.5, -0.25]
    third = write_lines(tmp_path / "c.jsonl", lines)
    chart = tmp_path / "agreement.png"
    compare_outputs([first, second, third], plot=str(chart))
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_two_real_runs_agree(tmp_path):
    outputs = [str(tmp_path / name) for name in ("a.jsonl", "b.jsonl")]
    for output in outputs:
        assert main(["run", "--prompt", "Hello", "--prompt", "DeepSpeed is", "--max-new-tokens", "4", "--logprobs",
                     "--output", output]) == 0
    assert are_output_files(outputs)
    [pair] = compare_files(outputs).pairs
    assert pair.agreeing == len(pair.rows) == 2 and pair.drift("token_drift").count == 8
    assert "2 of 2 rows agree (100.0%)" in compare_outputs(outputs)


def test_files_of_one_label_are_told_apart_by_their_names(tmp_path):
    (tmp_path / "again").mkdir()
    paths = [write_lines(tmp_path / name, ten_rows()) for name in ("a.jsonl", "b.jsonl", "again/a.jsonl")]
    for path, device in zip(paths, ("cpu", "cuda", "cpu")):
        (tmp_path / f"{path}.run.json").write_text(json.dumps({"model": "m", "last_run": {"device": device}}))
    agreement = compare_files(paths)
    assert [agreement.baseline.label] + [pair.other.label for pair in agreement.pairs] == [
        f"cpu ({paths[0]})", "cuda", f"cpu ({paths[2]})"]


def test_a_chart_without_matplotlib_is_one_line_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    first = write_lines(tmp_path / "a.jsonl", ten_rows())
    with pytest.raises(UsageError, match="--plot needs matplotlib: pip install") as raised:
        compare_outputs([first, str(tmp_path / "missing.jsonl")], plot=str(tmp_path / "chart.png"))
    assert "\n" not in str(raised.value)


def test_two_real_scores_agree(tmp_path):
    rows = tmp_path / "rows.jsonl"
    write_lines(rows, [{"text": "The quick brown fox", "choices": ["jumps", "sleeps"]},
                       {"text": "Hello there", "choices": ["friend", "enemy", "you"]}])
    outputs = [str(tmp_path / name) for name in ("a.jsonl", "b.jsonl")]
    for output in outputs:
        assert main(["score", "--dataset", str(rows), "--column", "text", "--choices-column", "choices",
                     "--token-logprobs", "--output", output]) == 0
    [pair] = compare_files(outputs).pairs
    assert pair.agreeing == len(pair.rows) == 2 and pair.drift("prompt_drift").count > 0
    assert pair.drift("sum_drift").largest < 1e-4  # one machine, one dtype: the same sums
