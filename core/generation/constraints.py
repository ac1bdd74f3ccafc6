"""The host side of the slots' constraints: each slot's row's grammar state, and the bitmask of the tokens each slot
may take next, which the runner copies into the decode step's fixed-shape mask input before a step.

A row with a structure (``RowSettings.structure``) follows it token by token in a matcher of the grammar engine
(``accelgen.generation.grammars``): the first token, drawn by the prefill under the grammar's first mask, then every
token a decode step chooses, read back after the step. A row of a reasoning model (``reasoning.ThinkMarkers``) may
think first: while it thinks every token but the end of a sequence is allowed, and its grammar starts after the
close marker. A row without a structure, and a slot without a row, allow every token (a row of all ones), so that
rows without constraints choose what they would without the mask. A row's end-of-sequence tokens are allowed only
where its grammar may end (not as text inside it, where a model's end token is a word); once its grammar is complete
its mask allows only them, and they end the row in the step as the model's own end does.

Shapes: B slots, W words of 32 tokens (``grammars.mask_words`` of the compiler's width); a mask is int32 [rows, W],
-1 (every bit set) where every token is allowed.
"""

from __future__ import annotations

import dataclasses

import torch

from accelgen.common.prompts import PromptError
from accelgen.common.structure import Structure
from accelgen.generation import grammars
from accelgen.generation.reasoning import ThinkMarkers
from accelgen.generation.scheduler import Row

ALL_TOKENS = -1  # a word of a mask row with every bit set


@dataclasses.dataclass
class RowGrammar:
    """One running row's place in its structure: ``phase`` "thinking" (no grammar yet), "may_think" (its first
    token may open its thinking or start its answer), "grammar" (``matcher`` follows the answer) or "ended"."""

    row: Row  # the row, which its prompt number names in errors
    structure: Structure
    phase: str
    matcher: object | None = None


class SlotConstraints:
    """The constraints of ``slots`` slots for one model: ``compiler`` (``grammars.GrammarCompiler``) makes the
    matchers, ``markers`` are the model's thinking markers (None: it does not think). A row its grammar engine stops
    following (a token its mask did not allow, a character next that no token writes, a limit of the engine) stops the
    run; with ``errors_as_rows`` (--skip-bad-rows), a row of one sample becomes an error row instead: its mask allows
    only its end from there."""

    def __init__(self, compiler: grammars.GrammarCompiler, slots: int, markers: ThinkMarkers | None,
                 errors_as_rows: bool = False):
        self.compiler, self.markers, self.errors_as_rows = compiler, markers, errors_as_rows
        words = grammars.mask_words(compiler.width)
        self.mask = torch.full((slots, words), ALL_TOKENS, dtype=torch.int32)  # [B, W]: what each slot may take next
        self.changed = False  # the mask changed since the runner last copied it to the device
        self._rows: dict[int, RowGrammar] = {}  # by slot: the running rows with a structure
        self._all_but_end = _without(torch.full((words,), ALL_TOKENS, dtype=torch.int32), compiler.eos_token_ids)
        self._end_only = _with(torch.zeros(words, dtype=torch.int32), compiler.eos_token_ids)
        self._first_masks: dict[Structure, torch.Tensor] = {}  # each structure's mask of its first token [W]
        self.rows_started = 0  # rows with a structure started so far

    @property
    def active(self) -> bool:
        """Whether a slot holds a row whose grammar follows its tokens: then every decode step's tokens are read
        back (:meth:`advance`) before the next one runs."""
        return bool(self._rows)

    @property
    def compile_seconds(self) -> float:
        return self.compiler.compile_seconds

    def first_masks(self, rows: list[Row], prompt_ids: list[list[int]]) -> torch.Tensor:
        """The masks [len(rows), W] of the rows' first tokens, drawn by their prompts' (``prompt_ids``) prefill."""
        masks = torch.full((len(rows), self.mask.shape[1]), ALL_TOKENS, dtype=torch.int32)
        for place, (row, ids) in enumerate(zip(rows, prompt_ids)):
            structure = row.settings.structure
            if structure is not None:
                masks[place] = self._mask_for(self._first_phase(ids), structure)
        return masks

    def start(self, slot: int, row: Row, first_token: int) -> None:
        """``row`` starts in ``slot`` with ``first_token``: its grammar follows it from there (a row without a
        structure, or with no token after its first, allows every token)."""
        self.release(slot)
        structure = row.settings.structure
        if structure is None:
            return
        self.rows_started += 1
        if row.settings.max_new_tokens <= 1:  # it has ended: its slot computes padding until it is read back
            return
        grammar = self._rows[slot] = RowGrammar(row, structure, self._first_phase(row.prompt_ids))
        if grammar.phase == "grammar":
            grammar.matcher = self.compiler.matcher(structure)
        elif grammar.phase == "thinking":
            self._set(slot, self._all_but_end)
        self._follow(slot, grammar, first_token)

    def advance(self, tokens: list[int], finished: list[bool]) -> None:
        """After a decode step: each slot's chosen token (``tokens`` [B], read back) joins its row's grammar, and
        the mask says what may come next; rows that have ended (``finished`` [B]) are let go."""
        for slot, grammar in list(self._rows.items()):
            self._follow(slot, grammar, tokens[slot])
            if finished[slot]:
                self.release(slot)

    def release(self, slot: int) -> None:
        """``slot`` holds no constrained row any more: every token allowed there."""
        if self._rows.pop(slot, None) is not None:
            self.mask[slot] = ALL_TOKENS
            self.changed = True

    def _follow(self, slot: int, grammar: RowGrammar, token: int) -> None:
        """``token`` joins the row in ``slot``; its mask row says what may follow."""
        if grammar.phase == "may_think":
            if token == self.markers.open_id:
                grammar.phase = "thinking"
                self._set(slot, self._all_but_end)
                return
            grammar.phase, grammar.matcher = "grammar", self.compiler.matcher(grammar.structure)
        elif grammar.phase == "thinking":
            if token == self.markers.close_id:  # its answer starts: its grammar from the first token
                grammar.phase, grammar.matcher = "grammar", self.compiler.matcher(grammar.structure)
                self._set(slot, self._mask_for("grammar", grammar.structure))
            return
        if grammar.phase == "ended":
            return
        matcher = grammar.matcher
        if not matcher.consume_token(token) or matcher.is_error():
            return self._fail(slot, grammar, f"the grammar engine stopped following its {grammar.structure.describe()} "
                                             f"({grammars.first_error_line(matcher) or 'a token it does not allow'})")
        if matcher.is_stopped() and token in self.compiler.eos_token_ids:
            grammar.phase = "ended"  # its mask stays as it was: its end only
            return
        grammars.fill_row(matcher, self.mask[slot])
        if not matcher.is_accepting():  # an end token whose text the grammar takes (a word) must not end the row here
            self.mask[slot] &= self._all_but_end
            if not self.compiler.writes_text(self.mask[slot]):  # what the grammar takes next, no token writes
                return self._fail(slot, grammar, f"its {grammar.structure.describe()} needs a character next that no "
                                                 f"token of this model's vocabulary writes; use a model whose vocabulary "
                                                 f"writes it, or another structure")
        self.changed = True

    def _fail(self, slot: int, grammar: RowGrammar, problem: str) -> None:
        """The row in ``slot`` cannot follow its grammar any further, for ``problem`` (a clause with its fix): an error
        row ending at its next token (``errors_as_rows``, a row of one sample), else the run stops naming it."""
        row = grammar.row
        if not self.errors_as_rows or row.settings.num_samples > 1:  # a prompt's samples come out together
            raise PromptError(row.number, f": {problem}.")
        row.error, grammar.phase = problem, "ended"
        self._set(slot, self._end_only)

    def _first_phase(self, prompt_ids: list[int]) -> str:
        """Where a row's grammar stands at its first token, given its prompt."""
        opened = None if self.markers is None else self.markers.opened_by(prompt_ids)
        return {True: "thinking", False: "grammar", None: "grammar" if self.markers is None else "may_think"}[opened]

    def _mask_for(self, phase: str, structure: Structure) -> torch.Tensor:
        """The mask row [W] of a row's first token in ``phase`` (its grammar's first tokens; and the opening of its
        thinking where it may think; every token but the end while it thinks)."""
        if phase == "thinking":
            return self._all_but_end
        if structure not in self._first_masks:
            first, matcher = torch.zeros(self.mask.shape[1], dtype=torch.int32), self.compiler.matcher(structure)
            grammars.fill_row(matcher, first)
            self._first_masks[structure] = first if matcher.is_accepting() else first & self._all_but_end
        first = self._first_masks[structure]
        return _with(first, [self.markers.open_id]) if phase == "may_think" else first

    def _set(self, slot: int, mask_row: torch.Tensor) -> None:
        self.mask[slot] = mask_row
        self.changed = True


def _with(mask_row: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """``mask_row`` [W] with ``tokens`` allowed too."""
    mask_row = mask_row.clone()
    for token in tokens:
        mask_row[token // grammars.BITS_PER_WORD] |= grammars.token_bit(token)
    return mask_row


def _without(mask_row: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """``mask_row`` [W] with ``tokens`` not allowed."""
    for token in tokens:
        mask_row[token // grammars.BITS_PER_WORD] &= ~grammars.token_bit(token)
    return mask_row

