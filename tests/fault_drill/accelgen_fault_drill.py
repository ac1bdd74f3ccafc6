"""A test plugin that makes one rank fail on purpose, to drill how a job ends when a worker fails.

It replaces the built-in ``cpu`` and ``hpu`` accelerators (a later plugin of the same name wins) with ones that
raise on rank ``ACCELGEN_FAULT_RANK`` in the hook ``ACCELGEN_FAULT_HOOK`` (``prepare_model``, after the rank
has loaded its model, by default; or ``shard``, after DeepSpeed has split it, which ``accelgen shard`` also
calls); with ``ACCELGEN_FAULT_STARTS=first``, only when the workers start first (not after a restart). Tests install it by putting this folder on PYTHONPATH (``fault_drill_environment`` in conftest.py):
the shipped code holds no such drill.
"""

import os

import accelgen
from accelgen_cpu import CpuAccelerator
from accelgen_hpu import HpuAccelerator


def _fail_here(hook: str, world) -> None:
    if os.environ.get("ACCELGEN_FAULT_STARTS") == "first" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0):
        return  # failing on the first start of the workers only
    rank = os.environ.get("ACCELGEN_FAULT_RANK")
    if rank is not None and int(rank) == world.rank and os.environ.get("ACCELGEN_FAULT_HOOK", "prepare_model") == hook:
        raise RuntimeError(f"injected fault on rank {world.rank}")


class FaultDrill:
    """Mixed into an accelerator: fails on the chosen rank in the chosen hook."""

    def prepare_model(self, model, device, run, world):
        model = super().prepare_model(model, device, run, world)
        _fail_here("prepare_model", world)
        return model

    def shard(self, model, world, run):
        model = super().shard(model, world, run)
        _fail_here("shard", world)
        return model


class FaultDrillCpu(FaultDrill, CpuAccelerator):
    pass


class FaultDrillHpu(FaultDrill, HpuAccelerator):
    pass


@accelgen.hookimpl
def accelgen_register_accelerators(register):
    register(FaultDrillCpu())
    register(FaultDrillHpu())
