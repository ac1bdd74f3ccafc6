"""OpenAI Batch files: a JSON-lines file of requests read as a dataset's rows, and the batch output lines written
for them (https://platform.openai.com/docs/guides/batch).

A request line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` ``/v1/chat/completions``
(``body.messages``) or ``/v1/completions`` (``body.prompt``). Its sampling fields (``max_tokens`` or
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n``) and its ``response_format``
(``json_schema`` or ``json_object``: the structure its completion is held to) become the row's own settings;
a field it leaves out takes the run's option (``--max-new-tokens``, ``--temperature``..., greedy unless
``--do-sample``). ``body.model`` names the run's model: its path or folder name, or one of the names
``--served-model-name`` gives it (vLLM's run-batch convention, for files written for another service); or one of the
run's LoRA adapters (``--lora NAME=PATH``: the row is completed with that adapter, as vLLM serves adapters by name). A
request naming anything else is an error row. So is a request that cannot be served (a field we do not honour set to
anything but its neutral value, a value out of range, more tokens than the run's slots hold): as in OpenAI's batch
API, one request's problem is its own line's ``error``, never the batch's.

A ``/v1/completions`` request may ask for log-probabilities as OpenAI's legacy API and vLLM give them: ``logprobs`` K
(0 to 20) gives each generated token's, and with ``echo`` true the prompt's tokens first (the first one's null), its
``text`` then the prompt and the completion; ``max_tokens`` 0 with ``echo`` scores the prompt alone. The choice's
``logprobs`` holds ``tokens`` (each token's text where it stands), ``token_logprobs``, ``top_logprobs`` (the token's and
its K best alternatives', by text; the engine keeps no alternatives of a generated token: its own alone) and
``text_offset`` (where each token starts in the prompt and completion). The run scores prompts (``prompt_logprobs``)
and records generated tokens' log-probabilities when some request asks (``TextRows``), each line writing its own.

An output line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` with the
body OpenAI's chat completion or completion object (``choices``, one per sample, a reasoning model's thinking in a
chat message's ``reasoning_content``; ``usage``: prompt and completion token counts); an error row has ``response`` null and ``error`` ``{"code", "message"}``. Every id is made from
the row's number, so a resumed run writes the same lines an uninterrupted one would (``created`` is when a line
was written).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Callable, Iterator

from accelgen.common.errors import UsageError, user_errors
from accelgen.common.prompts import BadPrompt, Conversation, PromptRequest, as_conversation, prompt_problem
from accelgen.common.settings import RowSettings
from accelgen.common.structure import response_format_structure
from accelgen.common.value_ranges import RANGES
from accelgen.generation.grammars import structure_problem
from accelgen.generation.text import Completion
from accelgen.jobs.dataset_paths import check_local_path
from accelgen.jobs.dataset_rows import DatasetRequest, TextRows
from accelgen.jobs.json_lines import first_bad_json_line

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
#: Body fields read as the row's settings, and the setting each one is.
SETTING_FIELDS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
                  "top_p": "top_p", "seed": "seed", "stop": "stop", "n": "num_samples", "response_format": "structure"}
#: Body fields that do not change what is generated: taken and left alone.
IGNORED_FIELDS = ("model", "messages", "prompt", "user", "metadata", "store", "service_tier")
#: Body fields accelgen does not honour, accepted only at the value that means "off".
NEUTRAL_VALUES = {"stream": (False,), "logprobs": (False, 0), "echo": (False,), "best_of": (1,), "presence_penalty": (0,),
                  "frequency_penalty": (0,), "logit_bias": ({},), "top_logprobs": (0,), "parallel_tool_calls": (True, False)}
#: What accelgen's finish reasons are called in OpenAI's objects.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
#: Most samples one request may ask for (OpenAI's own limit).
MOST_SAMPLES = 128
#: Body fields a /v1/completions request asks for log-probabilities with (a chat request may not set them).
LOGPROBS_FIELDS = ("logprobs", "echo")
#: Most alternatives a request's ``logprobs`` may ask for at each token (vLLM's limit; OpenAI's own is 5).
MOST_LOGPROBS = 20
#: Tokens before a token decoded with it to find its text where it stands (a SentencePiece space, a byte's character).
TEXT_CONTEXT = 8


def is_batch_file(source: str) -> bool:
    """Whether ``source`` is a local JSON-lines file whose first line is an OpenAI Batch request."""
    path = os.path.expanduser(source)
    if not (os.path.isfile(path) and path.lower().endswith((".jsonl", ".json"))):
        return False
    try:
        with open(path, "rb") as file:
            first = next((line for line in file if line.strip()), b"")
        data = json.loads(first.decode("utf-8-sig"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"custom_id", "body"} <= set(data)


def open_requests(dataset: DatasetRequest, model_names: "ServedNames") -> TextRows:
    """The requests of the batch file ``dataset.source`` as rows (:class:`PromptRequest`, in file order, the first
    ``dataset.limit``), read as they are needed once every line is checked to be JSON. ``model_names``: what a
    request's ``model`` may say to be served by the model or by one of its LoRA adapters (others are error rows)."""
    if dataset.column != DatasetRequest.column:
        raise UsageError(f"--column {dataset.column!r} does not apply to an OpenAI batch file (its prompts are each "
                         f"request's body.messages or body.prompt): drop --column.")
    if dataset.schema_column is not None:
        raise UsageError(f"--schema-column {dataset.schema_column!r} does not apply to an OpenAI batch file (a request "
                         f"holds its own schema in body.response_format): drop --schema-column.")
    if dataset.adapter_column is not None:
        raise UsageError(f"--lora-column {dataset.adapter_column!r} does not apply to an OpenAI batch file (each request "
                         f"names its adapter by body.model): drop --lora-column.")
    path = os.path.expanduser(dataset.source)
    check_local_path(dataset.source, path)
    bad_line = first_bad_json_line(path)
    if bad_line:
        raise UsageError(f"Batch file {dataset.source!r} {bad_line}.")
    _check_ids_apart(dataset.source, path)
    total, chat, constrained, prompt_logprobs, logprobs = 0, False, False, None, False
    for _, data in _request_lines(path, dataset.limit):
        total += 1
        chat = chat or (isinstance(data, dict) and data.get("url") == CHAT_URL)
        body = data.get("body") if isinstance(data, dict) else None
        constrained = constrained or (isinstance(body, dict) and body.get("response_format") not in (None, {"type": "text"}))
        echo, alternatives = _asked_logprobs(data)
        if alternatives is not None:  # the run scores prompts with the most alternatives any request asks for
            logprobs = True
            prompt_logprobs = max(prompt_logprobs or 0, alternatives) if echo else prompt_logprobs
    rows = (request_row(data, model_names) for _, data in _request_lines(path, dataset.limit))
    return TextRows(rows, total, conversational=chat, rows_choose=True, constrained=constrained,
                    prompt_logprobs=prompt_logprobs, logprobs=logprobs)


def _asked_logprobs(data: object) -> tuple[bool, int | None]:
    """Whether a request line asks for its prompt echoed, and the alternatives its ``logprobs`` asks for (None: no
    log-probabilities), as far as it is a /v1/completions request that asks them rightly (others are error rows)."""
    try:
        return _logprobs_fields(data["body"]) if data.get("url") == COMPLETIONS_URL else (False, None)
    except (ValueError, TypeError, KeyError, AttributeError):
        return False, None


def _check_ids_apart(source: str, path: str) -> None:
    """Raise UsageError naming the first two lines of the batch file that share a ``custom_id``: OpenAI refuses such
    a file, and their output lines could not be told apart (a custom_id is what a result is matched by)."""
    first_line_of: dict[str, int] = {}
    for number, data in _request_lines(path, None):
        custom_id = data.get("custom_id") if isinstance(data, dict) else None
        if not isinstance(custom_id, str):
            continue  # not a request: its own error row
        if custom_id in first_line_of:
            raise UsageError(f"Batch file {source!r} has custom_id {custom_id!r} on line {first_line_of[custom_id]} and "
                             f"again on line {number}: each request needs its own custom_id (its result is found by it); "
                             f"rename one of them.")
        first_line_of[custom_id] = number


def _request_lines(path: str, limit: int | None) -> Iterator[tuple[int, object]]:
    """The file's non-empty lines, parsed, with their line numbers (the first ``limit``)."""
    with user_errors(f"Cannot read batch file {path!r}", "make it readable, or pass another --dataset"):
        with open(path, encoding="utf-8-sig") as file:
            count = 0
            for number, line in enumerate(file, start=1):
                if line.strip() and (limit is None or count < limit):
                    count += 1
                    yield number, json.loads(line)


def request_row(data: object, model_names: "ServedNames") -> PromptRequest:
    """One request line as a row: its prompt and own settings, or (a BadPrompt) why it cannot be served."""
    fields = {"custom_id": data.get("custom_id"), "url": data.get("url")} if isinstance(data, dict) else {}
    try:
        prompt, settings, asked = _read_request(data, model_names)
    except ValueError as problem:
        return PromptRequest(BadPrompt(str(problem)), RowSettings(), fields)
    return PromptRequest(prompt, settings, {**fields, **asked})


def _read_request(data: object, model_names: "ServedNames") -> tuple[str | Conversation, RowSettings, dict]:
    """The request's prompt and settings, and what its line is to hold beside its completion (``echo``, ``logprobs``
    K, ``max_tokens`` 0: the prompt alone), as its fields; ValueError saying what is wrong with it."""
    if not isinstance(data, dict) or not isinstance(data.get("custom_id"), str) or not isinstance(data.get("body"), dict):
        raise ValueError("is not an OpenAI batch request (a custom_id text and a body object)")
    if data.get("method", "POST") != "POST" or data.get("url") not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url {data.get('url')!r} with method {data.get('method')!r} is not served: use POST "
                         f"{CHAT_URL} or {COMPLETIONS_URL}")
    body = data["body"]
    model = body.get("model")
    if model is not None and model not in model_names.accepted and model not in model_names.adapters:
        raise ValueError(model_names.refusal(model))
    completions = data["url"] == COMPLETIONS_URL
    for name, value in body.items():
        if name in SETTING_FIELDS or name in IGNORED_FIELDS or value is None or (completions and name in LOGPROBS_FIELDS):
            continue
        if name in LOGPROBS_FIELDS and value not in NEUTRAL_VALUES[name]:
            raise ValueError(f"sets {name}, which accelgen gives on {COMPLETIONS_URL} only (logprobs K, echo for the "
                             f"prompt's): remove it, or ask {COMPLETIONS_URL}")
        if value not in NEUTRAL_VALUES.get(name, ()):
            raise ValueError(f"sets {name}, which accelgen does not honour: remove it")
    echo, alternatives = _logprobs_fields(body) if completions else (False, None)
    prompt = _chat_prompt(body) if data["url"] == CHAT_URL else _text_prompt(body)
    asked = {"echo": True} if echo else {}
    if alternatives is not None:
        asked["logprobs"] = alternatives
    prompt_alone = echo and any(type(body.get(name)) is int and body[name] == 0 for name in ("max_tokens", "max_completion_tokens"))
    own = {setting: _setting(name, body[name]) for name, setting in SETTING_FIELDS.items()
           if body.get(name) is not None and not (prompt_alone and setting == "max_new_tokens")}
    if prompt_alone:  # the engine makes one token, which the line leaves out
        own["max_new_tokens"], asked["max_tokens"] = 1, 0
    return prompt, RowSettings(**own, adapter=model if model in model_names.adapters else None), asked


def _logprobs_fields(body: dict) -> tuple[bool, int | None]:
    """A /v1/completions body's ``echo``, and the alternatives its ``logprobs`` asks for (None: none asked);
    ValueError when either is not a value they take."""
    echo, alternatives = body.get("echo", False), body.get("logprobs")
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise ValueError(f"echo must be true or false (got {echo!r})")
    if alternatives is None or alternatives is False:
        return echo, None
    if type(alternatives) is not int or not 0 <= alternatives <= MOST_LOGPROBS:
        raise ValueError(f"logprobs must be a whole number from 0 to {MOST_LOGPROBS} (the alternatives given at each "
                         f"token) (got {alternatives!r})")
    return echo, alternatives


def _chat_prompt(body: dict) -> Conversation:
    messages = body.get("messages")
    if isinstance(messages, list):  # content given as parts: their text, joined
        messages = [{**message, "content": _joined_text(message["content"])}
                    if isinstance(message, dict) and isinstance(message.get("content"), list) else message
                    for message in messages]
    conversation, problem = as_conversation(messages)
    if problem:
        raise ValueError(f"body.messages {problem.split(': ')[0]}")
    return conversation


def _joined_text(parts: list) -> str:
    if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in parts):
        raise ValueError("has a message part that is not text (images, audio and files are not served)")
    return "".join(part["text"] for part in parts)


def _text_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    problem = prompt_problem(prompt) if isinstance(prompt, str) else "is not one text"
    if problem:
        raise ValueError(f"body.prompt {problem.split(': ')[0]}")
    return prompt


def _setting(name: str, value: object) -> object:
    """A body field's value as its setting; ValueError when it is out of range."""
    if name == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(stop, str) and stop for stop in stops):
            raise ValueError("stop must be a text or a list of texts, none empty")
        return tuple(stops)
    if name == "seed":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"seed must be a whole number (got {value!r})")
        return value % 2**64
    if name == "response_format":
        structure = response_format_structure(value)
        if structure is not None and (problem := structure_problem(structure)):
            raise ValueError(f"response_format's {structure.describe()} {problem}")
        return structure
    if name == "temperature" and value == 0:
        return 0.0  # greedy
    setting = SETTING_FIELDS[name]
    if not RANGES[setting].holds(value) or (name == "n" and value > MOST_SAMPLES):
        allowed = f"a whole number from 1 to {MOST_SAMPLES}" if name == "n" else RANGES[setting].describe()
        also = {"temperature": " (or 0: greedy)", "max_tokens": f" (or 0 with echo on {COMPLETIONS_URL}: the prompt alone)",
                "max_completion_tokens": f" (or 0 with echo on {COMPLETIONS_URL}: the prompt alone)"}.get(name, "")
        raise ValueError(f"{name} must be {allowed}{also} (got {value!r})")
    return value


@dataclasses.dataclass(frozen=True)
class ServedNames:
    """The names a batch request's ``model`` may give to be served by the run: ``given`` (``--served-model-name``,
    the first one written into each response) or, without any, the run's ``model_names`` (the model as named and its
    folder's name); and the run's LoRA ``adapters``, each served by its name."""

    model_names: tuple[str, ...]
    given: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()  # the run's LoRA adapters' names (--lora NAME=PATH): a request naming one has it

    def __post_init__(self):
        for name in self.given:  # (the model's own names are refused as adapters' with the adapters, check_names)
            if name in self.adapters:
                raise UsageError(f"--lora {name}=... and --served-model-name {name!r} give one name to an adapter and to "
                                 f"the model: a request naming {name!r} would not say which it means; rename the adapter "
                                 f"or the served model.")

    @property
    def accepted(self) -> tuple[str, ...]:
        """What a request may name to be served by the model itself."""
        return self.given or self.model_names

    @property
    def written(self) -> str:
        """The ``model`` of every response body completed by the model itself."""
        return self.accepted[0]

    def refusal(self, asked: str) -> str:
        """Why a request asking for model ``asked`` is not served, and what serves it."""
        served = ", ".join(map(repr, self.given)) + " (--served-model-name)" if self.given else repr(self.written)
        if self.adapters:
            served += f" and LoRA adapters {', '.join(map(repr, self.adapters))}"
        fix = f"{'add' if self.given else 'pass'} --served-model-name {asked!r} to serve it" + \
            ("" if self.given else " with this model")
        if self.adapters:  # a LoRA run: the name may as well be that of an adapter the command left out
            fix = f"pass --lora {asked}=PATH to serve an adapter under that name, or {fix}"
        return f"asks for model {asked!r}, and this run serves {served}: {fix}"


def _message(sample: dict) -> dict:
    """A chat choice's message: the answer, and a reasoning model's thinking apart (``reasoning_content``)."""
    message = {"role": "assistant", "content": sample["completion"]}
    if sample.get("reasoning") is not None:
        message["reasoning_content"] = sample["reasoning"]
    return message


class BatchOutputLines:
    """OpenAI batch output lines for the completions of a batch file's requests, by ``model``; ``tokenizer`` gives the
    model's tokenizer, read the first time a request's log-probabilities name their tokens."""

    def __init__(self, model: str, tokenizer: Callable[[], object] | None = None):
        self.model = model
        self.tokenizer_of = tokenizer

    @functools.cached_property
    def tokenizer(self):
        return self.tokenizer_of()

    def line(self, completion: Completion) -> dict:
        request = completion.request or {}
        line = {"id": f"batch_req_{completion.index}", "custom_id": request.get("custom_id")}
        if completion.finish_reason == "error":
            return {**line, "response": None, "error": {"code": "invalid_request", "message": completion.error}}
        samples = completion.completions or [{"completion": completion.completion, "finish_reason": completion.finish_reason,
                                              "completion_token_ids": completion.completion_token_ids,
                                              "reasoning": completion.reasoning, "logprobs": completion.logprobs}]
        if request.get("max_tokens") == 0:  # echo with max_tokens 0: the prompt alone (the one token made left out)
            samples = [{"completion": "", "finish_reason": "length", "completion_token_ids": [], "logprobs": []}] * len(samples)
        chat = request.get("url") == CHAT_URL
        echoed = completion.prompt if request.get("echo") else ""
        choices = [{"index": number, **({"message": _message(sample)} if chat else {"text": echoed + sample["completion"]}),
                    "logprobs": self._logprobs(completion, sample) if "logprobs" in request else None,
                    "finish_reason": FINISH_REASONS[sample["finish_reason"]]}
                   for number, sample in enumerate(samples)]
        new_tokens = sum(len(sample["completion_token_ids"]) for sample in samples)
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{completion.index}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": completion.adapter or self.model, "choices": choices,
                "usage": {"prompt_tokens": completion.prompt_token_count, "completion_tokens": new_tokens,
                          "total_tokens": completion.prompt_token_count + new_tokens}}
        return {**line, "response": {"status_code": 200, "request_id": f"req_{completion.index}", "body": body},
                "error": None}

    def _logprobs(self, completion: Completion, sample: dict) -> dict:
        """A completion choice's ``logprobs`` (legacy /v1/completions): its prompt's tokens first when the request
        echoes it (scored in the prefill), then its sample's; each token's text, log-probability, its own and its
        best alternatives' (up to K + 1, by text) and where it starts in the prompt and completion."""
        request, scores = completion.request, completion.prompt_scores
        alternatives, echo = request["logprobs"], request.get("echo", False)
        prompt_ids = scores.token_ids if scores is not None else self.tokenizer.encode(completion.prompt)
        new_ids = sample["completion_token_ids"]
        texts = _TokenTexts(self.tokenizer, prompt_ids + new_ids)
        chosen = ([None, *scores.logprobs[1:]] if echo else []) + list(sample.get("logprobs") or [])
        written = completion.prompt + sample["completion"]
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for place, position in enumerate(range(0 if echo else len(prompt_ids), len(prompt_ids) + len(new_ids))):
            if position == len(prompt_ids):  # the completion's tokens follow the prompt as the request gave it
                offset = len(completion.prompt)
            text = texts.of(position, texts.ids[position])
            # the characters it takes in the text: its own where the text holds them (a special token the prompt
            # spells out), else those it adds to its decoded text (none for a BOS, an EOS; a character's first byte)
            width = len(text) if written.startswith(text, offset) else len(texts.of(position, texts.ids[position], True))
            logprob, top = (None, None) if chosen[place] is None else (_finite(chosen[place]), {})
            if top is not None:
                best = [(texts.ids[position], chosen[place])]
                if position < len(prompt_ids) and scores.top is not None:
                    best += scores.top[position][:alternatives]  # (a generated token's alternatives are not kept)
                for token, value in sorted(best, key=lambda pair: -pair[1]):
                    top.setdefault(texts.of(position, token), _finite(value))  # texts may coincide: the likelier kept
            for field, value in zip(logprobs, (text, logprob, top, offset)):
                logprobs[field].append(value)
            offset += width
        return logprobs

    @staticmethod
    def problem(line: object, index: int) -> str | None:
        """Why a written ``line`` is not the output line of row ``index``, or None."""
        if not isinstance(line, dict) or set(line) != {"id", "custom_id", "response", "error"}:
            return "is not an OpenAI batch output line written by accelgen run"
        if line["id"] != f"batch_req_{index}":
            return f"is {line['id']!r}, not batch_req_{index}"
        return None

    #: What the output's rows are called where a run speaks of them.
    noun = "request"

    @staticmethod
    def is_error(line: dict) -> bool:
        """Whether a written line is a request that could not be served."""
        return line.get("error") is not None

    @staticmethod
    def error_of(completion: Completion) -> str:
        """Which request could not be served, and why: ``request 'r1' (line 2): asks for model ...``."""
        custom_id = (completion.request or {}).get("custom_id")
        name = f"request {custom_id!r}" if isinstance(custom_id, str) else f"request {completion.index}"
        return f"{name}: {completion.error}"

    @staticmethod
    def error_rows_line(error_rows: int, rows: int, where: str) -> str:
        """What a run says of its ``error_rows`` requests of ``rows`` that could not be served."""
        return (f"{error_rows} of {rows} requests could not be served: their output lines{where} hold the error "
                f"(response null, error.message says why)")

    @staticmethod
    def every_row_failed_line(rows: int, where: str) -> str:
        """The start of the error line of a run none of whose ``rows`` requests could be served."""
        none = f"none of the {rows} requests could be served" if rows > 1 else "the one request could not be served"
        return f"{none}: each output line{where} holds its error (response null, error.message says why)"

    @staticmethod
    def record_fields() -> dict:
        """What a new output's run record says of its lines: nothing (they hold OpenAI's fields only)."""
        return {}

    @staticmethod
    def edits(run_record: dict, dataset_keys: Callable[[], Iterator[object]]) -> Callable[[dict], str | None]:
        """Why a kept line (parsed) no longer stands for its request, or None, line after line from the first. A
        batch output line holds no prompt: its custom_id names the request it answers, and is compared with the
        custom_id of the request of its row (``dataset_keys()``: the batch file's, from the first, read again).
        A line past the requests read (a lower --limit) is not compared."""
        requests = dataset_keys()
        past_the_end = object()

        def edited(line: dict) -> str | None:
            request = next(requests, past_the_end)
            if request is past_the_end or line.get("custom_id") == request:
                return None
            return f"has custom_id {line.get('custom_id')!r} where the batch file's request of that row has {request!r}"
        return edited

    @staticmethod
    def row_key(line: dict) -> object:
        """What a written line says of the row it completes, to compare with the request's (:meth:`request_key`)."""
        return line.get("custom_id")

    @staticmethod
    def request_key(row: PromptRequest) -> object:
        return row.fields.get("custom_id")


def _finite(logprob: float) -> float:
    """A log-probability as JSON holds it: -inf (a token the model rules out) as -9999.0, as vLLM writes it."""
    return max(float(logprob), -9999.0)


class _TokenTexts:
    """The texts of a row's tokens ``ids`` where they stand: each decoded after the few tokens before it, so that a
    word's space (SentencePiece) and a character's bytes come out as they do in the whole text."""

    def __init__(self, tokenizer, ids: list[int]):
        self.tokenizer, self.ids = tokenizer, ids

    def of(self, position: int, token: int, skip_special_tokens: bool = False) -> str:
        """The text ``token`` would add at ``position`` (special tokens by name, unless skipped)."""
        before = self.ids[max(0, position - TEXT_CONTEXT):position]
        head = self.tokenizer.decode(before, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(before + [token], skip_special_tokens=skip_special_tokens)[len(head):]
