"""Rows scored rather than completed (``accelgen score``): a :class:`~accelgen.common.prompts.ScoreRequest`'s text and
continuations become the engine's prompts (the text followed by each continuation, or the text alone), every token
of which their prefill scores (``RunSettings.prompt_logprobs``, :mod:`accelgen.generation.prompt_scores`); their rows
are gathered back into the request's completion: the text's scores, and each continuation's log-likelihood after it.

A text continued by a text is split as lm-evaluation-harness splits it: the text's trailing spaces go to the
continuation, the two are tokenized together and the continuation's tokens are those after the text's own.
"""

from __future__ import annotations

import dataclasses

from accelgen.common.prompts import BadPrompt, Conversation, PromptError, ScoreRequest
from accelgen.generation.prompt_scores import ContinuationScore, PromptScores
from accelgen.generation.scheduler import Row
from accelgen.generation.text import Completion, PromptCodec

#: A request's prompts are numbered ``number * PARTS + part``: each its own, the request's number read back from it.
PARTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class EncodedRequest:
    """A score request's prompts as (number, token ids) pairs (ids as a string: why the row is an error row), how
    many of each prompt's first ids are the text's, the continuations' texts, and whether the text was truncated."""

    parts: list[tuple[int, list[int] | str]]
    text_tokens: int
    continuation_texts: list[str]
    truncated: bool
    text_scores: bool = True  # the text's own tokens are scored (else the continuations' alone)

    def scores_of(self, ids: list[int], alternatives: int) -> PromptScores:
        """What one of its prompts (``ids``) has scored: every token after the first, or its continuation's alone
        (without ``text_scores``); whether each is the greedy choice, in its continuation only."""
        continued = bool(self.continuation_texts)
        return PromptScores.unscored(ids, alternatives, self.text_tokens if continued and not self.text_scores else 1,
                                     self.text_tokens if continued else None)


class ScoreParts:
    """Score requests turned into prompts (:meth:`encode`), and their rows gathered back (:meth:`gather`)."""

    def __init__(self, codec: PromptCodec, errors_as_rows: bool):
        self.codec, self.errors_as_rows = codec, errors_as_rows
        self._requests: dict[int, tuple[ScoreRequest, EncodedRequest]] = {}  # by number: those whose rows are coming
        self._rows: list[Row] = []  # the rows of the request whose rows are coming out

    def encode(self, number: int, request: ScoreRequest) -> EncodedRequest:
        """The prompts of request ``number``: one per continuation, or the text alone. A request that cannot be
        scored stops the run (its number named), or with ``errors_as_rows`` is one error row."""
        try:
            encoded = self._encoded(number, request)
        except PromptError as error:
            if not self.errors_as_rows:
                raise
            encoded = EncodedRequest([(number * PARTS, error.problem)], 0, [], False)
        if len(encoded.parts) > PARTS:
            raise PromptError(number, f" has {len(encoded.parts)} choices, more than the {PARTS} a row may have: "
                                      f"split it.")
        self._requests[number] = (request, encoded)
        return encoded

    def _encoded(self, number: int, request: ScoreRequest) -> EncodedRequest:
        prompt, continuations = request.prompt, list(request.continuations)
        if request.choices and not continuations:
            raise PromptError(number, " has no choices: give it a list of at least one continuation.")
        for place, continuation in enumerate(continuations):
            if isinstance(continuation, str) and not continuation:
                what = f"choice {place}" if request.choices else "continuation"
                raise PromptError(number, f"'s {what} is empty: give it some text, or remove that row.")
        texts = [self._text_of(continuation) for continuation in continuations]
        if isinstance(prompt, tuple):  # token ids, as lm-evaluation-harness hands them
            text_ids, truncated = self._checked_ids(number, prompt), False
            return EncodedRequest([(number * PARTS + place, text_ids + self._checked_ids(number, continuation))
                                   for place, continuation in enumerate(continuations)] or [(number * PARTS, text_ids)],
                                  len(text_ids), texts, truncated, request.text_scores)
        if isinstance(prompt, str) and continuations:  # its trailing spaces go to the continuations
            kept = prompt.rstrip()
            spaces, prompt = prompt[len(kept):], kept
            if not prompt:
                raise PromptError(number, " is empty before its continuation: give it some text, or remove it.")
            continuations = [spaces + part if isinstance(part, str) else part for part in continuations]
        text_ids, truncated = self.codec.encode_row(number, prompt, errors_as_rows=False)
        parts = [(number * PARTS + place, text_ids + self._continuation_ids(number, prompt, text_ids, continuation))
                 for place, continuation in enumerate(continuations)]
        return EncodedRequest(parts or [(number * PARTS, text_ids)], len(text_ids), texts, truncated, request.text_scores)

    def _continuation_ids(self, number: int, prompt: str | Conversation, text_ids: list[int],
                          continuation: str | tuple[int, ...]) -> list[int]:
        """A continuation's token ids after the text's: a text's tokenized with the text (those after the text's own
        ids, where the text's ids begin them) or, after a conversation, alone."""
        if isinstance(continuation, tuple):
            return self._checked_ids(number, continuation)
        tokenizer = self.codec.tokenizer
        if isinstance(prompt, str):
            whole = tokenizer(prompt + continuation)["input_ids"]
            if whole[:len(text_ids)] == text_ids and len(whole) > len(text_ids):
                return list(whole[len(text_ids):])
        ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if not ids:
            raise PromptError(number, "'s continuation makes no tokens: give it some text.")
        return list(ids)

    def _checked_ids(self, number: int, ids: tuple[int, ...]) -> list[int]:
        """Token ids given as they are, checked against the vocabulary."""
        vocabulary = self.codec.vocab_size
        if not ids or not all(isinstance(token, int) and 0 <= token < vocabulary for token in ids):
            raise PromptError(number, f" holds token ids outside the model's vocabulary of {vocabulary} (or none): "
                                      f"give ids of this model's tokenizer.")
        return list(ids)

    def _text_of(self, continuation: str | tuple[int, ...]) -> str:
        return continuation if isinstance(continuation, str) else self.codec.tokenizer.decode(list(continuation))

    def gather(self, row: Row) -> Completion | None:
        """Take one of the rows of the request coming out (in order); once its last is in, the request's completion:
        its text's scores and its continuations' (an error row where any of its prompts is one)."""
        self._rows.append(row)
        number = row.number // PARTS
        request, encoded = self._requests[number]
        if len(self._rows) < len(encoded.parts):
            return None
        rows, self._rows = self._rows, []
        del self._requests[number]
        prompt = (request.prompt if isinstance(request.prompt, (str, Conversation)) else "" if isinstance(request.prompt, BadPrompt)
                  else self.codec.tokenizer.decode(list(request.prompt)))
        error = next((part for _, part in encoded.parts if isinstance(part, str)), None) or next(
            (row.error for row in rows if row.error is not None), None)
        if error is not None:
            return Completion(number, prompt if isinstance(prompt, str) else "", "", [], 0, "error", error=error)
        length = encoded.text_tokens
        text_scores = rows[0].prompt_scores.part(length)
        continuations = ([ContinuationScore(text, row.prompt_scores.total(length), len(row.prompt_ids) - length,
                                            len(text.encode()), row.prompt_scores.all_greedy(length),
                                            row.prompt_scores.logprobs[length:])
                          for row, text in zip(rows, encoded.continuation_texts)] if encoded.continuation_texts else None)
        return self.codec.scored(number, prompt, encoded.truncated, text_scores if encoded.text_scores else None,
                                 continuations, text_scores.token_ids)
