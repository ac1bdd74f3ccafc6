"""The built-in CUDA accelerator: NVIDIA GPUs, the decode step replayed as a CUDA graph, NCCL tensor parallelism.

Capture follows PyTorch's documented recipe at its three levels (create, capture, replay): a warm-up on
a side stream, then one capture per static shape, the captures of all live graphs sharing one memory
pool (``accelgen_cuda.graph_pool``: a new pool once they are all gone). The core hands over the whole
decode step (forward pass, token choice, end-of-sequence bookkeeping, position advance), working in
place on fixed-address buffers, so a replay copies nothing. Under tensor parallelism the NCCL
collectives (DeepSpeed AutoTP's all-reduce, our vocabulary-parallel all-reduce and all-gather) are
captured into the graph too: none of them waits for the host.

A step that cannot be captured (it reads a device value on the host, or copies host data in) makes
``capture`` raise with the step's own error; the core then runs that step eagerly, with one warning.

DeepSpeed's fused inference kernels (``replace_with_kernel_inject=True``) are not used: they keep a KV
cache of their own and would ignore the static cache the captured step writes and reads.

Settings read from the environment:

``ACCELGEN_CUDA_COMPILE=1`` (or an inductor mode, e.g. ``max-autotune-no-cudagraphs``)
    Compile the decode step with ``torch.compile`` (inductor fuses the small elementwise kernels: layer
    norms, bias adds, GELU, masking, softmax) and capture the compiled step in the CUDA graph. Off by
    default until measured on a GPU. Inductor caches what it compiles (``TORCHINDUCTOR_CACHE_DIR``), so
    a later run of the same model and shapes compiles much faster; the time shows as capture time.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from accelgen.common.errors import UsageError
from accelgen.common.settings import RunSettings, World
from accelgen.plugin.contract import Accelerator, Tuning, hookimpl
from accelgen_cuda.gpus import known_gpu_peaks
from accelgen_cuda.graph_pool import SharedGraphPool

COMPILE_VARIABLE = "ACCELGEN_CUDA_COMPILE"
#: torch.compile modes that capture CUDA graphs of their own, inside the one this plugin captures: refused.
_GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")

#: Eager runs of the decode step before capture: what a warm-up is for (cuBLAS handles and workspaces, NCCL
#: communicators, lazily built buffers, and with ACCELGEN_CUDA_COMPILE the compilation) happens in the first.
#: The contract allows one: each run records a token and advances the positions, and the buffers have room
#: for max_new_tokens - 1 runs, which can be one (the core starts the batch's decoding again after capture).
WARM_UP_RUNS = 1


class CudaAccelerator(Accelerator):
    name = "cuda"
    dist_backend = "nccl"
    supported_dtypes = ("bfloat16", "float16", "float32")
    default_dtype = "bfloat16"
    tuning = Tuning(captures_by_default=True)
    priority = 10  # above the CPU: --device auto picks a GPU when there is one
    one_process_per_device = True

    def __init__(self):
        self._graph_pool = SharedGraphPool(new_pool=lambda: torch.cuda.graph_pool_handle())
        self._compile_mode: str | None = None  # ACCELGEN_CUDA_COMPILE, read once in setup

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.cuda is None:
            return (f"this torch build ({torch.__version__}) has no CUDA support: "
                    f"install a CUDA build of torch (see https://pytorch.org/get-started)")
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
            return "CUDA_VISIBLE_DEVICES hides every GPU: unset it or list the GPUs to use"
        return (f"torch (CUDA {torch.version.cuda}) finds no usable GPU: check that nvidia-smi lists one "
                f"and that its driver supports CUDA {torch.version.cuda}")

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def setup(self, world: World) -> torch.device:
        device_count = torch.cuda.device_count()
        if world.local_rank >= device_count:
            raise UsageError(
                f"Local rank {world.local_rank} has no GPU: this machine shows {device_count} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                f"start at most {device_count} ranks per node."
            )
        self._compile_mode = _compile_mode()  # a bad value stops the run here, before the model loads
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)

    def check_shard(self, ranks: int) -> None:
        from accelgen.parallel.deepspeed_adapter import require_deepspeed

        require_deepspeed(ranks)

    def shard(self, model: torch.nn.Module, world: World, run: RunSettings) -> torch.nn.Module:
        from accelgen.parallel.deepspeed_adapter import shard_with_deepspeed

        # DeepSpeed allocates this rank's slices on the current GPU (set in setup)
        return shard_with_deepspeed(model, world, run.dtype)

    def capture(
        self, step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...], run: RunSettings
    ) -> Callable[..., torch.Tensor]:
        """A :class:`CapturedStep` replaying ``step`` as a CUDA graph on the ``example_inputs`` buffers."""
        if self._compile_mode is not None:
            step = torch.compile(step, mode=self._compile_mode, dynamic=False)  # compiled in the warm-up below
        _warm_up_on_side_stream(step, example_inputs)
        graph, output = _capture_graph(step, example_inputs, self._graph_pool.pool_for_capture())
        captured = CapturedStep(graph, output, example_inputs)
        self._graph_pool.register(captured)
        return captured

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def cluster_resources(self) -> dict[str, Any]:
        return {"num_gpus": 1}  # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it gave the replica

    def memory_stats(self) -> dict[str, int]:
        free_bytes, total_bytes = torch.cuda.mem_get_info()
        return {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "free_bytes": free_bytes,
            "total_bytes": total_bytes,
        }

    def is_out_of_memory(self, error: BaseException) -> bool:
        # The caching allocator raises torch.OutOfMemoryError; an allocation inside a library (cuBLAS,
        # NCCL, graph instantiation) surfaces as a plain CUDA error saying "out of memory".
        return isinstance(error, torch.OutOfMemoryError) or (
            isinstance(error, RuntimeError) and "CUDA error: out of memory" in str(error)
        )

    def describe(self) -> dict[str, Any]:
        device_name = torch.cuda.get_device_name() if self.is_available() else None
        peaks = known_gpu_peaks(device_name) if device_name else None
        return {
            "device_name": device_name,
            "device_count": self.device_count(),
            "driver": _driver_version(),
            "cuda_runtime": torch.version.cuda,
            "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())) if device_name else None,
            "peak_memory_bandwidth_gbps": peaks.memory_bandwidth_gbps if peaks else None,
            "peak_bf16_tflops": peaks.bf16_tflops if peaks else None,
        }


class CapturedStep:
    """A step replayed from its CUDA graph. Call it with the buffers it was captured on; it returns the same
    output tensor every time, which the next replay of a graph of this accelerator may overwrite."""

    def __init__(self, graph: torch.cuda.CUDAGraph, output: Any, inputs: tuple[torch.Tensor, ...]):
        self._graph, self._output = graph, output  # the graph's memory lives as long as this object
        self._input_addresses = [tensor.data_ptr() for tensor in inputs]

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if [tensor.data_ptr() for tensor in inputs] != self._input_addresses:
            raise ValueError("a captured CUDA graph must be replayed on the buffers it was captured with")
        self._graph.replay()
        return self._output


def _capture_graph(step: Callable[..., Any], inputs: tuple[torch.Tensor, ...], pool: object) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``step(*inputs)`` captured into a new graph that allocates from ``pool``; the graph and the step's output.

    When the step cannot be captured, its own error is raised, after the capture has been ended so that
    the stream and the allocator leave capture mode and eager work can go on."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # also frees pools whose graphs are all gone
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        # "thread_local": CUDA calls from other threads, such as the NCCL watchdog's event queries under
        # tensor parallelism, must not invalidate the capture (in older torch releases they could).
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            output = step(*inputs)
        except BaseException:
            with contextlib.suppress(RuntimeError):  # an invalidated capture fails to end: the step's error says why
                graph.capture_end()
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(capture_stream)
    return graph, output


def _compile_mode() -> str | None:
    """The inductor mode ``ACCELGEN_CUDA_COMPILE`` asks for ("1": inductor's default), or None when unset."""
    value = os.environ.get(COMPILE_VARIABLE, "0").strip()
    if value in ("", "0"):
        return None
    if value in _GRAPHING_COMPILE_MODES:
        raise UsageError(
            f"{COMPILE_VARIABLE}={value} captures CUDA graphs of its own inside accelgen's: set it to 1 or to "
            f"max-autotune-no-cudagraphs, or pass --no-graphs to let torch.compile graph the step alone."
        )
    return "default" if value == "1" else value


def _warm_up_on_side_stream(step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...]) -> None:
    """Run ``step`` eagerly on a side stream, as PyTorch requires before capturing it: lazy initialisation
    (cuBLAS workspaces, NCCL communicators) must not happen during capture."""
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())  # the inputs were written on the current stream
    with torch.cuda.stream(side_stream):
        for _ in range(WARM_UP_RUNS):
            step(*example_inputs)
    torch.cuda.current_stream().wait_stream(side_stream)


def _driver_version() -> str | None:
    """The NVIDIA driver version (e.g. "550.54.15") from NVML when ``pynvml`` is installed, else None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml, no driver, or no NVML library: the version is simply unknown
        return None
    return version.decode() if isinstance(version, bytes) else version


@hookimpl
def accelgen_register_accelerators(register):
    register(CudaAccelerator())
