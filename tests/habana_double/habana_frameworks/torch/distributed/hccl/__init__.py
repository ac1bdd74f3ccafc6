"""Test double of ``habana_frameworks.torch.distributed.hccl``: not Habana's software.

Importing the real module registers the ``hccl`` backend with ``torch.distributed``. This one registers
a backend of that name too, carried by gloo over the CPU, and counts the process groups it creates.

On a Gaudi, DeepSpeed's HPU accelerator reduces over HCCL and makes no shared-memory buffers. Under the double the
ranks' DeepSpeed runs its CPU accelerator, whose shared-memory all-reduce would make one buffer per rank in /dev/shm
(which only the CPU plugin removes): it is turned off here, so that DeepSpeed reduces over this backend's groups,
as on a Gaudi, and leaves nothing behind."""

import importlib.util

import torch.distributed

from habana_frameworks.torch import double_record


def _create_hccl_process_group(store, rank, size, timeout):
    double_record["hccl_process_group"] += 1
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in torch.distributed.Backend.backend_list:
    torch.distributed.Backend.register_backend("hccl", _create_hccl_process_group, devices=["cpu"])

if importlib.util.find_spec("deepspeed") is not None:
    from accelgen.parallel.deepspeed_adapter import deepspeed_quiet

    with deepspeed_quiet():  # DeepSpeed's first import, quiet as the plugin's own
        import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
