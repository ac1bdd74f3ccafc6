"""The plugin contract: the hook a plugin implements and the accelerator objects it registers.

A plugin is a module (or object) with functions marked ``@accelgen.hookimpl``. Plugins are found in
two ways, through one plugin manager (see ``accelgen.plugin.manager``): the built-in ones by module name,
and third-party ones through the ``accelgen`` entry-point group, e.g. in a plugin's pyproject::

    [project.entry-points.accelgen]
    my_device = "accelgen_my_device"

Hooks are called with keyword arguments only; an implementation may accept a subset of them.
Set ``ACCELGEN_TRACE_HOOKS=1`` to print every hook call to stderr.

The core calls a plugin's code (its import, its hooks, the members of its accelerators that list and choose
devices) through ``accelgen.plugin.isolation``: whatever that code raises, ``SystemExit`` included, sets the
plugin aside with one line naming it, and the other devices go on working. ``ACCELGEN_SKIP_PLUGINS=name,...``
leaves plugins out (an entry point's name, a built-in's module name, a package's name, or ``*`` for every
installed plugin that is not built in).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Protocol

import pluggy

if TYPE_CHECKING:  # torch is imported where a method needs it: `accelgen --help` must not pay for it
    import torch
    from transformers import PretrainedConfig

    from accelgen.common.settings import LaunchPlan, RunSettings, World

hookspec = pluggy.HookspecMarker("accelgen")
hookimpl = pluggy.HookimplMarker("accelgen")


@hookspec
def accelgen_register_accelerators(register: Callable[["Accelerator"], None]) -> None:
    """Register the accelerators this plugin provides by calling ``register(accelerator)`` for each.

    ``accelerator`` is an :class:`Accelerator`. Register it whether or not its hardware is present:
    availability is asked later through ``is_available()``, so that ``accelgen devices`` can say why a
    device cannot be used. Each one is checked as it registers; a broken one is refused with one line
    naming this plugin and what is wrong, and the other devices go on working. When two plugins register
    the same ``name``, the one registered later with the plugin manager wins (third-party plugins load
    after the built-ins, so an installed plugin can replace a built-in accelerator).
    """


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What a device may tune, apart from what it must declare: how the core best drives it. Every field has the
    default that suits an eager device needing nothing special; an accelerator replaces the ones its hardware does
    differently (``tuning = Tuning(captures_by_default=True, captures_prefill=False)``, or
    ``dataclasses.replace(Parent.tuning, ...)`` in a subclass). A device that keeps every default runs every job right,
    if perhaps slower than it could. Until ``accelgen.plugin.old_forms.OLD_TUNING_ACCEPTED_UNTIL`` a knob set on the
    accelerator itself (the contract before Tuning) is read as its tuning, with a deprecation line."""

    #: Whether ``capture`` is applied when the user neither asks for graphs nor turns them off.
    captures_by_default: bool = False
    #: With ``captures_by_default``: the decode steps a job's rows left must take before capturing pays for
    #: itself (a compiler's cost, seconds to minutes, against what it saves per step); a shorter job, or one whose
    #: length is not known (a call of the Python API), runs eagerly, and one that may be long enough starts eagerly
    #: until its ended rows say (``accelgen.generation.capture_decision``). 0: capturing always pays.
    capture_pays_after_steps: int = 0
    #: Whether the prefill shapes (a row count and a prompt bucket each) are captured too, or only the decode step.
    #: False where one capture costs more than the prefills of a shape save (a compiler: each shape compiles anew).
    captures_prefill: bool = True
    #: Whether an eager prefill (one not captured) runs its prompts one after another in one row, kept apart by the
    #: mask, instead of padded to the longest: every padding position a pass computes is saved, where the model's
    #: attention reads only the positions each query sees (a kernel of the device's own; a dense attention would
    #: compute the square of the row). Where the model's family allows (``Architecture.packs_prompts``).
    packs_prompts: bool = False
    #: Whether its kernels compute nothing for a row of zeros (its output a row of zeros, as the product gives it): a
    #: decode step's finished rows and empty slots, which see nothing, then run on zeros in place of their tokens'
    #: embeddings (``ModelForward``), and in a model without biases cost nothing in its linear layers.
    skips_zero_rows: bool = False
    #: In continuous batching, what one prefill pass costs beyond its prompts' own work (a pass's fixed overhead),
    #: in decode steps of the whole batch. Where it is more than nothing, slots freed while rows run wait for more to
    #: free, idle, until their idle slot-steps add up to that cost: one pass then starts several rows. 0: a freed
    #: slot takes the next row at the next look.
    prefill_pass_steps: float = 0
    #: True when the device's int8 also quantizes an output head that holds a weight of its own (not tied to the
    #: input embedding, not split over ranks): ``quantize`` passes ``head=True`` to
    #: ``accelgen.quantization.model_layers.quantize_linear_layers``; offloading and memory estimates count it.
    int8_quantizes_head: bool = False
class LinearLayout(Protocol):
    """A weight [out, in] that the core writes itself, and may write again, laid out for a device's own product."""

    def product(self, x: "torch.Tensor") -> "torch.Tensor":
        """x [M, in] times the weight as last laid out: x @ weight^T [M, out] (in captured steps too)."""

    def refresh(self) -> None:
        """The core wrote the weight: lay it out again, in place (captured steps keep the addresses they read)."""


#: ``draw(logits [B, V], inverse_temperatures [B], uniform [B]) -> token ids [B]`` (``Accelerator.token_draw``)
TokenDraw = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


class Accelerator(abc.ABC):
    """Everything that is specific to one kind of hardware. The core calls nothing else device-specific.

    Subclass it and write what your hardware does differently: ``name`` and the abstract methods
    ``is_available`` and ``setup`` are required (Python refuses to create an accelerator without them);
    every other member has the default documented on it, which suits an eager device that needs nothing
    special (no graphs, no tensor parallelism, no launcher of its own).

    Methods are called in this order during a run: (``worker_environment`` and ``launch_command`` in the
    launching process, when several ranks are asked for) -> ``is_available`` -> ``setup`` -> ``shard``
    while the model loads (only when ``world.size > 1``) -> ``prepare_model`` -> ``capture`` (once per
    static shape), or ``trace_step`` for a step not captured -> ``mark_step`` after every forward pass ->
    ``synchronize`` / ``memory_stats`` while measuring. None of them may import a vendor library at module import time: import it inside the
    method, so that ``import`` works on any machine. None reads the launcher's environment (``RANK``,
    ``WORLD_SIZE``...): the core reads it once and passes the :class:`~accelgen.common.settings.World` down.
    """

    #: Short name users pass as ``--device``, e.g. ``"npu"``. Required.
    name: str = ""
    #: ``torch.distributed`` backend for tensor parallelism, e.g. ``"nccl"``.
    dist_backend: str = "gloo"
    #: Dtypes this device runs, by their names in ``accelgen.common.settings.DTYPES``.
    supported_dtypes: tuple[str, ...] = ("float32",)
    #: Dtype used when the user asks for none; one of ``supported_dtypes``.
    default_dtype: str = "float32"
    #: Tie-breaker for ``--device auto``: the available accelerator with the highest priority is used.
    priority: int = 0
    #: True when each rank needs a device of its own (GPUs, Gaudi cards): a node then runs at most
    #: ``device_count()`` ranks. False where ranks share the device (CPU).
    one_process_per_device: bool = False
    #: True when the device computes in the host's own memory (the CPU): ``--offload cpu`` would make no
    #: room there, so only ``--offload disk`` is offered and accepted.
    shares_host_memory: bool = False
    #: Weight quantization schemes this device runs (``--quantize``), by their names in
    #: ``accelgen.common.settings.QUANTIZATION_SCHEMES``; asking for another is refused in one line.
    quantization_schemes: tuple[str, ...] = ()
    #: How the core best drives this device (graph capture, prefill, continuous batching): :class:`Tuning`'s defaults
    #: suit an eager device; a plugin replaces what its hardware does differently, e.g.
    #: ``tuning = Tuning(captures_by_default=True)``.
    tuning: Tuning = Tuning()

    @abc.abstractmethod
    def is_available(self) -> bool:
        """True when this machine can run on the device (software stack importable, hardware present)."""

    def unavailable_reason(self) -> str:
        """One sentence saying why ``is_available()`` is False and what to install or check.
        Only called when ``is_available()`` returned False. Default: that the plugin gives no reason."""
        return f"the plugin providing {self.name!r} gives no reason"

    def device_count(self) -> int:
        """Number of devices of this kind on this machine. Default: 1 when available, else 0."""
        return 1 if self.is_available() else 0

    @abc.abstractmethod
    def setup(self, world: "World") -> "torch.device":
        """Select the device for this process (rank ``world.rank`` of ``world.size``, ``world.local_rank``
        on its node) and return it. Must not initialise the process group: the core does that with
        ``dist_backend``."""

    def prepare_model(self, model: "torch.nn.Module", device: "torch.device", run: "RunSettings", world: "World") -> "torch.nn.Module":
        """Return the model ready for this device, with any device-specific patches. The model arrives with
        its weights in ``run.dtype`` on ``device`` (what ``setup`` returned), already split by ``shard`` under
        tensor parallelism (``world.size > 1``); the buffers that must stay float32 (rotary frequencies) are
        float32: do not cast the whole model again. With ``run.offload`` only part of the weights is on the
        device and Accelerate's hooks bring the rest in every forward pass: do not move the model.
        Default: the model as it is."""
        return model

    def shard(self, model: "torch.nn.Module", world: "World", run: "RunSettings") -> "torch.nn.Module":
        """Return the model split over ``world.size`` ranks with tensor parallelism: this rank's part, its
        parameters allocated on this rank's device; or raise ``accelgen.common.errors.UsageError`` saying why it
        cannot be. Called while the model loads, only when ``world.size > 1``, after the core has joined the
        process group with ``dist_backend``. The model usually arrives empty (parameters on the meta device):
        the core fills the parameters afterwards, each rank reading only its part of the checkpoint.
        ``accelgen.parallel.deepspeed_adapter.shard_with_deepspeed`` does all of this with DeepSpeed-Inference (AutoTP).
        Default: refused, since DeepSpeed may not know the device."""
        from accelgen.common.errors import UsageError

        raise UsageError(f"--world-size > 1 is not supported on {self.name}: its plugin does not shard models.")

    def check_shard(self, ranks: int) -> None:
        """Raise ``accelgen.common.errors.UsageError`` when this machine cannot split a model over ``ranks`` ranks
        with ``shard`` (a library it needs is not installed, say), in one line naming what to install. Called in the
        launching process before any rank starts, only when ``ranks > 1`` (a replica's ranks, under data
        parallelism). ``accelgen.parallel.deepspeed_adapter.require_deepspeed`` checks for DeepSpeed.
        Default: refused where ``shard`` is not written (it refuses), else nothing."""
        if type(self).shard is Accelerator.shard:
            self.shard(None, None, None)  # raises its UsageError

    def quantize(
        self, model: "torch.nn.Module", scheme: str, run: "RunSettings", calibrate: Callable[["torch.nn.Module"], None]
    ) -> "torch.nn.Module":
        """Return the model with its weights quantized to ``scheme`` (one of ``quantization_schemes``), for this
        device's kernels. Called after ``prepare_model``: the model is this rank's part, its weights in
        ``run.dtype`` on the device. ``accelgen.quantization.model_layers`` quantizes every linear layer, split by
        tensor parallelism or not, given the device's product (weight-only: activations stay in ``run.dtype``).
        A scheme that quantizes activations too needs their ranges: ``calibrate(model)`` runs the model given
        (as the quantizing library has prepared it to measure) over the core's calibration text, the same
        passes on every rank of a tensor-parallel job. Default: refused (no scheme is declared by default,
        so the core refuses ``--quantize`` before loading)."""
        from accelgen.common.errors import UsageError

        raise UsageError(f"--quantize {scheme} is not supported on {self.name}.")

    def capture_pays_after(self, config: "PretrainedConfig", run: "RunSettings", world: "World") -> int:
        """The decode steps a job of this model (its ``config``) with these settings must be expected to take before
        capturing its step pays for itself on this machine (with ``tuning.captures_by_default``; a shorter job runs
        eagerly). A device whose capture costs less when it has captured the same step before (a compiler with a
        cache) may answer less then; the answer only decides whether the step is captured, never what it computes.
        Called before the model loads. Default: ``tuning.capture_pays_after_steps``."""
        return self.tuning.capture_pays_after_steps

    def capture(
        self, step: Callable[..., "torch.Tensor"], example_inputs: tuple["torch.Tensor", ...], run: "RunSettings"
    ) -> Callable[..., "torch.Tensor"]:
        """Return a callable equivalent to ``step`` that replays a captured graph (CUDA graph, HPU
        graph, compiled code). ``step(*inputs)`` is the whole decode step: it reads and updates the static-shape
        buffers ``inputs`` in place (and the KV cache), never waits for the host, and returns the chosen
        tokens; ``example_inputs`` are those buffers, holding valid values (``accelgen.generation.decoding.DecodeState``).
        The returned callable is called with the same buffers (same shapes and addresses) for every decoded
        token and must have the same effect on them; what it returns is not read. ``capture`` may run
        ``step`` (to warm up or compile); the core sets the buffers again afterwards. It is called once
        per static shape, and again for a shape whose buffers and cache were made anew (the KV cache grows
        when a longer prompt bucket is met); the calls are counted. With ``capture_pays_after_steps`` it may be
        called while rows run in the buffers (a job found long enough as its rows end).

        When the step cannot be captured, raise (the step's own error says best why): the core then runs it
        eagerly, with one warning, and tries no more captures for that model. An error that
        ``is_out_of_memory`` recognises is reported as running out of memory instead.
        Default: the step itself (no graphs)."""
        return step

    def trace_step(
        self, step: Callable[..., "torch.Tensor"], example_inputs: tuple["torch.Tensor", ...], run: "RunSettings"
    ) -> Callable[..., "torch.Tensor"]:
        """Return ``step`` in a form that costs less per call and next to nothing to make (a trace of its operations
        that the device's runtime replays without the Python around them, made in one run of the step), for a decode
        step that ``capture`` does not take: a job too short for a capture to pay, or one whose capture waits until
        its rows say it pays. ``step`` and ``example_inputs`` are as for ``capture``, and what it returns is called
        the same way, with the same buffers; ``step`` is a module holding the model and the shape's cache as its state
        (``accelgen.generation.slot_shapes.DecodeStep``), so that a trace of it holds them as its module's, not as
        constants. Not called when the user turns graphs off (``--no-graphs``) or weights
        are offloaded. Raise when the step cannot be traced (a value the host reads from its tensors, an operation the
        runtime does not know): the core then runs it as it is, without a word (the same computation), keeps the
        reason in the run record, and tries no more traces for that model.
        Default: the step itself."""
        return step

    def linear_layout(self, weight: "torch.Tensor") -> LinearLayout | None:
        """A layout of ``weight`` [out, in], a product's weight that the core keeps and may write again (the stacked
        LoRA adapters of ``accelgen.adapters.lora_layer``, written when an adapter takes a buffer slot), for a product
        of this device's own that is faster than torch's over the weight as stored; called once per weight, on this
        device, after ``prepare_model``. Default: None (torch's product)."""
        return None

    def token_draw(self) -> "TokenDraw | None":
        """The device's own operator for a seeded draw, where it has one: ``draw(logits [B, V], inverse_temperatures
        [B], uniform [B]) -> token ids [B]`` (int64), the token ``accelgen.generation.sampling.choose_tokens`` draws
        when nothing is filtered out (no top-k, top-p or structure): the weights exp((logit - largest) x inverse
        temperature), those of an exponent below -87 zero, drawn from as ``sampling.draw`` draws, the same token up to
        the rounding of the weights. It runs inside captured steps: it must not wait for the host. Default: None (the
        core's torch operations, some thirty a step)."""
        return None

    def mark_step(self) -> None:
        """Called after each forward pass the core issues (the prefill, then every decode step, captured
        or not) and the token choice that follows it. Lazy-mode devices flush the operations queued so
        far here (Habana's ``htcore.mark_step()``). Must not wait for the device. Default: nothing."""

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work (for timing). Default: nothing, for devices
        whose operations have finished when they return."""

    def memory_stats(self) -> dict[str, int]:
        """Memory figures for reports, in bytes: ``peak_allocated_bytes`` when known (peak device memory
        held by tensors since the process started), and where the device can tell, ``free_bytes`` and
        ``total_bytes`` of its memory now: ``free_bytes`` is what ``--offload`` fills when the user gives no
        ``--max-device-memory`` (the user is asked for one where it is missing), ``total_bytes`` what the
        advice after running out of memory is sized by. Default: none known."""
        return {}

    def is_out_of_memory(self, error: BaseException) -> bool:
        """True when ``error`` says this device ran out of memory. The core then reports it as such (one
        line, with a batch size that would fit) instead of a crash, and ``accelgen bench`` records "oom"
        for that configuration and goes on with the next. Default: ``torch.OutOfMemoryError`` or
        Python's ``MemoryError``."""
        import torch

        return isinstance(error, (torch.OutOfMemoryError, MemoryError))

    def worker_environment(self, plan: "LaunchPlan") -> dict[str, str]:
        """Environment variables every rank of a job of ``plan.world_size`` ranks needs set before it starts
        (a vendor runtime that reads them when it loads); a value the user set wins. Default: none."""
        return {}

    def clean_up_after_workers(self, plan: "LaunchPlan") -> None:
        """Called on each node once all its ranks of the job ``plan`` have ended, however they ended: release what
        ranks may have left on the node (a rank killed outright runs no clean-up of its own). Default: nothing."""

    def launch_command(self, worker_argv: list[str], plan: "LaunchPlan") -> list[str] | None:
        """The command that starts this node's ranks of a job of ``plan.world_size`` ranks, or None to
        use torch's elastic launcher (torchrun), which suits most devices.

        Each rank the command starts must run ``python -m accelgen.cli <worker_argv>`` with RANK,
        WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (as torchrun and DeepSpeed's launcher do),
        and the command must exit non-zero when a rank fails. Devices whose vendor documents another
        launcher (Habana: DeepSpeed's launcher or mpirun) return it here. Default: None."""
        return None

    def cluster_resources(self) -> dict[str, Any]:
        """What one rank on this device asks of a Ray cluster's node, in the keywords of Ray's ``.options``
        (``num_cpus``, ``num_gpus``, ``resources={"NAME": n}``): ``accelgen run --ray`` places each replica on a node
        that has its ranks' worth (``--replica-resources`` says otherwise). Default: one CPU."""
        return {"num_cpus": 1}

    def summary_phrase(self) -> str | None:
        """What this accelerator chose for the run that its user should see, as a phrase the summary line shows
        after the device's name (the CPU: how many threads, of how many cores, and why), or None. Called after the
        run. Default: None."""
        return None

    def prepare_machine(self) -> list[str]:
        """Do this device's once-per-machine work now, ahead of the first job (``accelgen devices --prepare``, for
        images, cluster nodes and CI): build kernels of the plugin's own, say. Returns lines saying what is ready;
        raises ``accelgen.common.errors.UsageError`` saying why it cannot be done. Called only where
        ``is_available()``. Default: nothing to do."""
        return []

    def describe(self) -> dict[str, Any]:
        """Facts for reports and ``accelgen devices``: ``device_name``, ``device_count``, and where
        known ``driver``, ``peak_memory_bandwidth_gbps`` and ``peak_bf16_tflops`` (None if unknown); optionally
        ``kernels``, one line on kernels of the plugin's own (which, for which instructions, whether built), which
        ``accelgen devices`` shows under the device. Must not build or load anything.
        Default: the accelerator's name and count, nothing else known."""
        return {
            "device_name": self.name,
            "device_count": self.device_count(),
            "driver": None,
            "peak_memory_bandwidth_gbps": None,
            "peak_bf16_tflops": None,
        }
