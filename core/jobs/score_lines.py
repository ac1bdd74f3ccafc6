"""The output lines of ``accelgen score``: each row's scores (:mod:`accelgen.generation.scoring`) as one JSON line.

A line holds the row's ``index``, its ``prompt`` (and its ``continuation`` or ``choices``, as the row gave them),
``prompt_tokens``, ``prompt_logprob`` (the sum of the log-probabilities of its tokens after the first) and
``perplexity`` (``exp`` of minus their mean); with token scores, each token's id, log-probability (the first null)
and most likely alternatives; with a continuation, its log-likelihood after the text, its tokens and whether it is
the model's greedy continuation; with choices, each one's log-likelihood, tokens and UTF-8 bytes in the row's order,
and the best by the sum, per token and per byte. Lines are resumable as ``accelgen run``'s are (the same digest of
what stands for the row); an error row says why in ``error``, its scores null.
"""

from __future__ import annotations

import dataclasses
import json

from accelgen.common.prompts import PromptRequest, ScoreRequest
from accelgen.generation.prompt_scores import best_of
from accelgen.generation.text import Completion
from accelgen.jobs.completion_file import CompletionLines
from accelgen.jobs.prompt_digest import with_digest

#: What a line of each kind of score row holds beyond the text's scores.
SCORE_KINDS = ("text", "continuation", "choices")


@dataclasses.dataclass(frozen=True)
class ScoreLines(CompletionLines):
    """The lines of a score job whose rows are ``kind`` (one of :data:`SCORE_KINDS`); ``token_logprobs``: each token's
    scores are written, with that many alternatives (None: the sums alone)."""

    kind: str = "text"
    token_logprobs: int | None = None

    def line(self, completion: Completion) -> dict:
        line = {"index": completion.index, "prompt": completion.prompt}
        continuations = completion.continuations or []
        if self.kind == "continuation" and continuations:
            line["continuation"] = continuations[0].text
        elif self.kind == "choices" and continuations:
            line["choices"] = [choice.text for choice in continuations]
        if completion.finish_reason == "error":
            return with_digest({**line, "prompt_tokens": None, "prompt_logprob": None, "perplexity": None,
                                "finish_reason": "error", "error": completion.error})
        scores = completion.prompt_scores
        line.update(prompt_tokens=len(scores.token_ids), prompt_logprob=scores.total(), perplexity=scores.perplexity())
        if self.token_logprobs is not None:
            line.update(tokens=scores.token_ids, token_logprobs=scores.logprobs)
            if scores.top is not None:
                line["top_logprobs"] = scores.named_top()
        if self.kind == "continuation":
            [continuation] = continuations
            line.update(continuation_logprob=continuation.logprob, continuation_tokens=continuation.tokens,
                        continuation_greedy=continuation.greedy)
        elif self.kind == "choices":
            sums = [choice.logprob for choice in continuations]
            line.update(choice_logprobs=sums, choice_tokens=[choice.tokens for choice in continuations],
                        choice_bytes=[choice.bytes for choice in continuations],
                        best_choice=best_of(sums),
                        best_choice_per_token=best_of([choice.logprob / choice.tokens for choice in continuations]),
                        best_choice_per_byte=best_of([choice.logprob / max(choice.bytes, 1) for choice in continuations]))
        return with_digest({**line, "finish_reason": "scored"})

    @staticmethod
    def problem(line: object, index: int) -> str | None:
        """Why a written ``line`` (parsed) is not the scores of row ``index`` written by ``accelgen score``, or None."""
        if not isinstance(line, dict) or not {"index", "prompt", "prompt_logprob", "finish_reason"} <= set(line):
            return "is not a row's scores written by accelgen score (its fields: index, prompt, prompt_logprob, ...)"
        written = line["index"]
        if not isinstance(written, int) or isinstance(written, bool):
            return f"has index {json.dumps(written)}, not a whole row number (row {index} is expected there)"
        return None if written == index else f"is row {written}, not row {index}"

    @staticmethod
    def request_key(text: object) -> object:
        if isinstance(text, (ScoreRequest, PromptRequest)):
            return text.prompt
        return text

    @staticmethod
    def error_rows_line(error_rows: int, rows: int, where: str) -> str:
        return (f"{error_rows} of {rows} rows could not be scored and were written as error rows{where} "
                f"(finish_reason \"error\", with the reason in \"error\")")

    @staticmethod
    def every_row_failed_line(rows: int, where: str) -> str:
        none = f"none of the {rows} rows could be scored: each was" if rows > 1 else "the one row could not be scored: it was"
        return f"{none} written as an error row{where} (finish_reason \"error\", the reason in \"error\")"
