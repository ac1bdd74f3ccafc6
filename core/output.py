"""What a run shows and writes: completions on the terminal and as JSON lines, summaries, warnings."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from typing import IO, TYPE_CHECKING, Sequence

from accelgen.errors import AccelgenWarning, UsageError
from accelgen.generator import Completion
from accelgen.hookspecs import Accelerator
from accelgen.plugins import package_of

if TYPE_CHECKING:
    from accelgen.completion_job import CompletedRun


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
    """``module from distribution version`` of the code that provides ``accelerator``, for ``accelgen devices``."""
    module = type(accelerator).__module__
    package = package_of(accelerator)
    return f"{module} from {package}" if package else module


def print_summary(result: "CompletedRun") -> None:
    """One line on stderr: tokens, speed, load time, device, dtype, world size, graph captures."""
    generator = result.generator
    stats = generator.stats
    decode_seconds = sum(timing.decode_seconds for timing in stats.timings)
    decode_steps = sum(timing.decode_steps for timing in stats.timings)
    per_token_ms = 1000 * decode_seconds / max(decode_steps, 1)
    print(
        f"accelgen: {stats.new_tokens} new tokens in {result.generate_seconds:.2f} s "
        f"({stats.new_tokens / max(result.generate_seconds, 1e-9):.1f} tokens/s, decode {per_token_ms:.2f} ms/step), "
        f"model loaded in {result.load_seconds:.2f} s, device {generator.accelerator.name}, dtype {generator.run.dtype}, "
        f"world size {generator.world.size}, graph captures: {stats.graph_captures}"
        + (f" ({stats.capture_seconds:.1f} s)" if stats.graph_captures else "")
        + (", decoded eagerly: the decode step could not be captured" if generator.capture_failure else ""),
        file=sys.stderr,
    )


def print_rank_memory(rank_memory: list[dict], unsharded_parameter_bytes: int) -> None:
    """One line: each rank's parameter bytes against the unsharded model, and its memory statistics."""
    shares = " / ".join(f"{memory['parameter_bytes']:,}" for memory in rank_memory)
    ratios = " / ".join(f"{memory['parameter_bytes'] / unsharded_parameter_bytes:.2f}x" for memory in rank_memory)
    statistics = "; ".join(
        f"{name} per rank " + " / ".join(f"{memory[name]:,}" for memory in rank_memory)
        for name in rank_memory[0]
        if name != "parameter_bytes"
    )
    print(
        f"accelgen: parameter bytes per rank {shares} of {unsharded_parameter_bytes:,} unsharded ({ratios})"
        + (f"; {statistics}" if statistics else ""),
        file=sys.stderr,
    )


def show_our_warnings_as_lines(shown: bool) -> None:
    """accelgen's own warnings as one ``accelgen: warning: ...`` line each (on rank 0 only); others as usual."""
    library_default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, AccelgenWarning):
            library_default(message, category, filename, lineno, file, line)
        elif shown:
            print(f"accelgen: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def quiet_libraries() -> None:
    """Keep transformers' progress bars and advice off the terminal; errors still surface as ours."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hub_logging.set_verbosity_error()  # its retry chatter; the failure itself comes back as our one line
