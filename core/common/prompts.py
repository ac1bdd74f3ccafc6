"""What makes a text or a conversation usable as a prompt, checked in one place for prompts given on the
command line or to the Python API and for the rows of a dataset."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from accelgen.common.errors import UsageError
from accelgen.common.settings import RowSettings

#: ShareGPT's speakers (``{"from": ..., "value": ...}``) as chat roles; the roles themselves map to themselves.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant", "observation": "tool"}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A prompt made of chat messages (``{"role", "content"}``, in order), rendered by the model's chat template
    with the generation prompt added; one that ends with an assistant message is continued, not answered."""

    messages: tuple[dict, ...]

    @classmethod
    def of_user(cls, text: str) -> "Conversation":
        """``text`` as one user message (``--chat``)."""
        return cls(({"role": "user", "content": text},))

    @property
    def continues_reply(self) -> bool:
        return self.messages[-1]["role"] == "assistant"

    def with_system_prompt(self, text: str | None) -> "Conversation":
        """The conversation with a system message ``text`` first, unless it opens with its own."""
        if text is None or self.messages[0]["role"] == "system":
            return self
        return Conversation(({"role": "system", "content": text}, *self.messages))

    def answered(self, reply: str) -> list[dict]:
        """The messages with the assistant's ``reply`` added (appended to a continued assistant message)."""
        messages = [dict(message) for message in self.messages]
        if self.continues_reply:
            messages[-1]["content"] += reply
        else:
            messages.append({"role": "assistant", "content": reply})
        return messages


def as_conversation(value: object) -> tuple[Conversation | None, str | None]:
    """``value`` (a list of ``{role, content}`` or ShareGPT ``{from, value}`` messages) as a conversation, or
    why it cannot be one, as a clause."""
    if isinstance(value, str):
        return None, ("is a text, not a conversation (a list of {role, content} messages): make it one, e.g. "
                      "[{\"role\": \"user\", \"content\": ...}], or remove that row")
    if not isinstance(value, (list, tuple)) or not value:
        return None, "is not a conversation (a non-empty list of {role, content} messages): fix it, or remove that row"
    messages = []
    for number, message in enumerate(value):
        if isinstance(message, dict) and "from" in message and "role" not in message:  # ShareGPT
            speaker = message.get("from")
            if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
                return None, (f"message {number} is from {speaker!r}, not one of ShareGPT's speakers "
                              f"({', '.join(SHAREGPT_ROLES)}): fix it, or remove that row")
            message = {"role": SHAREGPT_ROLES[speaker], "content": message.get("value")}
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return None, (f"message {number} is not {{role, content}} text (or ShareGPT's {{from, value}}): fix it, "
                          f"or remove that row")
        problem = text_problem(message["content"])
        if problem:
            return None, f"message {number} {problem}"
        messages.append({"role": message["role"], "content": message["content"]})
    if not any(message["content"].strip() for message in messages):
        return None, "is a conversation with no text: give it some, or remove that row"
    return Conversation(tuple(messages)), None


@dataclasses.dataclass(frozen=True)
class BadPrompt:
    """A dataset row that cannot be a prompt, kept in its place (``--skip-bad-rows``): why, as a clause."""

    problem: str


@dataclasses.dataclass(frozen=True)
class PromptRequest:
    """A prompt that brings its own settings (a line of an OpenAI batch file, a dataset row with its own schema):
    ``prompt`` is a text, a conversation, or a BadPrompt (a request that cannot be served: an error row); ``fields``
    are what its output line names it by (``custom_id``, ``url``), handed back with its completion."""

    prompt: str | Conversation | BadPrompt
    settings: RowSettings
    fields: dict | None  # None: the row's output line holds no request (a dataset row held to its own schema)


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """A row to score rather than complete (``accelgen score``): its text (a text, a conversation, or token ids) and
    the continuations scored after it: none (the text alone is scored), one (a continuation's log-likelihood), or
    several ``choices`` ranked by theirs. Each continuation is a text, or token ids going after the text's.
    ``text_scores``: the text's own tokens are scored too (False, with continuations: theirs alone, the model's head
    run on no position of the text, as lm-evaluation-harness needs them)."""

    prompt: str | Conversation | BadPrompt | tuple[int, ...]
    continuations: tuple[str | tuple[int, ...], ...] = ()
    choices: bool = False
    text_scores: bool = True


def prompt_problem(text: object) -> str | None:
    """Why ``text`` cannot be a prompt, with the fix, as a clause ("is empty: give it some text"); None when
    it can. A dataset's missing value is None; bytes that are not UTF-8 reach Python from a shell as lone
    surrogates (their ``surrogateescape`` form). A :class:`Conversation` is checked when it is made."""
    if isinstance(text, (PromptRequest, ScoreRequest)):
        text = text.prompt
    if isinstance(text, tuple) and text and all(isinstance(token, int) for token in text):  # a score request's ids
        return None
    if isinstance(text, Conversation):
        return None
    if isinstance(text, (list, tuple)):  # messages, as the Python API takes them
        return as_conversation(text)[1]
    if isinstance(text, BadPrompt):
        return text.problem
    if text is None:
        return "is null (no text): fill it in, or remove that row"
    if not isinstance(text, str):
        return f"holds {type(text).__name__}, not text: give it text, or choose a text column"
    if not text.strip():
        return "is empty: give it some text, or remove it"
    return text_problem(text)


def text_problem(text: str, escaped_bytes: bool = True) -> str | None:
    """Why ``text`` holds something that is not text, with the fix, as a clause; None when it is all text. Bytes that
    are not UTF-8 reach Python from a shell as surrogates 0xDC80 + byte (their ``surrogateescape`` form); any other
    surrogate alone is half of a UTF-16 pair (a JSON ``\\ud800`` escape without its other half). ``escaped_bytes``
    False: the text was read from JSON, where ``\\udc80`` too is a lone surrogate, not a byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        if escaped_bytes and 0xDC80 <= code <= 0xDCFF:
            return (f"is not UTF-8 text (byte 0x{code & 0xFF:02x} at character {error.start}): convert it to UTF-8, "
                    f"e.g. with iconv -t UTF-8")
        return (f"holds a lone surrogate (U+{code:04X} at character {error.start}, half of a UTF-16 pair without its "
                f"other half, which is no character): remove it, or give it its pair")
    return None


#: What a line refusing a dataset's row adds: the flag that makes it an error row instead.
SKIP_BAD_ROWS = "or pass --skip-bad-rows to write such rows as error rows and go on"


class PromptError(UsageError):
    """A numbered prompt that cannot be completed: "Prompt {number}{rest}". A dataset job names the row and the
    dataset instead (:meth:`in_dataset`), since its prompts are the dataset's rows."""

    def __init__(self, number: int, rest: str):
        super().__init__(f"Prompt {number}{rest}")
        self.number, self.rest = number, rest

    @property
    def problem(self) -> str:
        """The problem alone, as an error row says it ("is empty: give it some text, or remove it")."""
        return self.rest.lstrip(" :").removesuffix(".")

    def in_dataset(self, source: str, column: str) -> UsageError:
        """The same problem, said of row ``number`` of the dataset ``source`` (which ``--skip-bad-rows`` would write
        as an error row)."""
        return UsageError(f"Dataset {source!r} row {self.number} (column {column!r}){self.rest.removesuffix('.')}, "
                          f"{SKIP_BAD_ROWS}.")


def check_prompts(prompts: Sequence[object], first_index: int = 0) -> None:
    """Raise UsageError when there are no ``prompts``, or naming the first (numbered from ``first_index``) that
    cannot be one."""
    if not prompts:
        raise UsageError("No prompts given: pass at least one prompt.")
    for index, prompt in enumerate(prompts, start=first_index):
        problem = prompt_problem(prompt)
        if problem:
            raise PromptError(index, f" {problem}.")
