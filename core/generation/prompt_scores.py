"""Prompt scores: each prompt token's log-probability given the tokens before it, computed in the prefill.

A prefill pass that scores keeps the hidden states the model's head reads at every position it runs
(``ModelForward.final_hidden_states``). The positions whose next token is one of the prompt's are taken, and the head is
applied to a few of them at a time (``LOGITS_AT_ONCE`` values at most), so that the memory stays bounded whatever the
row's length and the vocabulary's width: the whole [tokens, vocabulary] is never held. Each token gets its
log-probability (the log-softmax of the logits before it, in float32, as Hugging Face's forward gives it), whether it is
the model's greedy choice there (the logits' argmax), and its K most likely alternatives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import torch

#: The most logits the head computes at once for prompt scores (16 MiB in float32: a few hundred positions of a
#: vocabulary of tens of thousands, the passes over them kept in the processor's caches).
LOGITS_AT_ONCE = 1 << 22


@dataclasses.dataclass
class PromptScores:
    """A prompt's tokens, scored: for token i, its log-probability given the tokens before it, whether it is the
    model's greedy choice there, and (``top``, where alternatives are asked for) the K most likely tokens there as
    (id, log-probability), best first. Token 0 has nothing before it: None in each. Only tokens from ``scored_from``
    on are scored, and only those from ``greedy_from`` on say whether they are the greedy choice (None before): the
    head runs on no other position (a continuation's tokens alone, where its text's are not asked for)."""

    token_ids: list[int]
    logprobs: list[float | None]
    greedy: list[bool | None]
    top: list[list[tuple[int, float]] | None] | None
    texts: dict[int, str] | None = None  # each token's text (its tokens' and alternatives'), once named
    scored_from: int = 1
    greedy_from: int | None = None  # None: no token's (its length)

    @classmethod
    def unscored(cls, token_ids: list[int], alternatives: int, scored_from: int = 1,
                 greedy_from: int | None = None) -> "PromptScores":
        """The scores of ``token_ids`` before any is computed; ``alternatives``: K (0: none kept); the tokens scored
        from ``scored_from`` on, whether they are the greedy choice from ``greedy_from`` on (None: none)."""
        empty = [None] * len(token_ids)
        return cls(list(token_ids), list(empty), list(empty), list(empty) if alternatives else None, None,
                   scored_from, len(token_ids) if greedy_from is None else greedy_from)

    def fill(self, indices: list[int], logprobs: list[float], greedy: list[bool | None], top_ids: list[list[int]],
             top_logprobs: list[list[float]]) -> None:
        """Set the scores of the tokens at ``indices`` (a pass's; ``greedy`` None where it was not asked)."""
        for place, index in enumerate(indices):
            self.logprobs[index], self.greedy[index] = logprobs[place], greedy[place]
            if self.top is not None:
                self.top[index] = list(zip(top_ids[place], top_logprobs[place]))

    @classmethod
    def from_fields(cls, fields: dict) -> "PromptScores":
        """Scores from their fields read back from JSON (``dataclasses.asdict`` of some): pairs and ids as they were."""
        top = fields["top"]
        texts = fields.get("texts")
        return cls(fields["token_ids"], fields["logprobs"], fields["greedy"],
                   None if top is None else [None if pairs is None else [tuple(pair) for pair in pairs] for pairs in top],
                   None if texts is None else {int(token): text for token, text in texts.items()},
                   fields.get("scored_from", 1), fields.get("greedy_from"))

    def named_top(self) -> list[list[dict] | None]:
        """The alternatives of each token as an output line holds them: ``{"id", "token", "logprob"}``, best first."""
        texts = self.texts or {}
        return [None if top is None else [{"id": token, "token": texts.get(token), "logprob": logprob}
                                          for token, logprob in top] for top in self.top]

    def part(self, end: int) -> "PromptScores":
        """The scores of the first ``end`` tokens."""
        return dataclasses.replace(self, token_ids=self.token_ids[:end], logprobs=self.logprobs[:end],
                                   greedy=self.greedy[:end], top=None if self.top is None else self.top[:end],
                                   greedy_from=min(self.greedy_from, end))

    def total(self, start: int = 1, end: int | None = None) -> float:
        """The sum of the log-probabilities of tokens [start, end) (the log-likelihood of those tokens after the ones
        before them)."""
        return float(sum(self.logprobs[start:end]))

    def perplexity(self) -> float | None:
        """``exp`` of minus the mean log-probability of the tokens after the first; None for one token."""
        scored = len(self.token_ids) - 1
        return math.exp(-self.total() / scored) if scored > 0 else None

    def all_greedy(self, start: int, end: int | None = None) -> bool:
        """Whether every token of [start, end) is the model's greedy choice (the greedy continuation)."""
        return all(self.greedy[start:end])


@dataclasses.dataclass(frozen=True)
class ContinuationScore:
    """A continuation scored after its row's text (``text``: as the row gave it): the sum of its tokens'
    log-probabilities (its log-likelihood), how many tokens and UTF-8 bytes it has (for per-token and per-byte
    rankings), whether every token of it is the model's greedy choice (it is the greedy continuation), and each token's
    log-probability."""

    text: str
    logprob: float
    tokens: int
    bytes: int
    greedy: bool
    token_logprobs: list[float]


def best_of(values: list[float]) -> int:
    """The index of the largest of ``values`` (the first, on a tie): the best of a row's choices."""
    return max(range(len(values)), key=values.__getitem__)


class ScoredPositions(NamedTuple):
    """The positions of a prefill pass whose next token is scored: the hidden states [M, H] there, that next token
    [M], which of the pass's prompts it is of [M] and its index among that prompt's tokens [M]."""

    hidden: torch.Tensor
    targets: torch.Tensor
    prompts: torch.Tensor
    token_indices: torch.Tensor


def padded_positions(hidden: torch.Tensor, input_ids: torch.Tensor, prompt_mask: torch.Tensor, start: int,
                     prompts: int) -> ScoredPositions:
    """The scored positions of a pass over bucket positions [start, start + T) of left-padded prompts input_ids [k, P]
    (mask [k, P]) whose hidden states are ``hidden`` [k, T, H]: every real position of the first ``prompts`` rows (the
    others pad the shape) but each prompt's last, whose next token is the completion's."""
    bucket = input_ids.shape[1]
    positions = torch.arange(start, start + hidden.shape[1], device=input_ids.device)
    scored = prompt_mask[:prompts, start:start + hidden.shape[1]].bool() & (positions < bucket - 1)[None]
    rows, columns = scored.nonzero(as_tuple=True)
    lengths = prompt_mask[:prompts].sum(-1)
    return ScoredPositions(hidden[rows, columns], input_ids[rows, start + columns + 1], rows,
                           start + columns + 1 - (bucket - lengths[rows]))


def packed_positions(hidden: torch.Tensor, input_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     prompts: int) -> ScoredPositions:
    """The scored positions of a pass over left-padded prompts input_ids [k, P] (mask [k, P]) run packed in one row,
    their padding left out (``decoding.run_packed_prompts``), whose hidden states are ``hidden`` [1, N, H]: every token
    of the first ``prompts`` prompts but each one's last."""
    real = prompt_mask.bool()
    rows, length = prompt_mask.shape
    prompt_of = torch.arange(rows, device=input_ids.device)[:, None].expand(rows, length)[real]
    index_in_prompt = (prompt_mask.cumsum(-1) - 1)[real]
    tokens = input_ids[real]
    scored = (prompt_of[:-1] == prompt_of[1:]) & (prompt_of[:-1] < prompts)
    places = scored.nonzero(as_tuple=True)[0]
    return ScoredPositions(hidden[0, places], tokens[places + 1], prompt_of[places], index_in_prompt[places] + 1)


def score_positions(head_logits: Callable[[torch.Tensor], torch.Tensor], positions: ScoredPositions, vocabulary: int,
                    alternatives: int, greedy_wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each scored position's next token's log-probability [M] (float32), whether it is the logits' argmax [M] (where
    ``greedy_wanted`` [M]; False elsewhere), and the ``alternatives`` most likely tokens' ids and log-probabilities
    [M, K]: the head (``head_logits``: hidden states [T, H] -> logits [T, V] over a ``vocabulary`` of V) applied to a
    few positions at a time."""
    hidden, targets = positions.hidden, positions.targets
    count = hidden.shape[0]
    logprobs = torch.zeros(count, dtype=torch.float32, device=hidden.device)
    greedy = torch.zeros(count, dtype=torch.bool, device=hidden.device)
    top_ids = torch.zeros(count, alternatives, dtype=torch.long, device=hidden.device)
    top_logprobs = torch.zeros(count, alternatives, dtype=torch.float32, device=hidden.device)
    step = max(1, LOGITS_AT_ONCE // vocabulary)
    for first in range(0, count, step):
        end = min(count, first + step)
        logits = head_logits(hidden[first:end]).float()
        log_softmax = logits.log_softmax(-1)
        logprobs[first:end] = log_softmax.gather(1, targets[first:end, None])[:, 0]
        wanted = greedy_wanted[first:end]
        if bool(wanted.any()):  # the first largest, as argmax takes it; a pass over the logits: only where asked
            greedy[first:end][wanted] = logits[wanted].max(-1).indices == targets[first:end][wanted]
        if alternatives:
            best = log_softmax.topk(min(alternatives, logits.shape[-1]), dim=-1)
            top_ids[first:end, :best.indices.shape[1]], top_logprobs[first:end, :best.values.shape[1]] = best.indices, best.values
    return logprobs, greedy, top_ids, top_logprobs
