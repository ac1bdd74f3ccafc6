"""The Python interface: ``accelgen.load`` a model once, or ``accelgen.generate`` in one call.

Both build an ``accelgen.session.request.Request`` as the command line does and load it with :func:`load_request`,
which every rank of a launched job runs too.
"""

from __future__ import annotations

import os
from typing import Sequence

from accelgen.adapters.merge import merge_adapter
from accelgen.adapters.resident import ResidentAdapters
from accelgen.common.collector import start_up_ended
from accelgen.common.host_memory import peak_resident_bytes, resident_bytes, restart_peak
from accelgen.common.prompts import check_prompts
from accelgen.generation.generator import Generator
from accelgen.generation.text import Completion
from accelgen.model.loaded_model import LoadedModel
from accelgen.parallel.process_groups import init_process_group
from accelgen.quantization.calibration import calibration_pass
from accelgen.session.request import Request, build_request


def load(model: str | os.PathLike | None = None, **options) -> Generator:
    """Load ``model`` (a Hub id or local folder; the built-in default model when None) for generation.

    ``options`` are those of :func:`accelgen.session.request.build_request`: ``device``, ``random_weights``,
    ``trust_remote_code``, ``plugin_manager`` and the settings of ``accelgen.common.run_options``
    (``batch_size``, ``max_new_tokens``, ``dtype``, ``do_sample``...). With ``random_weights``, only the
    model's config is read (``model`` may then also be a config.json or a built-in config name, see
    ``accelgen.loading.random_weights``) and the weights are drawn at random on the device: for benchmarks.
    Inside a job started with several ranks (``accelgen run --world-size N`` or torchrun), every rank
    calls this: it joins the process group and the accelerator shards the model over the ranks.
    """
    return load_request(build_request(model, **options))


def load_request(request: Request) -> Generator:
    """Set the device up, load the model (this rank's part of it under tensor parallelism; what fits the
    memory cap with --offload), prepare it for the device: a Generator."""
    accelerator, run, world = request.accelerator, request.run, request.world
    request.check_prefix_store(world.size)
    device = accelerator.setup(world)
    init_process_group(world, accelerator.dist_backend)
    shard = (lambda model: accelerator.shard(model, world, run)) if world.size > 1 else None
    free_bytes = accelerator.memory_stats().get("free_bytes") if run.offload else None
    host_bytes_before_loading = resident_bytes()
    restart_peak()
    loaded = request.model.load(run, device, world, shard, free_bytes, accelerator.shares_host_memory,
                                accelerator.tuning.int8_quantizes_head, request.adapters.merged is not None)
    if request.adapters.merged is not None:  # into the weights as loaded, before the device lays them out
        merge_adapter(loaded.model, request.adapters.merged, world)
    model = accelerator.prepare_model(loaded.model, device, run, world)
    if run.quantize is not None:
        calibrate = calibration_pass(loaded.tokenizer, device, accelerator.mark_step)
        model = accelerator.quantize(model, run.quantize, run, calibrate)
    # named adapters over the layers as the device runs them (split, laid out, int8)
    adapters = (ResidentAdapters(model, request.adapters, run, world, device, accelerator.linear_layout)
                if request.adapters.named else None)
    model.requires_grad_(False)  # inference: no weight records gradients (nor may a tracer keep one as a constant)
    loading_host_memory = {"host_bytes_before_loading": host_bytes_before_loading,
                           "peak_host_bytes_loading": peak_resident_bytes()}
    generator = Generator(LoadedModel(model, loaded.tokenizer, accelerator, device, world, loaded.unsharded_parameter_bytes,
                                      loading_host_memory, loaded.placement, adapters, loaded.kept_weights), run,
                          capture_later=request.capture_later)
    start_up_ended()  # in the accelgen script: what the start built is left out of the collector's traversals
    return generator


def generate(prompts: Sequence[str | list[dict]], *, model: str | os.PathLike | None = None, **options) -> list[Completion]:
    """Completions for ``prompts``: texts, or conversations (each a list of ``{"role", "content"}`` messages,
    rendered by the chat template); ``options`` are those of :func:`load`."""
    if isinstance(prompts, str):
        prompts = [prompts]
    check_prompts(prompts)  # before loading a model for nothing
    return load(model, **options).generate(prompts)
