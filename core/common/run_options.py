"""The settings a run takes, each declared once: the keywords of ``accelgen.load`` and ``accelgen.generate``, the
options of ``accelgen run`` (and of ``score``, ``bench`` and ``eval`` where they take them) that carry the same names
(``--max-new-tokens`` for ``max_new_tokens``), and the docs' tables of them. A value given by any of those ways is
checked by its declaration (:func:`settings_given`); ``accelgen.session.request.run_settings`` makes them the run's
``RunSettings``.
"""

from __future__ import annotations

from typing import Any, Mapping

from accelgen.common.options import Option, json_object_text
from accelgen.common.settings import (
    BATCHING_MODES,
    DEFAULT_MOST_LORAS,
    DTYPES,
    OFFLOAD_MODES,
    QUANTIZATION_SCHEMES,
    AdapterSettings,
    ChatSettings,
    RunSettings,
    SamplingSettings,
)

ADAPTERS = "fine-tuned LoRA adapters (PEFT folders or Hub ids)"
CHAT = "instruction models (conversations are rendered by the tokenizer's chat template)"
STRUCTURE = 'structured output: every completion held to one structure (pip install "accelgen[structured]")'
OFFLOAD = "models larger than the device (Hugging Face Accelerate's big-model inference)"
DATASET = "dataset completion (instead of --prompt)"

#: The escapes ``--stop`` reads, as a shell cannot type a new line inside quotes.
STOP_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def stop_text(value: str) -> str:
    """The command line's ``--stop``: ``\\n``, ``\\t`` and ``\\\\`` read as a new line, a tab and a backslash; any other
    backslash is itself."""
    text, position = [], 0
    while position < len(value):
        escaped = value[position + 1: position + 2]
        if value[position] == "\\" and escaped in STOP_ESCAPES:
            text.append(STOP_ESCAPES[escaped])
            position += 2
        else:
            text.append(value[position])
            position += 1
    return "".join(text)


#: Every setting of a run, in the order ``accelgen run --help`` shows them.
RUN_OPTIONS = (
    Option("lora", group=ADAPTERS, kind="repeated", default=(), metavar="NAME=PATH",
           help="an adapter rows choose by NAME (--lora-column, or a batch request's model), run beside the base model "
                "in the same steps; repeat for several. PATH alone: one adapter merged into the weights for every row"),
    Option("max_loras", group=ADAPTERS, metavar="N",
           help=f"named adapters held on the device at once; others are copied in as their rows come (default: one per "
                f"adapter, at most {DEFAULT_MOST_LORAS})"),
    Option("max_lora_rank", group=ADAPTERS, metavar="R", default=AdapterSettings.max_lora_rank,
           help="the largest rank the device's buffers hold (default: the largest of the adapters')"),
    Option("dtype", choices=DTYPES, help="default: the device's (float32 on cpu)"),
    Option("quantize", choices=QUANTIZATION_SCHEMES,
           help="store the linear layers' weights as int8 (one scale per output channel) or the device's 8-bit float; "
                "activations stay in --dtype (see 'accelgen devices' for what a device runs)"),
    Option("graphs", kind="yes-no", help="capture the decode step as a graph (default: the device decides)"),
    Option("skip_bad_rows", group=DATASET, kind="switch", default=RunSettings.skip_bad_rows,
           help="write a row that cannot be completed (empty, not a prompt, too long, refused by the chat template) as "
                "an error row (finish_reason error, error: why) and go on, instead of stopping"),
    Option("chat", group=CHAT, kind="switch", default=ChatSettings.text_as_user,
           help="make each --prompt or text row one user message"),
    Option("system_prompt", group=CHAT, metavar="TEXT", default=ChatSettings.system_prompt,
           help="a system message first in every conversation that has none"),
    Option("chat_template", group=CHAT, metavar="FILE", dest="chat_template_file", default=ChatSettings.template,
           help="a Jinja chat template to render conversations with, instead of the tokenizer's"),
    Option("chat_template_kwargs", group=CHAT, metavar="JSON", parse=json_object_text("--chat-template-kwargs"),
           default=ChatSettings.template_kwargs,
           help="more variables for the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}'"),
    Option("json_schema", group=STRUCTURE, metavar="FILE", dest="json_schema_file",
           help="a JSON Schema (a .json file) every completion is a JSON value of"),
    Option("json_object", group=STRUCTURE, kind="switch", flag="--json", default=False,
           help="every completion a JSON object"),
    Option("regex", group=STRUCTURE, metavar="PATTERN", help="a regular expression every whole completion matches"),
    Option("choices", group=STRUCTURE, kind="repeated", flag="--choice", metavar="TEXT", default=None,
           help="a text every completion may be; repeat for each choice"),
    Option("max_new_tokens", default=RunSettings.max_new_tokens, help="default {default}"),
    Option("max_input_tokens", default=RunSettings.max_input_tokens, help="keep only the first N tokens of each prompt"),
    Option("batch_size", default=RunSettings.batch_size, help="rows decoded together: the batch shape"),
    Option("batching", choices=BATCHING_MODES, default=RunSettings.batching,
           help="continuous: a finished row's slot takes the next prompt at once; static: fixed batches, each decoded "
                "until its longest row ends (default {default})"),
    Option("buckets", kind="numbers", default=RunSettings.buckets, help="prompt length buckets, e.g. 32,64,128"),
    Option("ignore_eos", kind="switch", default=RunSettings.ignore_eos, help="always generate --max-new-tokens tokens"),
    Option("num_samples", default=RunSettings.num_samples,
           help="completions drawn for each prompt, with --do-sample; its prefill is computed once (default {default})"),
    Option("prefix_cache", metavar="SIZE", default=RunSettings.prefix_cache,
           help="device memory for the keys and values of prompt beginnings that rows share (a system prompt, few-shot "
                "examples), e.g. 2GiB: a row finding its beginning there prefills only the rest; 0 turns reuse off "
                "(default: an eighth of the free memory, at most 2GiB)"),
    Option("prefill_chunk", default=RunSettings.prefill_chunk,
           help="prompt tokens one prefill pass runs at most: a longer prompt is prefilled in passes of this many, the "
                "running rows taking a decode step between two, so none waits for a whole long prompt; 0: each prompt "
                "in one pass (default {default})"),
    Option("logprobs", kind="switch", default=RunSettings.logprobs,
           help="write each new token's log-probability (logprobs) under the model's own distribution: log_softmax of "
                "its logits, before --temperature, --top-k and --top-p"),
    Option("prompt_logprobs", bare=True, bare_value=0, metavar="K", range_in_help=False,
           default=RunSettings.prompt_logprobs,
           help="write each prompt token's log-probability given those before it (prompt_logprobs, the first null), "
                "computed in the prefill, with K most likely tokens at each (prompt_top_logprobs; default 0: none)"),
    Option("stop", kind="repeated", default=RunSettings.stop, metavar="TEXT", parse=stop_text,
           help="end a completion at the first occurrence of TEXT (not kept; finish_reason stop), on top of the model's "
                "end tokens; repeat for several. In TEXT, \\n is a new line, \\t a tab and \\\\ a backslash: --stop "
                "'\\n\\n' stops at a blank line"),
    Option("do_sample", kind="switch", default=SamplingSettings.do_sample, help="sample instead of greedy decoding"),
    Option("temperature", default=SamplingSettings.temperature, help="default {default}"),
    Option("top_k", default=SamplingSettings.top_k, help="0: off (default {default})"),
    Option("top_p", default=SamplingSettings.top_p, help="1.0: off (default {default})"),
    Option("seed", default=SamplingSettings.seed, help="decides the sampled draws of every row (default {default})"),
    Option("offload", group=OFFLOAD, choices=OFFLOAD_MODES,
           help="keep the weights that do not fit --max-device-memory in host memory (cpu) or in files (disk); they are "
                "brought to the device layer by layer in every step"),
    Option("max_device_memory", group=OFFLOAD,
           help="device memory the run may use, KV cache included, e.g. 8GiB (default: what the device has free)"),
    Option("offload_folder", group=OFFLOAD,
           help="with --offload disk: write the offloaded weights here in the run's dtype (default: read them in place "
                "from the checkpoint's safetensors files)"),
)

#: The run's settings by name.
RUN_SETTINGS: dict[str, Option] = {option.name: option for option in RUN_OPTIONS}
#: The settings a run takes, by name: the keywords of ``run_settings``, ``accelgen.load`` and ``accelgen.generate``.
SETTING_NAMES = tuple(RUN_SETTINGS)


def check_setting_names(names) -> None:
    """TypeError for a name that is no setting, as a Python function's for an unknown keyword."""
    unknown = set(names) - set(RUN_SETTINGS)
    if unknown:
        raise TypeError(f"unknown settings {', '.join(sorted(unknown))}; the settings are: {', '.join(SETTING_NAMES)}")


def settings_given(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting of a run: those ``given`` (each checked by its declaration), the others their defaults."""
    check_setting_names(given)
    settings = {name: given.get(name, option.default) for name, option in RUN_SETTINGS.items()}
    for name, value in settings.items():
        RUN_SETTINGS[name].check(value)
    return settings
