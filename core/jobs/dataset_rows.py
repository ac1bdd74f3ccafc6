"""The texts to complete, read from any source Hugging Face ``datasets`` reads.

A source is a Hub dataset id (with ``--dataset-config`` and ``--split``), a local JSON / JSONL / CSV /
Parquet file or a folder of them, or a folder written by ``save_to_disk``: a local JSON file is read by us, each row
its own JSON (``accelgen.jobs.json_lines``), any other source by ``datasets`` (``accelgen.jobs.dataset_split``), a
CSV file's rows holding bytes that are not UTF-8 found by us (``accelgen.jobs.csv_bytes``). Rows come out in dataset
order, one prompt (the chosen column) each: a text, or a conversation when the column holds lists of
``{role, content}`` messages (or ShareGPT's ``{from, value}``). With a schema column, each row comes as a
:class:`PromptRequest` holding its prompt and the JSON Schema its completion is held to (none where the column is
null or empty).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Iterator

from accelgen.common.errors import UsageError, user_errors
from accelgen.common.prompts import (
    SKIP_BAD_ROWS,
    BadPrompt,
    Conversation,
    PromptRequest,
    ScoreRequest,
    as_conversation,
    prompt_problem,
)
from accelgen.common.settings import AdapterSettings, RowSettings
from accelgen.common.structure import schema_structure
from accelgen.common.value_ranges import check_settings
from accelgen.generation.grammars import structure_problem
from accelgen.jobs.csv_bytes import holds_bytes_not_utf8, rows_not_utf8
from accelgen.jobs.dataset_paths import check_local_path
from accelgen.jobs.dataset_split import DatasetRequest, file_builder, load_split, unreadable_row
from accelgen.jobs.json_lines import JsonRows, UnreadableRow, surrogate_problem

TEXT_TYPES = ("string", "large_string")
#: The keys of a message in a conversation column: OpenAI's / TRL's, and ShareGPT's.
MESSAGE_KEYS = ({"role", "content"}, {"from", "value"})


@dataclasses.dataclass
class TextRows:
    """Prompts in dataset order (texts, or conversations), and how many there are (None when streaming without
    --limit)."""

    texts: Iterator[str | Conversation | BadPrompt]
    total: int | None
    revision: str | None = None  # the Hub revision the rows come from (None for local files and prompts)
    conversational: bool = False  # the rows are conversations (some of them, in a batch file)
    rows_choose: bool = False  # the rows bring their own settings (``PromptRequest``: an OpenAI batch file's requests)
    constrained: bool = False  # some rows bring their own structure (a schema column, a request's response_format)
    #: the most alternatives a row asks for with its prompt's log-probabilities (a batch request's echo and logprobs K)
    prompt_logprobs: int | None = None
    logprobs: bool = False  # some rows ask for their generated tokens' log-probabilities (a batch request's logprobs)


def open_rows(request: DatasetRequest) -> TextRows:
    """The request's rows, checked: the split and column exist, the column holds text, rows exist. A split
    that is not streamed is read through once here, so that a row which cannot be a prompt stops the run
    before any model loads, not hours into it; a streamed one is checked row by row as it is read. A local JSON file
    is read by us (``accelgen.jobs.json_lines``: each row its own JSON), any other source by ``datasets``."""
    check_settings(limit=request.limit)
    source = os.path.expanduser(request.source)
    check_local_path(request.source, source)
    not_utf8 = _csv_rows_not_utf8(request, source)
    if file_builder(source) == "json":
        dataset, revision = JsonRows(request.source, source), None
    else:
        dataset, revision = load_split(request, source, replace_bytes_not_utf8=not_utf8 is not None)
    kind = _check_column(dataset, request)
    if request.limit is not None and not isinstance(dataset, JsonRows):  # JSON rows: taken as they are read
        dataset = dataset.take(request.limit) if request.streaming else dataset.select(range(min(request.limit, len(dataset))))
    conversations = kind == "conversation" or (kind == "mixed" and _holds_conversations(dataset, request))
    total = None  # a streamed split's length is unknown
    if not request.streaming:
        total = sum(1 for _ in _row_texts(dataset, request, conversations, not_utf8 or {}))
    # a file read again on each pass (a JSON file) gives the rows the check counted, should it grow meanwhile
    texts = itertools.islice(_row_texts(dataset, request, conversations, not_utf8 or {}), total)
    first = next(texts, None)
    if first is None:
        raise UsageError(f"Dataset {request.source!r} (split {request.split!r}) has no rows to complete.")
    return TextRows(itertools.chain([first], texts), total, revision, conversational=conversations,
                    constrained=request.schema_column is not None)


def _holds_conversations(dataset, request: DatasetRequest) -> bool:
    """Whether a column of values of several types is one of conversations: some row is a list of messages (its rows
    that are not, a text among them, are then refused or error rows, never completed as text without the chat
    template). A streamed split is judged by its first rows, as it cannot be read ahead."""
    values = _column_values(dataset, request)
    if request.streaming:
        values = itertools.islice(values, ROWS_PER_READ)
    return any(isinstance(row, tuple) and isinstance(row[0], list) for row in values)


#: Rows read at a time from a split held on disk (a streamed one is read row by row).
ROWS_PER_READ = 1024


def _column_values(dataset, request: DatasetRequest) -> Iterator[tuple | UnreadableRow]:
    """Each row's values of the prompt, schema and adapter columns (None for a column not named), in dataset order, or
    (in a JSON file) why the row cannot be read; a row the datasets library cannot read stops with its index."""
    columns = (request.column, request.schema_column, request.adapter_column, request.scored_column)
    if isinstance(dataset, JsonRows):
        yield from itertools.islice(dataset.values(columns), request.limit)
        return
    rows = dataset.select_columns(list(dict.fromkeys(column for column in columns if column)))
    rows_per_read = 1 if request.streaming else ROWS_PER_READ
    batches = iter(rows.iter(batch_size=rows_per_read))
    index = 0
    while True:
        with user_errors("", "", explain=lambda error, index=index: unreadable_row(rows, request, index, rows_per_read, error)):
            batch = next(batches, None)
        if batch is None:
            return
        count = len(batch[request.column])
        for place in range(count):
            yield tuple(batch[column][place] if column else None for column in columns)
        index += count


def _row_texts(dataset, request: DatasetRequest, conversations: bool,
               not_utf8: dict[int, tuple[str, str]]) -> Iterator[str | Conversation | BadPrompt]:
    """The column's prompts in dataset order (``conversations``: each row must be one), held to the row's schema where
    a schema column is named, with the row's LoRA adapter where an adapter column is; a row that cannot be read, or is
    no prompt, stops with its index (or is kept as a BadPrompt with --skip-bad-rows). ``not_utf8``: the rows of a CSV
    file that held bytes which are not UTF-8 (:func:`accelgen.jobs.csv_bytes.rows_not_utf8`)."""
    from_json = isinstance(dataset, JsonRows)
    for index, values in enumerate(_column_values(dataset, request)):
        if isinstance(values, UnreadableRow):
            if request.skip_bad_rows:
                yield BadPrompt(values.problem)
                continue
            raise UsageError(f"Dataset {request.source!r} {values.where(index)} {values.what}: {values.fix}, "
                             f"{SKIP_BAD_ROWS}.")
        text, schema, adapter, scored = values
        if request.schema_column and not from_json:
            _check_schema_value(schema, request.schema_column)
        column, problem = not_utf8.get(index) or (_lone_surrogate(values, request) if from_json else (None, None))
        column = column or request.column
        if problem:
            text = None
        elif conversations:
            text, problem = as_conversation(text)
        else:
            problem = prompt_problem(text)
        if not problem and request.schema_column:
            text, problem = with_schema(text, schema)
            column = request.schema_column if problem else column
        if not problem and request.adapter_column:
            text, problem = with_adapter(text, adapter, request.adapters)
            column = request.adapter_column if problem else column
        if not problem and request.scores:
            text, problem = with_continuations(text, scored, request)
            column = request.scored_column if problem else column
        if problem and request.skip_bad_rows:  # what is wrong, without the fix to the file
            text = BadPrompt(problem.split(": ")[0] if column != request.schema_column
                             else f"its schema (column {column!r}) {problem.rsplit(': ', 1)[0]}")
        elif problem:
            raise UsageError(f"Dataset {request.source!r} row {index}, column {column!r}, {problem}, "
                             f"{SKIP_BAD_ROWS} (rows count from 0, as the output's \"index\").")
        yield text


def _lone_surrogate(values: tuple, request: DatasetRequest) -> tuple[str | None, str | None]:
    """The first column of a JSON row's ``values`` holding a lone surrogate, and the problem; (None, None) if none."""
    for column, value in zip((request.column, request.schema_column, request.adapter_column, request.scored_column),
                             values):
        problem = surrogate_problem(value) if column else None
        if problem:
            return column, problem
    return None, None


def _check_schema_value(schema: object, column: str) -> None:
    """Refuse a schema column that ``datasets`` did not read as JSON text: a column of objects is read through one type
    merged over the rows, which would hold a row to another row's key order and to nulls for the keys it lacks."""
    if schema is None or isinstance(schema, str):
        return
    held = ("objects read through one type merged over the rows (a row's schema would get another row's key order, "
            "and nulls for the keys it lacks)") if isinstance(schema, dict) else type(schema).__name__
    raise UsageError(f"--schema-column {column!r} holds {held}, not JSON text: store each schema as JSON text, or "
                     f"pass the rows as a JSON or JSON-lines file.")


def _csv_rows_not_utf8(request: DatasetRequest, source: str) -> dict[int, tuple[str, str]] | None:
    """For a local CSV file holding bytes that are not UTF-8, the rows whose columns in use hold one (see
    :func:`accelgen.jobs.csv_bytes.rows_not_utf8`); None for any other source."""
    if file_builder(source) != "csv" or not holds_bytes_not_utf8(source):
        return None
    return rows_not_utf8(source, [column for column in (request.column, request.schema_column, request.adapter_column,
                                                        request.scored_column) if column])


def with_schema(prompt: str | Conversation, schema: object) -> tuple[PromptRequest | str | Conversation, str | None]:
    """``prompt`` held to ``schema`` (a row's value of the schema column: a JSON Schema object or its text; null or
    empty: the row has none), or why the schema cannot be one, as a clause with its fix."""
    if schema is None or (isinstance(schema, str) and not schema.strip()):
        return prompt, None
    try:
        structure = schema_structure(schema)
    except ValueError as error:  # nested too deep among them: schema_structure bounds the depth before reading it
        return prompt, f"{error}: fix it, or empty it to leave the row unconstrained"
    problem = structure_problem(structure)
    if problem:
        return prompt, f"{problem}: fix it, or empty it to leave the row unconstrained"
    return PromptRequest(prompt, RowSettings(structure=structure), None), None


def with_adapter(prompt: str | Conversation | PromptRequest, name: object,
                  adapters: AdapterSettings) -> tuple[PromptRequest | str | Conversation, str | None]:
    """``prompt`` (held to its schema, or not) completed with the LoRA adapter ``name`` (a row's value of the
    --lora-column; null or empty: the base model), or why it cannot be, as a clause with its fix."""
    if name is None or name == "":
        return prompt, None
    if not isinstance(name, str):
        return prompt, f"holds {type(name).__name__}, not an adapter's name: write one, or leave it empty for the base model"
    if (problem := adapters.problem(name)) is not None:
        return prompt, problem
    if isinstance(prompt, PromptRequest):
        return dataclasses.replace(prompt, settings=dataclasses.replace(prompt.settings, adapter=name)), None
    return PromptRequest(prompt, RowSettings(adapter=name), None), None


def with_continuations(prompt: str | Conversation, value: object,
                       request: DatasetRequest) -> tuple[ScoreRequest | str | Conversation, str | None]:
    """``prompt`` as a row to score, with the row's ``value`` of the continuation or choices column (none named: the
    text alone), or why that value cannot be one, as a clause with its fix."""
    if request.scored_column is None:
        return ScoreRequest(prompt), None
    if request.choices:
        if isinstance(value, str) and value.strip().startswith("["):  # a list written as JSON text (a CSV column)
            try:
                value = json.loads(value)
            except ValueError:
                return prompt, "holds text that is not a JSON list of choices: write the choices as a JSON list of texts"
        if not isinstance(value, (list, tuple)) or not value:
            return prompt, "holds no list of choices: give each row a list of at least one text"
        if not all(isinstance(choice, str) and choice for choice in value):
            return prompt, "holds a choice that is not a text (or is empty): give each choice some text"
        return ScoreRequest(prompt, tuple(value), choices=True), None
    if not isinstance(value, str) or not value:
        return prompt, "holds no continuation: give each row a text to score after its prompt"
    return ScoreRequest(prompt, (value,)), None


def scored_option(request: DatasetRequest) -> str:
    """The option naming the column of a score job's continuations or choices."""
    return "--choices-column" if request.choices else "--continuation-column"


def _check_column(dataset, request: DatasetRequest) -> str:
    """Raise UsageError unless the column exists and holds text or conversations: "text", "conversation", or
    "mixed" (values of several types, each row read as what it is), and the schema and adapter columns named exist
    (the adapter column holding text: adapters' names)."""
    if isinstance(dataset, JsonRows):
        return _check_json_columns(dataset, request)
    # some streamed sources only know their columns once a row is read (their features are None)
    features = dataset.features
    if not features:
        with user_errors("", "", explain=lambda error: unreadable_row(dataset, request, 0, 1, error)):
            first_row = next(iter(dataset.take(1)), None)
        if first_row is None:
            raise UsageError(f"Dataset {request.source!r} (split {request.split!r}) has no rows to complete.")
        features = {name: None for name in first_row}
    if request.column not in features:
        raise UsageError(f"Column {request.column!r} is not in the dataset; its columns: {', '.join(features)}.")
    for option, column in (("--schema-column", request.schema_column), ("--lora-column", request.adapter_column),
                           (scored_option(request), request.scored_column)):
        if column is not None and column not in features:
            raise UsageError(f"{option} {column!r} is not in the dataset; its columns: {', '.join(features)}.")
    adapter_names = features.get(request.adapter_column)  # None: known row by row
    if adapter_names is not None and type(adapter_names).__name__ != "Json" \
            and getattr(adapter_names, "dtype", None) not in (*TEXT_TYPES, "null"):
        raise UsageError(f"--lora-column {request.adapter_column!r} holds {getattr(adapter_names, 'dtype', 'values')}, "
                         f"not the names of LoRA adapters: pass the column that names them.")
    feature = features[request.column]
    if feature is None or type(feature).__name__ == "Json":  # known row by row
        return "mixed"
    if _is_conversation(feature):
        return "conversation"
    if getattr(feature, "dtype", None) == "null":  # every row is null: each said so, or an error row (--skip-bad-rows)
        return "text"
    if getattr(feature, "dtype", None) not in TEXT_TYPES:
        text_columns = [name for name, kind in features.items() if getattr(kind, "dtype", None) in TEXT_TYPES]
        hint = f"text columns: {', '.join(text_columns)}" if text_columns else "the dataset has no text column"
        kind = getattr(feature, "dtype", type(feature).__name__)
        raise UsageError(f"Column {request.column!r} holds {kind}, not text nor a conversation ({hint}).")
    return "text"


def _check_json_columns(rows: JsonRows, request: DatasetRequest) -> str:
    """:func:`_check_column` for a JSON file's rows, each row its own JSON (a stream judged by its first rows), once the
    columns named are found and the prompt column holds some text or list: "conversation" when some row holds a list,
    else "mixed" (each row read as what it is)."""
    if request.split != "train":
        raise UsageError(f"Unknown split {request.split!r}; {request.source!r} has: train.")
    types = rows.column_types(ROWS_PER_READ if request.streaming else None)
    if not types:
        return "mixed"  # no row can be read: each says why
    for option, column in (("Column", request.column), ("--schema-column", request.schema_column),
                           ("--lora-column", request.adapter_column), (scored_option(request), request.scored_column)):
        if column is not None and column not in types:
            raise UsageError(f"{option} {column!r} is not in the dataset; its columns: {', '.join(types)}.")
    def held(column: str) -> str:
        return " and ".join(f"{kind}s" for kind in sorted(types[column] - {"null"}))

    names = types.get(request.adapter_column, set()) - {"null"}
    if names and "string" not in names:
        raise UsageError(f"--lora-column {request.adapter_column!r} holds {held(request.adapter_column)}, not the names "
                         f"of LoRA adapters: pass the column that names them.")
    prompts = types[request.column] - {"null"}
    if prompts and not prompts & {"string", "array"}:
        text_columns = [name for name, found in types.items() if found - {"null"} == {"string"}]
        hint = f"text columns: {', '.join(text_columns)}" if text_columns else "the dataset has no text column"
        raise UsageError(f"Column {request.column!r} holds {held(request.column)}, not text nor a conversation ({hint}).")
    return "conversation" if "array" in prompts else "mixed"  # some row a list of messages: each row must be one


def _is_conversation(feature) -> bool:
    """Whether a column's feature is a list of messages: of dicts with the keys of :data:`MESSAGE_KEYS`, or of
    JSON objects (what ``datasets`` makes of dicts whose keys differ from row to row; each row is checked)."""
    item = feature[0] if isinstance(feature, list) and len(feature) == 1 else getattr(feature, "feature", None)
    if type(item).__name__ == "Json":
        return True
    return isinstance(item, dict) and any(keys <= set(item) for keys in MESSAGE_KEYS)
