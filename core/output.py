"""What a run shows and writes: completions on the terminal and as JSON lines."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from typing import IO, Sequence

from accelgen.errors import UsageError
from accelgen.generator import Completion
from accelgen.hookspecs import Accelerator


class CompletionWriter:
    """Writes one JSON line per completion and flushes it, so a stopped run keeps what it finished."""

    def __init__(self, path: str):
        self.path = path
        self._file: IO[str] | None = None

    @classmethod
    def open(cls, path: str) -> "CompletionWriter":
        """Check now, before any model loads, that ``path`` can be written; the file is created on first write."""
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise UsageError(f"--output {path!r} is a folder: give a file name such as out.jsonl.")
        if not os.path.isdir(folder):
            raise UsageError(f"Cannot write --output {path!r}: folder {folder!r} does not exist.")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise UsageError(f"Cannot write --output {path!r}: permission denied.")
        return cls(path)

    def write(self, completions: Sequence[Completion]) -> None:
        if self._file is None:
            self._file = open(self.path, "w", encoding="utf-8")
        for completion in completions:
            self._file.write(json.dumps(dataclasses.asdict(completion), ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def print_batch(batch_number: int, completions: Sequence[Completion]) -> None:
    """Print a batch the way the published text-generation examples do."""
    print(f"Batch n°{batch_number}")
    for completion in completions:
        print(f"Input: {completion.prompt!r}")
        print(f"Output: {completion.prompt + completion.completion!r}")
    print(flush=True)


def describe_plugin(accelerator: Accelerator) -> str:
    """``module version`` of the code that provides ``accelerator``, for ``accelgen devices``."""
    module = type(accelerator).__module__
    top_level = module.split(".")[0]
    distributions = importlib.metadata.packages_distributions().get(top_level, [])
    for distribution in distributions:
        return f"{module} from {distribution} {importlib.metadata.version(distribution)}"
    return module
