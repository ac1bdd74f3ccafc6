"""``accelgen bench``: latency and throughput measured the same way on every device, by the protocol of
``accelgen.bench.protocol``. Every time is taken between two calls of the accelerator's ``synchronize``.

Figures per batch size (see :func:`measure_batch_size`): time to first token, per-token decode latency
and end-to-end latency (median and 90th percentile over the timed runs), tokens/s, ms per token per
sequence, the device's memory statistics, graph captures, and % of the memory-bandwidth roofline: the
bytes a decode step must read (this rank's weights, and the KV cache of the positions each row attends
to) over the device's peak bandwidth, against the measured time per step.
A batch size that runs out of device memory is recorded as ``"oom"`` and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any, Callable, Sequence

from accelgen.bench.protocol import BenchProtocol
from accelgen.bench.result_file import environment_facts, result_document
from accelgen.common.errors import first_line
from accelgen.common.settings import DTYPE_BYTES
from accelgen.generation.generator import Generator
from accelgen.loading.model_files import tokenizer_source
from accelgen.loading.model_source import ModelSource
from accelgen.model.memory import kv_cache_bytes_per_position, parameter_bytes
from accelgen.session.api import load_request
from accelgen.session.request import Request

#: ``say(what)``: told what the benchmark is doing as it goes (loading, each warm-up run, each timed run).
Say = Callable[[str], None]


def _silent(what: str) -> None:
    """A ``Say`` that tells no one."""


def measure(generator: Generator, protocol: BenchProtocol, report=None, say: Say = _silent) -> list[dict[str, Any]]:
    """One result row per batch size, smallest first; ``report(row)`` is called as each one is done."""
    rows = []
    for batch_size in sorted(set(protocol.batch_sizes)):
        row = measure_batch_size(generator, batch_size, protocol, say)
        gc.collect()  # free this size's caches (and, after running out of memory, what was half-built) first
        rows.append(row)
        if report:
            report(row)
    return rows


def measure_batch_size(generator: Generator, batch_size: int, protocol: BenchProtocol, say: Say = _silent
                       ) -> dict[str, Any]:
    """The figures for one batch size, or ``{"batch_size": n, "status": "oom", ...}`` when it does not fit; ``say`` is
    told of each run as it starts or ends."""
    accelerator = generator.accelerator
    sized = generator.with_batch_size(batch_size)
    prompts = [protocol.prompt] * batch_size
    names = generator.run.lora.names  # with named LoRA adapters, the rows go to them in turn
    adapters = [names[row % len(names)] for row in range(batch_size)] if names else None
    end_to_end_seconds = []
    placement = generator.loaded.placement
    traffic_before = (placement.moved_bytes, placement.forward_passes) if placement else (0, 0)
    try:
        for run in range(protocol.warmup_runs):
            say(f"batch size {batch_size}: warm-up run {run + 1} of {protocol.warmup_runs} (not timed; any graph "
                f"capture happens here), {protocol.max_new_tokens} new tokens")
            sized.generate(prompts, adapters)
        kept_before, places_before = sized.stats.new_tokens, sized.stats.slot_tokens
        prompts_before = prompt_counts(sized.stats)
        mask_seconds_before = sized.stats.mask_seconds
        for run in range(protocol.runs):
            accelerator.synchronize()
            started = time.perf_counter()
            sized.generate(prompts, adapters)  # tokenize, prefill, decode, detokenize: what a user waits for
            accelerator.synchronize()
            end_to_end_seconds.append(time.perf_counter() - started)
            say(f"batch size {batch_size}: timed run {run + 1} of {protocol.runs}: {end_to_end_seconds[-1]:.2f} s")
    except Exception as error:  # noqa: BLE001 - only out-of-memory is recorded, anything else goes on up
        if not accelerator.is_out_of_memory(error):
            raise
        return {"batch_size": batch_size, "status": "oom", "error": first_line(error)}

    timings = sized.stats.timings[-protocol.runs :]
    decode_seconds_per_token = [timing.seconds_per_decode_step for timing in timings]
    median_end_to_end = statistics.median(end_to_end_seconds)
    sequence_tokens = batch_size * protocol.max_new_tokens
    step_bytes = decode_step_bytes(sized, batch_size, prompt_token_count(sized, protocol.prompt), protocol.max_new_tokens)
    return {
        "batch_size": batch_size,
        "status": "ok",
        "first_token_ms": 1000 * statistics.median(timing.prefill_seconds for timing in timings),
        "decode_ms_per_token": _median_and_p90([1000 * seconds for seconds in decode_seconds_per_token]),
        "end_to_end_s": _median_and_p90(end_to_end_seconds),
        "tokens_per_second": sequence_tokens / median_end_to_end,
        "ms_per_token_per_sequence": 1000 * median_end_to_end / sequence_tokens,
        "decode_step_bytes": step_bytes,
        "roofline_percent": roofline_percent(
            step_bytes, accelerator.describe().get("peak_memory_bandwidth_gbps"), statistics.median(decode_seconds_per_token)
        ),
        # tokens kept (each row's up to its end: all of them, as the protocol ignores EOS) over the timed runs
        "kept_tokens_per_second": (sized.stats.new_tokens - kept_before) / sum(end_to_end_seconds),
        "slot_occupancy": (sized.stats.new_tokens - kept_before) / max(sized.stats.slot_tokens - places_before, 1),
        # over the timed runs (the prefix store is off unless asked, so that each run prefills as published)
        **{name: count - prompts_before[name] for name, count in prompt_counts(sized.stats).items()},
        **structure_figures(sized, timings, sized.stats.mask_seconds - mask_seconds_before),
        "graph_captures": sized.stats.graph_captures,
        "capture_seconds": sized.stats.capture_seconds,
        "step_traces": sized.stats.step_traces,  # decode steps traced instead of captured (the CPU's short runs)
        "memory": accelerator.memory_stats(),
        # offloaded weights brought to the device per forward pass (prefill or decode step), warm-up runs included
        "offload_moved_bytes_per_pass": (placement.moved_bytes - traffic_before[0])
        // max(placement.forward_passes - traffic_before[1], 1) if placement else None,
        # rows per LoRA adapter, and adapters copied into the buffers, warm-up runs included
        "lora_rows": dict(sized.stats.adapter_rows) if names else None,
        "lora_loads": sized.stats.adapter_loads if names else None,
    }


def structure_figures(generator: Generator, timings, mask_seconds: float) -> dict[str, Any]:
    """With a structure (``bench --json-schema`` ...): the rows held to it per run, its grammar's compile time (once,
    in the warm-up), and the host's work of following their tokens over the timed runs' decode time."""
    if generator.run.structure is None:
        return {}
    decode_seconds = sum(timing.decode_seconds for timing in timings)
    return {"constrained_rows": generator.run.batch_size, "grammar_compile_seconds": generator.stats.grammar_compile_seconds,
            "mask_share": mask_seconds / decode_seconds if decode_seconds else None}


def prompt_counts(stats) -> dict[str, int]:
    """The generator's counts so far of prompt tokens prefilled, of those run through the model, of those copied
    from the prefix store, and of the prompts that found a beginning there."""
    return {"prompt_tokens_in_runs": stats.prompt_tokens, "prefilled_tokens": stats.prefilled_tokens,
            "reused_prompt_tokens": stats.reused_tokens, "prefix_hits": stats.prefix_hits}


def decode_step_bytes(generator: Generator, batch_size: int, prompt_tokens: int, new_tokens: int) -> int:
    """Bytes an average decode step must read on this rank: every weight once (LoRA adapters' buffers too), and for
    each row the keys and values of the positions it attends to. Step s (1 to new_tokens - 1) attends to the prompt
    and s tokens, so prompt_tokens + new_tokens / 2 positions on average. Padding a static cache also reads is not
    counted: that is overhead the roofline should show, not hide."""
    config, run = generator.model.config, generator.run
    attended_positions = prompt_tokens + new_tokens / 2
    kv_bytes = kv_cache_bytes_per_position(config, run.dtype, generator.world.size) * batch_size * attended_positions
    adapters = generator.loaded.adapters
    return parameter_bytes(generator.model) + (adapters.buffer_bytes if adapters else 0) + round(kv_bytes)


def prompt_token_count(generator: Generator, prompt: str) -> int:
    """How many tokens ``prompt`` is for this generator's tokenizer (after any truncation)."""
    return len(generator.text.encode([prompt])[0][0])


def roofline_percent(step_bytes: int, peak_bandwidth_gbps: float | None, seconds_per_step: float) -> float | None:
    """How close one decode step comes to the memory-bandwidth limit: the time to read ``step_bytes`` at the
    device's peak bandwidth, as a percentage of the measured time per step (None when the peak is unknown)."""
    if not peak_bandwidth_gbps or seconds_per_step <= 0:
        return None
    return 100 * (step_bytes / (peak_bandwidth_gbps * 1e9)) / seconds_per_step


def _median_and_p90(values: Sequence[float]) -> dict[str, float]:
    """Median and 90th percentile (linear interpolation between the timed runs)."""
    if len(values) == 1:
        return {"median": values[0], "p90": values[0]}
    return {"median": statistics.median(values), "p90": statistics.quantiles(values, n=10, method="inclusive")[8]}


def run_benchmark(request: Request, protocol: BenchProtocol, label: str | None = None, report=None,
                  say: Say = _silent) -> dict[str, Any] | None:
    """Load the request's model once, then measure every batch size of ``protocol``; ``report(row, document)``
    is called as each is done, with the result document of the batch sizes measured so far (for a file that
    a later abort cannot take them from), and ``say`` told what is being done as it goes (on rank 0). Returns the
    result document on rank 0 (None on the other ranks)."""
    say = say if request.world.is_main else _silent
    say(f"loading {request.model.report_name} on {request.accelerator.name}")
    started = time.perf_counter()
    generator = load_request(request)
    load_seconds = time.perf_counter() - started
    say(f"loaded in {load_seconds:.1f} s; measuring batch sizes {', '.join(map(str, sorted(set(protocol.batch_sizes))))}"
        f": {protocol.warmup_runs} warm-up and {protocol.runs} timed runs of {protocol.max_new_tokens} new tokens each")
    if not generator.world.is_main:
        measure(generator, protocol)
        return None
    environment = environment_facts()  # once: it asks git
    rows: list[dict[str, Any]] = []

    def document() -> dict[str, Any]:  # after the rows: a capture failure is known once measuring has tried one
        return result_document(measurement_record(generator, request.model, protocol, rows, label, load_seconds,
                                                  environment))

    def measured(row: dict[str, Any]) -> None:
        rows.append(row)
        if report:
            report(row, document())

    measure(generator, protocol, measured, say)
    return document()


def measurement_record(
    generator: Generator, source: ModelSource, protocol: BenchProtocol, rows: list[dict[str, Any]], label: str | None,
    load_seconds: float, environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a result file says about one measured configuration, rows included."""
    hardware = generator.accelerator.describe()
    dtype_bytes = DTYPE_BYTES[generator.run.dtype]
    unsharded_bytes = generator.loaded.unsharded_parameter_bytes
    return {
        "label": label or _default_label(hardware.get("device_name") or generator.accelerator.name, generator.run.quantize),
        "accelerator": generator.accelerator.name,
        "hardware": hardware,
        "world_size": generator.world.size,
        "dtype": generator.run.dtype,
        "quantize": generator.run.quantize,  # the weights' scheme (None: the weights are in dtype)
        # what every completion was held to (bench --json-schema, --regex, --choice), None when nothing
        "structure": None if generator.run.structure is None else dataclasses.asdict(generator.run.structure),
        "graphs": bool(generator.run.use_graphs) and generator.capture_failure is None,
        "batching": generator.batching,
        "capture_failure": generator.capture_failure,
        "trace_failure": generator.stats.trace_failure,
        "offload": None if generator.loaded.placement is None else generator.loaded.placement.record(),
        "lora": _lora_record(generator),
        "model": {
            "name": source.report_name,
            "architecture": generator.model.config.model_type,
            "parameters": unsharded_bytes // dtype_bytes,
            "parameter_bytes": unsharded_bytes,
            "parameter_bytes_per_rank": parameter_bytes(generator.model),
            "random_weights": source.random_weights,
            "tokenizer": tokenizer_source(generator.tokenizer),
        },
        "protocol": protocol.as_record(prompt_token_count(generator, protocol.prompt)),
        "environment": environment or environment_facts(),
        "load_seconds": load_seconds,
        "results": list(rows),
    }


def _lora_record(generator: Generator) -> dict[str, Any] | None:
    """The run's LoRA adapters: those named (rows go to them in turn) with their buffers, or the one merged."""
    settings, adapters = generator.run.lora, generator.loaded.adapters
    if adapters is not None:
        return {"adapters": list(settings.names), "max_loras": settings.max_loras, "buffer_bytes": adapters.buffer_bytes}
    return None if settings.merged is None else {"merged": settings.merged}


def _default_label(device_name: str, quantize: str | None) -> str:
    """The column of a result in ``accelgen compare``: the device, and the weights' scheme when quantized (so
    int8 stands beside bfloat16 on the same hardware)."""
    return device_name if quantize is None else f"{device_name} {quantize}"
