"""A split read by Hugging Face ``datasets`` (a Hub dataset, a local CSV or Parquet file, a folder of data files or
one written by ``save_to_disk``), and what goes wrong reading it said in one line: a source not found, a cache that
cannot be written, an unknown split or configuration, a file or row that cannot be read."""

from __future__ import annotations

import dataclasses
import logging
import os
import re

from accelgen.common.errors import FILE_ERRORS, UsageError, first_line, reason, user_errors
from accelgen.common.settings import AdapterSettings
from accelgen.jobs.dataset_paths import FILE_BUILDERS, saved_with_save_to_disk


@dataclasses.dataclass(frozen=True)
class DatasetRequest:
    source: str
    column: str = "text"
    split: str = "train"
    config: str | None = None
    limit: int | None = None  # the first N rows only
    streaming: bool = False  # read rows as they are needed instead of loading the split
    skip_bad_rows: bool = False  # a row that is no prompt is kept as a BadPrompt (an error row) instead of refused
    adapter_column: str | None = None  # the column naming each row's LoRA adapter (--lora-column; empty: the base model)
    adapters: AdapterSettings = AdapterSettings()  # the adapters such a column may name
    schema_column: str | None = None  # the column holding each row's JSON Schema (--schema-column)
    #: the rows are scored (``accelgen score``): ``scored_column`` holds each row's continuation (a text) or, with
    #: ``choices``, its choices (a list of texts); None: the row's text alone is scored
    scores: bool = False
    scored_column: str | None = None
    choices: bool = False


def unreadable_row(rows, request: DatasetRequest, first_index: int, count: int, error: BaseException) -> str:
    """The error of reading rows ``first_index`` on, naming the first that cannot be read where it can."""
    if isinstance(_innermost(error), UnicodeDecodeError):
        return _not_utf8(request, error)
    if request.streaming:  # read in chunks by the reader: where in the chunk it failed is not known
        return (f"Cannot read dataset {request.source!r} (stopped after {first_index} rows): {reason(error)}: fix the "
                f"file (UTF-8 text, well-formed), or pass another --dataset.")
    index = first_index
    for index in range(first_index, min(first_index + count, len(rows))):  # find the row: read them one at a time
        try:
            rows[index]
        except FILE_ERRORS as row_error:
            error = row_error
            break
    return (f"Dataset {request.source!r} row {index} cannot be read ({reason(error)}): fix that row of the "
            f"file (UTF-8 text, well-formed), or remove it.")


def load_split(request: DatasetRequest, source: str, replace_bytes_not_utf8: bool) -> tuple[object, str | None]:
    """The requested split, and the Hub revision it was read at (None for a local source); a local CSV file's bytes
    that are not UTF-8 replaced where ``replace_bytes_not_utf8`` (the rows holding one are error rows). The datasets
    library is imported here, for the sources it reads (not a local JSON file, which is read without it)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its log of a file it cannot parse: ours says it
    logging.getLogger("huggingface_hub.repocard").setLevel(logging.ERROR)  # "no metadata" of a card without YAML
    with user_errors(f"Cannot read dataset {request.source!r}", "fix the file, or pass another --dataset",
                     errors=(*FILE_ERRORS, StopIteration, datasets.exceptions.DatasetsError, ConnectionError),
                     explain=lambda error: _explain_load_error(error, request, source)):
        if os.path.isfile(source):
            options = {"encoding_errors": "replace"} if replace_bytes_not_utf8 else {}
            return datasets.load_dataset(file_builder(source), data_files=source, split=request.split,
                                         streaming=request.streaming, **options), None
        if os.path.isdir(source) and saved_with_save_to_disk(source):
            return _saved_split(datasets.load_from_disk(source), request), None
        # what load_dataset does, keeping the builder: its hash is the Hub commit the rows are read at
        builder = datasets.load_dataset_builder(source, request.config)
        revision = None if os.path.isdir(source) else builder.hash
        if request.streaming:
            return builder.as_streaming_dataset(split=request.split), revision
        builder.download_and_prepare()
        return builder.as_dataset(split=request.split), revision


def _explain_load_error(error: BaseException, request: DatasetRequest, source: str) -> str | None:
    """The message for an error of loading the dataset, where we can say more than the error itself."""
    import datasets

    if isinstance(error, (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError)):
        return (f"Dataset {request.source!r} not found, or the Hub cannot be reached ({first_line(error)}): "
                f"pass a local JSON, JSONL, CSV or Parquet file, or a folder made by save_to_disk.")
    cache_folder = _unwritable_cache(error)
    if cache_folder:
        return (f"The datasets cache folder {cache_folder!r} cannot be written ({reason(error)}): set HF_DATASETS_CACHE "
                f"(or HF_HOME) to a writable folder.")
    if isinstance(error, StopIteration):  # what the JSON reader raises on an empty file
        return f"Dataset {request.source!r} (split {request.split!r}) has no rows to complete."
    if isinstance(_innermost(error), UnicodeDecodeError):
        return _not_utf8(request, error)
    if isinstance(error, ValueError):
        return _explain_value_error(error, request)
    return None


def _not_utf8(request: DatasetRequest, error: BaseException) -> str:
    return (f"Dataset {request.source!r} is not UTF-8 text ({reason(error)}): convert it to UTF-8, e.g. with "
            f"iconv -t UTF-8, or pass another --dataset.")


def _innermost(error: BaseException) -> BaseException:
    """The error at the bottom of a chain of wrapped ones (a library's "an error occurred" around the cause)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _unwritable_cache(error: BaseException) -> str | None:
    """The ``datasets`` cache folder, when ``error`` is its failure to write there (a read-only HOME)."""
    import datasets

    error = _innermost(error)
    written = getattr(error, "filename", None) if isinstance(error, OSError) else None
    if not isinstance(written, str):
        return None
    for folder in (datasets.config.HF_DATASETS_CACHE, datasets.config.HF_MODULES_CACHE):
        folder = os.path.abspath(str(folder))
        if os.path.commonpath([folder, os.path.abspath(written)]) == folder or folder.startswith(os.path.abspath(written) + os.sep):
            return folder
    return None


def file_builder(source: str) -> str | None:
    """The ``datasets`` builder that reads the local file ``source`` ("json", "csv", "parquet"); None for a folder or a
    Hub dataset."""
    return FILE_BUILDERS[os.path.splitext(source)[1].lower()] if os.path.isfile(source) else None


def _saved_split(saved, request: DatasetRequest):
    """The split of a DatasetDict written by save_to_disk (a single saved Dataset is used whole)."""
    if hasattr(saved, "keys"):
        if request.split not in saved:
            raise UsageError(f"Unknown split {request.split!r}; {request.source!r} has: {', '.join(saved)}.")
        saved = saved[request.split]
    return saved.to_iterable_dataset() if request.streaming else saved


def _explain_value_error(error: ValueError, request: DatasetRequest) -> str | None:
    split_names = re.search(r"(?:Should be one of|Available splits:) \[(.*)\]", str(error))  # loaded, streamed
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
    return None
