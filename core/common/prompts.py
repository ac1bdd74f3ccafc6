"""What makes a text usable as a prompt, checked in one place for prompts given on the command line or to
the Python API and for the rows of a dataset."""

from __future__ import annotations

from typing import Sequence

from accelgen.common.errors import UsageError


def prompt_problem(text: object) -> str | None:
    """Why ``text`` cannot be a prompt, with the fix, as a clause ("is empty: give it some text"); None when
    it can. A dataset's missing value is None; bytes that are not UTF-8 reach Python from a shell as lone
    surrogates (their ``surrogateescape`` form)."""
    if text is None:
        return "is null (no text): fill it in, or remove that row"
    if not isinstance(text, str):
        return f"holds {type(text).__name__}, not text: give it text, or choose a text column"
    if not text.strip():
        return "is empty: give it some text, or remove it"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(text[error.start]) & 0xFF  # a surrogate 0xDC80 + b stands for the undecodable byte b
        return (f"is not UTF-8 text (byte 0x{byte:02x} at character {error.start}): convert it to UTF-8, "
                f"e.g. with iconv -t UTF-8")
    return None


class PromptError(UsageError):
    """A numbered prompt that cannot be completed: "Prompt {number}{rest}". A dataset job names the row and the
    dataset instead (:meth:`in_dataset`), since its prompts are the dataset's rows."""

    def __init__(self, number: int, rest: str):
        super().__init__(f"Prompt {number}{rest}")
        self.number, self.rest = number, rest

    def in_dataset(self, source: str, column: str) -> UsageError:
        """The same problem, said of row ``number`` of the dataset ``source``."""
        return UsageError(f"Dataset {source!r} row {self.number} (column {column!r}){self.rest}")


def check_prompts(prompts: Sequence[object], first_index: int = 0) -> None:
    """Raise UsageError when there are no ``prompts``, or naming the first (numbered from ``first_index``) that
    cannot be one."""
    if not prompts:
        raise UsageError("No prompts given: pass at least one prompt.")
    for index, prompt in enumerate(prompts, start=first_index):
        problem = prompt_problem(prompt)
        if problem:
            raise PromptError(index, f" {problem}.")
