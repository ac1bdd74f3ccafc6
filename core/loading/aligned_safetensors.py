"""Safetensors files whose narrowest tensors start on a 64-byte boundary of the file, so that a map of the file
gives them aligned memory (a map starts on a page): int8 kernels load their weights with aligned vector
instructions (torch's CPU kernel faults on a weight that is not 16-byte aligned), and a weight used in place
costs no copy.

The format aligns nothing past its header (padded to 8 bytes): a tensor starts wherever the tensors sorted
before it end. The safetensors writer sorts tensors by dtype width (widest first), then by name, and writes
the header as compact JSON; so the header's length, and where the first tensor of the narrowest dtype starts,
can be computed before writing, and one metadata entry of spaces moves it onto the boundary. Tensors after
it stay aligned when the sizes before them are multiples of 64 bytes, as a large model's are; a loader checks
each tensor's alignment anyway.
"""

from __future__ import annotations

import json

import torch

from accelgen.loading.weight_sources import SAFETENSORS_DTYPES

ALIGNMENT = 64
#: The safetensors format's name of each dtype accelgen reads and writes, for the header's length.
FORMAT_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
PADDING_KEY = "accelgen_alignment_padding"


def save_aligned(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` with the first tensor of the narrowest dtype on a 64-byte boundary."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=_padded(tensors, metadata))


def _padded(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, str]:
    if any(tensor.dtype not in FORMAT_NAMES for tensor in tensors.values()):
        return metadata
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    narrowest = ordered[-1][1].element_size()
    before_narrowest = sum(tensor.numel() * tensor.element_size() for _, tensor in ordered
                           if tensor.element_size() > narrowest)
    for spaces in range(ALIGNMENT + 8):
        padded = {**metadata, PADDING_KEY: " " * spaces}
        if (8 + _header_length(ordered, padded) + before_narrowest) % ALIGNMENT == 0:
            return padded
    return metadata  # cannot happen: some number of spaces below 72 lands on the boundary


def _header_length(ordered: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> int:
    """The header's length as the safetensors writer makes it: compact JSON, padded with spaces to 8 bytes."""
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for name, tensor in ordered:
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": FORMAT_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    length = len(json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode())
    return length + (8 - length % 8) % 8
