"""The grammar engine, llguidance, behind three calls: is a structure usable (:func:`structure_problem`; for one
tokenizer, :meth:`GrammarCompiler.problem`), and, for one model's tokenizer, a fresh matcher of a structure
(:meth:`GrammarCompiler.matcher`) whose allowed next tokens fill a row of a bitmask (:func:`fill_row`). The only module
that imports the engine; it is an optional extra, and asking for structure without it is one line naming the extra.

What the checks catch: a structure the engine rejects as written (a keyword it does not implement, a pattern that does
not compile, an unsatisfiable schema), one that admits no text at all (an empty regex, a schema whose ``$ref`` only
loops), one the engine gives up on along the text it is walked through byte by byte (the lowest byte it allows, up to
:data:`WALKED_BYTES`: too many alternatives, too large a repetition), and, for a tokenizer, one whose first character no
token writes. Not caught: a limit the engine meets only on another path, deeper, or with a larger vocabulary, and a
character the vocabulary lacks further in (the row stops there, naming the structure).

A matcher follows one completion token by token and says which tokens may come next: one bit per token of the
logits' width, 32 tokens to an int32 word (the tokens past the tokenizer's own, in a vocabulary padded beyond it,
never). Each distinct structure is compiled once per compiler; a row gets a copy of its compiled matcher, which
costs a microsecond where compiling costs a millisecond or more.
"""

from __future__ import annotations

import functools
import json
import re
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


#: The ``x-guidance`` options of a schema that keep what is written JSON valid against the schema; the engine's
#: others write other JSON (``whitespace_pattern``) or ignore part of the schema (``lenient``, ``coerce_one_of``).
#: Separators are honoured when they are "," and ":" with JSON whitespace around them.
HONOURED_OPTIONS = ("whitespace_flexible", "item_separator", "key_separator", "json_allowed_escapes",
                    "json_allow_general_unicode_escapes")
SEPARATORS = {"item_separator": ",", "key_separator": ":"}

#: Bytes a structure is walked through before any tokenizer is known (:func:`structure_problem`).
WALKED_BYTES = 64


def grammar_of(structure: Structure) -> str:
    """The engine's grammar for ``structure`` (not checked: :func:`structure_problem`). Choices are one regular
    expression, an alternative per text (the engine follows a rule of at most a few thousand alternatives, but a
    regular expression of any number)."""
    matcher = engine().LLMatcher
    if structure.kind in ("json_schema", "json_object"):
        return matcher.grammar_from_json_schema(structure.text, defaults=JSON_OPTIONS)
    if structure.kind == "regex":
        return matcher.grammar_from_regex(structure.text)
    return matcher.grammar_from_regex("(?:" + "|".join(map(_literal, json.loads(structure.text))) + ")")


def _literal(text: str) -> str:
    """``text`` as a regular expression matching it alone: every character but a letter or digit escaped by its code."""
    return "".join(character if character.isascii() and character.isalnum() else f"\\x{{{ord(character):x}}}"
                   for character in text)


@functools.lru_cache(maxsize=4096)
def structure_problem(structure: Structure) -> str | None:
    """Why the engine cannot hold a completion to ``structure`` (a schema keyword it does not implement or an option
    that would write other JSON, a pattern that does not compile, no text it admits, a limit of the engine met), as a
    clause, or None. Needs no tokenizer: checked before any model loads."""
    if problem := _options_problem(structure):
        return problem
    try:
        problem = engine().LLMatcher.validate_grammar(grammar := grammar_of(structure))
    except ValueError as error:
        problem = str(error)
    if not problem:
        return _walk_problem(engine().LLMatcher(_byte_tokenizer(), grammar, log_level=0))
    what = {"regex": "does not compile", "choice": "cannot be matched"}.get(structure.kind, "is not a schema the grammar "
                                                                              "engine supports")
    return f"{what} ({engine_words(problem)})"


def _options_problem(structure: Structure) -> str | None:
    """Why a schema's ``x-guidance`` options would write text that is not JSON valid against it, or None."""
    options = json.loads(structure.text).get("x-guidance") if structure.kind == "json_schema" else None
    if options is None:
        return None
    if not isinstance(options, dict):
        return "has x-guidance that is not an object of the grammar engine's options"
    for name, value in options.items():
        separator = SEPARATORS.get(name)
        if name not in HONOURED_OPTIONS or (separator and not (isinstance(value, str) and
                                                              re.fullmatch(rf"[ \t\n\r]*{separator}[ \t\n\r]*", value))):
            return (f"has x-guidance {name} {json.dumps(value)}, which would write text that is not JSON valid against "
                    f"the schema (separators may be \",\" and \":\" with spaces around them)")
    return None


def _walk_problem(matcher) -> str | None:
    """Why ``matcher`` (on :func:`_byte_tokenizer`) admits no text, or the engine gives up on it, along the text of the
    lowest byte it allows at each step; None when none shows in :data:`WALKED_BYTES` bytes."""
    mask = torch_words(257)
    for step in range(WALKED_BYTES):
        fill_row(matcher, mask)
        allowed = _allowed_bytes(mask)
        if matcher.is_error() and not allowed and not matcher.is_accepting():
            return "admits no text" if step == 0 else "admits no complete text"
        if matcher.is_error():
            return f"is a structure the grammar engine cannot follow ({engine_words(matcher.get_error())})"
        if not allowed:
            return None  # complete: only its end may follow
        if not matcher.consume_token(allowed[0]) or matcher.is_error():
            return f"is a structure the grammar engine cannot follow ({engine_words(matcher.get_error())})"
    return None


@functools.lru_cache(maxsize=1)
def _byte_tokenizer():
    """A tokenizer of the 256 bytes and an end token (256), to follow a structure before the model's is known."""
    class Bytes:
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([byte]) for byte in range(256)] + [b""]

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return engine().LLTokenizer(engine().TokenizerWrapper(Bytes()), n_vocab=257, slices=[])


def engine_words(message: str) -> str:
    """The engine's message as one short line: the parser's own ``error:`` line where it quotes one, else its words
    before the parser's state."""
    errors = [line.strip().removeprefix("error:").strip() for line in message.splitlines() if line.strip().startswith("error:")]
    words = errors[-1] if errors else message.split("<state>")[0]
    return " ".join(words.removeprefix("Parser Error:").removeprefix("lexer error:").split())[:240]


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
        self.special_token_ids = [token for token in tokenizer.all_special_ids if token < self.width]
        self._text_tokens = None  # a mask row of the tokens that write text, made when first asked
        self._compiled: dict[Structure, object] = {}
        self.compile_seconds = 0.0

    def problem(self, structure: Structure) -> str | None:
        """Why rows cannot be held to ``structure`` (checked by :func:`structure_problem`) with this tokenizer: it cannot
        be compiled for it, or no token writes its first character; as a clause, or None."""
        compiled = self._compiled_matcher(structure)
        if compiled.is_error():
            return f"cannot be compiled for this model's tokenizer ({first_error_line(compiled)})"
        matcher, mask = compiled.deep_copy(), torch_words(self.width)
        fill_row(matcher, mask)
        if matcher.is_error():
            return f"is a structure the grammar engine cannot follow ({first_error_line(matcher)})"
        if not self.writes_text(mask) and not matcher.is_accepting():
            return f"admits no text this model's vocabulary can write (no token of it starts {_first_text(structure)})"
        return None

    def writes_text(self, mask_row) -> bool:
        """Whether ``mask_row`` allows a token that writes text (the engine may allow a special token, such as an
        unknown-token marker, that writes none)."""
        if self._text_tokens is None:
            self._text_tokens = torch_words(self.width) - 1  # every bit set
            for token in self.special_token_ids:
                self._text_tokens[token // BITS_PER_WORD] &= ~token_bit(token)
        return bool((mask_row & self._text_tokens).any())

    def matcher(self, structure: Structure):
        """A fresh matcher of ``structure``, at the start of a completion. UsageError with the engine's words when
        it cannot be compiled for this tokenizer (:func:`structure_problem` passed it without one)."""
        compiled = self._compiled_matcher(structure)
        if compiled.is_error():
            raise UsageError(f"The {structure.describe()} cannot be compiled for this model's tokenizer "
                             f"({first_error_line(compiled)}).")
        return compiled.deep_copy()

    def _compiled_matcher(self, structure: Structure):
        """``structure`` compiled for this tokenizer (once; a matcher in its error state where it cannot be)."""
        compiled = self._compiled.get(structure)
        if compiled is None:
            started = time.perf_counter()
            compiled = self._compiled[structure] = engine().LLMatcher(self.tokenizer, grammar_of(structure), log_level=0)
            self.compile_seconds += time.perf_counter() - started
        return compiled


def torch_words(logits_width: int):
    """An empty mask row (int32 CPU tensor) for logits of ``logits_width`` tokens."""
    import torch

    return torch.zeros(mask_words(logits_width), dtype=torch.int32)


def _first_text(structure: Structure) -> str:
    """What a completion held to ``structure`` may start with, as the bytes the engine allows first ("'{'")."""
    matcher = engine().LLMatcher(_byte_tokenizer(), grammar_of(structure), log_level=0)
    mask = torch_words(257)
    fill_row(matcher, mask)
    starts = [repr(chr(byte)) for byte in _allowed_bytes(mask) if byte < 128]
    return " or ".join(starts[:4]) + (" or ..." if len(starts) > 4 else "") if starts else "it"


def _allowed_bytes(mask_row) -> list[int]:
    """The bytes (tokens 0 to 255 of :func:`_byte_tokenizer`) ``mask_row`` allows."""
    words = mask_row.tolist()
    return [byte for byte in range(256) if words[byte // BITS_PER_WORD] >> (byte % BITS_PER_WORD) & 1]


def token_bit(token: int) -> int:
    """The int32 word of a mask row with only ``token``'s bit set, as a Python integer (bit 31 is the sign bit)."""
    bit = 1 << (token % BITS_PER_WORD)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


def fill_row(matcher, mask_row) -> None:
    """Write the tokens ``matcher`` allows next into ``mask_row`` (a contiguous int32 CPU tensor of
    :func:`mask_words` words, a bit per token)."""
    matcher.unsafe_compute_mask_ptr(mask_row.data_ptr(), mask_row.numel() * mask_row.element_size())


def first_error_line(matcher) -> str:
    """A matcher's error, as one line."""
    return engine_words(matcher.get_error())
