"""The Python interface: ``accelgen.load`` a model once, or ``accelgen.generate`` in one call."""

from __future__ import annotations

import os
from typing import Sequence

import pluggy

from accelgen.accelerators import AUTO_DEVICE, check_dtype, select_accelerator
from accelgen.errors import UsageError
from accelgen.generator import Completion, Generator
from accelgen.models import DEFAULT_MODEL, load_model
from accelgen.random_weights import build_random_model, resolve_model_config, tokenizer_for
from accelgen.plugins import get_plugin_manager
from accelgen.hookspecs import Accelerator
from accelgen.settings import DEFAULT_BUCKETS, RunSettings, SamplingSettings, World
from accelgen.tensor_parallel import init_process_group, parameter_bytes


def resolve(
    *,
    device: str = AUTO_DEVICE,
    dtype: str | None = None,
    batch_size: int = 1,
    max_new_tokens: int = 100,
    max_input_tokens: int | None = None,
    ignore_eos: bool = False,
    graphs: bool | None = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    trust_remote_code: bool = False,
    plugin_manager: pluggy.PluginManager | None = None,
) -> tuple[Accelerator, RunSettings]:
    """The accelerator and the run settings these options ask for, checked; loads nothing.

    ``graphs=None`` lets the accelerator decide whether to capture the decode step. Raises
    ``accelgen.UsageError`` with a one-line reason for any setting that cannot work.
    """
    accelerator = select_accelerator(plugin_manager or get_plugin_manager(), device)
    run = RunSettings(
        dtype=check_dtype(accelerator, dtype),
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        max_input_tokens=max_input_tokens,
        ignore_eos=ignore_eos,
        use_graphs=accelerator.captures_by_default if graphs is None else graphs,
        buckets=tuple(buckets),
        sampling=SamplingSettings(do_sample, temperature, top_k, top_p, seed),
        trust_remote_code=trust_remote_code,
    )
    check_run_settings(run)
    return accelerator, run


def load(model: str | os.PathLike | None = None, *, random_weights: bool = False, **settings) -> Generator:
    """Load ``model`` (a Hub id or local folder; the built-in default model when None) for generation.

    With ``random_weights``, only the model's config is read (``model`` may then also be a config.json
    or a built-in config name, see ``accelgen.random_weights``) and the weights are drawn at random on
    the device: for benchmarks. ``settings`` are those of :func:`resolve`. Inside a job started with
    several ranks (``accelgen run --world-size N`` or torchrun), every rank calls this: it joins the
    process group and the accelerator shards the model over the ranks.
    """
    accelerator, run = resolve(**settings)
    world = World.from_environment()
    torch_device = accelerator.setup(world)
    init_process_group(world, accelerator.dist_backend)
    if random_weights:
        name = str(model or DEFAULT_MODEL)
        _, config = resolve_model_config(name, run.trust_remote_code)
        loaded_model = build_random_model(config, run.dtype, torch_device, run.trust_remote_code)
        tokenizer, _ = tokenizer_for(name, run.trust_remote_code)
    else:
        loaded_model, tokenizer = load_model(model, run.dtype, run.trust_remote_code)
    unsharded_parameter_bytes = parameter_bytes(loaded_model)
    prepared_model = accelerator.prepare_model(loaded_model, run)
    if world.size > 1:
        prepared_model = accelerator.shard(prepared_model, world, run)
    return Generator(prepared_model, tokenizer, accelerator, torch_device, run, world, unsharded_parameter_bytes)


def generate(prompts: Sequence[str], *, model: str | os.PathLike | None = None, **settings) -> list[Completion]:
    """Completions for ``prompts``; ``settings`` are those of :func:`load`."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:  # before loading a model for nothing (generate_batches checks iterables as they run)
        raise UsageError("No prompts given: pass at least one prompt.")
    return load(model, **settings).generate(prompts)


def check_run_settings(run: RunSettings) -> None:
    """Raise UsageError for settings no model could run with."""
    if run.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1 (got {run.max_new_tokens}).")
    if run.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {run.batch_size}).")
    if run.max_input_tokens is not None and run.max_input_tokens < 1:
        raise UsageError(f"--max-input-tokens must be at least 1 (got {run.max_input_tokens}).")
    if not run.buckets or min(run.buckets) < 1:
        raise UsageError("--buckets must list positive prompt lengths, e.g. 32,64,128.")
    sampling = run.sampling
    if sampling.do_sample and sampling.temperature <= 0:
        raise UsageError(f"--temperature must be above 0 when sampling (got {sampling.temperature}).")
    if sampling.top_k < 0:
        raise UsageError(f"--top-k must be 0 (off) or more (got {sampling.top_k}).")
    if not 0 < sampling.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (got {sampling.top_p}).")
