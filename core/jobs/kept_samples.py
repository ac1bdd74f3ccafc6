"""The finished samples of a prompt whose line is not written yet (``--num-samples``), kept beside its output so that
a stopped run loses none of them: ``<output>.samples``, one JSON line per sample of the output's next row (its
completion's fields, its ``sample`` number and the digest of the row it completes), appended as each is done and
removed once the row's line is written. A resumed run takes them, when that row is still the dataset's (a row not yet
written may be edited between two runs), and makes only the samples after them; each sample's draws depend only on the
seed, its prompt's number, its own number and the step, so the row's line is the one the uninterrupted run writes.

Like the run record, the file is the output's own: never written through a link (a link or a hard link planted at its
name is refused), read only when the output's run record is this run's, and left as it is by a run refused."""

from __future__ import annotations

import hashlib
import json
import os
from typing import IO, Sequence

from accelgen.common.errors import UsageError
from accelgen.common.output_files import refuse_link
from accelgen.generation.text import Completion, SampleCompletion

#: The ending of the file beside an output (``<output>.samples``).
SAMPLES_SUFFIX = ".samples"
#: The field of a kept line naming the row its sample completes (:func:`row_digest`).
ROW_FIELD = "row_sha256"


def row_digest(row: object) -> str:
    """A digest of a row as the job reads it (a text, a conversation, a batch request and its settings): the samples
    kept for a row are taken only by that row."""
    return hashlib.sha256(repr(row).encode("utf-8", "surrogatepass")).hexdigest()


class KeptSamples:
    """The kept samples of one output, whose real file is ``output_file``."""

    def __init__(self, output_file: str, output: str, row: int, trusted: bool):
        """Those of row ``row`` (the output's next), read when ``trusted`` (the output's run record is this run's);
        any others are stale (a row since written, another run's) and go when this run writes. ``output``: the
        option's value, for messages."""
        self.path, self.row = output_file + SAMPLES_SUFFIX, row
        refuse_link(self.path, "Kept samples file")
        if os.path.lexists(self.path):
            status = os.stat(self.path)
            if not os.path.isfile(self.path) or status.st_nlink > 1:
                raise UsageError(f"Kept samples file {self.path!r} (beside --output {output!r}) is not a file accelgen "
                                 f"wrote ({'a folder or device' if not os.path.isfile(self.path) else 'a hard link'}): "
                                 f"move it away.")
        self.samples: list[Completion] = []  # of row ``row``, from its sample 0 on
        self.row_digest: str | None = None  # of the row they complete (:func:`row_digest`)
        self._kept_bytes = 0  # the bytes of the file that hold them: anything after (a torn line) goes
        if trusted:
            self._read()
        self._file: IO[bytes] | None = None

    def _read(self) -> None:
        """The file's first samples that are row ``row``'s samples 0, 1, ... in order (a torn or damaged line ends
        them: what follows is made again, identical)."""
        try:
            file = open(self.path, "rb")
        except FileNotFoundError:
            return
        with file:
            for line in file:
                try:
                    data = json.loads(line) if line.endswith(b"\n") else None
                    digest = data.pop(ROW_FIELD, None) if isinstance(data, dict) else None
                    kept = (isinstance(digest, str) and digest == (self.row_digest or digest)
                            and data.get("index") == self.row and data.pop("sample", None) == len(self.samples)
                            and Completion(**data))
                except (ValueError, TypeError):
                    kept = None
                if not kept:
                    return
                self.samples.append(kept)
                self.row_digest = digest
                self._kept_bytes += len(line)

    def of_row(self, digest: str) -> list[Completion]:
        """The samples kept, when the row they complete is still the one whose digest is ``digest``; else none (they
        go when this run keeps its own)."""
        if digest != self.row_digest:
            self.samples, self.row_digest, self._kept_bytes = [], None, 0
        return self.samples

    def keep(self, samples: Sequence[SampleCompletion], digest: str) -> None:
        """Append ``samples`` (row ``row``'s next ones, in order; ``digest``: the row's :func:`row_digest`), each line in
        one write."""
        if self._file is None:
            self._file = self._open()
        self.row_digest = digest
        for sample in samples:
            line = json.dumps({**sample.completion.as_row(), "sample": sample.sample, ROW_FIELD: digest},
                              ensure_ascii=False) + "\n"
            data = line.encode()
            written = 0
            while written < len(data):
                written += self._file.write(data[written:])
            self.samples.append(sample.completion)
            self._kept_bytes += len(data)

    def _open(self) -> IO[bytes]:
        """The file, to append to after the samples read (stale or torn lines cut): never through a link."""
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        if os.fstat(descriptor).st_nlink > 1:
            os.close(descriptor)
            raise UsageError(f"Kept samples file {self.path!r} is a file with another name (a hard link): move it away.")
        os.ftruncate(descriptor, self._kept_bytes)
        os.lseek(descriptor, 0, os.SEEK_END)
        return os.fdopen(descriptor, "wb", buffering=0)

    def moved_to(self, row: int) -> None:
        """Row ``row`` comes next in the output now (the rows before it are written): the samples of an earlier row go,
        and their file."""
        if row == self.row:
            return
        self.close()
        self.row, self.samples, self.row_digest, self._kept_bytes = row, [], None, 0
        if os.path.isfile(self.path) and not os.path.islink(self.path):
            os.remove(self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
