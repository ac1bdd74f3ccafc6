"""What a run shows: completions and summaries on the terminal, warnings as lines (the completions file is
``accelgen.jobs.completion_file``)."""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Sequence

from accelgen.common.errors import AccelgenWarning
from accelgen.generation.generator import Completion
from accelgen.plugin.contract import Accelerator
from accelgen.plugin.manager import package_of

if TYPE_CHECKING:
    from accelgen.jobs.completion_job import CompletedRun


def print_batch(batch_number: int, completions: Sequence[Completion]) -> None:
    """Print a batch the way the published text-generation examples do."""
    print(f"Batch n°{batch_number}")
    for completion in completions:
        print(f"Input: {completion.prompt!r}")
        print(f"Output: {completion.prompt + completion.completion!r}")
    print(flush=True)


def describe_plugin(accelerator: Accelerator) -> str:
    """``module from distribution version`` of the code that provides ``accelerator``, for ``accelgen devices``."""
    module = type(accelerator).__module__
    package = package_of(accelerator)
    return f"{module} from {package}" if package else module


def print_summary(result: "CompletedRun") -> None:
    """One line on stderr: tokens, speed, load time, device, dtype, world size, graph captures."""
    generator = result.generator
    stats = generator.stats
    decode_seconds = sum(timing.decode_seconds for timing in stats.timings)
    decode_steps = sum(timing.decode_steps for timing in stats.timings)
    per_token_ms = 1000 * decode_seconds / max(decode_steps, 1)
    print(
        f"accelgen: {stats.new_tokens} new tokens in {result.generate_seconds:.2f} s "
        f"({stats.new_tokens / max(result.generate_seconds, 1e-9):.1f} tokens/s, decode {per_token_ms:.2f} ms/step), "
        f"model loaded in {result.load_seconds:.2f} s, device {generator.accelerator.name}, dtype {generator.run.dtype}, "
        f"world size {generator.world.size}, graph captures: {stats.graph_captures}"
        + (f" ({stats.capture_seconds:.1f} s)" if stats.graph_captures else "")
        + (", decoded eagerly: the decode step could not be captured" if generator.capture_failure else ""),
        file=sys.stderr,
    )
    if generator.placement is not None:
        print(f"accelgen: {generator.placement.describe()}", file=sys.stderr)


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
