"""accelgen as a model of EleutherAI's lm-evaluation-harness (``accelgen eval``, ``lm_eval --model accelgen``).

:class:`GeneratorLM` answers lm-eval's three kinds of request with one loaded :class:`Generator`, the way lm-eval's
own ``hf`` model (HFLM) answers them, so that a task scores the same: texts encoded as HFLM encodes them,
``loglikelihood`` requests as score requests cut to the model's window by HFLM's rule and sent to the engine all at
once (it batches them continuously), ``loglikelihood_rolling`` as HFLM's disjoint windows, ``generate_until`` greedy
from the same truncated contexts, cut at the first stop text. lm-eval is imported only here, inside functions, and
only when this module is: ``import accelgen`` does not import it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from typing import Sequence

from accelgen.common.errors import UsageError
from accelgen.common.prompts import ScoreRequest
from accelgen.generation.generator import Generator
from accelgen.model.shape import context_limit

#: The name lm-eval knows accelgen's model by (``lm_eval --model accelgen``).
MODEL_NAME = "accelgen"
NOT_INSTALLED = "lm-evaluation-harness is not installed: pip install 'accelgen[eval]'"
#: The names a task may give its new-token budget, the first one present winning (as lm-eval reads them).
BUDGET_NAMES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
#: What else a task's generation settings may hold; anything more is refused, not ignored.
SAMPLING_NAMES = {"do_sample", "temperature", "top_p", "top_k"}
#: What a tokenizer says of a length it does not know (transformers' VERY_LARGE_INTEGER).
UNKNOWN_LENGTH = int(1e30)


def harness_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


@functools.cache
def lm_class() -> type:
    """``AccelgenLM``: :class:`GeneratorLM` as an lm-eval ``TemplateLM``, registered as lm-eval's model "accelgen"
    (made once, when lm-eval is first needed)."""
    if not harness_installed():
        raise UsageError(NOT_INSTALLED)
    import lm_eval.models  # noqa: F401 - the built-in models first: lm-eval fills an empty registry only
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    return register_model(MODEL_NAME)(type("AccelgenLM", (GeneratorLM, TemplateLM), {"__module__": __name__}))


def __getattr__(name: str):
    if name == "AccelgenLM":
        return lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class GeneratorLM:
    """A loaded generator as lm-eval's model: the methods of ``AccelgenLM`` (:func:`lm_class`), whose other base is
    lm-eval's ``TemplateLM`` (it encodes ``loglikelihood`` pairs with :meth:`tok_encode`, then calls
    :meth:`_loglikelihood_tokens`). Made from a ``generator``, or from ``accelgen.load``'s options (``pretrained``: the
    model; lm-eval's ``device`` and ``batch_size``; ``dtype``, ``max_new_tokens``...). ``max_length``: the window, in
    tokens, a request is cut to (default: what the model and the engine allow); ``max_gen_toks``: the new tokens a
    generation task that names none asks for; ``add_bos_token``: as HFLM's (None: the tokenizer's default)."""

    backend = "causal"

    def __init__(self, pretrained: str | None = None, generator: Generator | None = None, device: str | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None, **load_options):
        super().__init__()
        if generator is None:
            from accelgen.session.api import load

            # lm-eval's --device names a device and its index ("cuda:0", its default): accelgen's ranks pick the index
            options = {**load_options, **({"device": device.split(":")[0]} if device else {})}
            if batch_size is not None:
                options["batch_size"] = _batch_size(batch_size)
            generator = load(pretrained, **options)
        elif pretrained is not None or load_options:
            raise UsageError("Give AccelgenLM a loaded generator or the options to load one, not both.")
        self.generator, self.tokenizer = generator, generator.tokenizer
        self.add_bos_token, self._max_gen_toks = add_bos_token, int(max_gen_toks)
        self._device = generator.loaded.device
        longest = engine_window(generator)
        if max_length is not None and int(max_length) > longest:
            raise UsageError(f"max_length {max_length} is over the {longest} tokens this model's requests may hold here "
                             f"(its context less the scored and the new position, and the largest bucket): lower it.")
        self._max_length = int(max_length) if max_length is not None else min(longest, harness_window(generator))

    # -- what lm-eval reads ------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a rolling window's first token are scored after: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model_name": self.generator.model.config.name_or_path, "model_dtype": self.generator.run.dtype,
                "accelgen_device": self.generator.accelerator.name}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """HFLM's own encoding, run on this model's tokenizer: its default changed across lm-eval releases (0.4.9 adds
        no special token to a causal model's text unless ``add_bos_token``; later ones add the tokenizer's, none to a
        text that starts with the prefix token's text), and contexts must encode as the installed HFLM encodes them."""
        from lm_eval.models.huggingface import HFLM

        return HFLM.tok_encode(self, string, add_special_tokens=add_special_tokens, left_truncate_len=left_truncate_len)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # -- the three kinds of request ----------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: Sequence[tuple], disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Each (key, context ids, continuation ids): the continuation's log-likelihood after the context and whether it
        is the greedy one, the pair cut to its last ``max_length + 1`` tokens first (HFLM's rule)."""
        windows = [score_window(context, continuation, self.max_length) for _, context, continuation in requests]
        answers = self._scores(windows, disable_tqdm)
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:  # a rolling window's key is None: its text is cached whole
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood: the sum over HFLM's disjoint windows of ``max_length`` tokens, the first scored
        after the prefix token, every window of every text scored at once."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, counts = [], []
        for (text,) in (request.args for request in requests):
            pairs = [make_disjoint_window(pair) for pair in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += [(None, context, continuation) for context, continuation in pairs]
            counts.append(len(pairs))
        scores = iter(self._loglikelihood_tokens(windows, disable_tqdm))
        totals = [sum(logprob for logprob, _ in (next(scores) for _ in range(count))) for count in counts]
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each (context, settings): its completion from the context's last ``max_length - max_gen_toks`` tokens, cut
        at the first of its ``until`` texts (or the end token's). Requests of the same settings run together."""
        end_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for place, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(place)
        texts: list[str] = [""] * len(requests)
        for places in groups.values():
            until, new_tokens, settings = generation_settings(requests[places[0]].args[1], self.max_gen_toks, end_text)
            longest_context = self.max_length - new_tokens
            if longest_context <= 0:
                raise UsageError(f"A task asks for {new_tokens} new tokens, not fewer than the {self.max_length}-token "
                                 f"window: lower its max_gen_toks.")
            contexts = [self.tok_encode(requests[place].args[0], left_truncate_len=longest_context) for place in places]
            generator = self._generating(new_tokens, [text for text in until if text and text != end_text], settings)
            for place, (tokens, _) in zip(places, generator.generate_token_ids(contexts)):
                texts[place] = cut_at_stops(self.tok_decode(tokens), until)
                self.cache_hook.add_partial("generate_until", requests[place].args, texts[place])
        return texts

    # -- through the engine ------------------------------------------------------------------------

    def _scores(self, windows: list[ScoreRequest], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each window's continuation, the engine given them all at once."""
        from tqdm import tqdm

        answers = []
        with tqdm(total=len(windows), disable=disable_tqdm, desc="Running loglikelihood requests") as progress:
            for completions in self.generator.scoring().generate_batches(windows):
                for completion in completions:
                    if completion.finish_reason == "error":
                        raise UsageError(f"lm-eval request {completion.index} could not be scored: {completion.error}")
                    [continuation] = completion.continuations
                    answers.append((continuation.logprob, continuation.greedy))
                progress.update(len(completions))
        return answers

    def _generating(self, new_tokens: int, stop: list[str], settings: dict) -> Generator:
        """A generator of the same model for one group of requests: ``new_tokens`` at most, ending at ``stop``, greedy
        unless the task samples."""
        unknown = sorted(set(settings) - SAMPLING_NAMES)
        if unknown:
            raise UsageError(f"A task's generation settings hold {', '.join(unknown)}, which accelgen does not take: "
                             f"drop them (--gen_kwargs or the task's generation_kwargs).")
        run = self.generator.run
        # HFLM's reading: greedy unless do_sample, or a temperature above 0 with do_sample unsaid; at 0, greedy
        temperature, do_sample = float(settings.get("temperature") or 0.0), settings.get("do_sample")
        sampling = dataclasses.replace(run.sampling, do_sample=False)
        if temperature > 0 and do_sample is not False:
            sampling = dataclasses.replace(run.sampling, do_sample=True, temperature=temperature,
                                           top_p=float(settings.get("top_p", 1.0)), top_k=int(settings.get("top_k", 0)))
        return Generator(self.generator.loaded, dataclasses.replace(
            run, max_new_tokens=new_tokens, stop=tuple(stop), sampling=sampling, num_samples=1, prompt_logprobs=None,
            logprobs=False, structure=None, structured_rows=False), self.generator.adapter_slots)


def score_window(context: list[int], continuation: list[int], max_length: int) -> ScoreRequest:
    """The score request of a (context, continuation) pair as HFLM scores it: the pair's last ``max_length + 1`` tokens,
    the continuation's after the rest (the model reads ``max_length`` of them)."""
    if not continuation or len(continuation) > max_length:
        raise UsageError(f"A continuation of {len(continuation)} tokens cannot be scored in a {max_length}-token window: "
                         f"it must have 1 to {max_length}.")
    kept = (list(context) + list(continuation))[-(max_length + 1):]
    return ScoreRequest(tuple(kept[: -len(continuation)]), (tuple(continuation),), text_scores=False)  # theirs alone


def engine_window(generator: Generator) -> int:
    """The longest window a request may be cut to here: a scored sequence (window + 1 tokens) and the engine's one new
    position must fit the model's context, and the sequence the largest bucket."""
    longest = max(generator.run.buckets) - 1
    limit = context_limit(generator.model.config)
    return longest if limit is None else min(longest, limit - 2)


def harness_window(generator: Generator) -> int:
    """HFLM's window for this model: its config's n_positions, max_position_embeddings or n_ctx (a composite model's
    text config's), else its tokenizer's model_max_length, else 2048."""
    config = getattr(generator.model.config, "text_config", None) or generator.model.config
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(config, name, None) is not None:
            return int(getattr(config, name))
    length = getattr(generator.tokenizer, "model_max_length", None)
    return int(length) if length is not None and length < UNKNOWN_LENGTH else 2048


def generation_settings(settings: dict, default_new_tokens: int, end_text: str) -> tuple[list[str], int, dict]:
    """A task's generation settings as HFLM reads them: its stop texts (``until``, a text or a list) with the end
    token's text added, its new-token budget (``max_gen_toks`` or an alias, else ``default_new_tokens``), the rest."""
    rest = dict(settings)
    until = rest.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    if end_text not in until:
        until.append(end_text)
    budgets = [rest.pop(name) for name in BUDGET_NAMES if name in rest]
    return until, int(budgets[0]) if budgets else default_new_tokens, rest


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """``text`` before the first of ``stops`` (HFLM's cut: each stop in turn, empty ones skipped)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def _batch_size(value: int | str) -> int:
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    raise UsageError(f"batch_size {value!r}: accelgen's batch is the engine's slots, not searched for; give a number.")


# -- whole evaluations -------------------------------------------------------------------------------


def task_manager(tasks: Sequence[str], include_path: str | os.PathLike | None = None, builtin_tasks: bool = True):
    """lm-eval's task index (its own tasks unless ``builtin_tasks`` is False, and those under ``include_path``), once
    every one of ``tasks`` (names, globs, YAML files) is found in it."""
    if not harness_installed():
        raise UsageError(NOT_INSTALLED)
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise UsageError(f"--include-path {include_path} is not a folder: give the folder holding the task YAML files.")
    if not tasks:
        raise UsageError("No task to run: name at least one (--tasks hellaswag,arc_easy).")
    index = TaskManager(include_path=None if include_path is None else str(include_path), include_defaults=builtin_tasks)
    for task in tasks:
        if not index.match_tasks([task]) and not os.path.isfile(task):
            local = "" if include_path is not None else ", or pass --include-path for a folder of your own tasks"
            raise UsageError(f"lm-evaluation-harness has no task {task!r}: list them with `lm_eval ls tasks`{local}.")
    return index


def evaluate_generator(generator: Generator, tasks: Sequence[str], index=None, *, include_path: str | os.PathLike | None = None,
                       limit: int | float | None = None, num_fewshot: int | None = None,
                       output_path: str | os.PathLike | None = None, log_samples: bool = False, **lm_options) -> dict | None:
    """lm-eval's results of ``tasks`` for a loaded ``generator`` (``index``: a :func:`task_manager` made for them);
    ``output_path``: a JSON file they are written to. Every rank of a tensor-parallel job runs every request (each
    runs its part of the model); rank 0 alone gets the results and writes them (None on the others)."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    index = index or task_manager(tasks, include_path)
    model = lm_class()(generator=generator, **lm_options)
    results = simple_evaluate(model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=index,
                              log_samples=log_samples)
    if results is None or generator.world.rank != 0:
        return None
    if output_path is not None:
        with open(output_path, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=2, default=handle_non_serializable, ensure_ascii=False)
    return results


def evaluate(model: str | os.PathLike | None = None, tasks: Sequence[str] = (), *, include_path: str | os.PathLike | None = None,
             limit: int | float | None = None, num_fewshot: int | None = None, output_path: str | os.PathLike | None = None,
             log_samples: bool = False, builtin_tasks: bool = True, **load_options) -> dict | None:
    """lm-eval's results of ``tasks`` (names or globs of lm-eval's tasks, unless ``builtin_tasks`` is False, or of
    those under ``include_path``) for ``model`` loaded by ``accelgen.load(model, **load_options)``; see
    :func:`evaluate_generator`. The tasks are found before the model loads."""
    from accelgen.session.api import load

    if isinstance(tasks, str):
        tasks = [task for task in tasks.split(",") if task]
    index = task_manager(tasks, include_path, builtin_tasks)
    return evaluate_generator(load(model, **load_options), tasks, index, limit=limit, num_fewshot=num_fewshot,
                              output_path=output_path, log_samples=log_samples)


def result_table(results: dict) -> str:
    """lm-eval's Markdown table of ``results`` (with its table of groups, when the tasks had groups)."""
    from lm_eval.utils import make_table

    return make_table(results) + (f"\n{make_table(results, 'groups')}" if results.get("groups") else "")


def lm_eval_cli() -> None:
    """lm-eval's own command line with accelgen's model registered (``python -m accelgen.jobs.lm_eval_model run
    --model accelgen ...``): lm-eval loads no plugin of its own accord."""
    lm_class()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":  # python -m: the model registered once, by the module under its own name
    importlib.import_module("accelgen.jobs.lm_eval_model").lm_eval_cli()
elif harness_installed():
    lm_class()  # lm-eval's model "accelgen" exists once this module is imported
