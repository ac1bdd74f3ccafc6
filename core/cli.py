"""The ``accelgen`` commands (run, bench, compare, devices): each calls the core. Nothing here knows a device.
Their arguments are declared in ``accelgen.cli_arguments``."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
import warnings
from typing import Sequence

import pluggy

from accelgen.accelerators import registered_accelerators
from accelgen.api import load, resolve
from accelgen.bench import (
    BenchProtocol, check_output_path, measure, measurement_record, print_json, progress_line, result_document,
    write_result,
)
from accelgen.cli_arguments import build_parser
from accelgen.compare import (
    METRICS, check_chart_possible, comparison_table, draw_chart, load_measurements, render_markdown, render_text,
    write_text_file,
)
from accelgen.dataset_rows import DatasetRequest, TextRows, open_rows
from accelgen.errors import AccelgenWarning, UsageError
from accelgen.memory_advice import out_of_memory_advice, parameter_bytes_of_config
from accelgen.launcher import check_port_free, free_port, launch_workers, record_worker_failure, running_as_worker
from accelgen.models import DEFAULT_MODEL, load_config
from accelgen.output import CompletionWriter, describe_plugin, print_batch
from accelgen.plugins import get_plugin_manager
from accelgen.progress import Progress
from accelgen.random_weights import resolve_model_config
from accelgen.settings import LaunchPlan, World
from accelgen.tensor_parallel import check_shardable, gather_from_ranks, leave_process_group, parameter_bytes


def main(argv: Sequence[str] | None = None, plugin_manager: pluggy.PluginManager | None = None) -> int:
    """Entry point of the ``accelgen`` script; returns the exit status (2 for a user mistake)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker = running_as_worker()
    with warnings.catch_warnings():
        _show_our_warnings_as_lines(shown=not worker or World.from_environment().is_main)
        return _main(argv, plugin_manager, worker)


def _main(argv: list[str], plugin_manager: pluggy.PluginManager | None, worker: bool) -> int:
    try:
        arguments = build_parser().parse_args(argv)
        plugin_manager = plugin_manager or get_plugin_manager()
        if arguments.command == "devices":
            return devices_command(plugin_manager)
        if arguments.command == "compare":
            return compare_command(arguments)
        if arguments.command == "bench":
            return bench_command(arguments, plugin_manager, argv)
        return run_command(arguments, plugin_manager, argv)
    except UsageError as error:
        if not worker:
            print(f"accelgen: error: {error}", file=sys.stderr)
        elif not record_worker_failure(error):  # torch's launcher would print it once for the whole job
            print(f"accelgen: error: [rank {World.from_environment().rank}] {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not worker:
            print("accelgen: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if worker:
            record_worker_failure(error)
        raise


def _show_our_warnings_as_lines(shown: bool) -> None:
    """accelgen's own warnings as one ``accelgen: warning: ...`` line each (on rank 0 only); others as usual."""
    library_default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, AccelgenWarning):
            library_default(message, category, filename, lineno, file, line)
        elif shown:
            print(f"accelgen: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def devices_command(plugin_manager: pluggy.PluginManager) -> int:
    for accelerator in registered_accelerators(plugin_manager).values():
        if accelerator.is_available():
            status = f"available, {accelerator.device_count()} device(s)"
        else:
            status = f"unavailable: {accelerator.unavailable_reason()}"
        print(f"{accelerator.name:<8} {status}  [{describe_plugin(accelerator)}]")
    return 0


def run_command(arguments: argparse.Namespace, plugin_manager: pluggy.PluginManager, argv: Sequence[str]) -> int:
    if arguments.prompt and arguments.dataset:
        raise UsageError("Pass --prompt or --dataset, not both.")
    if not arguments.prompt and not arguments.dataset:
        raise UsageError("No prompts given: pass --prompt TEXT (repeat it for several prompts) or --dataset SOURCE.")
    for index, prompt in enumerate(arguments.prompt):
        if not prompt.strip():
            raise UsageError(f"Prompt {index} is empty: give it some text.")
    settings = dict(
        device=arguments.device,
        dtype=arguments.dtype,
        batch_size=arguments.batch_size,
        max_new_tokens=arguments.max_new_tokens,
        max_input_tokens=arguments.max_input_tokens,
        ignore_eos=arguments.ignore_eos,
        graphs=arguments.graphs,
        buckets=arguments.buckets,
        do_sample=arguments.do_sample,
        temperature=arguments.temperature,
        top_k=arguments.top_k,
        top_p=arguments.top_p,
        seed=arguments.seed,
        trust_remote_code=arguments.trust_remote_code,
        plugin_manager=plugin_manager,
    )
    return here_or_launched(arguments, settings, argv, generate_command)


def bench_command(arguments: argparse.Namespace, plugin_manager: pluggy.PluginManager, argv: Sequence[str]) -> int:
    protocol = BenchProtocol(tuple(arguments.batch_sizes), arguments.max_new_tokens, arguments.prompt,
                             arguments.warmup_runs, arguments.runs)
    protocol.check()
    if arguments.model_config and arguments.model:
        raise UsageError("Pass --model or --model-config, not both.")
    if arguments.model_config and not arguments.random_weights:
        raise UsageError("--model-config builds the model from its config alone: add --random-weights "
                         "(or pass --model to load real weights).")
    if arguments.output:
        check_output_path(arguments.output, arguments.overwrite)
    settings = dict(device=arguments.device, dtype=arguments.dtype, max_new_tokens=arguments.max_new_tokens,
                    ignore_eos=True, graphs=arguments.graphs, trust_remote_code=arguments.trust_remote_code,
                    plugin_manager=plugin_manager)
    return here_or_launched(arguments, settings, argv, lambda arguments, settings: measure_command(arguments, settings, protocol))


def measure_command(arguments: argparse.Namespace, settings: dict, protocol: BenchProtocol) -> int:
    """Load (or build) the model once, then measure every batch size; rank 0 reports and writes."""
    _quiet_transformers()
    model = arguments.model_config or arguments.model
    started = time.perf_counter()
    generator = load(model, random_weights=arguments.random_weights, **settings)
    load_seconds = time.perf_counter() - started
    is_main = generator.world.is_main
    report = (lambda row: print(progress_line(row, protocol.max_new_tokens), file=sys.stderr, flush=True)) if is_main else None
    rows = measure(generator, protocol, report)
    if is_main:
        if arguments.random_weights:
            model_name = resolve_model_config(str(model or DEFAULT_MODEL), arguments.trust_remote_code)[0]
        else:
            model_name = model or "accelgen built-in default"
        tokenizer_path = generator.tokenizer.name_or_path
        document = result_document(measurement_record(
            generator, protocol, rows, label=arguments.label, model_name=str(model_name),
            random_weights=arguments.random_weights, load_seconds=load_seconds,
            tokenizer_source="accelgen built-in default" if tokenizer_path == str(DEFAULT_MODEL) else tokenizer_path,
        ))
        if arguments.output:
            write_result(arguments.output, document)
            print(f"accelgen: wrote {arguments.output}", file=sys.stderr)
        if arguments.json:
            print_json(document)
    leave_process_group()
    return 0


def compare_command(arguments: argparse.Namespace) -> int:
    if arguments.plot:
        check_chart_possible(arguments.plot)
    table = comparison_table(load_measurements(arguments.files), METRICS[arguments.metric], arguments.baseline)
    print(render_text(table))
    if arguments.markdown:
        write_text_file(arguments.markdown, render_markdown(table))
    if arguments.plot:
        draw_chart(table, arguments.plot)
    return 0


def here_or_launched(arguments: argparse.Namespace, settings: dict, argv: Sequence[str], command) -> int:
    """Run ``command`` in this process (one rank of a launched job, or a one-rank job), or launch the
    job's ranks when several are asked for; each rank then runs ``command``."""
    if running_as_worker():
        launched_size = World.from_environment().size
        if arguments.world_size not in (None, launched_size):
            raise UsageError(f"--world-size {arguments.world_size} differs from the launcher's {launched_size} ranks.")
    elif arguments.world_size not in (None, 1):
        return launch(arguments, settings, argv)
    return command(arguments, settings)


def open_inputs(arguments: argparse.Namespace) -> tuple[TextRows, CompletionWriter | None]:
    """The texts to complete and the output writer, both checked; nothing is loaded or written yet."""
    if arguments.dataset:
        rows = open_rows(DatasetRequest(
            source=arguments.dataset, column=arguments.column, split=arguments.split, config=arguments.dataset_config,
            limit=arguments.limit, streaming=arguments.streaming,
        ))
    else:
        rows = TextRows(iter(arguments.prompt), len(arguments.prompt))
    writer = None
    if arguments.output:
        writer = CompletionWriter.open(arguments.output, _run_description(arguments), arguments.overwrite)
    return rows, writer


def _run_description(arguments: argparse.Namespace) -> dict:
    """What decides an output file's rows: a resumed run must match it."""
    if arguments.dataset:
        source = dict(dataset=arguments.dataset, dataset_config=arguments.dataset_config, split=arguments.split,
                      column=arguments.column)
    else:
        source = dict(prompts_sha256=hashlib.sha256(json.dumps(arguments.prompt).encode()).hexdigest())
    settings = ("dtype", "batch_size", "max_new_tokens", "max_input_tokens", "ignore_eos", "buckets", "do_sample",
                "temperature", "top_k", "top_p", "seed")
    return dict(model=arguments.model or "accelgen built-in default", **source,
                **{name: list(value) if isinstance(value := getattr(arguments, name), tuple) else value
                   for name in settings})


def launch(arguments: argparse.Namespace, settings: dict, argv: Sequence[str]) -> int:
    """Check what can be checked here, then start this node's share of the ranks."""
    world_size, nnodes = arguments.world_size, arguments.nnodes
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1 (got {world_size}).")
    if nnodes < 1 or world_size % nnodes:
        raise UsageError(f"--world-size {world_size} must be a multiple of --nnodes {nnodes}: each node runs as many ranks.")
    if not 0 <= arguments.node_rank < nnodes:
        raise UsageError(f"--node-rank must be between 0 and {nnodes - 1} (got {arguments.node_rank}).")
    accelerator, _ = resolve(**settings)
    per_node = world_size // nnodes
    if accelerator.one_process_per_device and per_node > accelerator.device_count():
        raise UsageError(
            f"--world-size {world_size} needs {per_node} {accelerator.name} devices on this node, which has "
            f"{accelerator.device_count()}: lower --world-size or add nodes with --nnodes."
        )
    if getattr(arguments, "random_weights", False):
        config = resolve_model_config(str(arguments.model_config or arguments.model or DEFAULT_MODEL), arguments.trust_remote_code)[1]
    else:
        config = load_config(arguments.model, arguments.trust_remote_code)
    check_shardable(config, world_size)
    if arguments.command == "run":
        open_inputs(arguments)
    master_port = arguments.master_port or (free_port() if nnodes == 1 else 29500)
    if arguments.node_rank == 0:
        check_port_free(arguments.master_addr, master_port)
    _quiet_transformers()
    plan = LaunchPlan(world_size, nnodes, arguments.node_rank, arguments.master_addr, master_port)
    return launch_workers(argv, plan, accelerator.launch_command(list(argv), plan))


def generate_command(arguments: argparse.Namespace, settings: dict) -> int:
    """Load, generate and report, in this process (one rank of a job, or the whole job)."""
    _quiet_transformers()
    rows, writer = open_inputs(arguments)
    done = writer.completed_rows if writer else 0
    is_main = World.from_environment().is_main
    if rows.total is not None and done >= rows.total:
        if is_main:
            print(f"accelgen: all {rows.total} rows are already in {arguments.output}; nothing to do.", file=sys.stderr)
        return 0
    if done and is_main:
        print(f"accelgen: resuming: {done} rows already in {arguments.output}", file=sys.stderr)
    accelerator, run = resolve(**settings)
    generator = None
    try:
        started = time.perf_counter()
        generator = load(arguments.model, **settings)
        loaded = time.perf_counter()
        _inject_fault_if_asked(generator.world)
        _generate_rows(generator, arguments, rows, writer, done, is_main)
    except Exception as error:  # noqa: BLE001 - out of memory becomes advice, anything else goes on up
        if accelerator.is_out_of_memory(error):
            raise UsageError(_out_of_memory_line(accelerator, run, arguments, generator)) from None
        raise
    rank_memory = gather_from_ranks(
        {"parameter_bytes": parameter_bytes(generator.model), **generator.accelerator.memory_stats()}, generator.world
    )
    if is_main:
        _print_summary(generator, load_seconds=loaded - started, total_seconds=time.perf_counter() - loaded)
        _print_rank_memory(rank_memory, generator.unsharded_parameter_bytes)
    leave_process_group()
    return 0


def _generate_rows(generator, arguments: argparse.Namespace, rows: TextRows, writer: CompletionWriter | None,
                   done: int, is_main: bool) -> None:
    """Generate every row not yet done; rank 0 prints and writes each batch as it comes."""
    progress = Progress(rows.total, done) if is_main and arguments.dataset else None
    first_batch = done // arguments.batch_size + 1
    texts = itertools.islice(rows.texts, done, None)
    try:
        for batch_number, completions in enumerate(generator.generate_batches(texts, done), start=first_batch):
            if is_main and not arguments.quiet:
                print_batch(batch_number, completions)
            if is_main and writer:
                writer.write(completions)
            if progress:
                progress.update(len(completions))
    finally:
        if writer:
            writer.close()
        if progress:
            progress.close()


def _out_of_memory_line(accelerator, run, arguments: argparse.Namespace, generator) -> str:
    """The out-of-memory error as one line, with a batch size or world size that would fit."""
    world = World.from_environment()
    config = load_config(arguments.model, arguments.trust_remote_code)
    if generator is not None:
        weight_bytes_per_rank = parameter_bytes(generator.model)
        bucket_length = generator.last_bucket_length or min(run.buckets)
    else:  # the weights themselves did not fit
        weight_bytes_per_rank = parameter_bytes_of_config(config, run.dtype) // world.size
        bucket_length = min(run.buckets)
    advice = out_of_memory_advice(
        config, dtype=run.dtype, batch_size=run.batch_size, cache_length=bucket_length + run.max_new_tokens,
        world_size=world.size, weight_bytes_per_rank=weight_bytes_per_rank,
        total_bytes=accelerator.memory_stats().get("total_bytes"),
    )
    kept = f" (rows finished so far are kept in {arguments.output})" if arguments.output else ""
    return f"Out of memory on {accelerator.name} with --batch-size {run.batch_size} and --world-size {world.size}{kept}: {advice}"


def _inject_fault_if_asked(world: World) -> None:
    """Fault injection for tests and drills: ACCELGEN_FAULT_RANK=N makes rank N fail after loading."""
    fault_rank = os.environ.get("ACCELGEN_FAULT_RANK")
    if fault_rank is not None and int(fault_rank) == world.rank:
        raise RuntimeError(f"injected fault on rank {world.rank} (ACCELGEN_FAULT_RANK={fault_rank})")


def _print_summary(generator, load_seconds: float, total_seconds: float) -> None:
    stats = generator.stats
    decode_seconds = sum(timing.decode_seconds for timing in stats.timings)
    decode_steps = sum(timing.decode_steps for timing in stats.timings)
    per_token_ms = 1000 * decode_seconds / max(decode_steps, 1)
    print(
        f"accelgen: {stats.new_tokens} new tokens in {total_seconds:.2f} s "
        f"({stats.new_tokens / max(total_seconds, 1e-9):.1f} tokens/s, decode {per_token_ms:.2f} ms/step), "
        f"model loaded in {load_seconds:.2f} s, device {generator.accelerator.name}, dtype {generator.run.dtype}, "
        f"world size {generator.world.size}, graph captures: {stats.graph_captures}"
        + (f" ({stats.capture_seconds:.1f} s)" if stats.graph_captures else "")
        + (", decoded eagerly: the decode step could not be captured" if generator.capture_failure else ""),
        file=sys.stderr,
    )


def _print_rank_memory(rank_memory: list[dict], unsharded_parameter_bytes: int) -> None:
    """One line: each rank's parameter bytes against the unsharded model, and its memory statistics."""
    shares = " / ".join(f"{memory['parameter_bytes']:,}" for memory in rank_memory)
    ratios = " / ".join(f"{memory['parameter_bytes'] / unsharded_parameter_bytes:.2f}x" for memory in rank_memory)
    statistics = "; ".join(
        f"{name} per rank " + " / ".join(f"{memory[name]:,}" for memory in rank_memory)
        for name in rank_memory[0]
        if name != "parameter_bytes"
    )
    print(
        f"accelgen: parameter bytes per rank {shares} of {unsharded_parameter_bytes:,} unsharded ({ratios})"
        + (f"; {statistics}" if statistics else ""),
        file=sys.stderr,
    )


def _quiet_transformers() -> None:
    """Keep transformers' progress bars and advice off the terminal; errors still surface as ours."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hub_logging.set_verbosity_error()  # its retry chatter; the failure itself comes back as our one line


if __name__ == "__main__":
    sys.exit(main())
