"""A local checkpoint's weight files, checked before loading: a truncated download, a corrupt header or a
shard the index names but the folder lacks is found from the files' headers alone (a few KiB each), and
named in one line, before any process loads (or, in a tensor-parallel job, before any rank starts).

The safetensors layout: 8 bytes (little-endian header length N), N bytes of JSON header giving each tensor's
``data_offsets`` [begin, end) within the data that follows; the data must end exactly at the file's end.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import struct

from accelgen.common.errors import UsageError

#: A header longer than this is not a header (the safetensors format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "model*.bin", "*.pt")


class HeaderError(ValueError):
    """A safetensors file whose header cannot be read."""


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
            raise HeaderError("corrupt header (not the JSON a safetensors file begins with)") from None
    if not isinstance(header, dict):
        raise HeaderError("corrupt header (not the JSON a safetensors file begins with)")
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
            return sorted(set(json.load(index_file)["weight_map"].values()))

    def weight_files(self) -> tuple[list[str], bool]:
        """(the model's weight files, whether they are safetensors); safetensors preferred."""
        if self._indexed_names is not None:
            return [os.path.join(self.folder, name) for name in self._indexed_names], True
        safetensors = sorted(glob.glob(os.path.join(self.folder, "*.safetensors")))
        if safetensors:
            return safetensors, True
        for pattern in PICKLE_PATTERNS:
            pickles = sorted(glob.glob(os.path.join(self.folder, pattern)))
            if pickles:
                return pickles, False
        raise UsageError(f"Model folder {self.folder!r} holds no weights (*.safetensors or pytorch_model*.bin): "
                         f"pass a folder made by save_pretrained.")

    def problem(self, names: list[str] | None = None) -> str | None:
        """The first damaged or missing weight file, as "file: what is wrong", or None: of the files ``names``
        (a pre-sharded folder's, by the manifest), else of the folder's safetensors files and shard index."""
        if names is None:
            names = sorted(name for name in os.listdir(self.folder) if name.endswith(".safetensors"))
            try:
                names_in_index = self._indexed_names
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                return f"{SAFETENSORS_INDEX}: not a readable shard index ({type(error).__name__}: {error})"
            if names_in_index is not None:
                missing = [name for name in names_in_index if name not in names]
                if missing:
                    return f"{missing[0]}: named by {SAFETENSORS_INDEX} but missing from the folder ({len(missing)} shard(s) missing)"
                names = names_in_index
        for name in names:
            problem = self._safetensors_problem(os.path.join(self.folder, name))
            if problem:
                return f"{name}: {problem}"
        return None

    def _safetensors_problem(self, path: str) -> str | None:
        """What is wrong with the safetensors file at ``path`` (truncated, corrupt header), or None."""
        size = os.path.getsize(path)
        try:
            header, data_start = self.header(path)
            data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        except HeaderError as error:
            return str(error)
        except (KeyError, TypeError, IndexError, AttributeError):
            return "corrupt header (not the JSON a safetensors file begins with)"
        if data_end > size - data_start:
            return f"truncated: {size:,} bytes, the header describes {data_start + data_end:,}"
        return None
