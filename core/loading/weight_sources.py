"""Where a model's weights are read from, tensor by tensor and slice by slice: safetensors files (a slice
reads only its own bytes), pickle checkpoints (whole files), or seeded random values.

Each source answers three questions about a tensor named by the model's parameter names: its full shape
(``shape``); the values of one part of it written into a destination (``copy_into``), converted to the
destination's dtype and put on its device; and, where the part lies in one piece in the source's own
memory (a memory-mapped file), a host tensor over that memory (``view``: no copy at all).
``accelgen.loading.weight_loading`` decides which part, and which way it is read.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import zlib
from typing import Callable

import torch

from accelgen.common.errors import UsageError
from accelgen.loading import checkpoint_files

#: madvise(MADV_POPULATE_READ) (Linux >= 5.14): map every page of a range now, reading none into new memory.
#: Python 3.11's mmap module does not name it.
MADV_POPULATE_READ = 22

#: The safetensors format's dtype names that accelgen reads (those of ``checkpoint_files.SAFETENSORS_DTYPE_BYTES``).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class TensorPart:
    """Rows ``[start, start + length)`` along ``dim`` of a tensor."""

    dim: int
    start: int
    length: int

    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)

    def shape_of(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        return full_shape[: self.dim] + (self.length,) + full_shape[self.dim + 1 :]


class CheckpointWeights:
    """Tensors of a checkpoint by name; a model's parameter name is looked up as it is, then without (or
    with) the model's base prefix (BLOOM's published checkpoints name ``h.0...`` what the model calls
    ``transformer.h.0...``)."""

    def __init__(self, where: str, tensors: dict, base_model_prefix: str = ""):
        self.where = where
        self._tensors = tensors  # name -> whatever ``_read`` takes
        self._prefix = f"{base_model_prefix}." if base_model_prefix else ""

    def names(self) -> list[str]:
        """The names the checkpoint stores its tensors under."""
        return list(self._tensors)

    def stored_name(self, name: str) -> str:
        """The name the checkpoint stores the model's tensor ``name`` under (messages name it so)."""
        return self.key(name)

    def key(self, name: str) -> str:
        for candidate in (name, name.removeprefix(self._prefix), self._prefix + name):
            if candidate in self._tensors:
                return candidate
        raise UsageError(
            f"{self.where} holds no tensor {name!r} (it holds {len(self._tensors)}, e.g. "
            f"{', '.join(sorted(self._tensors)[:3])}): it was saved for another model; pass the model's own folder."
        )


class SafetensorsWeights(CheckpointWeights):
    """Safetensors files. A part whose bytes lie in one piece in the file (a whole tensor, a block of rows)
    is memory-mapped (``view``): its pages are the page cache's, shared and never copied. A strided part
    (a block of columns) is read with positioned reads of exactly its bytes, straight into the destination
    when it is host memory of the file's dtype: a map of it would touch, and count in the process's resident
    memory, nearly every page of the whole tensor, so every rank would seem to hold what it read past."""

    #: tensors are read from files that ``location`` names (an offload may read them there, in place)
    reads_in_place = True

    def __init__(self, paths: list[str], base_model_prefix: str = "", where: str | None = None,
                 read_header: Callable[[str], tuple[dict, int]] | None = None):
        """``read_header(path)``: the file's header and where its data starts (a folder's reader, which keeps
        the headers it has read; default: read each file's)."""
        read_header = read_header or checkpoint_files.read_safetensors_header
        tensors = {}
        for path in paths:
            header, data_start = read_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    tensors[name] = (path, data_start + entry["data_offsets"][0], SAFETENSORS_DTYPES[entry["dtype"]],
                                     tuple(entry["shape"]))
        super().__init__(where or os.path.dirname(paths[0]), tensors, base_model_prefix)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[self.key(name)][3]

    def copy_into(self, destination: torch.Tensor, name: str, part: TensorPart | None) -> None:
        path, offset, dtype, shape = self._tensors[self.key(name)]
        part = part or TensorPart(0, 0, shape[0] if shape else 1)
        direct = destination.is_cpu and destination.dtype == dtype and destination.is_contiguous()
        buffer = destination if direct else torch.empty(destination.shape, dtype=dtype)
        _read_part(path, offset, shape, part, buffer)
        if not direct:
            destination.copy_(buffer)

    def location(self, name: str) -> tuple[str, str]:
        """(the file holding the tensor, its name there)."""
        key = self.key(name)
        return self._tensors[key][0], key

    def view(self, name: str, part: TensorPart | None) -> torch.Tensor | None:
        """``part`` of the tensor as a host tensor over the file's own pages (a private map: a write would
        copy the page, never change the file), or None where its bytes are not in one piece, not aligned to
        its dtype, or not all in the file (a truncated file is then reported by ``copy_into``)."""
        path, offset, dtype, shape = self._tensors[self.key(name)]
        part = part or TensorPart(0, 0, shape[0] if shape else 1)
        if math.prod(shape[: part.dim]) > 1:
            return None  # one piece per outer index
        inner_bytes = math.prod(shape[part.dim + 1 :]) * dtype.itemsize
        start, size = offset + part.start * inner_bytes, part.length * inner_bytes
        if size == 0 or start % dtype.itemsize:
            return None
        with open(path, "rb") as file:
            if start + size > os.fstat(file.fileno()).st_size:
                return None
            page_start = start - start % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(file.fileno(), start + size - page_start, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=page_start)
        try:
            mapping.madvise(MADV_POPULATE_READ)  # mapped now, so the first forward pass finds every page
        except (OSError, ValueError):
            pass  # an older kernel: pages are mapped on first touch instead
        values = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=start - page_start)
        return values.view(dtype).view(part.shape_of(shape) if shape else ())


def _read_part(path: str, offset: int, shape: tuple[int, ...], part: TensorPart, buffer: torch.Tensor) -> None:
    """Read ``part`` of the tensor stored C-contiguously at ``offset`` of ``path`` into the contiguous host
    tensor ``buffer``: the tensor seen as [outer, shape[dim], inner], one read per outer index."""
    outer = math.prod(shape[: part.dim])
    inner = math.prod(shape[part.dim + 1 :])
    row_bytes = part.length * inner * buffer.element_size()
    stride_bytes = shape[part.dim] * inner * buffer.element_size() if shape else 0
    start_bytes = part.start * inner * buffer.element_size()
    target = memoryview(buffer.view(-1).view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as file:
        for index in range(outer):
            file.seek(offset + index * stride_bytes + start_bytes)
            chunk = target[index * row_bytes : (index + 1) * row_bytes]
            while chunk:
                read = file.readinto(chunk)
                if not read:
                    raise UsageError(f"{path} ends early: the file is truncated; download or save the model again.")
                chunk = chunk[read:]


class PickleWeights(CheckpointWeights):
    """``.bin`` checkpoints (torch's pickle format): memory-mapped where the file allows, else read whole.
    Only torch's weights-only loader reads them: a file whose unpickling would call anything else (run code)
    is refused, never loaded."""

    def __init__(self, paths: list[str], base_model_prefix: str = ""):
        tensors = {}
        for path in paths:
            try:
                tensors.update(checkpoint_files.load_pickle(path))
            except checkpoint_files.DamagedPickle as error:
                raise UsageError(f"{path} is damaged ({error}): download or save the model again.") from None
        super().__init__(os.path.dirname(paths[0]), tensors, base_model_prefix)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[self.key(name)].shape)

    def copy_into(self, destination: torch.Tensor, name: str, part: TensorPart | None) -> None:
        values = self._tensors[self.key(name)]
        destination.copy_(values if part is None else values[part.index()])

    def view(self, name: str, part: TensorPart | None) -> torch.Tensor | None:
        values = self._tensors[self.key(name)]
        values = values if part is None else values[part.index()]
        return values if values.is_contiguous() else None


class RandomWeights:
    """Seeded random values for a model built from its config (benchmarks: speed does not depend on the
    values): matrices drawn from N(0, ``std``), vectors ones (norm weights) or zeros (biases). Each part
    is drawn on its own (a rank draws only what it holds), seeded by the tensor's name and the part."""

    #: values drawn here are finite: loading does not check them
    drawn_at_random = True

    def __init__(self, shapes: dict[str, tuple[int, ...]], std: float, seed: int = 0):
        self._shapes, self._std, self._seed = shapes, std, seed

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def view(self, name: str, part: TensorPart | None) -> None:
        return None  # drawn straight into the destination

    def copy_into(self, destination: torch.Tensor, name: str, part: TensorPart | None) -> None:
        if destination.dim() == 1:
            destination.fill_(1.0 if name.endswith("weight") else 0.0)
            return
        seed = self._seed * 1_000_003 + zlib.crc32(name.encode()) + (part.start if part else 0)
        try:
            generator = torch.Generator(device=destination.device).manual_seed(seed)
        except (RuntimeError, TypeError):  # a device without generators of its own: drawn on the host
            generator = torch.Generator().manual_seed(seed)
            destination.copy_(torch.empty(destination.shape).normal_(0.0, self._std, generator=generator))
        else:
            destination.normal_(0.0, self._std, generator=generator)
