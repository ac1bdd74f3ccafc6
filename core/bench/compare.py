"""``accelgen compare``: result files from any machines -> one table (terminal, Markdown) and a chart.

One row per (model, world size, batch size), one column per hardware label, the way the published
Gaudi2 / A100 / Gaudi1 tables read; each cell also gives its speed relative to the baseline column.
Files whose protocol differs from the baseline's (new-token count, prompt, dtype, decoding) are
flagged in the table and in notes below it, never mixed in silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

from accelgen.bench.result_file import SCHEMA, SCHEMA_VERSION
from accelgen.common.errors import UsageError, user_errors
from accelgen.common.output_files import check_output_file, is_same_file, write_whole_file


@dataclasses.dataclass(frozen=True)
class Metric:
    """One figure of a result row that a table can show."""

    title: str
    unit: str
    lower_is_better: bool
    read: Callable[[dict], float | None]
    digits: int


def _median(name: str) -> Callable[[dict], float | None]:
    return lambda row: (row.get(name) or {}).get("median")


METRICS = {
    "end-to-end": Metric("End-to-end latency", "s", True, _median("end_to_end_s"), 3),
    "decode": Metric("Decode latency per token", "ms", True, _median("decode_ms_per_token"), 2),
    "first-token": Metric("Time to first token", "ms", True, lambda row: row.get("first_token_ms"), 1),
    "ms-per-token-per-sequence": Metric("Time per token per sequence", "ms", True,
                                        lambda row: row.get("ms_per_token_per_sequence"), 2),
    "throughput": Metric("Throughput", "tokens/s", False, lambda row: row.get("tokens_per_second"), 1),
    "roofline": Metric("Share of the memory-bandwidth roofline", "%", False, lambda row: row.get("roofline_percent"), 1),
}

#: Protocol fields that must agree for two columns to be compared.
PROTOCOL_FIELDS = ("max_new_tokens", "prompt", "decoding", "ignore_eos")


@dataclasses.dataclass
class Measurement:
    """One hardware configuration's results, as read from a file."""

    label: str
    file: str
    source: str  # "measured" or "published"
    record: dict[str, Any]


@dataclasses.dataclass
class Table:
    metric: Metric
    columns: list[str]
    baseline: str
    rows: list[tuple[tuple[str, int, int], dict[str, float | str]]]  # (model, world size, batch) -> cells
    flagged: dict[str, str]  # column -> why its protocol differs from the baseline's
    notes: list[tuple[bool, str]]  # (about a flagged column, text)


def load_measurements(paths: list[str]) -> list[Measurement]:
    """Every measurement in ``paths``; one-line UsageError for a file that is missing or not a result. Measurements of
    one hardware label share its column, unless two of them measure the same rows: then each measurement of that
    label has a column of its own, named by its file (:func:`_told_apart`)."""
    measurements: list[Measurement] = []
    for path in paths:
        document = _read_result_file(path)
        for record in document["measurements"]:
            measurements.append(Measurement(record["label"], path, document.get("source", "measured"), record))
    return _told_apart(measurements)


def _told_apart(measurements: list[Measurement]) -> list[Measurement]:
    """``measurements`` with the label of each that shares its label with another of the same rows (two runs of one
    hardware) followed by its file's name, or its path where two files share a name: ``cpu (run1.json)``."""
    clashing = {first.label for number, first in enumerate(measurements) for second in measurements[number + 1:]
                if first.label == second.label and _row_keys(first.record) & _row_keys(second.record)}
    for label in clashing:
        files = [measurement.file for measurement in measurements if measurement.label == label]
        names = [Path(file).name for file in files]
        for measurement in measurements:
            if measurement.label == label:
                name = Path(measurement.file).name
                measurement.label = f"{label} ({name if names.count(name) == 1 else measurement.file})"
    return measurements


def _row_keys(record: dict) -> set[tuple[str, int, int]]:
    """The table rows a measurement fills: (model, world size, batch size)."""
    return {(record["model"]["name"], record["world_size"], row["batch_size"]) for row in record["results"]}


def _read_result_file(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise UsageError(f"Result file {path!r} does not exist.")
    with user_errors(f"Result file {path!r} is not readable JSON", "pass files written by 'accelgen bench'"):
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise UsageError(f"{path!r} is not an accelgen bench result (no \"schema\": \"{SCHEMA}\"): "
                         f"pass files written by 'accelgen bench'.")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(f"{path!r} has result schema version {document.get('schema_version')}, this accelgen reads "
                         f"version {SCHEMA_VERSION}: measure again with this version, or compare it with the accelgen that wrote it.")
    problem = shape_problem(document, DOCUMENT_SHAPE)
    if problem:
        raise UsageError(f"Result file {path!r}: {problem}: pass files written by 'accelgen bench'.")
    return document


@dataclasses.dataclass(frozen=True)
class Maybe:
    """A field that may be absent or null, holding ``shape`` when present."""

    shape: Any


#: What this module reads of a result file, and the types it needs: a type, an object's fields (dict), a
#: non-empty list of items of one shape ([shape]), or Maybe(shape). Read once, when the file is read.
_MEDIAN = Maybe({"median": Maybe(float)})
ROW_SHAPE = {
    "batch_size": int, "status": Maybe(str), "end_to_end_s": _MEDIAN, "decode_ms_per_token": _MEDIAN,
    "first_token_ms": Maybe(float), "ms_per_token_per_sequence": Maybe(float), "tokens_per_second": Maybe(float),
    "roofline_percent": Maybe(float),
}
RECORD_SHAPE = {
    "label": str, "model": {"name": str}, "world_size": int, "dtype": Maybe(str), "protocol": dict,
    "reference": Maybe(dict), "results": [ROW_SHAPE],
}
DOCUMENT_SHAPE = {"source": Maybe(str), "measurements": [RECORD_SHAPE]}
_TYPE_NAMES = {int: "a whole number", float: "a number", str: "text", dict: "an object", list: "a list"}
#: What a figure read may be, besides 0: a time, a rate or a share that a machine can measure (never NaN,
#: infinite or negative, nor so far from 1 that a table or chart of it is meaningless or cannot be drawn).
#: Whole numbers (batch sizes, world sizes) count from 1.
FIGURE_RANGE = (1e-9, 1e15)


def shape_problem(value: Any, shape: Any, where: str = "") -> str | None:
    """What in ``value`` does not have ``shape`` ("field measurements[0].results[1].batch_size should be a whole
    number, not str"), or None."""
    if isinstance(shape, Maybe):
        return None if value is None else shape_problem(value, shape.shape, where)
    field = f"field {where}" if where else "the file"
    if isinstance(shape, dict) and shape is not dict:
        if not isinstance(value, dict):
            return f"{field} should be an object, not {type(value).__name__}"
        for key, item_shape in shape.items():
            if key not in value and not isinstance(item_shape, Maybe):
                return f"field {where + '.' if where else ''}{key} is missing"
            problem = shape_problem(value.get(key), item_shape, f"{where + '.' if where else ''}{key}")
            if problem:
                return problem
        return None
    if isinstance(shape, list):
        if not isinstance(value, list) or not value:
            return f"{field} should be a non-empty list" + ("" if isinstance(value, list) else f", not {type(value).__name__}")
        return next((problem for index, item in enumerate(value)
                     if (problem := shape_problem(item, shape[0], f"{where}[{index}]"))), None)
    accepted = (int, float) if shape is float else shape
    if not isinstance(value, accepted) or isinstance(value, bool):
        return f"{field} should be {_TYPE_NAMES[shape]}, not {type(value).__name__}"
    if shape is int and value < 1:
        return f"{field} should be a whole number of at least 1, not {value!r}"
    if shape is float and not (value == 0 or FIGURE_RANGE[0] <= value <= FIGURE_RANGE[1]):
        return f"{field} should be 0 or a number from {FIGURE_RANGE[0]:g} to {FIGURE_RANGE[1]:g}, not {value!r}"
    return None


def comparison_table(measurements: list[Measurement], metric: Metric, baseline: str | None = None) -> Table:
    """The table of ``metric`` for ``measurements``, relative to the ``baseline`` label (default: first)."""
    columns = list(dict.fromkeys(measurement.label for measurement in measurements))
    baseline = _baseline_column(columns, measurements, baseline)
    reference = next(measurement for measurement in measurements if measurement.label == baseline)
    cells: dict[tuple[str, int, int], dict[str, float | str]] = {}
    flagged: dict[str, str] = {}
    for measurement in measurements:
        difference = _protocol_difference(measurement.record, reference.record)
        if difference:
            flagged[measurement.label] = difference
        for row in measurement.record["results"]:
            key = (measurement.record["model"]["name"], measurement.record["world_size"], row["batch_size"])
            value = "oom" if row.get("status") == "oom" else metric.read(row)
            if value is not None:
                cells.setdefault(key, {})[measurement.label] = value
    notes = [(True, f"{label}: {why}; not comparable with {baseline}.") for label, why in flagged.items()]
    published: dict[str, list[str]] = {}
    for measurement in measurements:
        if measurement.source == "published":
            published.setdefault(_reference_of(measurement.record), []).append(measurement.label)
    notes += [(False, f"{', '.join(labels)}: published figures ({reference}), not measured by accelgen.")
              for reference, labels in published.items()]
    shared: dict[str, list[str]] = {}
    for measurement in measurements:
        if measurement.label != measurement.record["label"]:
            shared.setdefault(measurement.record["label"], []).append(measurement.label)
    notes += [(False, f"{', '.join(dict.fromkeys(labels))}: files of one label, {label!r}, measuring the same rows, told "
                      f"apart by their files (accelgen bench --label names a run).") for label, labels in shared.items()]
    return Table(metric, columns, baseline, sorted(cells.items()), flagged, notes)


def _baseline_column(columns: list[str], measurements: list[Measurement], asked: str | None) -> str:
    """The column ``--baseline`` names (default: the first); a label its files share must be told apart."""
    if asked is None or asked in columns:
        return asked or columns[0]
    named = list(dict.fromkeys(measurement.label for measurement in measurements if measurement.record["label"] == asked))
    if named:
        raise UsageError(f"--baseline {asked!r} labels {len(named)} columns ({', '.join(named)}): pass one of them.")
    raise UsageError(f"--baseline {asked!r} is not among the hardware labels: {', '.join(columns)}.")


def _protocol_difference(record: dict, reference: dict) -> str:
    """What in ``record``'s protocol (or dtype) differs from ``reference``'s, as a phrase ('' if nothing)."""
    differences = [
        f"{field} {record['protocol'].get(field)!r} (baseline {reference['protocol'].get(field)!r})"
        for field in PROTOCOL_FIELDS
        if record["protocol"].get(field) != reference["protocol"].get(field)
    ]
    if record.get("dtype") != reference.get("dtype"):
        differences.append(f"dtype {record.get('dtype')} (baseline {reference.get('dtype')})")
    return ", ".join(differences)


def _reference_of(record: dict) -> str:
    reference = record.get("reference") or {}
    return ", ".join(str(part) for part in (reference.get("title"), reference.get("url")) if part) or "source not given"


def _cell_text(table: Table, cells: dict[str, float | str], column: str) -> str:
    value = cells.get(column)
    if value is None:
        return "-"
    if value == "oom":
        return "oom"
    text = f"{value:.{table.metric.digits}f} {table.metric.unit}"
    base = cells.get(table.baseline)
    if isinstance(base, float | int) and base and value:
        speed = base / value if table.metric.lower_is_better else value / base
        text += f" ({speed:.2f}x)"
    return text


def _header(table: Table, column: str) -> str:
    return column + (" *" if column in table.flagged else "")


def _grid(table: Table) -> list[list[str]]:
    header = ["model", "world size", "batch"] + [_header(table, column) for column in table.columns]
    body = [
        [model, str(world_size), str(batch_size)] + [_cell_text(table, cells, column) for column in table.columns]
        for (model, world_size, batch_size), cells in table.rows
    ]
    return [header] + body


def _caption(table: Table) -> str:
    better = "lower" if table.metric.lower_is_better else "higher"
    return (f"{table.metric.title} ({table.metric.unit}, {better} is better); in brackets, speed relative to "
            f"{table.baseline} (above 1.00x: faster).")


def render_text(table: Table) -> str:
    """The table for a terminal: aligned columns, the caption above, notes below."""
    grid = _grid(table)
    widths = [max(len(line[index]) for line in grid) for index in range(len(grid[0]))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in grid]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join([_caption(table), *lines, *(_note_line(note, flag="*") for note in table.notes)])


def _note_line(note: tuple[bool, str], flag: str) -> str:
    """A note as a list item; notes on flagged columns carry the flag their header carries."""
    flagged, text = note
    return f"{flag if flagged else '-'} {text}"


def render_markdown(table: Table) -> str:
    grid = _grid(table)
    alignment = ["---", "---:", "---:"] + ["---:"] * len(table.columns)
    lines = [_caption(table), "", "| " + " | ".join(grid[0]) + " |", "| " + " | ".join(alignment) + " |"]
    lines += ["| " + " | ".join(line) + " |" for line in grid[1:]]
    if table.notes:
        lines += [""] + [_note_line(note, flag="\\*") for note in table.notes]
    return "\n".join(lines) + "\n"


def write_text_file(path: str, option: str, text: str) -> None:
    """Write ``text`` to ``path`` whole (``option``, e.g. "--markdown", names it in errors)."""
    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)

    write_whole_file(path, option, write)


def check_outputs_apart(result_files: list[str], outputs: dict[str, str]) -> None:
    """Raise UsageError when an output (``{"--markdown": path, ...}``) is one of the result files read, by any
    name (a link to it, a hard link), or the other output: each would overwrite what is read or written."""
    named = list(outputs.items())
    for index, (option, path) in enumerate(named):
        for other in result_files + [other_path for _, other_path in named[index + 1:]]:
            if is_same_file(path, other):
                what = f"the result file {other!r} being read" if other in result_files else f"the other output ({other!r})"
                raise UsageError(f"{option} {path!r} is {what}: write the table and the chart to files of their own.")


def check_chart_possible(path: str) -> None:
    """Raise UsageError, before any work, when a chart cannot be drawn to ``path``."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install \"accelgen[plot]\" (or matplotlib).") from None
    check_output_file(path, "--plot", "chart.png")


#: The most hardware columns a chart draws: beyond, its bars and their labels no longer read (the table shows any
#: number of columns).
MAX_CHART_COLUMNS = 16


def check_chart_columns(table: Table) -> None:
    """Raise UsageError, before anything is printed or written, when ``table`` has too many columns to chart."""
    if len(table.columns) > MAX_CHART_COLUMNS:
        raise UsageError(f"--plot draws at most {MAX_CHART_COLUMNS} hardware columns and the files give "
                         f"{len(table.columns)}: chart fewer files at a time, or leave out --plot (the table shows them all).")


#: Above this ratio between the largest and smallest value, the chart's value axis is logarithmic: a CPU
#: beside GPUs and Gaudis spans orders of magnitude, which a linear axis shows as one bar and a row of slivers.
LOG_SCALE_SPAN = 10


def chart_figure(table: Table):
    """A grouped bar chart of the table: one group per row, one bar per hardware, each bar labelled with its
    value and its speed relative to the baseline (as in the table's cells); "oom" written where it ran out."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    group_names = [f"{model}\nbatch {batch}, world {world}" for (model, world, batch), _ in table.rows]
    columns = len(table.columns)
    bar_width = 0.8 / max(columns, 1)
    # the legend below the bars, in as many columns as its longest label leaves room for; the figure grows to
    # hold its rows (constrained layout keeps it inside the image, however many columns)
    legend_column_inches = 0.6 + 0.075 * max(len(_header(table, column)) for column in table.columns)
    width = max(6.0, 1.6 * len(group_names) * max(columns, 2) / 2, legend_column_inches)
    legend_columns = max(1, min(columns, int(width // legend_column_inches)))
    legend_rows = -(-columns // legend_columns)
    figure, axes = pyplot.subplots(figsize=(width, 4.5 + 0.2 * legend_rows), layout="constrained")
    values = [value for _, cells in table.rows for value in cells.values() if isinstance(value, float | int) and value > 0]
    logarithmic = bool(values) and max(values) / min(values) > LOG_SCALE_SPAN
    if logarithmic:
        axes.set_yscale("log")
    for index, column in enumerate(table.columns):
        positions = [group + (index - (columns - 1) / 2) * bar_width for group in range(len(table.rows))]
        column_values = [cells.get(column) for _, cells in table.rows]
        heights = [value if isinstance(value, float | int) else 0 for value in column_values]
        bars = axes.bar(positions, heights, bar_width, label=_header(table, column))
        for bar, value, (_, cells) in zip(bars, column_values, table.rows):
            if value == "oom" or isinstance(value, float | int):
                label = "oom" if value == "oom" else _cell_text(table, cells, column).replace(" (", "\n(")
                height = bar.get_height() if value != "oom" else (min(values) / 3 if logarithmic else 0)
                axes.annotate(label, (bar.get_x() + bar.get_width() / 2, height), ha="center", va="bottom", fontsize=7)
    axes.set_xticks(range(len(table.rows)), group_names, fontsize=8)
    scale = ", logarithmic scale" if logarithmic else ""
    axes.set_ylabel(f"{table.metric.title} ({table.metric.unit}{scale})")
    axes.set_title(f"{table.metric.title}, {'lower' if table.metric.lower_is_better else 'higher'} is better")
    if logarithmic:  # every bar visible above the floor, room for the labels above the tallest
        axes.set_ylim(min(values) / 3, max(values) * 4)
    else:
        axes.margins(y=0.25)
    figure.legend(loc="outside lower center", ncols=legend_columns, fontsize=8)
    return figure


def draw_chart(table: Table, path: str) -> None:
    """Write :func:`chart_figure` of the table to ``path`` as a PNG."""
    check_chart_possible(path)
    from matplotlib import pyplot

    figure = chart_figure(table)
    try:
        write_whole_file(path, "--plot", lambda temporary: figure.savefig(temporary, dpi=120, format="png"))
    finally:
        pyplot.close(figure)
