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
    """Appends one JSON line per completion, flushed line by line, so a run stopped at any moment
    (SIGKILL included) keeps every row it finished; the same run started again resumes after them.

    Beside the output a small file ``<output>.run.json`` describes the run that writes it (model,
    source, settings); a different run is refused on an existing file unless it overwrites.
    """

    def __init__(self, path: str, run_description: dict, overwrite: bool):
        self.path = path
        self.run_file = path + ".run.json"
        self.run_description = run_description
        self.overwrite = overwrite
        self._file: IO[str] | None = None
        self.completed_rows = 0 if overwrite else self._count_completed_rows()

    @classmethod
    def open(cls, path: str, run_description: dict, overwrite: bool = False) -> "CompletionWriter":
        """Check now, before any model loads, that ``path`` can be written and belongs to this run.

        Nothing is changed on disk until the first completion is written."""
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise UsageError(f"--output {path!r} is a folder: give a file name such as out.jsonl.")
        if not os.path.isdir(folder):
            raise UsageError(f"Cannot write --output {path!r}: folder {folder!r} does not exist.")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise UsageError(f"Cannot write --output {path!r}: permission denied.")
        return cls(path, run_description, overwrite)

    def _count_completed_rows(self) -> int:
        """Complete lines already in the file (a torn last line does not count), checked against this run."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return 0
        if not os.path.exists(self.run_file):
            raise UsageError(
                f"--output {self.path!r} already exists and was not written by accelgen run: "
                f"pass --overwrite to replace it, or choose another file."
            )
        with open(self.run_file, encoding="utf-8") as run_file:
            earlier = json.load(run_file)
        if earlier != self.run_description:
            changed = sorted(key for key in earlier.keys() | self.run_description.keys()
                             if earlier.get(key) != self.run_description.get(key))
            raise UsageError(
                f"--output {self.path!r} holds completions of another run (different {', '.join(changed)}): "
                f"pass --overwrite to replace it, or the same arguments to resume it."
            )
        rows = 0
        with open(self.path, "rb") as existing:
            for line in existing:
                if not line.endswith(b"\n"):
                    break  # torn by a stop mid-write: written again on resume
                if json.loads(line)["index"] != rows:
                    raise UsageError(f"--output {self.path!r} is out of order at line {rows + 1}: pass --overwrite.")
                rows += 1
        return rows

    def write(self, completions: Sequence[Completion]) -> None:
        if self._file is None:
            self._file = self._open_for_append()
        for completion in completions:
            self._file.write(json.dumps(dataclasses.asdict(completion), ensure_ascii=False) + "\n")
            self._file.flush()

    def _open_for_append(self) -> IO[str]:
        if self.completed_rows == 0:  # a new file, or one being overwritten
            with open(self.run_file + ".tmp", "w", encoding="utf-8") as run_file:
                json.dump(self.run_description, run_file, indent=1)
            os.replace(self.run_file + ".tmp", self.run_file)
            return open(self.path, "w", encoding="utf-8")
        with open(self.path, "r+b") as existing:  # cut a torn last line
            existing.truncate(_end_of_last_complete_line(existing))
        return open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _end_of_last_complete_line(existing: IO[bytes]) -> int:
    content = existing.read()
    return content.rfind(b"\n") + 1


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
