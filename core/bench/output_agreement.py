"""``accelgen compare`` of output files: do the answers stay the same from one machine, dtype, quantization or world
size to another? Two or more JSON-lines files written by ``accelgen run`` or ``accelgen score`` for the same rows,
each compared row by row (rows matched by "index") with a baseline file: a table (terminal, Markdown) and a chart.

A run row agrees when its new tokens (every sample's) are the same; a score row when it picks the same best choice
(a row with choices), the same continuation_greedy (a row with a continuation), or else when its prompt_logprob is
within the tolerance. Log-probabilities are compared as drift, their absolute difference, over the tokens both rows
share up to the first that differs. Pure JSON: no torch (docs/agreement.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from accelgen.bench.compare import check_chart_possible, write_text_file
from accelgen.bench.result_file import SCHEMA
from accelgen.common.errors import UsageError, first_line, user_errors
from accelgen.common.output_files import check_output_file, is_same_file, real_path, write_whole_file

#: The field that makes a JSON line an output line of each command (with "index").
KIND_FIELDS = {"completion_token_ids": "run", "prompt_logprob": "score"}
#: Score rows without a choice or a continuation agree when their prompt_logprob values a and b satisfy
#: |a - b| <= tolerance * max(1, |a|, |b|): relative (a prompt_logprob grows with the prompt, and a relative bound
#: keeps perplexity within about tolerance x the mean negative log-likelihood per token, 0.3% at 3 nats), and
#: absolute below 1 nat (a short prompt's sum near 0). 1e-3 passes float32 sums taken in another order (~1e-6)
#: and flags what a lower precision changes (a bfloat16 token's log-probability moves by ~1e-2).
DEFAULT_TOLERANCE = 1e-3
#: How many differing rows the table names per file (all of them are in :class:`PairAgreement`).
SHOWN_DIFFERENCES = 3
#: The longest first line read to tell an output file from another file.
FIRST_LINE_LIMIT = 1 << 24
WHAT_TO_PASS = "pass JSON-lines files written by 'accelgen run --output' or 'accelgen score --output'"


def _first_line(path: str) -> object:
    """The first non-blank line of ``path`` parsed as JSON, or None when it is no JSON line (or unreadable)."""
    try:
        with open(path, encoding="utf-8") as file:
            while text := file.readline(FIRST_LINE_LIMIT):
                if text.strip():
                    return json.loads(text)
    except (OSError, ValueError):
        pass
    return None


def _line_kind(line: object) -> str | None:
    """"run" or "score" for an output line of that command, else None."""
    if not isinstance(line, dict) or "index" not in line:
        return None
    return next((kind for field, kind in KIND_FIELDS.items() if field in line), None)


def is_output_file(path: str) -> bool:
    """Whether ``path`` is an accelgen output (JSON lines, each with "index" and "completion_token_ids" or
    "prompt_logprob"), as opposed to a bench result file (one JSON document) or anything else."""
    return os.path.isfile(path) and _line_kind(_first_line(path)) is not None


def are_output_files(paths: list[str]) -> bool:
    """True when every file of ``paths`` is an accelgen output (compare their answers), False when none is (compare
    bench result files); a mix raises UsageError naming one of each."""
    outputs = [path for path in paths if is_output_file(path)]
    if not outputs or len(outputs) == len(paths):
        return bool(outputs)
    other = next(path for path in paths if path not in outputs)
    if not os.path.exists(other):
        raise UsageError(f"{other!r} does not exist: {WHAT_TO_PASS}.")
    if _is_result_file(other):
        raise UsageError(f"{outputs[0]!r} is an output file and {other!r} a bench result file: compare outputs with "
                         f"outputs (do the answers agree) or result files with result files (speed), not both at once.")
    raise UsageError(_not_an_output(other))


def _is_result_file(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and document.get("schema") == SCHEMA


def _not_an_output(path: str) -> str:
    return (f"{path!r} is not an accelgen output (JSON lines with \"index\" and \"completion_token_ids\" or "
            f"\"prompt_logprob\"): {WHAT_TO_PASS}.")


@dataclasses.dataclass
class OutputFile:
    """One output file as read: its rows by index (error rows included) and the run record beside it."""

    path: str
    kind: str  # "run" or "score"
    rows: dict[int, dict]
    record: dict  # the run record ({} when there is none)
    label: str = ""


def read_output(path: str) -> OutputFile:
    """The rows of ``path``; one-line UsageError for a file that is not a whole accelgen output."""
    if not is_output_file(path):
        raise UsageError(f"{path!r} does not exist: {WHAT_TO_PASS}." if not os.path.exists(path) else _not_an_output(path))
    rows: dict[int, dict] = {}
    kinds = set()
    with user_errors(f"Cannot read output file {path!r}", WHAT_TO_PASS), open(path, encoding="utf-8") as file:
        for number, text in enumerate(file, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except ValueError as error:
                raise UsageError(f"{path!r} line {number} is not JSON ({first_line(error)}): {WHAT_TO_PASS} (a run "
                                 f"stopped while writing: start it again to finish the file).") from None
            kind = _line_kind(line)
            why = _line_problem(line, kind) or (f"repeats row {line['index']}" if line["index"] in rows else None)
            if why:
                raise UsageError(f"{path!r} line {number} {why}: {WHAT_TO_PASS}.")
            kinds.add(kind)
            rows[line["index"]] = line
    if len(kinds) > 1:
        raise UsageError(f"{path!r} mixes lines of accelgen run and accelgen score: {WHAT_TO_PASS}, one command's each.")
    return OutputFile(path, kinds.pop(), rows, _run_record(path))


def _line_problem(line: object, kind: str | None) -> str | None:
    """Why a parsed line is not an output line this module can compare, or None."""
    if kind is None:
        return "is not an output line"
    if not isinstance(line["index"], int) or isinstance(line["index"], bool):
        return f"has index {json.dumps(line['index'])}, not a row number"
    samples = line.get("completions") or [line] if kind == "run" else []
    if not all(isinstance(sample, dict) and isinstance(sample.get("completion_token_ids"), list) for sample in samples):
        return "has completion_token_ids that are not a list"
    return None


def _run_record(path: str) -> dict:
    """The run record beside ``path`` (where accelgen.jobs.completion_file.run_record_path puts it, a layer of this
    one's height, not imported), or {} when there is none or it cannot be read: labels only, never required."""
    try:
        with open(real_path(path) + ".run.json", encoding="utf-8") as file:
            record = json.load(file)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _described(record: dict) -> dict[str, str]:
    """What a run record says of the run that might tell files apart: model, device, dtype, quantization, world size."""
    last = record.get("last_run") if isinstance(record.get("last_run"), dict) else {}
    found = {"model": record.get("model"), "device": last.get("device"), "dtype": last.get("dtype") or record.get("dtype"),
             "quantize": last.get("quantize") or record.get("quantize"), "world": last.get("world_size")}
    return {name: (f"world {value}" if name == "world" else str(value)) for name, value in found.items() if value}


def default_labels(files: list[OutputFile]) -> list[str]:
    """Each file's label: what its run record says that differs between the files ("cuda bfloat16"), else its file
    name; the file's name (or path) where that leaves two files one label."""
    described = [_described(file.record) for file in files]
    differing = [name for name in ("model", "device", "dtype", "quantize", "world")
                 if len({description.get(name) for description in described}) > 1]
    labels = [" ".join(description[name] for name in differing if name in description) or Path(file.path).name
              for file, description in zip(files, described)]
    names = [Path(file.path).name for file in files]
    shared = {label for label in labels if labels.count(label) > 1}
    for number, file in enumerate(files):
        if labels[number] in shared:
            name = names[number] if names.count(names[number]) == 1 else file.path
            labels[number] = name if labels[number] == names[number] else f"{labels[number]} ({name})"
    return labels


@dataclasses.dataclass
class Drift:
    """Absolute differences of log-probabilities: how many, their sum and the largest."""

    count: int = 0
    total: float = 0.0
    largest: float = 0.0

    def add(self, difference: float) -> None:
        self.count, self.total, self.largest = self.count + 1, self.total + difference, max(self.largest, difference)

    def merge(self, other: "Drift") -> None:
        self.count, self.total, self.largest = self.count + other.count, self.total + other.total, max(self.largest, other.largest)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclasses.dataclass
class RowComparison:
    """One row of a file against the baseline's row of the same index."""

    index: int
    agree: bool
    difference: str  # what differs, for people ("token 3 is 91, baseline 82"); "" when the rows agree
    first_difference: int | None  # the first new token (run) or prompt token (score with tokens) that differs
    sample: int | None  # the sample (run rows with several) first_difference is in
    token_drift: Drift  # new tokens' log-probabilities (run, "logprobs")
    prompt_drift: Drift  # prompt tokens' ("prompt_logprobs" of a run, "token_logprobs" of a score)
    sum_drift: float | None  # |prompt_logprob difference| (score)

    @property
    def headline_drift(self) -> float | None:
        """The row's drift as the chart draws it: a score row's prompt_logprob difference, else the largest
        difference of one token's log-probability (new tokens first), None without log-probabilities."""
        if self.sum_drift is not None:
            return self.sum_drift
        drift = self.token_drift if self.token_drift.count else self.prompt_drift
        return drift.largest if drift.count else None


def _first_difference(first: list, second: list) -> int | None:
    """The first position where two token lists differ (one ending counts), None when they are equal."""
    position = next((at for at, (one, two) in enumerate(zip(first, second)) if one != two), min(len(first), len(second)))
    return None if len(first) == len(second) == position else position


def _drift(first: list | None, second: list | None, shared: int | None) -> Drift:
    """The drift of two lists of log-probabilities over their first ``shared`` positions (all when None; nulls skipped)."""
    drift = Drift()
    pairs = list(zip(first, second)) if isinstance(first, list) and isinstance(second, list) else []
    for one, two in pairs[:shared]:
        if isinstance(one, int | float) and isinstance(two, int | float):
            drift.add(abs(one - two))
    return drift


def _prompt_drift(base: dict, other: dict, ids: str, logprobs: str) -> tuple[Drift, int | None]:
    """The drift of the prompt tokens' log-probabilities up to the first prompt token that differs, and that token."""
    listed = isinstance(base.get(ids), list) and isinstance(other.get(ids), list)
    position = _first_difference(base[ids], other[ids]) if listed else None
    return _drift(base.get(logprobs), other.get(logprobs), position), position


def _token(tokens: list, position: int) -> str:
    return str(tokens[position]) if position < len(tokens) else "end"


def compare_run_rows(index: int, base: dict, other: dict) -> RowComparison:
    """Two ``accelgen run`` rows: the same new tokens, sample by sample, and their log-probabilities' drift."""
    base_samples, other_samples = base.get("completions") or [base], other.get("completions") or [other]
    difference, first, sample, token_drift = "", None, None, Drift()
    if len(base_samples) != len(other_samples):
        difference = f"{len(other_samples)} samples, baseline {len(base_samples)}"
    for number, (one, two) in enumerate(zip(base_samples, other_samples)):
        position = _first_difference(one["completion_token_ids"], two["completion_token_ids"])
        token_drift.merge(_drift(one.get("logprobs"), two.get("logprobs"), position))
        if position is not None and first is None:
            first, sample = position, (number if len(base_samples) > 1 else None)
            where = f"sample {number} token" if sample is not None else "token"
            difference = difference or (f"{where} {position} is {_token(two['completion_token_ids'], position)}, "
                                        f"baseline {_token(one['completion_token_ids'], position)}")
    prompt_drift, _ = _prompt_drift(base, other, "prompt_token_ids", "prompt_logprobs")
    return RowComparison(index, not difference, difference, first, sample, token_drift, prompt_drift, None)


def compare_score_rows(index: int, base: dict, other: dict, tolerance: float = DEFAULT_TOLERANCE) -> RowComparison:
    """Two ``accelgen score`` rows: the same best choice, the same continuation_greedy, or else a prompt_logprob
    within ``tolerance`` (:data:`DEFAULT_TOLERANCE`); drift of prompt_logprob and of token_logprobs."""
    differences = [f"{field} {other.get(field)}, baseline {base.get(field)}" for field in ("best_choice", "continuation_greedy")
                   if (field in base or field in other) and base.get(field) != other.get(field)]
    one, two = base.get("prompt_logprob"), other.get("prompt_logprob")
    numbers = isinstance(one, int | float) and isinstance(two, int | float)
    sum_drift = abs(one - two) if numbers else None
    plain = not any(field in row for row in (base, other) for field in ("best_choice", "continuation_greedy"))
    if plain and (not numbers and one != two or numbers and sum_drift > tolerance * max(1.0, abs(one), abs(two))):
        differences.append(f"prompt_logprob {two:.6g}, baseline {one:.6g}" if numbers else f"prompt_logprob {two}, baseline {one}")
    prompt_drift, first = _prompt_drift(base, other, "tokens", "token_logprobs")
    return RowComparison(index, not differences, "; ".join(differences), first, None, Drift(), prompt_drift, sum_drift)


@dataclasses.dataclass
class PairAgreement:
    """A file against the baseline: its rows compared, and those that could not be."""

    baseline: OutputFile
    other: OutputFile
    rows: list[RowComparison]  # the rows compared, by index
    only_in_baseline: list[int]
    only_in_other: list[int]
    error_rows: list[int]  # held by both files, an error row in one of them or both: not compared
    other_prompts: list[int]  # the same index but another prompt (prompt_sha256): not compared

    @property
    def agreeing(self) -> int:
        return sum(row.agree for row in self.rows)

    @property
    def differing(self) -> list[RowComparison]:
        return [row for row in self.rows if not row.agree]

    def drift(self, name: str) -> Drift:
        """The drift of all rows together: ``name`` "token_drift" or "prompt_drift" (per token), "sum_drift" (per row)."""
        together = Drift()
        for row in self.rows:
            if name == "sum_drift":
                if row.sum_drift is not None:
                    together.add(row.sum_drift)
            else:
                together.merge(getattr(row, name))
        return together


def _is_error(row: dict) -> bool:
    return row.get("finish_reason") == "error"


def compare_pair(baseline: OutputFile, other: OutputFile, tolerance: float = DEFAULT_TOLERANCE) -> PairAgreement:
    """``other`` against ``baseline``, on the rows both hold."""
    common = sorted(baseline.rows.keys() & other.rows.keys())
    errors = [index for index in common if _is_error(baseline.rows[index]) or _is_error(other.rows[index])]
    prompts = [index for index in common if index not in errors and None not in (
        digests := (baseline.rows[index].get("prompt_sha256"), other.rows[index].get("prompt_sha256")))
        and digests[0] != digests[1]]
    compared = []
    for index in common:
        if index not in errors and index not in prompts:
            base, row = baseline.rows[index], other.rows[index]
            compared.append(compare_run_rows(index, base, row) if baseline.kind == "run"
                            else compare_score_rows(index, base, row, tolerance))
    return PairAgreement(baseline, other, compared, sorted(baseline.rows.keys() - other.rows.keys()),
                         sorted(other.rows.keys() - baseline.rows.keys()), errors, prompts)


@dataclasses.dataclass
class Agreement:
    """Every file against the baseline."""

    baseline: OutputFile
    pairs: list[PairAgreement]
    tolerance: float

    @property
    def kind(self) -> str:
        return self.baseline.kind


def compare_files(paths: list[str], labels: list[str] | None = None, baseline: str | None = None,
                  tolerance: float = DEFAULT_TOLERANCE) -> Agreement:
    """Each file of ``paths`` against the ``baseline`` (a label or a path; default: the first file)."""
    if len(paths) < 2:
        raise UsageError(f"Comparing outputs takes two or more files, not {len(paths)}: pass the outputs of one set of rows "
                         f"run on each machine, dtype or world size.")
    if not (isinstance(tolerance, int | float) and 0 <= tolerance < math.inf):
        raise UsageError(f"--tolerance {tolerance!r} is not a number from 0 up: pass a relative tolerance such as 1e-3.")
    if labels is not None and len(labels) != len(paths):
        raise UsageError(f"{len(labels)} labels for {len(paths)} files: give one label per file, in the files' order.")
    files = [read_output(path) for path in paths]
    kinds = {file.kind for file in files}
    if len(kinds) > 1:
        run, score = (next(file.path for file in files if file.kind == kind) for kind in ("run", "score"))
        raise UsageError(f"{run!r} holds accelgen run outputs and {score!r} accelgen score outputs: compare outputs of one command.")
    for file, label in zip(files, labels or default_labels(files)):
        file.label = label
    chosen = files[0] if baseline is None else next(
        (file for file in files if baseline in (file.label, file.path)), None)
    if chosen is None:
        raise UsageError(f"--baseline {baseline!r} is none of the files' labels: {', '.join(file.label for file in files)}.")
    return Agreement(chosen, [compare_pair(chosen, file, tolerance) for file in files if file is not chosen], tolerance)


def _number(value: float | None) -> str:
    return "-" if value is None else "0" if value == 0 else f"{value:.1e}"


#: The drift columns: (title, PairAgreement.drift name); a column shows where a file has that drift.
DRIFT_COLUMNS = (("token logprob drift mean / max", "token_drift"), ("prompt token drift mean / max", "prompt_drift"),
                 ("prompt_logprob drift mean / max", "sum_drift"))


def _grid(agreement: Agreement) -> list[list[str]]:
    columns = [(title, name) for title, name in DRIFT_COLUMNS if any(pair.drift(name).count for pair in agreement.pairs)]
    header = ["file", "agreement", *(title for title, _ in columns), "first rows that differ"]
    body = []
    for pair in agreement.pairs:
        compared = len(pair.rows)
        share = f" ({100 * pair.agreeing / compared:.1f}%)" if compared else ""
        drifts = [pair.drift(name) for _, name in columns]
        differing = [f"row {row.index}: {row.difference}" for row in pair.differing[:SHOWN_DIFFERENCES]]
        more = len(pair.differing) - SHOWN_DIFFERENCES
        body.append([pair.other.label, f"{pair.agreeing} of {compared} rows agree{share}",
                     *(f"{_number(drift.mean)} / {_number(drift.largest if drift.count else None)}" for drift in drifts),
                     "; ".join(differing + ([f"{more} more"] if more > 0 else [])) or "-"])
    return [header] + body


def _caption(agreement: Agreement) -> str:
    base = agreement.baseline
    rule = ("run rows agree when their new tokens are the same" if agreement.kind == "run" else
            f"score rows agree on the same best_choice, the same continuation_greedy, or else a prompt_logprob within "
            f"{agreement.tolerance:g} (relative, absolute below 1)")
    where = "" if Path(base.path).name in base.label else f" ({base.path})"
    return (f"Answers compared with {base.label}{where}, rows matched by \"index\": {rule}; drift is the absolute "
            f"difference of log-probabilities, over the tokens both rows share up to the first that differs.")


#: Run record fields that decide a row's answer besides the machine: files that differ in them may differ for that alone.
SETTINGS_FIELDS = ("max_new_tokens", "max_input_tokens", "ignore_eos", "do_sample", "temperature", "top_k", "top_p",
                   "seed", "model_identity")  # a row's own prompt is checked by its prompt_sha256


def settings_difference(record: dict, baseline: dict) -> str:
    """What in run record ``record`` differs from ``baseline``'s among :data:`SETTINGS_FIELDS` ('' when nothing, or
    when a file has no record)."""
    differing = [field for field in SETTINGS_FIELDS if field in record and field in baseline and record[field] != baseline[field]]
    return ", ".join(f"{field} {json.dumps(record[field])} (baseline {json.dumps(baseline[field])})"
                     if field != "model_identity" else "another model (model_identity)" for field in differing)


def _notes(agreement: Agreement) -> list[str]:
    notes = []
    for pair in agreement.pairs:
        parts = []
        if difference := settings_difference(pair.other.record, pair.baseline.record):
            parts.append(f"run with other settings than the baseline, {difference}: its answers may differ for that alone")
        if pair.only_in_baseline or pair.only_in_other:
            parts.append(f"compared on the rows both files hold ({len(pair.only_in_baseline)} only in "
                         f"{Path(pair.baseline.path).name}, {len(pair.only_in_other)} only in {Path(pair.other.path).name})")
        if pair.error_rows:
            parts.append(f"{len(pair.error_rows)} error rows not compared (rows {_indices(pair.error_rows)})")
        if pair.other_prompts:
            parts.append(f"{len(pair.other_prompts)} rows of another prompt not compared (rows {_indices(pair.other_prompts)})")
        if parts:
            notes.append(f"{pair.other.label}: " + "; ".join(parts) + ".")
    return notes


def _indices(indices: list[int]) -> str:
    return ", ".join(map(str, indices[:SHOWN_DIFFERENCES])) + (", ..." if len(indices) > SHOWN_DIFFERENCES else "")


def render_text(agreement: Agreement) -> str:
    """The table for a terminal: the caption above, aligned columns, notes below."""
    grid = _grid(agreement)
    widths = [max(len(line[index]) for line in grid) for index in range(len(grid[0]))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in grid]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join([_caption(agreement), *lines, *(f"- {note}" for note in _notes(agreement))])


def render_markdown(agreement: Agreement) -> str:
    grid = _grid(agreement)
    escaped = [[text.replace("|", "\\|") for text in line] for line in grid]
    lines = [_caption(agreement), "", "| " + " | ".join(escaped[0]) + " |", "| " + " | ".join(["---"] * len(grid[0])) + " |"]
    lines += ["| " + " | ".join(line) + " |" for line in escaped[1:]]
    notes = _notes(agreement)
    return "\n".join(lines + ([""] + [f"- {note}" for note in notes] if notes else [])) + "\n"


def chart_figure(agreement: Agreement):
    """Two panels: each file's share of rows agreeing with the baseline, and the distribution (CDF) of each row's drift."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, (bars, curves) = pyplot.subplots(1, 2, figsize=(11, 1.5 + 0.5 * max(len(agreement.pairs), 4)), layout="constrained")
    labels = [pair.other.label for pair in agreement.pairs]
    shares = [100 * pair.agreeing / len(pair.rows) if pair.rows else 0 for pair in agreement.pairs]
    drawn = bars.barh(range(len(labels)), shares)
    bars.set_yticks(range(len(labels)), labels, fontsize=8)
    bars.invert_yaxis()
    bars.bar_label(drawn, [f"{pair.agreeing} of {len(pair.rows)}" for pair in agreement.pairs], fontsize=8)
    bars.set_xlim(0, 115)
    bars.set_xlabel("rows agreeing (%)")
    bars.set_title(f"Agreement with {agreement.baseline.label}", fontsize=10)
    drifts = {pair.other.label: sorted(row.headline_drift for row in pair.rows if row.headline_drift is not None)
              for pair in agreement.pairs}
    positive = [value for values in drifts.values() for value in values if value > 0]
    right = 2 * max(positive, default=1.0)  # each curve drawn on to the right edge, where every row is below
    for label, values in drifts.items():
        if values:  # from (0, 0), a step up at each row's drift
            curves.step([0, *values, right], [0, *((number + 1) / len(values) for number in range(len(values))), 1],
                        where="post", label=label)
    if positive:  # zero drift at the left edge, small and large drifts apart
        curves.set_xscale("symlog", linthresh=min(positive))
    curves.set_xlim(0, right)
    if any(drifts.values()):
        curves.legend(fontsize=8)
    else:
        curves.text(0.5, 0.5, "no log-probabilities in these files\n(accelgen run --logprobs writes them)",
                    ha="center", va="center", transform=curves.transAxes)
    what = "|prompt_logprob difference|" if agreement.kind == "score" else "largest |log-probability difference| of a token"
    curves.set_xlabel(f"row's {what}")
    curves.set_ylabel("share of rows at or below")
    curves.set_title("Drift of the rows' log-probabilities", fontsize=10)
    return figure


def draw_chart(agreement: Agreement, path: str) -> None:
    """Write :func:`chart_figure` to ``path`` as a PNG."""
    from matplotlib import pyplot

    figure = chart_figure(agreement)
    try:
        write_whole_file(path, "--plot", lambda temporary: figure.savefig(temporary, dpi=120, format="png"))
    finally:
        pyplot.close(figure)


def check_outputs_apart(paths: list[str], outputs: dict[str, str]) -> None:
    """Raise UsageError when an output (``{"--markdown": path, ...}``) is a file being compared (or its run record),
    by any name, or the other output: each would overwrite what is read or written."""
    named = list(outputs.items())
    for number, (option, path) in enumerate(named):
        for read in paths:
            if is_same_file(path, read) or is_same_file(path, real_path(read) + ".run.json"):
                raise UsageError(f"{option} {path!r} is the output file {read!r} being compared (or its run record): "
                                 f"write the table and the chart to files of their own.")
        for _, other in named[number + 1:]:
            if is_same_file(path, other):
                raise UsageError(f"{option} {path!r} is the other output ({other!r}): write the table and the chart to "
                                 f"files of their own.")


def compare_outputs(paths: list[str], labels: list[str] | None = None, baseline: str | None = None,
                    markdown: str | None = None, plot: str | None = None, tolerance: float = DEFAULT_TOLERANCE) -> str:
    """Compare output files (:func:`compare_files`), write the Markdown table to ``markdown`` and the chart to
    ``plot`` when given (each checked before any file is read), and return the table for the terminal."""
    if plot:
        check_chart_possible(plot)
    if markdown:
        check_output_file(markdown, "--markdown", "agreement.md")
    check_outputs_apart(paths, {option: path for option, path in (("--markdown", markdown), ("--plot", plot)) if path})
    agreement = compare_files(paths, labels, baseline, tolerance)
    if markdown:
        write_text_file(markdown, "--markdown", render_markdown(agreement))
    if plot:
        draw_chart(agreement, plot)
    return render_text(agreement)
