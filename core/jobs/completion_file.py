"""The JSON-lines file a run's completions go to: one line per row, appended as each batch completes, so a
run stopped at any moment (SIGKILL, a full disk) keeps every row it finished and the same run started again
resumes after them.

Beside it, ``<output>.run.json`` records what decides the rows (model, source, settings): a different run
is refused on an existing file unless it overwrites. A line kept on resume must still stand for the row it
completed: one whose prompt was edited by hand (:mod:`accelgen.jobs.prompt_digest`; an OpenAI batch line's
custom_id) is refused, naming its line. Every check is made when the file is opened, before
any model loads; nothing on disk changes until the first completion is written. An --output that is a
symbolic link is its target: the run record (and the lock) lie beside the real file, so every name of one
output resumes the same rows; a run record that is itself a link is refused, never written through.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import IO, Callable, Iterator, Sequence

from accelgen.common.errors import AccelgenWarning, UsageError, reason, user_errors
from accelgen.common.output_files import check_output_file, real_path, refuse_link, replace_whole
from accelgen.common.prompts import PromptRequest
from accelgen.generation.text import OPTIONAL_FIELDS, SCORE_FIELDS, Completion, SampleCompletion
from accelgen.jobs.kept_samples import SAMPLES_SUFFIX, KeptSamples
from accelgen.jobs.output_lock import OutputLock
from accelgen.jobs.prompt_digest import DIGEST_FIELD, RECORD_FIELD, digest_problem, with_digest

#: The run record's field of what the last run on the output did (its figures: ``accelgen run --details`` prints them).
LAST_RUN_FIELD = "last_run"
#: Run record fields not compared with a resumed run's: the model as named, for people (the same model by another
#: path resumes; what decides is ``model_identity``, its content), what the lines carry (an output resumes in
#: the form it was started in), and what the last run did.
UNCOMPARED_FIELDS = ("model", RECORD_FIELD, LAST_RUN_FIELD)

#: The fields a line may hold besides :data:`LINE_FIELDS` (lines written before the digest have none; the prompt's
#: scores are written with --prompt-logprobs).
OPTIONAL_LINE_FIELDS = (*OPTIONAL_FIELDS, DIGEST_FIELD, "prompt_token_ids", "prompt_logprobs", "prompt_top_logprobs")
#: The fields of every line, in order: a line without them was not written by ``accelgen run``.
LINE_FIELDS = tuple(field.name for field in dataclasses.fields(Completion)
                    if field.name not in OPTIONAL_LINE_FIELDS and field.name not in SCORE_FIELDS)


def run_record_path(output: str) -> str:
    """Where the run record of ``output`` lies: beside the real file, so every name of one output shares it."""
    return real_path(output) + ".run.json"


class CompletionLines:
    """accelgen's own output lines: each completion's fields (:meth:`Completion.as_row`) and the digest of its
    prompt (:mod:`accelgen.jobs.prompt_digest`)."""

    @staticmethod
    def line(completion: Completion) -> dict:
        return with_digest(completion.as_row())

    @staticmethod
    def record_fields() -> dict:
        """What a new output's run record says of its lines: each carries its prompt's digest."""
        return {RECORD_FIELD: DIGEST_FIELD}

    @staticmethod
    def edits(run_record: dict, dataset_keys: Callable[[], Iterator[object]] | None) -> Callable[[dict], str | None]:
        """Why a kept line (parsed) no longer stands for its row, or None, line after line from the first: its
        prompt is not the one its digest was made of (a line without one is refused only when ``run_record``, the
        output's, says every line was written with one). The dataset is not read (``dataset_keys`` unused)."""
        required = run_record.get(RECORD_FIELD) == DIGEST_FIELD
        return lambda line: digest_problem(line, required)

    @staticmethod
    def problem(line: object, index: int) -> str | None:
        """Why a written ``line`` (parsed) is not the completion of row ``index`` written by ``accelgen run``, or None."""
        if not isinstance(line, dict) or not set(LINE_FIELDS) <= set(line) <= {*LINE_FIELDS, *OPTIONAL_LINE_FIELDS}:
            return f"is not a completion written by accelgen run (its fields: {', '.join(LINE_FIELDS)})"
        written = line["index"]
        if not isinstance(written, int) or isinstance(written, bool):
            return f"has index {json.dumps(written)}, not a whole row number (row {index} is expected there)"
        if written != index:
            return f"is row {written}, not row {index}"
        return None

    #: What the output's rows are called where a run speaks of them.
    noun = "row"

    @staticmethod
    def is_error(line: dict) -> bool:
        """Whether a written line is an error row (``--skip-bad-rows``)."""
        return line.get("finish_reason") == "error"

    @staticmethod
    def error_of(completion: Completion) -> str:
        """Which row an error row is, and why: ``row 3: is empty``."""
        return f"row {completion.index}: {completion.error}"

    @staticmethod
    def error_rows_line(error_rows: int, rows: int, where: str) -> str:
        """What a run says of its ``error_rows`` of ``rows`` (``where``: " in FILE", or nothing)."""
        return (f"{error_rows} of {rows} rows could not be completed and were written as error rows{where} "
                f"(finish_reason \"error\", with the reason in \"error\")")

    @staticmethod
    def every_row_failed_line(rows: int, where: str) -> str:
        """The start of the error line of a run none of whose ``rows`` could be completed."""
        none = f"none of the {rows} rows could be completed: each was" if rows > 1 else "the one row could not be completed: it was"
        return f"{none} written as an error row{where} (finish_reason \"error\", the reason in \"error\")"

    @staticmethod
    def row_key(line: dict) -> object:
        """What a written line says of the row it completes, to compare with the dataset's (:meth:`request_key`);
        None for a line whose prompt was edited (:class:`CompletionFile` names it)."""
        return None if digest_problem(line, required=False) else line.get("prompt")

    @staticmethod
    def request_key(text: object) -> object:
        return text.prompt if isinstance(text, PromptRequest) else text  # a row with its own schema or adapter: its prompt


#: The endings of the files kept beside an output (its run record; its lock, ``accelgen.jobs.output_lock``; the samples
#: of its next row, ``accelgen.jobs.kept_samples``): never an output themselves, with or without --overwrite.
COMPANION_SUFFIXES = (".run.json", ".lock", SAMPLES_SUFFIX)


class CompletionFile:
    """Appends completions to ``path``, resuming after the rows already there when ``run_record`` matches."""

    def __init__(self, path: str, run_record: dict, overwrite: bool = False, lock: bool = True,
                 lines=CompletionLines(), dataset_keys: Callable[[], Iterator[object]] | None = None):
        """``lock``: take the output's lock (:mod:`accelgen.jobs.output_lock`) until :meth:`close`; the ranks of a
        job other than rank 0 read the file but do not lock it. ``lines``: what a line holds (accelgen's own,
        or ``accelgen.jobs.openai_batch.BatchOutputLines``). ``dataset_keys()``: the rows from the first, as
        ``lines.request_key`` gives them, for lines that are checked against their rows on resume."""
        check_output_file(path, "--output", "out.jsonl")
        if path.endswith(COMPANION_SUFFIXES):
            raise UsageError(f"--output {path!r} has the name of the files accelgen keeps beside an output (its run "
                             f"record, *.run.json, and its lock, *.lock), which another output may need to resume: "
                             f"choose a name ending otherwise, such as out.jsonl.")
        self.path, self.lines = path, lines
        self.run_file = run_record_path(path)
        refuse_link(self.run_file, "Run record")
        if os.path.exists(self.run_file) and not os.path.isfile(self.run_file):
            raise UsageError(f"Run record {self.run_file!r} (beside --output {path!r}) is not a file: move it away.")
        self.run_record = {**run_record, **lines.record_fields()}
        self.dataset_keys = dataset_keys
        self._file: IO[bytes] | None = None
        self._lock = OutputLock(path) if lock else None
        if self._lock:
            self._lock.acquire()
        self.error_rows = 0  # of the completed rows, those that are error rows
        #: the finished samples of the next row (``--num-samples``), kept by a run stopped before its line
        self.kept: KeptSamples | None = None
        try:
            self.completed_rows = 0 if overwrite else self._count_completed_rows()
            self.kept = KeptSamples(real_path(path), path, self.completed_rows, trusted=not overwrite and self._same_run())
        except BaseException:
            self.close()
            raise

    def _count_completed_rows(self) -> int:
        """Complete lines already in the file (a torn last line does not count), checked against this run."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return 0
        if not os.path.exists(self.run_file):
            raise UsageError(
                f"--output {self.path!r} already exists and was not written by accelgen run: "
                f"pass --overwrite to replace it, or choose another file."
            )
        earlier = self._earlier_run_record()
        self._check_same_run(earlier)
        edited = self.lines.edits(earlier, self.dataset_keys)
        rows = 0
        with user_errors(f"Cannot read --output {self.path!r}", "pass --overwrite to start it again, or another file"):
            with open(self.path, "rb") as existing:
                for line in existing:
                    if not line.endswith(b"\n"):
                        break  # torn by a stop mid-write: written again on resume
                    written, problem = self._read_line(line, rows)
                    keep = f"keep its first {rows} lines (head -n {rows}) to resume after them, or " if rows else ""
                    if problem:
                        raise UsageError(f"--output {self.path!r} line {rows + 1} {problem}: the file is damaged; "
                                         f"{keep}pass --overwrite to start it again.")
                    edit = edited(written)
                    if edit:
                        raise UsageError(f"--output {self.path!r} line {rows + 1} (row {rows}) {edit}: kept, it would "
                                         f"stand for a row that says otherwise; restore that line, {keep}pass "
                                         f"--overwrite to start it again.")
                    self.error_rows += self.lines.is_error(written)
                    rows += 1
        return rows

    def _same_run(self) -> bool:
        """Whether the output's run record says this run wrote it (refused otherwise when the output holds rows)."""
        try:
            self._check_same_run(self._earlier_run_record())
        except UsageError:
            return False
        return True

    def _earlier_run_record(self) -> dict:
        fix = f"it says which run wrote {self.path!r}; restore it, or pass --overwrite to start the output again"
        with user_errors(f"Run record {self.run_file!r} cannot be read", fix):
            with open(self.run_file, encoding="utf-8") as run_file:
                earlier = json.load(run_file)
        if not isinstance(earlier, dict):
            raise UsageError(f"Run record {self.run_file!r} holds {type(earlier).__name__}, not a run's description: {fix}.")
        return earlier

    def _check_same_run(self, earlier: dict) -> None:
        changed = sorted(key for key in earlier.keys() | self.run_record.keys()
                         if key not in UNCOMPARED_FIELDS and earlier.get(key) != self.run_record.get(key))
        if changed:
            raise UsageError(
                f"--output {self.path!r} holds completions of another run (different {', '.join(changed)}): "
                f"pass --overwrite to replace it, or the same arguments to resume it."
            )

    def write(self, completions: Sequence[Completion]) -> None:
        """Append ``completions``, one line each, each line in one write; a failed write (a full disk) stops
        the run in one line, the rows written before it kept."""
        for completion in completions:
            line = (json.dumps(self.lines.line(completion), ensure_ascii=False) + "\n").encode()
            with user_errors(f"Cannot write --output {self.path!r}",
                             f"{self.completed_rows} rows are kept; make room (or move the file and its .run.json) "
                             f"and run the same command again to resume after them"):
                if self._file is None:
                    self._file = self._open_for_append()
                _write_all(self._file, line)
            self.completed_rows += 1
            self.error_rows += completion.finish_reason == "error"
        self.kept.moved_to(self.completed_rows)

    def record_last_run(self, figures: dict) -> None:
        """Add ``figures``, what the run that just ended did, to the output's run record (``last_run``; a resumed run
        replaces them). Where the record cannot be written (a full disk), one warning: the rows are kept."""
        if not os.path.isfile(self.run_file):
            return  # no row written, no record
        try:
            with open(self.run_file, encoding="utf-8") as run_file:
                record = json.load(run_file)  # as the output was started: a resumed run changes nothing else in it
            replace_whole(self.run_file, lambda path: _write_json(path, {**record, LAST_RUN_FIELD: figures}))
        except (OSError, ValueError) as error:
            warnings.warn(AccelgenWarning(f"the run's figures were not added to {self.run_file!r} ({reason(error)}); "
                                          f"its rows are kept in {self.path!r}"), stacklevel=2)

    def keep_samples(self, samples: Sequence[SampleCompletion], row_digest: str) -> None:
        """Keep ``samples``, the next finished samples of the next row (``accelgen.jobs.kept_samples``; ``row_digest``:
        that row's), so that a stop before its line loses none; the output is opened first (its run record written, as
        for its first line)."""
        if not samples:
            return
        with user_errors(f"Cannot write the samples of --output {self.path!r}",
                         f"{self.completed_rows} rows are kept; make room and run the same command again to resume"):
            if self._file is None:
                self._file = self._open_for_append()
            self.kept.keep(samples, row_digest)

    def _open_for_append(self) -> IO[bytes]:
        if self.completed_rows == 0:  # a new file, or one being overwritten
            replace_whole(self.run_file, self._write_run_record)
            return open(self.path, "wb", buffering=0)
        with open(self.path, "r+b") as existing:  # cut a torn last line
            existing.truncate(existing.read().rfind(b"\n") + 1)
        return open(self.path, "ab", buffering=0)

    def _write_run_record(self, path: str) -> None:
        _write_json(path, self.run_record)

    def _read_line(self, line: bytes, index: int) -> tuple[object, str | None]:
        """``line`` parsed, and why it is not the line of row ``index`` written by ``accelgen run`` (or None)."""
        try:
            row = json.loads(line)
        except ValueError as error:  # not JSON, or not UTF-8
            return None, f"is not a JSON line ({reason(error)})"
        return row, self.lines.problem(row, index)

    def close(self) -> None:
        """Close the file and give up its lock (again: nothing)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.kept is not None:
            self.kept.close()
        if self._lock:
            self._lock.release()




def _write_json(path: str, record: dict) -> None:
    with open(path, "w", encoding="utf-8") as run_file:
        json.dump(record, run_file, indent=1)


def _write_all(file: IO[bytes], data: bytes) -> None:
    """Write all of ``data`` to an unbuffered file (a write may take only part of it)."""
    written = 0
    while written < len(data):
        written += file.write(data[written:])
