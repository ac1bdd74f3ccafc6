"""The ``accelgen`` commands (run, bench, shard, compare, devices): each parses, calls the core and prints.

Nothing here knows a device; the arguments are declared in ``accelgen.cli.parser``. The layers below are
imported inside the commands that use them, so that ``accelgen --help`` and ``accelgen compare`` start
without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import sys
import warnings
from typing import TYPE_CHECKING, Callable, Sequence

from accelgen.cli.parser import build_parser
from accelgen.cli.signals import Stopped, interrupts_end_at_once, signals_stop_the_command
from accelgen.cli.terminal import (
    bench_progress_line,
    closed_reader_streams,
    describe_plugin,
    discard_output_to,
    flush_output,
    print_batch,
    print_error_rows,
    print_summary,
    quiet_libraries,
    show_our_warnings_as_lines,
)
from accelgen.common.errors import CLOSED_OUTPUT_STATUS, EVERY_ROW_FAILED_STATUS, UsageError
from accelgen.common.output_files import holds_rows
from accelgen.common.settings import World
from accelgen.parallel.launcher import record_worker_failure, running_as_worker
from accelgen.parallel.worker_processes import lost_a_peer, restarts_so_far, written_by_this_job

if TYPE_CHECKING:
    from accelgen.plugin.manager import PluginManager
    from accelgen.session.request import Request


#: The largest --json-schema file read: a schema of many kilobytes is large; a file of megabytes is not one.
SCHEMA_MOST_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Invocation:
    """One call of the command line: its arguments, as given and as parsed, and where this process runs."""

    argv: list[str]
    arguments: argparse.Namespace
    worker: bool  # a rank started by a launcher (ours, torchrun or DeepSpeed's), not the user's own process
    world: World  # this process among the job's ranks, read once from the launcher's environment (one replica)


def main(argv: Sequence[str] | None = None, plugin_manager: PluginManager | None = None) -> int:
    """Entry point of the ``accelgen`` script; returns the exit status (2 for a user mistake, 3 when every row of
    the run's output is an error row (``--skip-bad-rows``), 141 when the
    reader of the output closed it: the command stops quietly, what it wrote to files is kept; 128 + the
    signal's number when SIGTERM or SIGHUP stopped it, what it made for itself removed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker, world = running_as_worker(), World.from_environment()
    arguments = None
    with warnings.catch_warnings(), signals_stop_the_command(worker) as stop:
        show_our_warnings_as_lines(shown=not worker or world.is_main)
        try:
            arguments = build_parser().parse_args(argv)
            status = _run(Invocation(argv, arguments, worker, world), plugin_manager)
            flush_output()
            return status
        except BrokenPipeError:
            closed = closed_reader_streams()
            if not closed:
                raise  # not our output: a connection lost, shown as it is
            discard_output_to(closed)
            return CLOSED_OUTPUT_STATUS
        except UsageError as error:
            if not worker:
                print(f"accelgen: error: {error}", file=sys.stderr)
            elif not record_worker_failure(error):  # torch's launcher would print it once for the whole job
                print(f"accelgen: error: [rank {world.rank}] {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if not worker:
                print(f"accelgen: interrupted{_kept(arguments)}", file=sys.stderr)
            return 130
        except Stopped as stopped:
            return _stopped(stopped.signal_number, arguments)
        except Exception as error:
            if stop.interrupted:  # a library made the Ctrl-C raised inside its code an error of its own
                print(f"accelgen: interrupted{_kept(arguments)}", file=sys.stderr)
                return 130
            if stop.signal_number is not None:  # a library made the Stopped raised inside its code an error of its own
                return _stopped(stop.signal_number, arguments)
            if worker:
                record_worker_failure(error)
                if lost_a_peer(error):  # the launcher names the rank that went first; this one says nothing
                    return 1
            raise


def script(argv: Sequence[str] | None = None) -> int:
    """The ``accelgen`` script and ``python -m accelgen.cli``: :func:`main` in a process of its own, the collector kept
    off what the command's start builds (``accelgen.common.collector``)."""
    from accelgen.common.collector import command_process

    with command_process():
        return main(argv)


def _stopped(signal_number: int, arguments: argparse.Namespace | None) -> int:
    """Say that SIGTERM or SIGHUP stopped the command; its exit status."""
    print(f"accelgen: stopped ({signal.Signals(signal_number).name}){_kept(arguments)}", file=sys.stderr)
    return 128 + signal_number


def _kept(arguments: argparse.Namespace | None) -> str:
    """What the line of a stopped ``accelgen run`` with an output adds: where its finished rows are, and how to go on."""
    if arguments is None or getattr(arguments, "command", None) != "run" or not getattr(arguments, "output", None):
        return ""
    if not holds_rows(arguments.output):
        return ": no row had finished yet"
    return f": the rows finished are kept in {arguments.output}, and the same command resumes"


def _run(invocation: Invocation, plugin_manager: PluginManager | None) -> int:
    command = invocation.arguments.command
    if command == "compare":
        return compare_command(invocation.arguments)
    with interrupts_end_at_once(f"accelgen: interrupted{_kept(invocation.arguments)}"):
        from accelgen.plugin.manager import get_plugin_manager

        plugin_manager = plugin_manager or get_plugin_manager()
    if command == "devices":
        return devices_command(plugin_manager, prepare=invocation.arguments.prepare, as_json=invocation.arguments.json)
    return {"bench": bench_command, "shard": shard_command, "run": run_command, "score": run_command,
            "eval": eval_command}[command](invocation, plugin_manager)


def devices_command(plugin_manager: PluginManager, prepare: bool = False, as_json: bool = False) -> int:
    """List every accelerator, and under each available one what its plugin's own kernels are (``describe()``'s
    ``kernels``); with ``prepare``, each available accelerator's ``prepare_machine()`` first; ``as_json``: the same
    facts as one JSON document."""
    from accelgen.plugin.isolation import SKIP_VARIABLE
    from accelgen.plugin.registry import accelerator_registry, warn_about_old_forms

    registry = accelerator_registry(plugin_manager)
    warn_about_old_forms(registry, list(registry.accelerators))
    listed = []
    for accelerator in registry.accelerators.values():
        available = accelerator.is_available()
        if available and prepare:
            for line in accelerator.prepare_machine():
                print(f"{accelerator.name}: {line}", file=sys.stderr)
        listed.append({"name": accelerator.name, "available": available, "plugin": describe_plugin(accelerator),
                       **({"devices": accelerator.device_count(), "quantize": list(accelerator.quantization_schemes),
                           "kernels": accelerator.describe().get("kernels")} if available
                          else {"unavailable": accelerator.unavailable_reason()})})
    if as_json:
        print(json.dumps({"accelerators": listed, "broken": [plugin.line() for plugin in registry.broken],
                          "skipped": [str(plugin) for plugin in registry.skipped]}, indent=2))
        return 0
    for listing in listed:
        status = (f"available, {listing['devices']} device(s)" + "".join(f", --quantize {scheme}" for scheme in
                                                                        listing["quantize"])
                  if listing["available"] else f"unavailable: {listing['unavailable']}")
        print(f"{listing['name']:<8} {status}  [{listing['plugin']}]")
        if listing.get("kernels"):
            print(f"{'':<8} {listing['kernels']}")
    for plugin in registry.broken:
        print(f"{'broken':<8} plugin {plugin.line()}")
    for plugin in registry.skipped:
        print(f"{'skipped':<8} plugin {plugin} (left out by {SKIP_VARIABLE})")
    return 0


def run_command(invocation: Invocation, plugin_manager: PluginManager) -> int:
    """``accelgen run``, and ``accelgen score`` (the same job, its rows scored: ``accelgen.jobs.score_lines``)."""
    arguments = invocation.arguments
    scoring = arguments.command == "score"
    scored_column = (arguments.continuation_column or arguments.choices_column) if scoring else None
    if scored_column is not None and not arguments.dataset:
        flag = "--choices-column" if arguments.choices_column else "--continuation-column"
        raise UsageError(f"{flag} names a column of --dataset: pass --dataset (a --prompt text is scored alone).")
    if arguments.prompt and arguments.dataset:
        raise UsageError("Pass --prompt or --dataset, not both.")
    if not arguments.prompt and not arguments.dataset:
        what = "texts to score" if scoring else "prompts"
        raise UsageError(f"No {what} given: pass --prompt TEXT (repeat it for several) or --dataset SOURCE.")
    if arguments.lora_column is not None and not arguments.dataset:
        raise UsageError("--lora-column names a column of --dataset (each row's adapter); --prompt rows run on the base "
                         "model: complete a dataset, or drop --lora-column.")
    with interrupts_end_at_once(f"accelgen: interrupted{_kept(arguments)}"):  # until the output is opened
        from accelgen.jobs.completion_job import open_job
        from accelgen.jobs.dataset_rows import DatasetRequest

        if arguments.schema_column and not arguments.dataset:
            raise UsageError("--schema-column names a column of --dataset holding each row's schema: pass --dataset, "
                             "or --json-schema FILE for the --prompt texts.")
        if arguments.ray is None and (arguments.replicas != 1 or arguments.replica_resources is not None):
            flag = "--replicas" if arguments.replicas != 1 else "--replica-resources"
            raise UsageError(f"{flag} says how replicas run on a Ray cluster: add --ray, or use --data-parallel on one "
                             f"machine.")
        if arguments.ray is not None:
            _check_cluster_options(arguments, invocation.worker)
        request = _request(arguments, plugin_manager, _replica_world(invocation), _cluster_device(arguments, plugin_manager),
                           chat_template=_chat_template(arguments.chat_template_file),
                           json_schema=_json_schema(arguments.json_schema_file),
                           # a score's work is its prefills: no decode step worth capturing
                           **({"prompt_logprobs": arguments.token_logprobs or 0, "graphs": False} if scoring else {}))
        # before the output is opened: each rank of a replica holds a store of its share of the heads
        request.check_prefix_store(request.world.size if invocation.worker
                                   else max(1, (arguments.world_size or 1) // arguments.data_parallel))
        if arguments.ray is None and not invocation.worker and arguments.world_size in (None, 1) and arguments.data_parallel == 1:
            from accelgen.model.empty_model import import_model_code

            import_model_code(request.model.config())  # the model is built in this process: its code, now
    if arguments.lora_column is not None and not request.run.lora.named:
        raise UsageError("--lora-column names each row's adapter among those given by name: add --lora NAME=PATH for "
                         "each, or drop --lora-column.")
    dataset = DatasetRequest(
        source=arguments.dataset, column=arguments.column, split=arguments.split, config=arguments.dataset_config,
        limit=arguments.limit, streaming=arguments.streaming, skip_bad_rows=arguments.skip_bad_rows,
        schema_column=arguments.schema_column, adapter_column=arguments.lora_column, adapters=request.run.lora,
        scores=scoring, scored_column=scored_column, choices=scoring and arguments.choices_column is not None,
    ) if arguments.dataset else None
    # the launcher of the node holding rank 0 locks the output for its ranks; a worker locks when it is rank 0
    # and no launcher of ours holds the lock (torchrun started by hand)
    job = open_job(request, prompts=arguments.prompt, dataset=dataset, output=arguments.output,
                   # a restarted worker resumes what the job wrote (an output from before it is still replaced)
                   overwrite=arguments.overwrite and not (restarts_so_far() and written_by_this_job(arguments.output)),
                   lock_output=request.world.is_main if invocation.worker else arguments.node_rank == 0,
                   served_model_names=arguments.served_model_name, scores=_score_lines(arguments) if scoring else None)
    try:
        if arguments.ray is not None:
            return _generate(arguments, request, job)  # the replicas are Ray's; this process drives them
        return _here_or_launched(invocation, request, lambda: _generate(arguments, request, job))
    finally:
        job.close()  # the output's lock, held by the launcher for the whole of a tensor-parallel job


def _score_lines(arguments: argparse.Namespace):
    """What the lines of ``accelgen score`` hold, by its options."""
    from accelgen.jobs.score_lines import ScoreLines

    kind = "choices" if arguments.choices_column else "continuation" if arguments.continuation_column else "text"
    return ScoreLines(kind, arguments.token_logprobs)


def _chat_template(path: str | None) -> str | None:
    """The text of the ``--chat-template`` file, checked, or None."""
    if path is None:
        return None
    from accelgen.jobs.chat_template import read_chat_template

    return read_chat_template(path)


def _json_schema(path: str | None) -> object:
    """The JSON Schema of the ``--json-schema`` file (a small regular file; checked further by the request), or None."""
    if path is None:
        return None
    from accelgen.common.errors import UsageError
    from accelgen.common.input_files import read_small_text_file
    from accelgen.common.structure import schema_value

    fix = "pass a UTF-8 file holding a JSON Schema, e.g. {\"type\": \"object\", \"properties\": {...}}"
    text = read_small_text_file(path, "--json-schema", SCHEMA_MOST_BYTES, fix)
    try:
        schema = schema_value(text)
    except ValueError as error:
        raise UsageError(f"--json-schema {path!r} {error}: {fix}") from None
    if schema is None:  # None would be no --json-schema at all
        raise UsageError(f"--json-schema {path!r} holds null, not a JSON Schema: {fix}")
    return schema


def _replica_world(invocation: Invocation) -> World:
    """This process's place in the job, in its replica (``--data-parallel``), once a worker's split is checked
    (the user's own process launches the ranks, or is the whole job)."""
    from accelgen.parallel.launcher import check_data_parallel

    job = invocation.world
    if not invocation.worker:
        return job
    check_data_parallel(job.size, invocation.arguments.data_parallel, job.local_size)
    return job.in_replicas(invocation.arguments.data_parallel)


def _generate(arguments: argparse.Namespace, request: Request, job) -> int:
    """Generate in this process (one rank of a job, or the whole job) and report; rank 0 prints and writes."""
    from accelgen.jobs.completion_job import complete
    from accelgen.parallel.process_groups import leave_process_group

    quiet_libraries()
    is_main = request.world.is_main
    if job.finished:
        if is_main:
            print(f"accelgen: all {job.rows.total} rows are already in {job.output}; nothing to do.", file=sys.stderr)
        return 0
    if (job.done or job.samples_kept) and is_main:
        samples = f", and {job.samples_kept} samples of row {job.done}" if job.samples_kept else ""
        print(f"accelgen: resuming: {job.done} rows already in {job.output}{samples}", file=sys.stderr)
    on_batch = None if arguments.quiet else functools.partial(print_batch, error_of=job.lines.error_of)
    show_progress = bool(arguments.dataset) or arguments.num_samples > 1
    if arguments.ray is not None:
        report = _complete_on_cluster(arguments, request, job, on_batch, show_progress)
    else:
        report = complete(request, job, on_batch=on_batch, show_progress=show_progress)
    every_row_failed = False
    if is_main and report is None:  # every replica was lost at the very end, with what it did
        print(f"accelgen: the rows are written{f' in {job.output}' if job.output else ''}; the replicas' figures were "
              f"lost with them", file=sys.stderr)
    elif is_main:
        job.record_last_run(report)
        print_summary(report, job, details=arguments.details)
        every_row_failed = print_error_rows(*job.error_rows(report), report, job)
    leave_process_group()
    return EVERY_ROW_FAILED_STATUS if every_row_failed else 0


def eval_command(invocation: Invocation, plugin_manager: PluginManager) -> int:
    """``accelgen eval``: lm-evaluation-harness's tasks on the engine; the tasks found before the model loads."""
    from accelgen.jobs.lm_eval_model import task_manager

    arguments = invocation.arguments
    index = task_manager(arguments.tasks, arguments.include_path)  # lm_eval installed, every task found
    request = _request(arguments, plugin_manager, invocation.world)
    return _here_or_launched(invocation, request, lambda: _evaluate(arguments, request, index))


def _evaluate(arguments: argparse.Namespace, request: Request, index) -> int:
    """Evaluate in this process (one rank of a job, or the whole job); rank 0 prints the table and writes --output."""
    from accelgen.jobs.lm_eval_model import evaluate_generator, result_table
    from accelgen.parallel.process_groups import leave_process_group
    from accelgen.session.api import load_request

    quiet_libraries()
    results = evaluate_generator(load_request(request), arguments.tasks, index, limit=arguments.limit,
                                 num_fewshot=arguments.num_fewshot, output_path=arguments.output,
                                 log_samples=arguments.log_samples, max_length=arguments.max_length)
    if results is not None:  # rank 0
        print(result_table(results))
        if arguments.output:
            print(f"accelgen: wrote {arguments.output}", file=sys.stderr)
    leave_process_group()
    return 0


def bench_command(invocation: Invocation, plugin_manager: PluginManager) -> int:
    from accelgen.bench.protocol import BenchProtocol
    from accelgen.bench.result_file import check_output_path

    arguments = invocation.arguments
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
    # sized for the largest batch of the sweep: what --offload keeps room for on the device
    request = _request(arguments, plugin_manager, invocation.world, ignore_eos=True,
                       batch_size=max(protocol.batch_sizes), json_schema=_json_schema(arguments.json_schema_file))
    return _here_or_launched(invocation, request, lambda: _measure(arguments, request, protocol))


def _measure(arguments: argparse.Namespace, request: Request, protocol) -> int:
    """Measure in this process; rank 0 reports each batch size as it is done and writes the result file with
    the sizes measured so far (a later abort keeps them)."""
    from accelgen.bench.measure import run_benchmark
    from accelgen.bench.result_file import print_json, write_result
    from accelgen.parallel.process_groups import leave_process_group

    quiet_libraries()
    sweep = len(set(protocol.batch_sizes))

    def report(row: dict, document: dict) -> None:
        line = bench_progress_line(row, protocol.max_new_tokens)
        if arguments.output:
            write_result(arguments.output, document)
            measured = len(document["measurements"][0]["results"])
            line += f"; kept in {arguments.output}" + (f" ({measured} of {sweep} batch sizes)" if sweep > 1 else "")
        print(line, file=sys.stderr, flush=True)

    def say(what: str) -> None:
        print(f"accelgen: bench: {what}", file=sys.stderr, flush=True)

    document = run_benchmark(request, protocol, arguments.label, report=report,
                             **({} if arguments.quiet else {"say": say}))
    if document is not None:
        if arguments.output:
            print(f"accelgen: wrote {arguments.output}", file=sys.stderr)
        if arguments.json:
            print_json(document)
    leave_process_group()
    return 0


def shard_command(invocation: Invocation, plugin_manager: PluginManager) -> int:
    from accelgen.jobs.shard_job import check_shard_request, remove_staging_left

    arguments = invocation.arguments
    if arguments.world_size is None:
        raise UsageError("accelgen shard needs --world-size N: the number of ranks the runs will use.")
    request = _request(arguments, plugin_manager, invocation.world)
    check_shard_request(request, arguments.output, arguments.overwrite)
    status = None
    try:
        status = _here_or_launched(invocation, request, lambda: _shard(arguments, request))
        return status
    finally:
        if status != 0 and not invocation.worker and arguments.node_rank == 0:
            # the job did not complete and none of its ranks runs any more: what they wrote goes (a full disk back)
            remove_staging_left(arguments.output)


def _shard(arguments: argparse.Namespace, request: Request) -> int:
    """Write this rank's part of the pre-sharded model (rank 0 completes the folder)."""
    from accelgen.jobs.shard_job import shard_model
    from accelgen.parallel.process_groups import leave_process_group

    quiet_libraries()
    files = shard_model(request, arguments.output, arguments.max_file_mib << 20)
    if request.world.is_main:
        print(f"accelgen: wrote {arguments.output}: {request.world.size} rank(s), {request.run.dtype}, {files} file(s)",
              file=sys.stderr)
    leave_process_group()
    return 0


def compare_command(arguments: argparse.Namespace) -> int:
    """Bench result files into tables and a chart; output files of the same rows into their agreement."""
    from accelgen.bench.output_agreement import DEFAULT_TOLERANCE, are_output_files, compare_outputs

    if are_output_files(arguments.files):
        print(compare_outputs(arguments.files, baseline=arguments.baseline, markdown=arguments.markdown, plot=arguments.plot,
                              tolerance=DEFAULT_TOLERANCE if arguments.tolerance is None else arguments.tolerance))
        for path, what in ((arguments.markdown, "the Markdown table"), (arguments.plot, "the chart")):
            if path:
                print(f"accelgen: wrote {what} to {os.path.abspath(path)}", file=sys.stderr)
        return 0
    if arguments.tolerance is not None:
        raise UsageError("--tolerance applies to output files of accelgen run / score: drop it for bench result files.")
    from accelgen.bench.compare import (
        METRICS,
        check_chart_columns,
        check_chart_possible,
        check_outputs_apart,
        comparison_table,
        draw_chart,
        load_measurements,
        render_markdown,
        render_text,
        write_text_file,
    )
    from accelgen.common.output_files import check_output_file

    if arguments.plot:
        check_chart_possible(arguments.plot)
    if arguments.markdown:
        check_output_file(arguments.markdown, "--markdown", "table.md")
    check_outputs_apart(arguments.files, {option: path for option, path in
                                          (("--markdown", arguments.markdown), ("--plot", arguments.plot)) if path})
    table = comparison_table(load_measurements(arguments.files), METRICS[arguments.metric], arguments.baseline)
    if arguments.plot:
        check_chart_columns(table)
    print(render_text(table))
    if arguments.markdown:
        write_text_file(arguments.markdown, "--markdown", render_markdown(table))
        print(f"accelgen: wrote the Markdown table to {os.path.abspath(arguments.markdown)}", file=sys.stderr)
    if arguments.plot:
        draw_chart(table, arguments.plot)
        print(f"accelgen: wrote the chart to {os.path.abspath(arguments.plot)}", file=sys.stderr)
    return 0


def _request(arguments: argparse.Namespace, plugin_manager: PluginManager, world: World, cluster_device: str | None = None,
             **fixed_settings) -> Request:
    """The request the command's arguments make for this process's ``world`` (``fixed_settings`` are not the
    user's to choose); with ``cluster_device``, for replicas on that device of a Ray cluster's nodes, which this
    machine need not have."""
    from accelgen.session.request import build_request

    return build_request(
        getattr(arguments, "model_config", None) or arguments.model,
        random_weights=getattr(arguments, "random_weights", False), device=cluster_device or arguments.device,
        device_here=cluster_device is None, trust_remote_code=arguments.trust_remote_code, plugin_manager=plugin_manager,
        world=world, **_settings(arguments) | fixed_settings,
    )


def _settings(arguments: argparse.Namespace) -> dict:
    """The run settings the command's arguments give (``accelgen.common.run_options``)."""
    from accelgen.common.run_options import SETTING_NAMES

    return {name: getattr(arguments, name) for name in SETTING_NAMES if hasattr(arguments, name)}


def _cluster_device(arguments: argparse.Namespace, plugin_manager: PluginManager) -> str | None:
    """With --ray, the device of the replicas: --device, or for auto the best one the cluster's nodes hold (joining the
    cluster to see them); None without --ray."""
    if getattr(arguments, "ray", None) is None:
        return None
    from accelgen.plugin.registry import AUTO_DEVICE
    from accelgen.ray.cluster import cluster_device, connect

    if arguments.device != AUTO_DEVICE:
        return arguments.device
    return cluster_device(connect(arguments.ray or None), plugin_manager, arguments.device)


def _check_cluster_options(arguments: argparse.Namespace, worker: bool) -> None:
    """Refuse what does not go with --ray: the options of accelgen's own launcher, and tensor parallelism inside a
    replica (not built yet)."""
    if worker:
        raise UsageError("--ray starts its replicas itself: run it as one command, not under torchrun or a launcher.")
    for flag, given in (("--data-parallel", arguments.data_parallel != 1), ("--nnodes", arguments.nnodes != 1),
                        ("--node-rank", arguments.node_rank != 0)):
        if given:
            raise UsageError(f"{flag} is for a job accelgen launches itself; with --ray, say how many copies of the model "
                             f"share the rows with --replicas, and Ray places them: drop {flag}.")
    if arguments.offload is not None:
        raise UsageError("--offload goes with one process on one machine: drop --ray or --offload.")


def _complete_on_cluster(arguments: argparse.Namespace, request: Request, job, on_batch, show_progress: bool):
    """Complete ``job`` on the Ray cluster the arguments name (``accelgen.ray.cluster_job``): its report."""
    from accelgen.ray.cluster import ReplicaResources
    from accelgen.ray.cluster_job import ClusterPlan, complete_on_cluster
    from accelgen.ray.replica import ReplicaRecipe

    # the settings build each replica's request; the run they make is replaced by the one the driver decided
    ranks = arguments.world_size or 1  # each replica's, on one node
    request.check_world_size(ranks)
    recipe = ReplicaRecipe(arguments.model, request.accelerator.name, False, arguments.trust_remote_code, _settings(arguments),
                           world_size=ranks)
    resources = (ReplicaResources.of(arguments.replica_resources) if arguments.replica_resources is not None
                 else ReplicaResources.of(request.accelerator.cluster_resources(), ranks))
    plan = ClusterPlan(arguments.replicas, resources, arguments.ray or None, arguments.max_restarts)
    return complete_on_cluster(request, job, recipe, plan, on_batch, show_progress)


def _here_or_launched(invocation: Invocation, request: Request, command: Callable[[], int]) -> int:
    """Run ``command`` in this process (one rank of a launched job, or a one-rank job), or launch the
    job's ranks when several are asked for; each rank then runs the same command line."""
    arguments = invocation.arguments
    data_parallel = getattr(arguments, "data_parallel", 1)
    if invocation.worker:
        job_size = request.world.size * request.world.replicas
        if arguments.world_size not in (None, job_size):
            raise UsageError(f"--world-size {arguments.world_size} differs from the launcher's {job_size} ranks.")
    elif arguments.world_size not in (None, 1) or data_parallel > 1:
        from accelgen.parallel.launcher import check_node_devices, launch_job, plan_launch

        # restarted workers resume an output; without one they would print every completion again
        restarts = getattr(arguments, "max_restarts", 0) if getattr(arguments, "output", None) else 0
        plan = plan_launch(arguments.world_size or 1, arguments.nnodes, arguments.node_rank, arguments.master_addr,
                           arguments.master_port, data_parallel, restarts, arguments.node_wait)
        check_node_devices(request.accelerator, plan)
        request.check_world_size(plan.world_size, data_parallel)
        quiet_libraries()
        ended = launch_job(request.accelerator, plan, invocation.argv)
        if ended.line is not None:
            stopped = ended.status in (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP)
            print(f"accelgen: {ended.line}{_kept(arguments) if stopped else ''}", file=sys.stderr)
        return ended.status
    return command()
