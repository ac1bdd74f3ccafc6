"""Text in and out of the generator: prompts (texts or conversations) become token ids (checked, truncated),
new token ids become completions. The generator itself works on token ids only.

A conversation is rendered and tokenized by the tokenizer's chat template in one call
(``apply_chat_template(tokenize=True)``), so its ids are the tokenizer's own: no second BOS from tokenizing
rendered text again. A reasoning model's thinking (``reasoning.ThinkMarkers``) is decoded apart from its answer."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from accelgen.common.errors import UsageError, first_line
from accelgen.common.prompts import Conversation, PromptError, PromptRequest, as_conversation, check_prompts
from accelgen.common.settings import ChatSettings, RunSettings
from accelgen.generation.prompt_scores import ContinuationScore, PromptScores
from accelgen.generation.reasoning import ThinkMarkers
from accelgen.generation.scheduler import Row

#: The fields of a :class:`Completion` its output line holds only when they are set.
OPTIONAL_FIELDS = ("messages", "error", "logprobs", "completions", "request", "reasoning", "adapter")
#: The fields of a :class:`Completion` an output line never holds as they are (``as_row`` writes what they say).
SCORE_FIELDS = ("prompt_scores", "continuations")


@dataclasses.dataclass
class Completion:
    """One prompt's result. ``prompt`` is the text the model saw (the kept tokens, when truncated);
    ``completion`` is the new text only (a reasoning model's answer, its thinking in ``reasoning``); ``index`` the
    prompt's position (its row in a dataset)."""

    index: int
    prompt: str
    completion: str
    completion_token_ids: list[int]
    prompt_token_count: int
    finish_reason: str  # "eos" (the model ended it), "stop" (a stop text did), "length" (max_new_tokens reached),
    # or "error" (the prompt could not be completed: ``error`` says why; --skip-bad-rows)
    messages: list[dict] | None = None  # a conversation's messages with the assistant's reply added
    error: str | None = None
    logprobs: list[float] | None = None  # each new token's log-probability under the model, with --logprobs
    completions: list[dict] | None = None  # with --num-samples N > 1: every sample's own fields (the row's are the first's)
    request: dict | None = None  # a prompt request's fields (an OpenAI batch line's custom_id and url)
    reasoning: str | None = None  # a reasoning model's thinking, between its markers (the completion is its answer)
    adapter: str | None = None  # the LoRA adapter it was completed with, by name (None: the base model)
    #: its prompt's tokens scored (``--prompt-logprobs``; a score row's text), with the texts of the tokens named
    prompt_scores: PromptScores | None = None
    continuations: list[ContinuationScore] | None = None  # a score row's continuations, scored (``accelgen score``)

    def as_row(self) -> dict:
        """The completion as an output line's fields (those of :data:`OPTIONAL_FIELDS` only when they hold
        something: ``messages`` for a conversation, ``error`` for an error row, ``logprobs`` when recorded,
        ``completions`` with several samples; ``prompt_logprobs`` (and ``prompt_top_logprobs``) with prompt scores)."""
        row = {name: value for name, value in dataclasses.asdict(
            dataclasses.replace(self, prompt_scores=None, continuations=None)).items()
            if (value is not None or name not in OPTIONAL_FIELDS) and name not in SCORE_FIELDS}
        if self.prompt_scores is not None:
            row.update(prompt_token_ids=self.prompt_scores.token_ids, prompt_logprobs=self.prompt_scores.logprobs)
            if self.prompt_scores.top is not None:
                row["prompt_top_logprobs"] = self.prompt_scores.named_top()
        return row

    @classmethod
    def from_fields(cls, fields: dict) -> "Completion":
        """A completion from ``dataclasses.asdict`` of one, read back from JSON (rows handed between replicas)."""
        scores, continuations = fields.get("prompt_scores"), fields.get("continuations")
        return cls(**{**fields, "prompt_scores": None if scores is None else PromptScores.from_fields(scores),
                      "continuations": None if continuations is None
                      else [ContinuationScore(**continuation) for continuation in continuations]})

    @classmethod
    def of_samples(cls, samples: list["Completion"]) -> "Completion":
        """One prompt's completion from its samples (in order): the first's fields, and with several, each
        sample's completion, tokens, finish reason (and log-probabilities) in ``completions``."""
        if len(samples) == 1:
            return samples[0]
        own = ("completion", "completion_token_ids", "finish_reason", "logprobs", "reasoning")
        listed = [{name: getattr(sample, name) for name in own if getattr(sample, name) is not None} for sample in samples]
        return dataclasses.replace(samples[0], completions=listed)



@dataclasses.dataclass(frozen=True)
class SampleCompletion:
    """One sample's completion of its prompt, given out as its row ends: sample ``sample`` of the prompt's ``samples``
    (a prompt without ``--num-samples`` is sample 0 of 1)."""

    completion: Completion
    sample: int
    samples: int

    @property
    def ends_prompt(self) -> bool:
        return self.sample == self.samples - 1


class PromptSamples:
    """Samples, given out in order, gathered into their prompts' completions (:meth:`Completion.of_samples`); the
    first prompt's first samples may be ``kept`` ones (a stopped run's), the others then following them."""

    def __init__(self, kept: Sequence[Completion] = ()):
        self.gathered: list[Completion] = list(kept)  # of the prompt whose samples are coming out

    def add(self, sample: SampleCompletion) -> Completion | None:
        """Gather ``sample``; its prompt's completion once it is the prompt's last sample, else None."""
        del self.gathered[sample.sample:]  # the samples before it, and only those
        self.gathered.append(sample.completion)
        if not sample.ends_prompt:
            return None
        completion, self.gathered = Completion.of_samples(self.gathered), []
        return completion


def no_chat_template(chat: ChatSettings) -> str:
    """The line refusing conversations on a model whose tokenizer has no chat template: what to pass, and with
    ``--chat`` given (``chat.text_as_user``), that text prompts run without it."""
    instead = "or complete the text prompts without --chat" if chat.text_as_user else "or complete a column of text"
    return (f"This model's tokenizer has no chat template to render conversations with: pass --chat-template FILE "
            f"(a Jinja template), {instead}.")


class PromptCodec:
    """Encodes prompts for one model and decodes its completions, with ``tokenizer``, as ``run`` says (its
    ``max_input_tokens``, ``chat`` and ``stop``); ``markers``: the model's thinking markers (None: it does not think);
    ``end_token_ids``: the tokens that end a sequence (one that closes a row's structure is not part of its text)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, run: RunSettings,
                 markers: ThinkMarkers | None = None, end_token_ids: Sequence[int] = ()):
        self.tokenizer, self.vocab_size, self.max_input_tokens = tokenizer, vocab_size, run.max_input_tokens
        self.chat, self.markers, self.end_token_ids = run.chat, markers, set(end_token_ids)

    def conversation(self, prompt: str | Conversation) -> Conversation | None:
        """The conversation ``prompt`` is (a list of messages is one; a text is one with ``--chat``), with the
        system prompt; None for text."""
        if isinstance(prompt, PromptRequest):
            prompt = prompt.prompt
        if isinstance(prompt, (list, tuple)):
            prompt = as_conversation(prompt)[0]  # checked already (check_prompts)
        if isinstance(prompt, str):
            if not self.chat.text_as_user:
                if self.chat.system_prompt is not None:
                    raise UsageError("--system-prompt goes with conversations: add --chat to make each text prompt "
                                     "one user message, or complete a column of messages.")
                return None
            prompt = Conversation.of_user(prompt)
        return prompt.with_system_prompt(self.chat.system_prompt)

    def encode(self, prompts: Sequence[str | Conversation], first_index: int = 0) -> tuple[list[list[int]], list[bool]]:
        """Token ids per prompt, truncated to their first ``max_input_tokens`` tokens, and which prompts were
        truncated (a conversation is refused instead: cutting it would cut its generation prompt).
        ``first_index`` is the first prompt's number, for error messages."""
        check_prompts(prompts, first_index)
        limit = self.max_input_tokens
        token_ids, truncated = [], []
        for index, prompt in enumerate(prompts, start=first_index):
            conversation = self.conversation(prompt)
            if isinstance(prompt, PromptRequest):
                prompt = prompt.prompt
            if conversation is None:
                ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            else:
                ids = self._conversation_ids(conversation, index)
                if limit is not None and len(ids) > limit:
                    raise PromptError(index, f" makes {len(ids)} tokens with its chat template, over --max-input-tokens "
                                             f"{limit}: shorten the conversation, or raise --max-input-tokens.")
            truncated.append(limit is not None and len(ids) > limit)
            token_ids.append(ids[:limit] if limit is not None else ids)
        for index, ids in enumerate(token_ids, start=first_index):
            if not ids:
                raise UsageError(f"Prompt {index} makes no tokens: give it some text (or drop that row from the dataset).")
            if max(ids) >= self.vocab_size:
                raise UsageError(
                    f"Prompt {index} has token id {max(ids)}, outside the model's vocabulary of {self.vocab_size}: "
                    f"the tokenizer does not belong to this model."
                )
        return token_ids, truncated

    def encode_row(self, number: int, prompt: str | Conversation, errors_as_rows: bool) -> tuple[list[int] | str, bool]:
        """One prompt's ids and whether they were truncated; with ``errors_as_rows``, a prompt that cannot be
        completed gives its problem (a string: an error row) instead of stopping the run."""
        try:
            [ids], [truncated] = self.encode([prompt], first_index=number)
        except PromptError as error:
            if not errors_as_rows:
                raise
            return error.problem, False
        return ids, truncated

    def _conversation_ids(self, conversation: Conversation, number: int) -> list[int]:
        """The ids of ``conversation`` rendered by the chat template (``--chat-template``, else the tokenizer's)."""
        template = self.chat.template or self.tokenizer.chat_template
        if template is None:
            raise UsageError(no_chat_template(self.chat))
        continues = conversation.continues_reply
        try:
            encoded = self.tokenizer.apply_chat_template(
                list(conversation.messages), chat_template=template, tokenize=True, return_dict=True,
                add_generation_prompt=not continues, continue_final_message=continues, **(self.chat.template_kwargs or {}))
        except Exception as error:  # noqa: BLE001 - a template's own refusal (raise_exception) or a Jinja error
            import jinja2

            if isinstance(error, jinja2.TemplateSyntaxError):  # the template's fault, whatever the row
                raise UsageError(f"The chat template line {error.lineno} is not valid Jinja ({error.message}): fix it, "
                                 f"or pass another chat template.") from None
            raise PromptError(number, f": the chat template cannot render it ({first_line(error)}); fix the "
                                      f"conversation, or pass another --chat-template.") from None
        return list(encoded["input_ids"])

    def new_text(self, prompt_token_ids: list[int], new_token_ids: list[int]) -> str:
        """The text ``new_token_ids`` add to the prompt: decoded together, so that word boundaries (e.g.
        SentencePiece spaces) come out right."""
        prompt_text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=True)
        return self.tokenizer.decode(list(prompt_token_ids) + new_token_ids, skip_special_tokens=True)[len(prompt_text):]

    def tokens_to_stop(self, prompt_token_ids: list[int], new_token_ids: list[int], stop: Sequence[str]) -> int | None:
        """How many of ``new_token_ids`` it takes for their text to hold one of the ``stop`` texts (the token
        completing it included), or None when it holds none. Where a stop is found depends only on the tokens,
        not on when the host looked at them."""
        if not stop or _stop_at(self.new_text(prompt_token_ids, new_token_ids), stop) is None:
            return None
        low, high = 1, len(new_token_ids)  # the shortest prefix whose text holds a stop text
        while low < high:
            middle = (low + high) // 2
            if _stop_at(self.new_text(prompt_token_ids, new_token_ids[:middle]), stop) is None:
                low = middle + 1
            else:
                high = middle
        return low

    def completion(self, row: Row, prompt: str | Conversation, truncated: bool, new_token_ids: list[int],
                   finish_reason: str) -> Completion:
        """The completion of ``row`` (its ``prompt``) from its kept new token ids (its text cut before the stop
        text, when a stop text ended it); its error row when the row could not be completed."""
        index, prompt_token_ids = row.number, row.prompt_ids
        request = None
        if isinstance(prompt, PromptRequest):
            prompt, request = prompt.prompt, prompt.fields
        if row.error is not None:
            return Completion(index, prompt if isinstance(prompt, str) else "", "", [], 0, "error", error=row.error,
                              request=request)
        prompt_text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=True)
        text_ids = new_token_ids
        if finish_reason == "stop" and row.settings.structure is not None and new_token_ids[-1:] and \
                new_token_ids[-1] in self.end_token_ids:  # its grammar's end: a model's end token may be a word
            text_ids = new_token_ids[:-1]
        reasoning, text = self._reasoning_and_answer(prompt_token_ids, text_ids)
        if finish_reason == "stop":
            reasoning, text = (None if part is None else part[: _stop_at(part, row.settings.stop)] for part in (reasoning, text))
        conversation = self.conversation(prompt)
        if conversation is not None:  # what the model saw: the rendered template, its markers included
            prompt = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        return Completion(
            index=index,
            prompt=prompt_text if truncated else prompt,  # what the model saw
            completion=text,
            completion_token_ids=new_token_ids,
            prompt_token_count=len(prompt_token_ids),
            finish_reason=finish_reason,
            messages=None if conversation is None else conversation.answered(text),
            logprobs=None if row.logprobs is None else row.logprobs[: len(new_token_ids)],
            request=request,
            reasoning=reasoning,
            adapter=row.settings.adapter,
            prompt_scores=None if row.prompt_scores is None else self.named(row.prompt_scores),
        )

    def scored(self, number: int, prompt: str | Conversation, truncated: bool, text_scores: PromptScores | None,
               continuations: list | None, text_ids: list[int]) -> Completion:
        """The completion of score request ``number`` (its text's tokens ``text_ids``): its text's scores (named; None
        where only its continuations were scored), its ``continuations``' scores; ``prompt``: the text the model saw,
        as :meth:`completion` gives it."""
        prompt_text = self.tokenizer.decode(text_ids, skip_special_tokens=not isinstance(prompt, Conversation))
        return Completion(number, prompt_text if truncated or not isinstance(prompt, str) else prompt, "", [],
                          len(text_ids), "scored", prompt_scores=None if text_scores is None else self.named(text_scores),
                          continuations=continuations)

    def named(self, scores: PromptScores) -> PromptScores:
        """``scores`` with the texts of their tokens and alternatives (each token decoded alone)."""
        if scores.top is None:  # only alternatives are written with their texts
            return scores
        ids = set(scores.token_ids) | {token for top in scores.top if top for token, _ in top}
        return dataclasses.replace(scores, texts={token: self.tokenizer.decode([token]) for token in ids})

    def _reasoning_and_answer(self, prompt_token_ids: list[int], new_token_ids: list[int]) -> tuple[str | None, str]:
        """The text of the thinking among ``new_token_ids`` (None when they hold none) and of the answer after it."""
        span = None if self.markers is None else self.markers.thinking_span(prompt_token_ids, new_token_ids)
        if span is None:
            return None, self.new_text(prompt_token_ids, new_token_ids)
        start, end = span
        return (self.new_text(prompt_token_ids + new_token_ids[:start], new_token_ids[start:end]),
                self.new_text(prompt_token_ids + new_token_ids[: end + 1], new_token_ids[end + 1:]))


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    """Where the first of the ``stop`` texts begins in ``text``, or None."""
    found = [position for each in stop if (position := text.find(each)) >= 0]
    return min(found) if found else None


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token id that ends a sequence: the generation config's, else the model config's or tokenizer's."""
    generation_config = getattr(model, "generation_config", None)
    for source in (generation_config, model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return []
