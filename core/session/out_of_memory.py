"""Running out of device memory, said in one line with what would fit instead (``accelgen.model.memory``)."""

from __future__ import annotations

from accelgen.common.output_files import holds_rows
from accelgen.generation.generator import Generator
from accelgen.model.memory import out_of_memory_advice, parameter_bytes, parameter_bytes_of_config
from accelgen.session.request import Request


def out_of_memory_line(request: Request, generator: Generator | None, kept_output: str | None = None) -> str:
    """Running out of memory as one line, with a batch size or world size that would fit, or the offloading
    that would; ``generator`` is None when the weights themselves did not fit, ``kept_output`` the file
    holding the rows finished so far."""
    run, world = request.run, request.world
    offload_mode = "disk" if request.accelerator.shares_host_memory else "cpu"
    config = request.model.config()
    cache_length = min(run.buckets) + run.max_new_tokens
    if generator is not None:
        weight_bytes_per_rank = parameter_bytes(generator.model)
        cache_length = generator.cache_length_in_use or cache_length  # the one cache all buckets share
    else:
        head = request.accelerator.tuning.int8_quantizes_head and world.size == 1  # (split over ranks, the head stays)
        weight_bytes_per_rank = parameter_bytes_of_config(config, run.dtype, run.quantize, head) // world.size
    advice = out_of_memory_advice(
        config, dtype=run.dtype, batch_size=run.batch_size, cache_length=cache_length,
        world_size=world.size, weight_bytes_per_rank=weight_bytes_per_rank,
        total_bytes=request.accelerator.memory_stats().get("total_bytes"),
        offload_mode=None if run.offload is not None or world.size > 1 else offload_mode,
        device_is_host=request.accelerator.shares_host_memory, prefill_chunk=run.prefill_chunk,
    )
    kept = f" (rows finished so far are kept in {kept_output})" if holds_rows(kept_output) else ""
    return (f"Out of memory on {request.accelerator.name} with --batch-size {run.batch_size} and --world-size "
            f"{world.size}{kept}: {advice}")

