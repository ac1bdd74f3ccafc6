"""Test double of ``habana_frameworks.torch.distributed.hccl``: not Habana's software.

Importing the real module registers the ``hccl`` backend with ``torch.distributed``. This one registers
a backend of that name too, carried by gloo over the CPU, and counts the process groups it creates."""

import torch.distributed

from habana_frameworks.torch import double_record


def _create_hccl_process_group(store, rank, size, timeout):
    double_record["hccl_process_group"] += 1
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in torch.distributed.Backend.backend_list:
    torch.distributed.Backend.register_backend("hccl", _create_hccl_process_group, devices=["cpu"])
