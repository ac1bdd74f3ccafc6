"""The ``accelgen`` command: parses arguments and calls the core. Nothing here knows a device."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from typing import Sequence

import pluggy

from accelgen.accelerators import AUTO_DEVICE, registered_accelerators
from accelgen.api import load, resolve
from accelgen.dataset_rows import DatasetRequest, TextRows, open_rows
from accelgen.errors import UsageError
from accelgen.launcher import check_port_free, free_port, launch_workers, record_worker_failure, running_as_worker
from accelgen.models import load_config
from accelgen.output import CompletionWriter, print_batch, describe_plugin
from accelgen.plugins import get_plugin_manager
from accelgen.progress import Progress
from accelgen.settings import DEFAULT_BUCKETS, DTYPES, LaunchPlan, World
from accelgen.tensor_parallel import check_shardable, gather_from_ranks, leave_process_group, parameter_bytes


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line (and exit status 2) instead of usage text."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accelgen", description="Static-shape LLM text generation on any accelerator.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="generate completions for prompts")
    run.add_argument("--device", default=AUTO_DEVICE, help="accelerator name (see 'accelgen devices'); default: best available")
    run.add_argument("--model", help="Hub id or local folder (default: the built-in demo model)")
    run.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    data = run.add_argument_group("dataset completion (instead of --prompt)")
    data.add_argument("--dataset", help="Hub dataset id, local JSON/JSONL/CSV/Parquet file or folder, or a save_to_disk folder")
    data.add_argument("--dataset-config", help="the dataset's configuration (Hub datasets with several)")
    data.add_argument("--split", default="train", help="split to complete (default: train)")
    data.add_argument("--column", default="text", help="column holding the prompts (default: text)")
    data.add_argument("--limit", type=int, help="complete only the first N rows")
    data.add_argument("--streaming", action="store_true", help="read rows as needed (datasets larger than memory)")
    run.add_argument("--overwrite", action="store_true", help="replace an --output file of another run instead of refusing")
    run.add_argument("--max-new-tokens", type=int, default=100)
    run.add_argument("--max-input-tokens", type=int, help="keep only the first N tokens of each prompt")
    run.add_argument("--batch-size", type=int, default=1, help="fixed batch shape; the last batch is padded")
    run.add_argument("--dtype", choices=DTYPES, help="default: the device's (float32 on cpu)")
    run.add_argument("--buckets", type=_int_list, default=DEFAULT_BUCKETS, help="prompt length buckets, e.g. 32,64,128")
    run.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    run.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="capture the decode step as a graph (default: the device decides)")
    run.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--trust-remote-code", action="store_true", help="allow model code from the Hub to run")
    run.add_argument("--output", help="write one JSON line per prompt to this file")
    run.add_argument("--quiet", action="store_true", help="print no completions, only the summary")
    parallel = run.add_argument_group("tensor parallelism (started with torch's elastic launcher)")
    parallel.add_argument("--world-size", type=int, help="ranks in the whole job, all nodes together (default 1)")
    parallel.add_argument("--nnodes", type=int, default=1, help="machines taking part (run accelgen on each)")
    parallel.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 to nnodes-1")
    parallel.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, reachable from every node")
    parallel.add_argument("--master-port", type=int, help="free port on node 0 (default: any free port on one node, 29500 on several)")

    commands.add_parser("devices", help="list every registered accelerator and whether it can run here")
    return parser


def main(argv: Sequence[str] | None = None, plugin_manager: pluggy.PluginManager | None = None) -> int:
    """Entry point of the ``accelgen`` script; returns the exit status (2 for a user mistake)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker = running_as_worker()
    try:
        arguments = build_parser().parse_args(argv)
        plugin_manager = plugin_manager or get_plugin_manager()
        if arguments.command == "devices":
            return devices_command(plugin_manager)
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
    if running_as_worker():
        launched_size = World.from_environment().size
        if arguments.world_size not in (None, launched_size):
            raise UsageError(f"--world-size {arguments.world_size} differs from the launcher's {launched_size} ranks.")
    elif arguments.world_size not in (None, 1):
        return launch(arguments, settings, argv)
    return generate_command(arguments, settings)


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
    check_shardable(load_config(arguments.model, arguments.trust_remote_code), world_size)
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
    started = time.perf_counter()
    generator = load(arguments.model, **settings)
    loaded = time.perf_counter()
    _inject_fault_if_asked(generator.world)
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
    rank_memory = gather_from_ranks(
        {"parameter_bytes": parameter_bytes(generator.model), **generator.accelerator.memory_stats()}, generator.world
    )
    if is_main:
        _print_summary(generator, load_seconds=loaded - started, total_seconds=time.perf_counter() - loaded)
        _print_rank_memory(rank_memory, generator.unsharded_parameter_bytes)
    leave_process_group()
    return 0


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
        f"world size {generator.world.size}, graph captures: {stats.graph_captures}",
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


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None


def _quiet_transformers() -> None:
    """Keep transformers' progress bars and advice off the terminal; errors still surface as ours."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hub_logging.set_verbosity_error()  # its retry chatter; the failure itself comes back as our one line


if __name__ == "__main__":
    sys.exit(main())
