"""What a run shows: completions and summaries on the terminal, warnings as lines (the completions file is
``accelgen.jobs.completion_file``)."""

from __future__ import annotations

import os
import select
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

from accelgen.common.errors import AccelgenWarning
from accelgen.parallel.worker_processes import restarts_so_far
from accelgen.plugin.contract import Accelerator
from accelgen.plugin.manager import package_of

if TYPE_CHECKING:  # not imported at run time: `accelgen --help` and `accelgen compare` import no torch
    from accelgen.generation.text import Completion
    from accelgen.jobs.completion_job import CompletionJob, RunReport



def print_batch(batch_number: int, completions: Sequence["Completion"], error_of: Callable[["Completion"], str]) -> None:
    """Print a batch the way the published text-generation examples do: each prompt, then its output (each sample's,
    with ``--num-samples``); an error row as the row it is and why (``error_of``)."""
    print(f"Batch n°{batch_number}")
    for completion in completions:
        if completion.finish_reason == "error":
            print(f"Error: {error_of(completion)}")
            continue
        print(f"Input: {completion.prompt!r}")
        if completion.finish_reason == "scored":
            print(f"Score: {score_phrase(completion)}")
            continue
        samples = completion.completions or [{"completion": completion.completion}]
        for number, sample in enumerate(samples, start=1):
            label = f"Output (sample {number}/{len(samples)})" if len(samples) > 1 else "Output"
            print(f"{label}: {completion.prompt + sample['completion']!r}")
    print(flush=True)


def score_phrase(completion: "Completion") -> str:
    """What a scored row's line says, in words: its text's log-likelihood and perplexity, its continuation's or its
    best choice."""
    from accelgen.generation.prompt_scores import best_of  # after a run: torch is loaded

    scores = completion.prompt_scores
    phrase = f"log-likelihood {scores.total():.4f} over {len(scores.token_ids) - 1} tokens after the first"
    if (perplexity := scores.perplexity()) is not None:
        phrase += f", perplexity {perplexity:.3f}"
    continuations = completion.continuations or []
    if len(continuations) == 1:
        [continuation] = continuations
        greedy = "the greedy continuation" if continuation.greedy else "not the greedy continuation"
        phrase += f"; continuation {continuation.text!r}: {continuation.logprob:.4f} ({greedy})"
    elif continuations:
        best = best_of([choice.logprob for choice in continuations])
        phrase += f"; best of {len(continuations)} choices: {best} ({continuations[best].text!r}, {continuations[best].logprob:.4f})"
    return phrase


def flush_output() -> None:
    """Send what is still buffered for standard output now, so that a reader gone away (``| head -1``) shows as
    BrokenPipeError inside the command, not as an error at exit."""
    sys.stdout.flush()


def closed_reader_streams() -> list[int]:
    """The standard output and error descriptors whose reader has gone (a pipe whose reading end is closed
    reports POLLERR); empty when a BrokenPipeError came from elsewhere (then it is a bug or a lost connection)."""
    poll = select.poll()
    for descriptor in (1, 2):
        poll.register(descriptor, select.POLLOUT)
    return [descriptor for descriptor, events in poll.poll(0) if events & select.POLLERR]


def discard_output_to(descriptors: list[int]) -> None:
    """Point ``descriptors`` at the null device: what Python would still flush at exit is dropped quietly
    instead of raising BrokenPipeError again."""
    null = os.open(os.devnull, os.O_WRONLY)
    for descriptor in descriptors:
        os.dup2(null, descriptor)
    os.close(null)


def describe_plugin(accelerator: Accelerator) -> str:
    """``module from distribution version`` of the code that provides ``accelerator``, for ``accelgen devices``."""
    module = type(accelerator).__module__
    package = package_of(accelerator)
    return f"{module} from {package}" if package else module


def print_error_rows(error_rows: int, rows: int, report: "RunReport", job: "CompletionJob") -> bool:
    """Say on stderr how many of the job's ``rows`` are error rows (``--skip-bad-rows``; a batch file's requests that
    could not be served), if any, in the job's terms; when every one is, as an error line naming the first and why.
    Whether every row is one (the run then exits with ``EVERY_ROW_FAILED_STATUS``)."""
    if not error_rows:
        return False
    where = f" in {job.output}" if job.output else ""
    if error_rows < rows:
        print(f"accelgen: {job.lines.error_rows_line(error_rows, rows, where)}", file=sys.stderr)
        return False
    first = "" if not report.first_error else f"; {report.first_error}" if rows == 1 else f"; the first, {report.first_error}"
    fix = f"Fix {'it' if rows == 1 else 'them'}" + (", then run again with --overwrite" if job.output else " and run again")
    print(f"accelgen: error: {job.lines.every_row_failed_line(rows, where)}{first}. {fix}.", file=sys.stderr)
    return True


def print_summary(report: "RunReport", job: "CompletionJob", details: bool = False) -> None:
    """On stderr, one line: the rows completed, the new tokens and their rate, the load time, where the output is. With
    ``details``, then what the run ran on and how (``print_details``)."""
    noun = job.noun if report.rows == 1 else f"{job.noun}s"
    capturing = f", {report.capture_seconds:.1f} s of it capturing the decode step" if report.capture_seconds >= 1 else ""
    if report.prompt_logprobs is not None and report.new_tokens <= report.rows:  # rows scored (accelgen score)
        tokens = report.prompts.tokens if report.prompts else 0
        done = (f"{report.rows:,} {noun} scored, {tokens:,} tokens in {report.generate_seconds:.2f} s "
                f"({report.rows_per_second:,.1f} rows/s, {tokens / max(report.generate_seconds, 1e-9):,.1f} tokens/s)")
    else:
        done = (f"{report.rows:,} {noun}, {report.new_tokens:,} new tokens in {report.generate_seconds:.2f} s "
                f"({report.tokens_per_second:,.1f} tokens/s{capturing})")
    kept = f" ({report.kept_weights})" if report.kept_weights else ""
    print(f"accelgen: {done}; model loaded in {report.load_seconds:.2f} s{kept}"
          f"{_restarts()}" + (f"; written to {job.output}" if job.output else ""), file=sys.stderr)
    if details:
        print_details(report)


def print_details(report: "RunReport") -> None:
    """On stderr: one line of the device, dtype, world size, decode step, graph captures, batching and prompts' prefill;
    one of each replica's rows and tokens and the job's rows/s, with --data-parallel; one of where offloaded weights
    sat, when they were; one of each rank's parameter bytes and memory (the writer's replica's ranks)."""
    print(
        f"accelgen: device {report.device}"
        + ("" if report.device_settings is None else f" ({report.device_settings})") + f", dtype {report.dtype}"
        + ("" if report.quantize is None else f" ({report.quantize} weights)") + ", "
        f"world size {_world_size(report)}, decode {report.ms_per_decode_step:.2f} ms/step, "
        f"graph captures: {report.graph_captures}"
        + (f" ({report.capture_seconds:.1f} s)" if report.graph_captures else "")
        + (", decoded eagerly: the decode step could not be captured" if report.capture_failure else "")
        + (f", decode steps traced: {report.step_traces}" if report.step_traces else "")
        + f"; {report.batching} batching"
        + ("" if report.slot_occupancy is None else f", slot occupancy {100 * report.slot_occupancy:.0f}%")
        + _prompt_figures(report.prompts) + _structure_figures(report.structure)
        + ("" if report.adapters is None else f"; {report.adapters.describe()}"),
        file=sys.stderr,
    )
    if report.replicas:
        print("accelgen: " + "; ".join(
            f"replica {replica.replica}: {replica.rows} rows, {replica.new_tokens} kept tokens in {replica.seconds:.2f} s"
            for replica in report.replicas) + f"; the job: {report.rows} rows in {report.generate_seconds:.2f} s "
            f"({report.rows_per_second:.2f} rows/s)" + _held_back(report.replicas), file=sys.stderr)
    if report.offload is not None:
        print(f"accelgen: {report.offload}", file=sys.stderr)
    print_rank_memory(report.rank_memory, report.unsharded_parameter_bytes)


def _prompt_figures(prompts) -> str:
    """What the summary line says of the prompts' prefill: tokens in prompts, run through the model, and taken
    from the prefix store (with how many prompts found their beginning there, and the store's size)."""
    if prompts is None or not prompts.tokens:
        return ""
    said = f"; prompt tokens {prompts.tokens:,}, prefilled {prompts.prefilled:,} ({prompts.prefilled / prompts.tokens:.0%})"
    if prompts.prefix_store_bytes is None:
        return said + ", prefix reuse off"
    hits = f"{prompts.prefix_hits} prompt{'' if prompts.prefix_hits == 1 else 's'}"
    return said + (f", {prompts.reused:,} from the prefix store ({hits} found a beginning there; store "
                   f"{prompts.prefix_store_bytes / 2**20:,.0f} MiB)")


def _structure_figures(structure) -> str:
    """What the summary line says of rows held to a structure: how many, their grammars' compile time, and the
    host's share of the decode time spent following their tokens."""
    if structure is None:
        return ""
    share = "" if structure.mask_share is None else f", masks {100 * structure.mask_share:.1f}% of decode time"
    return f"; {structure.rows} rows constrained (grammars compiled in {structure.compile_seconds:.3f} s{share})"


def _held_back(replicas: list) -> str:
    """What the summary says of replicas held back by a slower one (``accelgen.jobs.row_exchange``), if any."""
    held = [replica for replica in replicas if replica.waited_seconds > 0]
    if not held:
        return ""
    return "; held back by a slower replica's row: " + ", ".join(
        f"replica {replica.replica} waited {replica.waited_seconds:.2f} s" for replica in held)


def _restarts() -> str:
    """What the summary says of the workers' restarts after a failure (``--max-restarts``): the figures are those of
    the workers' last start, which resumed the output."""
    restarts = restarts_so_far()
    return f" (workers started again {restarts} time{'' if restarts == 1 else 's'}; figures since)" if restarts else ""


def _world_size(report: "RunReport") -> str:
    if not report.replicas:
        return str(report.world_size)
    replicas = len(report.replicas)
    return f"{report.world_size * replicas} ({replicas} replicas of {report.world_size})"


def print_rank_memory(rank_memory: list[dict], unsharded_parameter_bytes: int) -> None:
    """One line: each rank's parameter bytes against the unsharded model, and its memory statistics."""
    shares = " / ".join(f"{memory['parameter_bytes']:,}" for memory in rank_memory)
    ratios = " / ".join(f"{memory['parameter_bytes'] / unsharded_parameter_bytes:.2f}x" for memory in rank_memory)
    statistics = "; ".join(
        f"{name} per rank " + " / ".join(f"{memory[name]:,}" for memory in rank_memory)
        for name in rank_memory[0]
        if name.startswith("peak_")  # what the run held at most (free and total memory are the machine's, not the run's)
    )
    if "host_bytes_before_loading" in rank_memory[0]:
        added = " / ".join(f"{memory['peak_host_bytes_loading'] - memory['host_bytes_before_loading']:,}" for memory in rank_memory)
        statistics += f"; host bytes added while loading per rank {added}"
    print(
        f"accelgen: parameter bytes per rank {shares} of {unsharded_parameter_bytes:,} unsharded ({ratios})"
        + (f"; {statistics}" if statistics else ""),
        file=sys.stderr,
    )


def show_our_warnings_as_lines(shown: bool) -> None:
    """accelgen's own warnings as one ``accelgen: warning: ...`` line each (on rank 0 only); others as usual."""
    library_default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, AccelgenWarning):
            library_default(message, category, filename, lineno, file, line)
        elif shown:
            print(f"accelgen: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def quiet_libraries() -> None:
    """Keep transformers' progress bars and advice off the terminal; errors still surface as ours."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hub_logging.set_verbosity_error()  # its retry chatter; the failure itself comes back as our one line


def bench_progress_line(row: dict[str, Any], max_new_tokens: int) -> str:
    """One line per measured configuration, for the terminal."""
    if row["status"] == "oom":
        return f"accelgen: bench batch size {row['batch_size']}: out of memory (recorded as oom); going on"
    roofline = row["roofline_percent"]
    return (
        f"accelgen: bench batch size {row['batch_size']}: {row['end_to_end_s']['median']:.3f} s for "
        f"{max_new_tokens} tokens, first token {row['first_token_ms']:.1f} ms, decode "
        f"{row['decode_ms_per_token']['median']:.2f} ms/token (p90 {row['decode_ms_per_token']['p90']:.2f}), "
        f"{row['tokens_per_second']:.1f} tokens/s, {row['ms_per_token_per_sequence']:.2f} ms/token/sequence, "
        f"roofline {'unknown' if roofline is None else f'{roofline:.1f}%'}, graph captures {row['graph_captures']}"
        + (f" ({row['capture_seconds']:.1f} s)" if row["graph_captures"] else "")
        + ("" if row.get("mask_share") is None else f", masks {100 * row['mask_share']:.1f}% of decode time "
           f"({row['constrained_rows']} rows constrained, grammar compiled in {row['grammar_compile_seconds']:.3f} s)")
        + ("" if not row.get("lora_rows") else "; LoRA rows " + ", ".join(
            f"{name} {count}" for name, count in row["lora_rows"].items()) + f", {row['lora_loads']} loads")
    )
