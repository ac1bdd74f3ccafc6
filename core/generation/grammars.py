"""The grammar engine, llguidance, behind three calls: is a structure usable (:func:`structure_problem`), and, for one
model's tokenizer, a fresh matcher of a structure (:meth:`GrammarCompiler.matcher`) whose allowed next tokens fill a
row of a bitmask (:func:`fill_row`). The only module that imports the engine; it is an optional extra, and asking
for structure without it is one line naming the extra.

A matcher follows one completion token by token and says which tokens may come next: one bit per token of the
logits' width, 32 tokens to an int32 word (the tokens past the tokenizer's own, in a vocabulary padded beyond it,
never). Each distinct structure is compiled once per compiler; a row gets a copy of its compiled matcher, which
costs a microsecond where compiling costs a millisecond or more.
"""

from __future__ import annotations

import functools
import time

from accelgen.common.errors import UsageError
from accelgen.common.structure import Structure

ENGINE_MISSING = ('Structured output (--json-schema, --json, --regex, --choice, --schema-column, a batch request\'s '
                  'response_format) needs the llguidance grammar engine, which is not installed: '
                  'pip install "accelgen[structured]".')

#: How JSON is written: no whitespace a schema does not ask for, "," and ":" between items (a model left free to
#: write whitespace can go on writing it until its budget ends). A schema's own "x-guidance" options come after.
JSON_OPTIONS = {"whitespace_flexible": False}

#: Bits (tokens) per word of a bitmask row.
BITS_PER_WORD = 32


def mask_words(logits_width: int) -> int:
    """Words in a bitmask row for logits of ``logits_width`` tokens."""
    return -(-logits_width // BITS_PER_WORD)


def engine():
    """The llguidance module; UsageError naming the extra when it is not installed."""
    try:
        import llguidance
    except ImportError:
        raise UsageError(ENGINE_MISSING) from None
    return llguidance


def grammar_of(structure: Structure) -> str:
    """The engine's grammar for ``structure`` (not checked: :func:`structure_problem`)."""
    matcher = engine().LLMatcher
    if structure.kind in ("json_schema", "json_object"):
        return matcher.grammar_from_json_schema(structure.text, defaults=JSON_OPTIONS)
    if structure.kind == "regex":
        return matcher.grammar_from_regex(structure.text)
    return engine().grammar_from("choice", structure.text)


@functools.lru_cache(maxsize=4096)
def structure_problem(structure: Structure) -> str | None:
    """Why the engine cannot hold a completion to ``structure`` (a schema keyword it does not implement, a pattern
    that does not compile), as a clause, or None. Needs no tokenizer: checked before any model loads."""
    try:
        problem = engine().LLMatcher.validate_grammar(grammar_of(structure))
    except ValueError as error:
        problem = str(error)
    if not problem:
        return None
    what = {"regex": "does not compile", "choice": "cannot be matched"}.get(structure.kind, "is not a schema the grammar "
                                                                              "engine supports")
    return f"{what} ({engine_words(problem)})"


def engine_words(message: str) -> str:
    """The engine's message as one short line: the parser's own ``error:`` line where it quotes one, else all of it."""
    errors = [line.strip().removeprefix("error:").strip() for line in message.splitlines() if line.strip().startswith("error:")]
    return (errors[-1] if errors else " ".join(message.split()))[:240]


class GrammarCompiler:
    """Matchers for one tokenizer, over logits of ``logits_width`` tokens, ending at ``eos_token_ids`` (the tokens
    a matcher allows once its grammar is complete). Counts the seconds spent compiling. Its masks are ``width`` tokens
    wide: the logits', or the tokenizer's where it has more tokens than the model's logits (those are never chosen)."""

    def __init__(self, tokenizer, logits_width: int, eos_token_ids: list[int]):
        engine()
        import llguidance.hf

        self.width = max(logits_width, len(tokenizer))
        eos = [token for token in eos_token_ids if token < logits_width] or None
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.width, eos_token=eos)
        except ValueError as error:  # a slow (Python) tokenizer
            raise UsageError(f"Structured output needs a fast tokenizer (tokenizer.json), and this model's is "
                             f"{type(tokenizer).__name__} ({error}): convert it, or run without a structure.") from None
        self.eos_token_ids = list(self.tokenizer.eos_tokens)
        self._compiled: dict[Structure, object] = {}
        self.compile_seconds = 0.0

    def matcher(self, structure: Structure):
        """A fresh matcher of ``structure``, at the start of a completion. UsageError with the engine's words when
        it cannot be compiled for this tokenizer (:func:`structure_problem` passed it without one)."""
        compiled = self._compiled.get(structure)
        if compiled is None:
            started = time.perf_counter()
            compiled = engine().LLMatcher(self.tokenizer, grammar_of(structure), log_level=0)
            self.compile_seconds += time.perf_counter() - started
            if compiled.is_error():
                raise UsageError(f"The {structure.describe()} cannot be compiled for this model's tokenizer "
                                 f"({first_error_line(compiled)}).")
            self._compiled[structure] = compiled
        return compiled.deep_copy()


def fill_row(matcher, mask_row) -> None:
    """Write the tokens ``matcher`` allows next into ``mask_row`` (a contiguous int32 CPU tensor of
    :func:`mask_words` words, a bit per token)."""
    matcher.unsafe_compute_mask_ptr(mask_row.data_ptr(), mask_row.numel() * mask_row.element_size())


def first_error_line(matcher) -> str:
    """A matcher's error, as one line."""
    return engine_words(matcher.get_error())
