"""The decode step traced into TorchScript: its operations replayed without the Python around them.

A step that is not compiled (a job too short for inductor's compile to pay for itself, or one whose compile waits until
its rows say it pays) spends much of its time in Python between its operations: module calls, transformers' wrappers,
the core's own code. The tracer runs the step once and records the operations it runs; the graph it makes runs them
from C++, the plugin's operators among them, for the cost of that one run. The step's shapes are static, so that one
trace per shape serves every call. The graph runs as recorded, without TorchScript's optimizations, which take the
tensors a graph holds but never writes for constants: the core writes some of them between calls (a LoRA adapter loaded
into its buffers). A step in which the host reads a value from a tensor (a branch on data) would be replayed with this
call's outcome: the tracer warns of every such read, and any warning refuses the trace (the step then runs as it is).
Branches on sizes read them as numbers (``accelgen.common.static_sizes``), which warns of nothing.

``torch.jit.trace`` is deprecated since torch 2.13 in favour of ``torch.compile`` and ``torch.export``: the one costs a
compile (seconds), the other replays its graph in Python. It still works; where a later torch removes it, the step runs
as it is.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


class StepNotTraceable(RuntimeError):
    """The step reads a value from its tensors on the host (what the tracer said), or the tracer is gone."""


def traced(step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...]) -> Callable[..., torch.Tensor]:
    """``step`` traced over ``example_inputs`` (which the one run of the trace reads and updates, as a call would), or
    StepNotTraceable. A step that is a module is traced as one: the tensors it holds as its state (its parameters and
    buffers, its submodules') are the graph's module's, freed with it; any other tensor the step reads becomes a
    constant of the graph, which torch keeps until the process ends."""
    trace = getattr(torch.jit, "trace", None)
    if trace is None:
        raise StepNotTraceable("this torch has no torch.jit.trace")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit.trace's own, said above
        with torch.no_grad():
            step_graph = trace(step, example_inputs, check_trace=False)
    reads = [warning for warning in said if issubclass(warning.category, torch.jit.TracerWarning)]
    if reads:
        first = reads[0]
        raise StepNotTraceable(f"{str(first.message).split('.')[0]} at {first.filename}:{first.lineno}")

    inline = getattr(torch._C, "_jit_pass_inline", None)
    if inline is not None and isinstance(step_graph, torch.jit.ScriptModule):
        # the calls of the step's submodules inlined into its graph, before its first run: one graph where each of the
        # model's modules was a method call of the interpreter's (some sixty a step)
        inline(step_graph.graph)

    def replay(*buffers: torch.Tensor) -> torch.Tensor:
        # As recorded, without TorchScript's optimizations: they take the tensors the graph holds and never writes
        # itself for constants (a LoRA adapter's buffers, which the core writes between calls, folded as they were)
        with torch.jit.optimized_execution(False):
            return step_graph(*buffers)

    return replay
