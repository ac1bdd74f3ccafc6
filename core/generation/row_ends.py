"""Where a row's completion ends, decided on the host from its tokens: at its first end token (unless
``--ignore-eos``), at the token completing its first stop text (``--stop``, or a row's own), or at its token
budget (the run's ``--max-new-tokens``, or a row's own). A row held to a structure ends at an end token only once its
grammar is complete (its mask allows one then, and only then): it ends "stop", as at a stop text.

End tokens are also found on the device, inside the decode step, which frees a row's slot at the next look;
stop texts are found by decoding, at the looks, the tokens of the rows still running. Where a row ends
depends only on its tokens, never on when the host looked.
"""

from __future__ import annotations

from accelgen.generation.runner import SlotRunner
from accelgen.generation.scheduler import Row
from accelgen.generation.text import PromptCodec


class RowEnds:
    """Ends rows for one run: ``eos_token_ids`` end a row unless ``ignore_eos``; each row's stop texts end it
    (found by ``text``)."""

    def __init__(self, text: PromptCodec, eos_token_ids: list[int], ignore_eos: bool):
        self.text = text
        self.eos_token_ids = set() if ignore_eos else set(eos_token_ids)

    def with_stopped(self, finished: list[bool], running: dict[int, Row], runner: SlotRunner) -> list[bool]:
        """``finished`` (per slot) with the ``running`` rows (by slot) whose text has reached a stop text marked
        too: their tokens so far are read back from ``runner``, only when there are stop texts."""
        running = {slot: row for slot, row in running.items() if not finished[slot] and row.settings.stop}
        if not running:
            return finished
        for (slot, row), row_tokens in zip(running.items(), runner.new_tokens(list(running))):
            made = row.settings.max_new_tokens - row.budget  # its first token and the steps it has taken
            if self.text.tokens_to_stop(row.prompt_ids, row_tokens[:made], row.settings.stop) is not None:
                finished[slot] = True
        return finished

    def trim(self, row: Row) -> tuple[list[int], str]:
        """The row's new tokens up to and including its first end token or the token completing its first stop
        text, whichever comes first, and why it ended ("eos", "stop" or "length"; "error" for an error row; "stop" for
        a row whose grammar completed)."""
        if row.error is not None:
            return [], "error"
        tokens, reason = row.new_tokens[: row.settings.max_new_tokens], "length"
        for position, token in enumerate(tokens):
            if token in self.eos_token_ids:
                tokens, reason = tokens[: position + 1], "eos" if row.settings.structure is None else "stop"
                break
        stop = self.text.tokens_to_stop(row.prompt_ids, tokens, row.settings.stop)
        if stop is not None:
            return tokens[:stop], "stop"
        return tokens, reason
