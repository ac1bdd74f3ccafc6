"""The built-in CPU accelerator: runs everywhere, chooses its threads from the machine as it finds it, packs float
weights once in oneDNN's layout, captures the decode step with ``torch.compile`` (a job too short for that traces it into
TorchScript), runs int8 weights as int8 products
of rows quantized as they come, and runs C++ kernels of its own where they pay (``kernels/``, built once per machine
by :mod:`accelgen_cpu.native_kernels`): a decode step's attention over only the cache positions each row sees, and
for Llama's attention modules the whole of it in one operator; Llama-family RMSNorm; int8 products of a few rows."""

from __future__ import annotations

import os
import platform
from typing import Any, Callable

import torch

from accelgen.common.errors import UsageError, interruption_in
from accelgen.common.host_memory import peak_resident_bytes, system_memory
from accelgen.common.settings import LaunchPlan, RunSettings, World
from accelgen.plugin.contract import Accelerator, TokenDraw, Tuning, hookimpl
from accelgen_cpu.compile_marks import compiled_before, mark_compiled, step_key
from accelgen_cpu.extension_lock import (
    check_extension_build_lock,
    deepspeed_build_folder,
    deepspeed_builds_in_its_folder,
)
from accelgen_cpu.host_allocator import keep_freed_memory, return_freed_memory
from accelgen_cpu.int8_kernels import choose_int8_kernels, int8_product_on_cpu
from accelgen_cpu.load_follower import LoadFollower
from accelgen_cpu.native_kernels import kernels_status, native_kernels, native_operator
from accelgen_cpu.norms import use_fused_norms
from accelgen_cpu.packed_linear import FloatPanels, pack_linear_layers
from accelgen_cpu.shared_memory import prepare_shared_memory_all_reduce, remove_buffers_left, unlink_shared_memory_buffer
from accelgen_cpu.step_trace import traced
from accelgen_cpu.threads import ThreadChoice, ThreadChooser, launch_environment, most_threads


class CpuAccelerator(Accelerator):
    """The host's own processor. Ranks share it (each with the threads it was given), over gloo.

    Capture is compilation (inductor, with its C++ wrapper): it costs tens of seconds the first time a model's step
    is compiled (seconds once inductor's cache holds it). A decode step not compiled is traced into TorchScript
    (``step_trace``: made in one run of the step), which saves most of the eager step's per-operation overhead too, so
    that a compile saves little more per step: by default only the decode step of a job long enough to pay it back
    even uncached is compiled, or, where this machine compiled the same step before (its compile cache holds it:
    ``compile_marks``), of a job long enough to pay back loading it (``--graphs`` / ``--no-graphs`` decide otherwise;
    RESULTS-log.md, "Traced decode steps"). The prefill shapes always run eagerly: each would compile anew, for a few
    runs."""

    name = "cpu"
    tuning = Tuning(
        captures_by_default=True,
        capture_pays_after_steps=100_000,
        captures_prefill=False,
        packs_prompts=True,  # its attention reads only the positions each query sees (decode_attention.py)
        skips_zero_rows=True,  # its int8 products and its attention compute nothing for a row of zeros, or one that sees nothing
        # An eager prefill pass costs about two decode steps beyond its prompts' work on a small model (a forward
        # pass's per-operation overhead), about one on a large one (every weight read, as a step reads it)
        prefill_pass_steps=1.5,
        int8_quantizes_head=True,
    )
    #: The decode steps after which a compile pays where inductor's cache holds the step (loading it costs seconds)
    warm_capture_pays_after_steps = 25_000
    supported_dtypes = ("float32", "bfloat16")
    shares_host_memory = True
    quantization_schemes = ("int8",)

    #: Threads chosen for this run, once its model is ready (``prepare_model``); None before.
    thread_choice: ThreadChoice | None = None
    _thread_chooser: ThreadChooser | None = None  # from ``setup`` on
    #: Follows the machine's load during the run (torch's threads), where the run may compute with more than one.
    load_follower: LoadFollower | None = None
    _step_key: str | None = None  # the run's decode step's in ``compile_marks``, from ``prepare_model`` on

    def is_available(self) -> bool:
        return True

    def setup(self, world: World) -> torch.device:
        self._thread_chooser = ThreadChooser()  # how busy the machine is gets measured over the model's loading
        return_freed_memory()  # while it loads; kept once it is ready
        return torch.device("cpu")

    def prepare_model(self, model: torch.nn.Module, device: torch.device, run: RunSettings,
                      world: World) -> torch.nn.Module:
        from accelgen_cpu.decode_attention import (  # transformers' attention registry
            use_decode_attention,
            use_decode_self_attention,
        )

        choice = self.thread_choice = (self._thread_chooser or ThreadChooser()).choose(world.local_size)
        most = most_threads(world.local_size)
        self.load_follower = None if most <= 1 else LoadFollower(most, choice.cores, choice.ranks_here, choice.threads,
                                                                 torch.set_num_threads)
        self._step_key = step_key(model.config, run, _compiled_for(most))
        through_interface = use_decode_attention(model)
        if run.offload is None and native_kernels():  # offloaded modules run under Accelerate's hooks
            if through_interface:
                use_decode_self_attention(model)
            use_fused_norms(model)
        if run.quantize is None and run.offload is None:  # int8 layers come later; offloaded ones change every pass
            pack_linear_layers(model, run.batch_size)
        if run.quantize is None:  # the model is ready (else once quantized)
            keep_freed_memory()
        return model

    def linear_layout(self, weight: torch.Tensor) -> FloatPanels | None:
        # a few rows times a small weight (an adapter's): the panels kernel is several times torch's product here
        # (RESULTS-log.md, "LoRA adapters")
        operator = native_operator("float_panels_linear") if weight.dtype == torch.float32 else None
        return None if operator is None else FloatPanels(weight, operator)

    def token_draw(self) -> TokenDraw | None:
        return native_operator("draw_tokens")

    def worker_environment(self, plan: LaunchPlan) -> dict[str, str]:
        return launch_environment(plan.processes_per_node)

    def clean_up_after_workers(self, plan: LaunchPlan) -> None:
        remove_buffers_left(plan)

    def mark_step(self) -> None:
        if self.load_follower is not None:
            self.load_follower.after_step()

    def capture_pays_after(self, config, run: RunSettings, world: World) -> int:
        if compiled_before(step_key(config, run, _compiled_for(most_threads(world.local_size)))):
            return self.warm_capture_pays_after_steps
        return self.tuning.capture_pays_after_steps

    def summary_phrase(self) -> str | None:
        if self.thread_choice is None:
            return None
        followed = None if self.load_follower is None else self.load_follower.describe()
        return self.thread_choice.describe() + ("" if followed is None else f"; {followed}")

    def check_shard(self, ranks: int) -> None:
        from accelgen.parallel.deepspeed_adapter import require_deepspeed

        require_deepspeed(ranks)

    def shard(self, model: torch.nn.Module, world: World, run: RunSettings) -> torch.nn.Module:
        from accelgen.parallel.deepspeed_adapter import require_deepspeed, shard_with_deepspeed

        require_deepspeed(world.size)
        shared_memory = prepare_shared_memory_all_reduce(world)
        if shared_memory:  # DeepSpeed compiles the kernel on first use, in this install's folder
            check_extension_build_lock(deepspeed_build_folder(), world.local_rank)
        with deepspeed_builds_in_its_folder():  # this install's: another's build is never rebuilt, nor loaded
            try:
                model = shard_with_deepspeed(model, world, run.dtype, host_ranks=world.local_size if shared_memory else None)
            except BaseException:  # a model AutoTP cannot split, say: the job ends, its buffers must not stay behind
                unlink_shared_memory_buffer(world, wait=False)
                raise
        unlink_shared_memory_buffer(world)
        return model

    def quantize(self, model: torch.nn.Module, scheme: str, run: RunSettings, calibrate) -> torch.nn.Module:
        from accelgen.quantization.model_layers import quantize_linear_layers

        model = quantize_linear_layers(model, int8_product_on_cpu, head=self.tuning.int8_quantizes_head)
        if run.offload is None:  # offloaded weights arrive at each pass as stored: they keep that layout's kernel
            choose_int8_kernels(model, run.batch_size)  # by a rule over the instructions and the decode step's rows
        keep_freed_memory()
        return model

    def capture(
        self, step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...], run: RunSettings
    ) -> Callable[..., torch.Tensor]:
        # Static shapes and in-place cache updates let inductor compile the step once per shape. Its C++ wrapper calls
        # the step's kernels (the plugin's operators among them) from compiled code, where the Python one spent a
        # call's overhead on each of them; a step with an operator the C++ wrapper cannot call (DeepSpeed's all-reduce,
        # under tensor parallelism) takes the Python one.
        # A run whose threads follow the load compiles kernels that read the threads at each call.
        follows_load = self.load_follower is not None
        try:
            compiled = _compiled(step, example_inputs, cpp_wrapper=True, follows_load=follows_load)
        except (torch._dynamo.exc.BackendCompilerFailed, NotImplementedError) as error:
            if (interruption := interruption_in(error)) is not None:  # Ctrl-C or a stop, wrapped by the compiler
                raise interruption from None
            compiled = _compiled(step, example_inputs, cpp_wrapper=False, follows_load=follows_load)
        if self._step_key is not None:  # the next job of this step finds it in the cache
            mark_compiled(self._step_key)
        return compiled

    def trace_step(
        self, step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...], run: RunSettings
    ) -> Callable[..., torch.Tensor]:
        # A step not compiled runs its operations from TorchScript's C++ (``step_trace``): made in one run of the step,
        # it saves most of the Python between them (module calls, transformers' wrappers) at every call.
        return traced(step, example_inputs)

    def memory_stats(self) -> dict[str, int]:
        # the process's peak resident memory, weights and caches included
        return {"peak_rss_bytes": peak_resident_bytes(), **system_memory()}

    def is_out_of_memory(self, error: BaseException) -> bool:
        # The CPU allocator raises RuntimeError ("DefaultCPUAllocator: can't allocate memory"), or
        # torch.OutOfMemoryError in recent releases; plain Python allocations raise MemoryError.
        return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
        )

    def prepare_machine(self) -> list[str]:
        """Build this processor's variant of the plugin's C++ kernels now (for an image, a cluster's nodes, CI), so
        that the first job loads them; a build that fails is refused in one line (the command fails)."""
        from accelgen_cpu.kernel_variants import chosen_variant
        from accelgen_cpu.native_build import BuildFailure
        from accelgen_cpu.native_kernels import load_variant

        variant = chosen_variant()
        if variant is not None:
            try:
                load_variant(variant)
            except BuildFailure as failure:
                raise UsageError(f"The CPU plugin's C++ kernels could not be built: {failure.reason}; "
                                 f"{failure.fix}.") from None
        return [kernels_status()]

    def describe(self) -> dict[str, Any]:
        return {
            "device_name": _cpu_model_name(),
            "device_count": 1,
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "driver": None,
            "peak_memory_bandwidth_gbps": None,
            "peak_bf16_tflops": None,
            "kernels": kernels_status(),
        }


def _compiled(step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...],
              cpp_wrapper: bool, follows_load: bool = False) -> Callable[..., torch.Tensor]:
    # The compiler keeps its graphs by code object, and the steps of every model share their code: each compiled step
    # gets a code object of its own, so that no other step, another model's above all, is ever given its graph.
    # A step compiled whole into one graph checks no guard before a call: the core calls it with nothing but the
    # buffers it was compiled over (the contract of ``capture``), and its closure (the model, its cache) is its own,
    # so every guard would pass. A step the compiler breaks into graphs keeps the guards that choose which runs, less
    # those on the model's modules and weights, which accelgen never changes after loading (the kernels are chosen
    # before; offloaded steps, whose weights arrive at each pass, are never compiled).
    try:
        return _compiled_now(step, example_inputs, cpp_wrapper, whole=True, follows_load=follows_load)
    except torch._dynamo.exc.Unsupported:  # a graph break
        return _compiled_now(step, example_inputs, cpp_wrapper, whole=False, follows_load=follows_load)


def _compiled_now(step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...], cpp_wrapper: bool,
                  whole: bool, follows_load: bool) -> Callable[..., torch.Tensor]:
    """``step`` compiled (now, so that the time lands in capture, not in the first token): ``whole``, into one graph
    that checks no guard; else in graphs that check all guards but the modules'. ``follows_load``: its kernels take
    the threads torch has at each call, not those it had when compiled."""
    # a conversion to bfloat16 rounds where the step says so, as the eager step does: left to itself the compiler carries
    # float32 on into the next operation, and a step's values would depend on which operations are the plugin's own
    options: dict[str, Any] = {"cpp_wrapper": cpp_wrapper, "emulate_precision_casts": True,
                               "cpp.dynamic_threads": follows_load}
    if (skip_module_guards := getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)) is not None:
        options["guard_filter_fn"] = _no_guards if whole else skip_module_guards
    compiled_step = torch.compile(_of_its_own_code(step), dynamic=False, fullgraph=whole, options=options)
    compiled_step(*example_inputs)
    return compiled_step


def _compiled_for(most_threads: int) -> str:
    """The threads a run's compiled step is made for: "1", or "any" where the run may change its threads (its kernels
    read them at each call)."""
    return "any" if most_threads > 1 else "1"


def _no_guards(entries: list) -> list[bool]:
    return [False] * len(entries)


def _of_its_own_code(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``step``, called through a function whose code object no other function has."""

    def own(*buffers: torch.Tensor) -> torch.Tensor:
        return step(*buffers)

    own.__code__ = own.__code__.replace()  # a copy: a new code object
    return own


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@hookimpl
def accelgen_register_accelerators(register):
    register(CpuAccelerator())
