"""A reasoning model's thinking: the tokens between its markers (``<think>`` ... ``</think>``), which come before its
answer. Where a model's tokenizer has both markers as tokens of their own, a completion's thinking is written apart
from its answer, and a row's structure holds the answer only, from the end of the thinking on.

Whether a completion starts inside its thinking is read from its prompt: a chat template that opens the thinking
for the model (``<think>`` last of the markers in the prompt) starts it there; one that closes it (an empty
``<think></think>``, as templates write when asked not to think) starts at the answer; a prompt with neither may
open it with its first token.
"""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedTokenizerBase

#: The markers around a model's thinking, as its tokenizer spells them.
THINK_MARKERS = ("<think>", "</think>")


@dataclasses.dataclass(frozen=True)
class ThinkMarkers:
    """The token ids of a model's thinking markers."""

    open_id: int
    close_id: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> "ThinkMarkers | None":
        """The markers of ``tokenizer``, None when it lacks either as a token of its own."""
        vocabulary = tokenizer.get_vocab()
        ids = [vocabulary.get(marker) for marker in THINK_MARKERS]
        return None if None in ids else cls(*ids)

    def opened_by(self, prompt_ids: list[int]) -> bool | None:
        """Whether ``prompt_ids`` leave the model inside its thinking (True), past it (False), or neither said
        (None: no marker in the prompt)."""
        for token in reversed(prompt_ids):
            if token in (self.open_id, self.close_id):
                return token == self.open_id
        return None

    def thinking_span(self, prompt_ids: list[int], new_ids: list[int]) -> tuple[int, int] | None:
        """Where the thinking lies among ``new_ids``: [start, end) of its own tokens (the markers left out; ``end``
        is the close marker's place, or the length when it never closes), None when the completion does not think."""
        if self.opened_by(prompt_ids):
            start = 0
        elif new_ids[:1] == [self.open_id] and self.opened_by(prompt_ids) is None:
            start = 1
        else:
            return None
        end = new_ids.index(self.close_id, start) if self.close_id in new_ids[start:] else len(new_ids)
        return start, end
