"""A local checkpoint's weight files, checked before loading: a truncated download, a corrupt header or a
shard the index names but the folder lacks is found from the files' headers alone (a few KiB each), and
named in one line, before any process loads (or, in a tensor-parallel job, before any rank starts).

A weight file must be a regular file (a pipe would block the reader for ever, a device never ends), and the
shard index may name only files of the folder. Pickle (``.bin``) files in torch's zip format are checked by
their zip directory (a truncated download) and by torch's weights-only loader, memory-mapped (the pickle is
read, the tensors are not): a file whose loading would run code is refused, never loaded (:func:`load_pickle`).

The safetensors layout: 8 bytes (little-endian header length N), N bytes of JSON header giving each tensor's
``data_offsets`` [begin, end) within the data that follows; the data must end exactly at the file's end.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import re
import stat
import struct
import zipfile

from accelgen.common.errors import UsageError, reason
from accelgen.loading.pre_sharded import has_rank_metadata, rank_metadata_problem

#: A header longer than this is not a header (the safetensors format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "model*.bin", "*.pt")
#: Bytes per value of each safetensors dtype accelgen reads (``accelgen.loading.weight_sources`` maps the same
#: names to torch dtypes).
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                           "BOOL": 1}
CORRUPT_HEADER = "corrupt header (not the JSON a safetensors file begins with)"
#: The first bytes of torch's zip checkpoint format (a zip archive's local file header).
ZIP_MAGIC = b"PK\x03\x04"


class HeaderError(ValueError):
    """A safetensors file whose header cannot be read."""


class DamagedPickle(ValueError):
    """A torch (pickle) checkpoint that cannot be read: the message says why."""


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """(the header of the safetensors file at ``path``: tensor name -> dtype, shape, data_offsets; the byte at
    which the tensors' data begins). Raises HeaderError for a file that is not one."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{size} bytes, too short to be a safetensors file")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise HeaderError(f"corrupt header (it claims {header_bytes:,} bytes in a file of {size:,})")
        try:
            header = json.loads(file.read(header_bytes))
        except ValueError:
            raise HeaderError(CORRUPT_HEADER) from None
    if not isinstance(header, dict):
        raise HeaderError(CORRUPT_HEADER)
    return header, 8 + header_bytes


class CheckpointFolder:
    """A local model folder's weight files, each safetensors header read at most once: the files are checked
    from their headers before anything loads, and loaded with the same headers."""

    def __init__(self, folder: str):
        self.folder = folder
        self._headers: dict[str, tuple[dict, int]] = {}

    def header(self, path: str) -> tuple[dict, int]:
        """:func:`read_safetensors_header` of ``path``, read on first use."""
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)
        return self._headers[path]

    @functools.cached_property
    def _indexed_names(self) -> list[str] | None:
        """The files the folder's shard index names, read once; None when it has no index."""
        index = os.path.join(self.folder, SAFETENSORS_INDEX)
        if not os.path.isfile(index):
            return None
        with open(index, encoding="utf-8") as index_file:
            names = json.load(index_file)["weight_map"].values()
        for name in names:
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"it names {name!r}, not a file of the folder")
        return sorted(set(names))

    def weight_files(self) -> tuple[list[str], bool]:
        """(the model's weight files, whether they are safetensors); safetensors preferred."""
        if self._indexed_names is not None:
            return [os.path.join(self.folder, name) for name in self._indexed_names], True
        safetensors = sorted(glob.glob(os.path.join(self.folder, "*.safetensors")))
        if safetensors:
            return safetensors, True
        pickles = self._pickle_files()
        if pickles:
            return pickles, False
        raise UsageError(f"Model folder {self.folder!r} holds no weights (*.safetensors or pytorch_model*.bin): "
                         f"pass a folder made by save_pretrained.")

    def _pickle_files(self) -> list[str]:
        """The folder's pickle checkpoint files (of the first pattern that finds any), for a folder without safetensors."""
        for pattern in PICKLE_PATTERNS:
            pickles = sorted(glob.glob(os.path.join(self.folder, pattern)))
            if pickles:
                return pickles
        return []

    def problem(self, names: list[str] | None = None) -> str | None:
        """The first damaged or missing weight file, as "file: what is wrong", or None: of the files ``names``
        (a pre-sharded folder's rank files, by the manifest: each must hold its rank's tensors), else of the
        folder's safetensors files and shard index, or its pickle files when it has no safetensors."""
        rank_files = names is not None
        if names is None:
            names = sorted(name for name in os.listdir(self.folder) if name.endswith(".safetensors"))
            try:
                names_in_index = self._indexed_names
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
                return f"{SAFETENSORS_INDEX}: not a readable shard index ({type(error).__name__}: {error})"
            if names_in_index is not None:
                missing = [name for name in names_in_index if name not in names]
                if missing:
                    return f"{missing[0]}: named by {SAFETENSORS_INDEX} but missing from the folder ({len(missing)} shard(s) missing)"
                names = names_in_index
            if not names:
                return _first_problem([os.path.basename(path) for path in self._pickle_files()], self.folder, _pickle_problem)
        problem = _first_problem(names, self.folder, self._safetensors_problem)
        if problem or not rank_files:
            return problem
        required = any(has_rank_metadata(self.header(os.path.join(self.folder, name))[0]) for name in names)
        return _first_problem(names, self.folder, lambda path: rank_metadata_problem(
            os.path.basename(path), self.header(path)[0], required))

    def _safetensors_problem(self, path: str) -> str | None:
        """What is wrong with the safetensors file at ``path`` (not a regular file, truncated, a corrupt header
        or one describing a tensor its bytes cannot hold), or None."""
        size = _regular_file_size(path)
        if size is None:
            return NOT_REGULAR
        try:
            header, data_start = self.header(path)
        except HeaderError as error:
            return str(error)
        data_end = 0
        for name, entry in header.items():
            if name != "__metadata__":
                problem = _tensor_entry_problem(name, entry)
                if problem:
                    return problem
                data_end = max(data_end, entry["data_offsets"][1])
        if data_end > size - data_start:
            return f"truncated: {size:,} bytes, the header describes {data_start + data_end:,}"
        return None


def _tensor_entry_problem(name: str, entry: object) -> str | None:
    """What is wrong with a safetensors header's description of the tensor ``name``: a dtype accelgen does not
    read, or a shape and offsets that are not numbers, or whose bytes do not match (a tensor read from the
    header's bytes, or from its neighbours'); None when it is sound."""
    if not isinstance(entry, dict):
        return CORRUPT_HEADER
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BYTES:
        return (f"tensor {name!r} has dtype {str(dtype)[:20]!r}, which accelgen does not read (it reads "
                f"{', '.join(SAFETENSORS_DTYPE_BYTES)})")
    if not (_whole_numbers(shape) and _whole_numbers(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        return f"corrupt header (tensor {name!r}: its shape and data_offsets are not whole numbers from 0)"
    tensor_bytes = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != tensor_bytes:
        return (f"corrupt header (tensor {name!r} of shape {shape[:8]} in {dtype} is {tensor_bytes:,} bytes, its "
                f"offsets span {offsets[1] - offsets[0]:,})")
    return None


def _whole_numbers(value: object) -> bool:
    """Whether ``value`` (from JSON) is a list of whole numbers from 0."""
    return isinstance(value, list) and all(isinstance(number, int) and not isinstance(number, bool) and number >= 0
                                           for number in value)


#: What a weight file that is a folder, a pipe or a device is.
NOT_REGULAR = "not a regular file (a folder, a pipe, a device or a broken link)"


def _first_problem(names: list[str], folder: str, problem_of) -> str | None:
    """The first of the files ``names`` of ``folder`` that ``problem_of(path)`` finds wrong, as "file: problem"."""
    for name in names:
        problem = problem_of(os.path.join(folder, name))
        if problem:
            return f"{name}: {problem}"
    return None


def _regular_file_size(path: str) -> int | None:
    """The size of the regular file at ``path`` (a link followed), or None when it is anything else."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def _pickle_problem(path: str) -> str | None:
    """What is wrong with the torch checkpoint at ``path``, as far as its first bytes and zip directory tell
    (not a regular file, truncated, neither torch's zip format nor a legacy pickle), or None."""
    size = _regular_file_size(path)
    if size is None:
        return NOT_REGULAR
    with open(path, "rb") as file:
        magic = file.read(4)
    if not magic.startswith(b"\x80") and magic != ZIP_MAGIC:  # a pickle's protocol opcode: torch's legacy format
        return "not a torch checkpoint (neither torch's zip format nor a pickle)"
    if magic != ZIP_MAGIC:
        return None  # read whole when loaded: not twice
    try:
        with zipfile.ZipFile(path) as archive:
            end = max((member.header_offset + member.compress_size for member in archive.infolist()), default=0)
    except (zipfile.BadZipFile, OSError, ValueError):
        return "truncated or damaged (its zip directory cannot be read)"
    if end > size:
        return f"truncated ({size:,} bytes, its zip directory describes {end:,} and more)"
    try:
        load_pickle(path)  # memory-mapped: the pickle is read, the tensors' bytes are not
    except DamagedPickle as error:
        return f"damaged ({error})"
    return None


def load_pickle(path: str) -> dict:
    """The tensors (name: tensor) of the torch checkpoint at ``path``, read by torch's weights-only loader
    (memory-mapped when it is torch's zip format; the legacy format cannot be). Raises UsageError for a file
    whose loading would run code or that holds anything but named tensors; DamagedPickle for a damaged one."""
    import pickle

    import torch

    with open(path, "rb") as file:
        zip_format = file.read(4) == ZIP_MAGIC
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zip_format)
    except pickle.UnpicklingError as error:
        called = re.search(r"GLOBAL (\S+)", str(error))
        if called:
            raise UsageError(
                f"{path} was refused: loading it would run code ({called[1]}): convert it to safetensors where you "
                f"trust it (load the model with transformers, then save_pretrained), and pass that folder.") from None
        raise DamagedPickle(reason(error)) from None
    except (RuntimeError, EOFError, ValueError, OSError) as error:
        raise DamagedPickle(reason(error)) from None
    if not isinstance(state, dict):
        raise UsageError(f"{path} holds a {type(state).__name__}, not a state dict of tensors: pass a checkpoint saved "
                         f"by save_pretrained.")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise UsageError(f"{path} holds a {type(value).__name__} under {key!r}, not a tensor under a name: pass a "
                             f"checkpoint saved by save_pretrained.")
    return state
