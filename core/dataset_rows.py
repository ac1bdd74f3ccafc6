"""The texts to complete, read from any source Hugging Face ``datasets`` reads.

A source is a Hub dataset id (with ``--dataset-config`` and ``--split``), a local JSON / JSONL / CSV /
Parquet file or a folder of them, or a folder written by ``save_to_disk``. Rows come out in dataset
order, one text (the chosen column) each.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import Iterator

from accelgen.errors import UsageError, first_line

#: Local file suffixes and the ``datasets`` builder that reads them.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
TEXT_TYPES = ("string", "large_string")


@dataclasses.dataclass(frozen=True)
class DatasetRequest:
    source: str
    column: str = "text"
    split: str = "train"
    config: str | None = None
    limit: int | None = None  # the first N rows only
    streaming: bool = False  # read rows as they are needed instead of loading the split


@dataclasses.dataclass
class TextRows:
    """Texts in dataset order, and how many there are (None when streaming without --limit)."""

    texts: Iterator[str]
    total: int | None


def open_rows(request: DatasetRequest) -> TextRows:
    """The request's rows, checked: the split and column exist, the column holds text, rows exist."""
    import datasets

    if request.limit is not None and request.limit < 1:
        raise UsageError(f"--limit must be at least 1 (got {request.limit}).")
    datasets.disable_progress_bars()
    dataset = _load_split(request)
    _check_column(dataset, request)
    if request.limit is not None:
        dataset = dataset.take(request.limit) if request.streaming else dataset.select(range(min(request.limit, len(dataset))))
    texts = (row[request.column] for row in dataset.select_columns([request.column]))
    first = next(texts, None)
    if first is None:
        raise UsageError(f"Dataset {request.source!r} (split {request.split!r}) has no rows to complete.")
    total = None if request.streaming else len(dataset)  # a streamed split's length is unknown
    return TextRows(itertools.chain([first], texts), total)


def _load_split(request: DatasetRequest):
    import datasets

    source = os.path.expanduser(request.source)
    try:
        if os.path.isfile(source):
            builder = FILE_BUILDERS.get(os.path.splitext(source)[1].lower())
            if builder is None:
                raise UsageError(
                    f"Cannot read {source!r}: use a file ending in {', '.join(FILE_BUILDERS)}, or a dataset folder."
                )
            return datasets.load_dataset(builder, data_files=source, split=request.split, streaming=request.streaming)
        if os.path.isdir(source) and _saved_with_save_to_disk(source):
            return _saved_split(datasets.load_from_disk(source), request)
        if os.path.isdir(source):
            return datasets.load_dataset(source, request.config, split=request.split, streaming=request.streaming)
        if source.startswith((".", "/", "~")):
            raise UsageError(f"Dataset path {source!r} does not exist.")
        return datasets.load_dataset(source, request.config, split=request.split, streaming=request.streaming)
    except UsageError:
        raise
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
        raise UsageError(
            f"Dataset {request.source!r} not found, or the Hub cannot be reached ({first_line(error)}): "
            f"pass a local JSON, JSONL, CSV or Parquet file, or a folder made by save_to_disk."
        ) from None
    except ValueError as error:
        raise UsageError(_explain_value_error(error, request)) from None


def _saved_with_save_to_disk(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in ("dataset_dict.json", "state.json"))


def _saved_split(saved, request: DatasetRequest):
    """The split of a DatasetDict written by save_to_disk (a single saved Dataset is used whole)."""
    if hasattr(saved, "keys"):
        if request.split not in saved:
            raise UsageError(f"Unknown split {request.split!r}; {request.source!r} has: {', '.join(saved)}.")
        saved = saved[request.split]
    return saved.to_iterable_dataset() if request.streaming else saved


def _check_column(dataset, request: DatasetRequest) -> None:
    # some streamed sources only know their columns once a row is read (their features are None)
    features = dataset.features or {name: None for name in next(iter(dataset.take(1)), {})}
    if request.column not in features:
        raise UsageError(f"Column {request.column!r} is not in the dataset; its columns: {', '.join(features)}.")
    feature = features[request.column]
    if feature is not None and getattr(feature, "dtype", None) not in TEXT_TYPES:
        text_columns = [name for name, kind in features.items() if getattr(kind, "dtype", None) in TEXT_TYPES]
        hint = f"text columns: {', '.join(text_columns)}" if text_columns else "the dataset has no text column"
        kind = getattr(feature, "dtype", type(feature).__name__)
        raise UsageError(f"Column {request.column!r} holds {kind}, not text ({hint}).")


def _explain_value_error(error: ValueError, request: DatasetRequest) -> str:
    message = first_line(error)
    split_names = re.search(r"Should be one of \[(.*)\]", str(error))
    if split_names:
        return f"Unknown split {request.split!r}; {request.source!r} has: {split_names.group(1).replace(chr(39), '')}."
    if "corresponds to no data" in str(error):  # what datasets says of an empty file
        return f"Dataset {request.source!r} (split {request.split!r}) has no rows to complete."
    config_names = re.search(r"(?:available configs|Available): \[(.*?)\]", str(error))
    if config_names:
        available = config_names.group(1).replace("'", "")
        if request.config is None:
            return f"Dataset {request.source!r} has several configurations: pass --dataset-config (one of: {available})."
        return f"Unknown --dataset-config {request.config!r} for {request.source!r}; available: {available}."
    return f"Cannot read dataset {request.source!r}: {message}"
