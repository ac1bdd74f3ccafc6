"""What pins a dataset's rows in a run record, so that a stopped run resumes only on the rows it started on.

A local source is pinned by its content: ``dataset_content`` is the size and SHA-256 of the file (``sha256sum``
gives the same digest), or of every file of a folder (names, sizes and bytes, in name order). A Hub dataset is
pinned by ``dataset_revision``, the commit ``datasets`` resolved and read the rows at. A resumed run whose source
still has its pin goes on at once.

A source whose pin changed may still hold the same rows where it matters: rows appended at its end, a bad row past
those done fixed, an edit past ``--limit``. Then the rows already done decide: each is compared with the prompt the
output holds for it (read once, before the model loads), and the run resumes only when every one is the same,
since each row is completed on its own (its text and number decide it). The record keeps the pin the output was
started with: it is written once, and the comparison with the output, not the pin, is what a resume trusts. A row
cut to ``--max-input-tokens`` is held in the output as the model saw it, so it never compares equal: such a run
resumes only on an unchanged source.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterator

from accelgen.common.errors import UsageError, user_errors
from accelgen.jobs.dataset_paths import folder_files
from accelgen.jobs.dataset_rows import DatasetRequest

#: The run record's fields that pin a dataset's rows (an older record has neither, and resumes unchecked).
PIN_FIELDS = ("dataset_content", "dataset_revision")
#: Bytes hashed at a time.
CHUNK_BYTES = 1 << 20
#: Characters of a changed row that its error quotes.
QUOTED_CHARACTERS = 40


def dataset_pin(request: DatasetRequest, revision: str | None) -> dict:
    """The record's pin of the dataset's rows as they are now (``revision``: the Hub commit its rows came from)."""
    source = os.path.expanduser(request.source)
    if revision is not None or not os.path.exists(source):
        return dict(dataset_revision=revision)
    with user_errors(f"Cannot read dataset {request.source!r}", "make it readable, or pass another --dataset"):
        if os.path.isfile(source):
            size, digest = _file_digest(source)
            return dict(dataset_content=dict(bytes=size, sha256=digest))
        folder_hash, total = hashlib.sha256(), 0
        for name in folder_files(source):
            size, digest = _file_digest(os.path.join(source, name))
            folder_hash.update(f"{name}\0{size}\0{digest}\n".encode())
            total += size
        return dict(dataset_content=dict(bytes=total, sha256=folder_hash.hexdigest()))


def resumable_pin(request: DatasetRequest, pin: dict, earlier: dict | None, output: str,
                  reread: Callable[[], Iterator[str]], row_key: Callable[[dict], object]) -> dict:
    """The pin to record for a run resuming after the rows of an ``earlier`` run record (None: a run starting
    afresh, which records ``pin``); ``reread()`` gives the dataset's rows from its first, as what ``row_key`` reads
    from an output line (the prompt text; a batch request's custom_id), to compare with the output's when the pin
    changed. Raise UsageError when a row already done is not the dataset's any more."""
    if earlier is None or earlier.get("dataset") != request.source:
        return pin  # a new output, or another dataset: the run record's own comparison says so
    earlier_pin = {field: earlier[field] for field in PIN_FIELDS if field in earlier}
    if not earlier_pin:
        return {}  # written before datasets were pinned: resumes as it did then
    if earlier_pin != pin:
        changed = _first_changed_row(output, reread(), row_key)
        if changed and earlier.get("max_input_tokens") is not None:
            changed += ", the output holding each row as cut to --max-input-tokens"
        if changed:
            raise UsageError(
                f"Dataset {request.source!r} changed since the rows in --output {output!r} were completed "
                f"({_what_changed(earlier_pin, pin)}; {changed}): pass --overwrite to complete it again, or a new --output."
            )
    return earlier_pin


def _first_changed_row(output: str, texts: Iterator[str], row_key: Callable[[dict], object]) -> str | None:
    """What differs first between the rows ``output`` holds (``row_key`` of each line) and the dataset's ``texts``
    (None: the output's rows are all still the dataset's). Reading stops at a line that is not a whole completion:
    ``CompletionFile`` judges the output itself."""
    with user_errors(f"Cannot read --output {output!r}", "pass --overwrite to start it again, or another file"):
        with open(output, "rb") as written:
            for index, line in enumerate(written):
                try:
                    prompt = row_key(json.loads(line)) if line.endswith(b"\n") else None
                except (ValueError, TypeError, KeyError, AttributeError):
                    prompt = None
                if not isinstance(prompt, str):
                    return None
                text = next(texts, None)
                if text is None:
                    return f"it has {index} rows, the output {index + 1} or more"
                if text != prompt:
                    return f"row {index} was {_quoted(prompt)}, now {_quoted(text)}"
    return None


def _quoted(text: str) -> str:
    return repr(text if len(text) <= QUOTED_CHARACTERS else text[:QUOTED_CHARACTERS] + "...")


def _what_changed(earlier_pin: dict, pin: dict) -> str:
    if "dataset_revision" in earlier_pin or "dataset_revision" in pin:
        return f"revision {earlier_pin.get('dataset_revision')} then, {pin.get('dataset_revision')} now"
    then, now = earlier_pin["dataset_content"], pin["dataset_content"]
    then_bytes = then.get("bytes") if isinstance(then, dict) else None
    if then_bytes != now["bytes"]:
        return f"{then_bytes} bytes then, {now['bytes']} now"
    return "same size, other bytes"


def _file_digest(path: str) -> tuple[int, str]:
    """The file's size and SHA-256."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
