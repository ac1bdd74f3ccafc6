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

The file is written tensor by tensor from each tensor's own memory (the safetensors writer first makes a copy of
every tensor as bytes): writing adds nothing to the memory of what it writes.
"""

from __future__ import annotations

import json
import struct

import torch

from accelgen.loading.weight_sources import SAFETENSORS_DTYPES

ALIGNMENT = 64
#: The safetensors format's name of each dtype accelgen reads and writes, for the header's length.
FORMAT_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
PADDING_KEY = "accelgen_alignment_padding"


def save_aligned(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """Write ``tensors`` (host or device tensors of the dtypes :data:`FORMAT_NAMES` names) as a safetensors file, the
    first tensor of the narrowest dtype on a 64-byte boundary; raises OSError where the file cannot be written."""
    unknown = sorted({str(tensor.dtype) for tensor in tensors.values() if tensor.dtype not in FORMAT_NAMES})
    if unknown:
        raise ValueError(f"safetensors holds no {', '.join(unknown)} tensors")
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    header = _header(ordered, _padded(ordered, metadata))
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(header)))
        file.write(header)
        for _, tensor in ordered:
            if tensor.numel():
                file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _padded(ordered: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> dict[str, str]:
    if not ordered:
        return metadata
    narrowest = ordered[-1][1].element_size()
    before_narrowest = sum(tensor.numel() * tensor.element_size() for _, tensor in ordered
                           if tensor.element_size() > narrowest)
    for spaces in range(ALIGNMENT + 8):
        padded = {**metadata, PADDING_KEY: " " * spaces}
        if (8 + len(_header(ordered, padded)) + before_narrowest) % ALIGNMENT == 0:
            return padded
    return metadata  # cannot happen: some number of spaces below 72 lands on the boundary


def _header(ordered: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The header of ``ordered`` tensors written in that order, as the safetensors writer makes it: compact JSON,
    padded with spaces to 8 bytes."""
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for name, tensor in ordered:
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": FORMAT_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    return header + b" " * ((8 - len(header) % 8) % 8)
