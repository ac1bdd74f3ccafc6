"""The built-in Habana Gaudi accelerator (Gaudi, Gaudi2, Gaudi3): lazy mode, HPU graphs, HCCL, Habana's DeepSpeed.

How a run goes on Gaudi:

- setup: the PyTorch bridge is imported in lazy mode (``PT_HPU_LAZY_MODE=1`` unless set, see
  ``accelgen_hpu.bridge``); importing ``habana_frameworks.torch.distributed.hccl`` registers the
  ``hccl`` backend the core joins the process group with.
- prepare_model: the model moves to the card as Hugging Face transformers builds it. optimum-habana's
  ``adapt_transformers_to_gaudi()`` is deliberately not applied: its Gaudi model classes (BLOOM, Llama,
  ...) keep their own key/value tensors (legacy tuples written at ``token_idx``, or ``reuse_cache``
  buffers), ignore ``cache_position`` ("Ignoring cache position for HPU") and never write into the Hugging
  Face ``StaticCache`` the core's decode loop reads; it also patches transformers process-wide. The core
  already gives lazy mode what those classes exist for: one static shape per bucket, a preallocated cache.
- capture: the decode step is wrapped in an HPU graph (``wrap_in_hpu_graph_func``) once per bucket.
- mark_step: ``htcore.mark_step()`` after every forward pass, which hands the queued graph to the card.
- quantize: ``--quantize fp8`` through Intel Neural Compressor, measured and converted at load
  (``accelgen_hpu.fp8``), before the graphs are captured.
- shard: DeepSpeed-Inference AutoTP (``deepspeed.init_inference``), Habana's DeepSpeed fork on Gaudi.
- launch: DeepSpeed's launcher starts one rank per card, as Habana's inference guides do, with
  ``PT_HPU_ENABLE_LAZY_COLLECTIVES=true`` in every rank's environment (Habana requires it for HPU graphs
  together with DeepSpeed tensor parallelism; a job started by hand must set it too).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable

import torch

from accelgen.common.errors import UsageError
from accelgen.common.settings import LaunchPlan, RunSettings, World
from accelgen.plugin.contract import Accelerator, Tuning, hookimpl
from accelgen_hpu import bridge, fp8

#: Text of the bridge's error when device memory runs out (e.g. "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed
#: for size::939524096 (896)MB"), as matched by accelerate's and Habana's vLLM troubleshooting guides.
OUT_OF_MEMORY_TEXT = "PT_DEVMEM Allocation failed"
#: Habana's DeepSpeed fork (tensor parallelism on Gaudi), as pip installs it: it is not on PyPI.
HABANA_DEEPSPEED = "git+https://github.com/HabanaAI/DeepSpeed.git@1.21.0"


class HpuAccelerator(Accelerator):
    name = "hpu"
    dist_backend = "hccl"
    supported_dtypes = ("bfloat16", "float32")
    default_dtype = "bfloat16"
    tuning = Tuning(captures_by_default=True)  # HPU graphs remove the host's per-step graph building in lazy mode
    priority = 20  # above the CPU (0): with --device auto a machine with Gaudi cards uses them
    one_process_per_device = True
    quantization_schemes = ("fp8",)  # Gaudi2 and later, through Intel Neural Compressor (accelgen_hpu.fp8)

    def is_available(self) -> bool:
        return bridge.unavailable_reason() is None

    def unavailable_reason(self) -> str:
        return bridge.unavailable_reason() or "it is available"

    def device_count(self) -> int:
        if not self.is_available():
            return 0
        _, hpu = bridge.import_bridge()
        return hpu.device_count()

    def setup(self, world: World) -> torch.device:
        _, hpu = bridge.import_bridge()
        if world.size > 1:
            import habana_frameworks.torch.distributed.hccl  # noqa: F401  registers the "hccl" backend
        # Each rank owns one card (Habana's launcher and DeepSpeed's give every process its own module).
        return bridge.torch_device()

    def check_shard(self, ranks: int) -> None:
        from accelgen.parallel.deepspeed_adapter import require_deepspeed

        require_deepspeed(ranks, install=f"pip install {HABANA_DEEPSPEED}")

    def shard(self, model: torch.nn.Module, world: World, run: RunSettings) -> torch.nn.Module:
        from accelgen.parallel.deepspeed_adapter import shard_with_deepspeed

        # Habana's fork turns enable_cuda_graph=True into wrap_in_hpu_graph over the whole model, prefill
        # included, and capture() below would then nest a graph inside it: graphs stay ours, per bucket.
        return shard_with_deepspeed(model, world, run.dtype, enable_cuda_graph=False)

    def quantize(
        self, model: torch.nn.Module, scheme: str, run: RunSettings, calibrate: Callable[[torch.nn.Module], None]
    ) -> torch.nn.Module:
        _, hpu = bridge.import_bridge()
        device_name = hpu.get_device_name()
        fp8.check_fp8_generation(bridge.generation_facts(device_name)["generation"], device_name)
        return fp8.quantize_to_fp8(model, run.dtype, calibrate)

    def capture(
        self, step: Callable[..., torch.Tensor], example_inputs: tuple[torch.Tensor, ...], run: RunSettings
    ) -> Callable[..., torch.Tensor]:
        htcore, hpu = bridge.import_bridge()
        # In lazy mode the buffer writes queued since the last mark_step would otherwise be recorded into
        # the graph and replayed with every token: run them first.
        htcore.mark_step()
        graphed_step = hpu.wrap_in_hpu_graph_func(step)
        graphed_step(*example_inputs)  # the first call captures the graph; later calls replay it
        htcore.mark_step()
        return graphed_step

    def mark_step(self) -> None:
        htcore, _ = bridge.import_bridge()
        htcore.mark_step()

    def synchronize(self) -> None:
        _, hpu = bridge.import_bridge()
        hpu.synchronize()

    def cluster_resources(self) -> dict[str, Any]:
        return {"resources": {"HPU": 1}}  # the resource Ray finds on a Gaudi node (HABANA_VISIBLE_MODULES set per actor)

    def memory_stats(self) -> dict[str, int]:
        _, hpu = bridge.import_bridge()
        stats = hpu.memory_stats()  # bytes: InUse, MaxInUse, Limit (the card's memory usable by tensors)
        return {
            "peak_allocated_bytes": int(stats["MaxInUse"]),
            "free_bytes": int(stats["Limit"] - stats["InUse"]),
            "total_bytes": int(stats["Limit"]),
        }

    def is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, torch.OutOfMemoryError) or (
            isinstance(error, RuntimeError) and OUT_OF_MEMORY_TEXT in str(error)
        )

    def worker_environment(self, plan: LaunchPlan) -> dict[str, str]:
        return {"PT_HPU_ENABLE_LAZY_COLLECTIVES": "true"}  # HPU graphs with DeepSpeed tensor parallelism

    def launch_command(self, worker_argv: list[str], plan: LaunchPlan) -> list[str]:
        """DeepSpeed's launcher, one rank per card of this node (``deepspeed --num_gpus N``): it sets RANK,
        WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and stops every rank when one fails."""
        if plan.nnodes > 1:
            raise UsageError(
                "--nnodes > 1 on hpu: start accelgen on every node with DeepSpeed's launcher and a hostfile "
                "yourself (deepspeed --hostfile HOSTS --module accelgen.cli run ...), without --world-size."
            )
        if importlib.util.find_spec("deepspeed") is None:
            raise UsageError(f"--world-size > 1 on hpu needs Habana's DeepSpeed: pip install {HABANA_DEEPSPEED}")
        return [
            sys.executable, "-m", "deepspeed.launcher.runner",  # `deepspeed`, with this interpreter
            "--num_gpus", str(plan.processes_per_node),
            "--master_port", str(plan.master_port),
            "--no_local_rank",  # accelgen reads LOCAL_RANK from the environment
            "--module", "accelgen.cli", *worker_argv,
        ]

    def describe(self) -> dict[str, Any]:
        _, hpu = bridge.import_bridge()
        device_name = hpu.get_device_name()
        facts = bridge.generation_facts(device_name)
        return {
            "device_name": device_name,
            "device_count": hpu.device_count(),
            "driver": bridge.bridge_version(),
            **facts,
        }


@hookimpl
def accelgen_register_accelerators(register):
    register(HpuAccelerator())
