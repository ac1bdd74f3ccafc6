"""A run as the user asked for it, built and checked once, then passed down.

The command line, the Python API (``accelgen.load``, ``accelgen.generate``) and every launched worker
build their :class:`Request` with :func:`build_request`: the accelerator is chosen (and the plugins asked)
once, the settings are checked once, the launcher's environment is read once. The settings a run takes are
declared in ``accelgen.common.run_options``: their names are the Python API's keywords, and the command line's
options carry the same names (``--max-new-tokens`` for ``max_new_tokens``); :func:`run_settings` makes them a
``RunSettings``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

from accelgen.adapters.adapter_set import AdapterSet, check_names
from accelgen.common.errors import UsageError
from accelgen.common.prompts import prompt_problem
from accelgen.common.run_options import check_setting_names, settings_given
from accelgen.common.settings import (
    DEFAULT_MOST_LORAS,
    AdapterSettings,
    ChatSettings,
    OffloadSettings,
    RunSettings,
    SamplingSettings,
    World,
)
from accelgen.common.structure import Structure, job_structure
from accelgen.common.value_ranges import parse_memory_size
from accelgen.generation.capture_decision import CaptureWhenItPays
from accelgen.generation.grammars import structure_problem
from accelgen.generation.prefix_store import BLOCK_TOKENS
from accelgen.loading.model_source import ModelSource
from accelgen.loading.offload import check_offload_world
from accelgen.model.memory import kv_cache_bytes_per_position
from accelgen.plugin.contract import Accelerator
from accelgen.plugin.manager import PluginManager, get_plugin_manager
from accelgen.plugin.registry import AUTO_DEVICE, check_dtype, select_accelerator


@dataclasses.dataclass(frozen=True)
class Request:
    """What to run, where, and how: checked, ready to load."""

    model: ModelSource
    run: RunSettings
    accelerator: Accelerator
    world: World
    adapters: AdapterSet  # the LoRA adapters of ``run.lora``, read and checked against the model
    #: the capture of a job that may be long enough for it, decided as its rows end (``capture_decided``)
    capture_later: CaptureWhenItPays | None = None

    def capture_decided(self, rows: int | None) -> "Request":
        """The request with a capture left undecided (``run.use_graphs`` None: the device's capture pays only for
        long jobs) decided for a job of ``rows`` rows (their samples) left; None: a number not known beforehand (a
        streamed dataset), where the cost is certain and the payback is not: not captured. A decided one is kept. How
        many decode steps pay is the accelerator's answer for this model on this machine
        (``Accelerator.capture_pays_after``). A job whose rows all take their whole ``--max-new-tokens`` is decided
        now; one whose rows may end early and that may be long enough is left to its rows (``capture_later``),
        eager until they say it pays (``accelgen.generation.capture_decision``)."""
        if self.run.use_graphs is not None:
            return self
        if rows is None:
            return dataclasses.replace(self, run=dataclasses.replace(self.run, use_graphs=False))
        pays_after = self.accelerator.capture_pays_after(self.model.config(), self.run, self.world)
        rows_here = -(-rows // self.world.replicas)  # each replica runs its share
        may_pay = -(-rows_here // self.run.batch_size) * self.run.max_new_tokens >= pays_after  # every row its whole
        if may_pay and self.run.rows_end_early:
            return dataclasses.replace(self, capture_later=CaptureWhenItPays(pays_after, rows_here, self.run.batch_size))
        return dataclasses.replace(self, run=dataclasses.replace(self.run, use_graphs=may_pay))

    def check_prefix_store(self, ranks: int) -> None:
        """Raise UsageError when ``--prefix-cache`` asks for a store smaller than one block of prompt keys and values
        on each of a replica's ``ranks`` (16 positions over every layer, its share of the heads): it would hold
        nothing, and reuse would be off without a word. Read from the model's config, before the model loads."""
        asked = self.run.prefix_cache
        if not asked:
            return
        block = kv_cache_bytes_per_position(self.model.config(), self.run.dtype, ranks) * BLOCK_TOKENS
        if asked < block:
            smallest = f"{-(-block // 2**20)}MiB" if block >= 2**20 else f"{-(-block // 2**10)}KiB"
            raise UsageError(f"--prefix-cache {asked:,} bytes holds no block of prompt keys and values: one block "
                             f"({BLOCK_TOKENS} positions over every layer, in {self.run.dtype}) takes {block:,} bytes "
                             f"{'on each rank ' if ranks > 1 else ''}of this model; pass at least {smallest} (a store "
                             f"holds many blocks), or 0 to turn prefix reuse off.")

    def check_world_size(self, world_size: int, data_parallel: int = 1) -> None:
        """Raise UsageError when the run cannot go over ``world_size`` ranks in ``data_parallel`` replicas
        (a library the device's sharding needs that is not installed, heads that do not split over a replica's ranks,
        a pre-sharded folder made for another split or dtype, offloading): before any rank starts."""
        replica_ranks = world_size // data_parallel
        if replica_ranks > 1:
            self.accelerator.check_shard(replica_ranks)
        self.model.check_runs_on(replica_ranks, self.run.dtype, self.run.quantize)
        check_offload_world(self.run, world_size)


def build_request(
    model: str | os.PathLike | None = None,
    *,
    random_weights: bool = False,
    device: str = AUTO_DEVICE,
    trust_remote_code: bool = False,
    plugin_manager: PluginManager | None = None,
    world: World | None = None,
    device_here: bool = True,
    **settings,
) -> Request:
    """The request for ``model`` (a Hub id or folder; None: the built-in model) on ``device`` with the settings of
    ``accelgen.common.run_options`` (docs/options.md); loads nothing. ``world`` defaults to the launcher's environment.
    With ``device_here`` False the device is other machines' (a Ray job's replicas), which check it; this one does
    not. Raises ``accelgen.UsageError`` with a one-line reason for anything that cannot work."""
    check_setting_names(settings)  # before a device is chosen for nothing
    accelerator = select_accelerator(plugin_manager or get_plugin_manager(), device, here=device_here)
    source = ModelSource(None if model is None else str(model), random_weights, trust_remote_code)
    run, world = run_settings(accelerator, **settings), world or World.from_environment()
    return Request(source, run, accelerator, world, checked_adapters(run, source, world))


def checked_adapters(run: RunSettings, source: ModelSource, world: World) -> AdapterSet:
    """The run's LoRA adapters, read (a Hub adapter downloaded) and checked against the model before it loads."""
    if not run.lora.named and run.lora.merged is None:
        return AdapterSet(run.lora)
    if run.offload is not None:
        raise UsageError("--lora cannot go with --offload: adapters are added to layers the device holds whole; drop one "
                         "of them (or merge the adapter into the model with PEFT, and offload that).")
    if run.quantize not in (None, "int8"):
        raise UsageError(f"--lora cannot go with --quantize {run.quantize} yet: the device converts the layers the "
                         f"adapters are added to; use --quantize int8, or none.")
    if run.lora.merged is not None and run.quantize is not None and source.pre_sharded_manifest is not None:
        raise UsageError("--lora PATH (merged into the weights) needs the model's full-precision weights, and this folder "
                         "holds them in int8: pass the original model, or name the adapter (--lora NAME=PATH) to run it "
                         "beside the int8 weights.")
    check_names(run.lora, source.names)
    adapters = AdapterSet(run.lora, world)
    adapters.check_fits(source.config(), run.dtype, source.trust_remote_code)
    return adapters


def run_settings(accelerator: Accelerator, **given) -> RunSettings:
    """The checked settings of a run on ``accelerator``: those ``given`` by the names of
    ``accelgen.common.run_options`` (``accelgen run --help`` and docs/options.md say what each does), each checked by
    its declaration, the others at their defaults; then checked together. ``dtype`` None takes the device's default;
    ``graphs`` None lets the device decide whether to capture the decode step (a device whose capture pays only for
    long jobs leaves it to the job: :meth:`Request.capture_decided`), a step not captured running as the device traces
    it (``Accelerator.trace_step``), and False runs every step as it is. ``prefix_cache`` and ``max_device_memory`` are
    bytes or sizes such as "2GiB"; ``json_schema`` a schema or its JSON text; ``lora`` ``NAME=PATH`` texts, a mapping of
    names to paths, or one path to merge into the weights."""
    settings = settings_given(given)
    quantize, offload, graphs = settings["quantize"], settings["offload"], settings["graphs"]
    check_quantization(accelerator, quantize)
    if quantize not in (None, "int8") and offload is not None:  # int8 layers are the core's; others the device's
        raise UsageError(f"--quantize {quantize} cannot go with --offload: the device converts its layers after they "
                         f"are loaded, which offloaded layers are not; drop one of them, or use --quantize int8.")
    if offload is not None and graphs:
        raise UsageError("--graphs cannot go with --offload: offloaded weights are brought to the device in every "
                         "step, which no captured graph replays; drop --graphs.")
    trace_steps = graphs is not False and offload is None  # what is not captured is traced, unless graphs are off
    if graphs is None:  # offloaded steps are never captured; otherwise the device decides, or the job's length
        if not accelerator.tuning.captures_by_default or offload is not None:
            graphs = False
        elif accelerator.tuning.capture_pays_after_steps:
            graphs = None  # decided by Request.capture_decided
        else:
            graphs = True
    prefix_cache = settings["prefix_cache"]
    made = dict(
        dtype=check_dtype(accelerator, settings["dtype"]),
        use_graphs=graphs,
        trace_steps=trace_steps,
        buckets=tuple(settings["buckets"]),
        stop=tuple(settings["stop"]),
        sampling=SamplingSettings(**{field.name: settings[field.name] for field in dataclasses.fields(SamplingSettings)}),
        offload=offload_settings(offload, settings["max_device_memory"], settings["offload_folder"]),
        chat=ChatSettings(settings["chat"], settings["system_prompt"], settings["chat_template"],
                          settings["chat_template_kwargs"]),
        prefix_cache=None if prefix_cache is None else 0 if str(prefix_cache).strip() == "0"
        else parse_memory_size(prefix_cache, "--prefix-cache"),
        structure=checked_structure(settings["json_schema"], settings["json_object"], settings["regex"],
                                    settings["choices"]),
        lora=adapter_settings(settings["lora"], settings["max_loras"], settings["max_lora_rank"]),
    )
    # a setting that is a field of RunSettings of the same name and value goes as it is
    run = RunSettings(**{field.name: settings[field.name] for field in dataclasses.fields(RunSettings)
                         if field.name in settings and field.name not in made}, **made)
    _check(run)
    return run


def adapter_settings(lora: str | Sequence[str] | Mapping[str, str], max_loras: int | None,
                     max_lora_rank: int | None) -> AdapterSettings:
    """The checked ``--lora`` (each ``NAME=PATH``, or one ``PATH`` merged into the weights), ``--max-loras`` and
    ``--max-lora-rank``."""
    specs = list(lora.items()) if isinstance(lora, Mapping) else [lora] if isinstance(lora, (str, os.PathLike)) else lora
    named, merged = [], []
    for spec in specs:
        name, path = spec if isinstance(spec, tuple) else _name_and_path(os.fspath(spec))
        (merged if name is None else named).append(path if name is None else (name, os.fspath(path)))
    if merged and (named or len(merged) > 1):
        raise UsageError("--lora PATH without a name is merged into the weights for every row, and goes alone: name "
                         "each adapter (--lora NAME=PATH) to choose them row by row.")
    if not named and (max_loras is not None or max_lora_rank is not None):
        given = "--max-loras" if max_loras is not None else "--max-lora-rank"
        raise UsageError(f"{given} sizes the buffers of named adapters: add --lora NAME=PATH, or drop {given}.")
    return AdapterSettings(tuple(named), merged[0] if merged else None,
                           max_loras or min(len(named), DEFAULT_MOST_LORAS), max_lora_rank)


def _name_and_path(spec: str) -> tuple[str | None, str]:
    """(name, path) of ``NAME=PATH``; (None, path) for a path alone (its text before a ``=`` names a folder, or is empty)."""
    name, equals, path = spec.partition("=")
    if not equals or not name or "/" in name or os.sep in name or os.path.exists(spec):
        return None, spec
    if not path:
        raise UsageError(f"--lora {spec!r} names no adapter folder: write --lora NAME=PATH.")
    return name, path


def check_quantization(accelerator: Accelerator, scheme: str | None) -> None:
    """Raise UsageError for a quantization scheme (one of QUANTIZATION_SCHEMES) that the device does not run."""
    if scheme is not None and scheme not in accelerator.quantization_schemes:
        runs = (f"it runs --quantize {' and '.join(accelerator.quantization_schemes)}" if accelerator.quantization_schemes
                else "it runs no quantized weights")
        raise UsageError(f"--quantize {scheme} is not supported on {accelerator.name}: {runs}; "
                         f"drop --quantize or pick another device.")


def offload_settings(
    mode: str | None, max_device_memory: str | int | None, folder: str | os.PathLike | None
) -> OffloadSettings | None:
    """The checked ``--offload`` (one of OFFLOAD_MODES), ``--max-device-memory`` and ``--offload-folder`` (None: no
    offloading), together."""
    if mode is None:
        if max_device_memory is not None or folder is not None:
            given = "--max-device-memory" if max_device_memory is not None else "--offload-folder"
            raise UsageError(f"{given} goes with --offload: add --offload disk (or cpu), or drop {given}.")
        return None
    if mode == "cpu" and folder is not None:
        raise UsageError("--offload-folder is where --offload disk writes weights; --offload cpu keeps them in host "
                         "memory: drop --offload-folder, or use --offload disk.")
    max_device_bytes = None if max_device_memory is None else parse_memory_size(max_device_memory, "--max-device-memory")
    return OffloadSettings(mode, max_device_bytes, None if folder is None else os.fspath(folder))


def checked_structure(json_schema: dict | str | None, json_object: bool, regex: str | None,
                      choices: Sequence[str] | None) -> Structure | None:
    """The structure every completion is held to, checked by the grammar engine; UsageError naming the flag."""
    try:
        choices = [choices] if isinstance(choices, str) else None if choices is None else list(choices)
        structure = job_structure(json_schema, json_object, regex, choices)
    except ValueError as error:
        raise UsageError(f"{error}.") from None
    if structure is not None and (problem := structure_problem(structure)):
        raise UsageError(f"{structure.flag} {problem}: fix it, or drop {structure.flag}.")
    return structure


#: Names apply_chat_template takes itself, which a template variable may not be.
CHAT_TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def _check(run: RunSettings) -> None:
    """Raise UsageError for settings no model could run with, together (each alone is checked by its declaration)."""
    if run.num_samples > 1 and not run.sampling.do_sample:
        raise UsageError(f"--num-samples {run.num_samples} with greedy decoding gives {run.num_samples} equal "
                         f"completions: add --do-sample (or drop --num-samples).")
    if not run.buckets:
        raise UsageError("--buckets must list prompt lengths, e.g. 32,64,128.")
    if run.chat.system_prompt is not None and (problem := prompt_problem(run.chat.system_prompt)):
        raise UsageError(f"--system-prompt {problem}.")
    for text in run.stop:
        if not isinstance(text, str) or not text:
            raise UsageError(f"--stop {text!r} is not a text to stop at: give at least one character.")
    kwargs = run.chat.template_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise UsageError(f"--chat-template-kwargs must be a JSON object of template variables, e.g. "
                         f"'{{\"enable_thinking\": false}}' (got {type(kwargs).__name__}).")
    if kwargs and (taken := sorted(set(kwargs) & set(CHAT_TEMPLATE_ARGUMENTS))):
        raise UsageError(f"--chat-template-kwargs names {', '.join(taken)}, which accelgen sets itself: give only the "
                         f"template's own variables.")
    if run.chat.template is not None and not run.chat.template.strip():
        raise UsageError("--chat-template is empty: give a Jinja chat template, or drop it to use the tokenizer's.")
