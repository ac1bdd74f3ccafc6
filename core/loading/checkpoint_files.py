"""A local checkpoint's weight files, checked before loading: a truncated download, a corrupt header or a
shard the index names but the folder lacks is found from the files' headers alone (a few KiB each), and
named in one line, before any process loads (or, in a tensor-parallel job, before any rank starts).

The safetensors layout: 8 bytes (little-endian header length N), N bytes of JSON header giving each tensor's
``data_offsets`` [begin, end) within the data that follows; the data must end exactly at the file's end.
"""

from __future__ import annotations

import json
import os
import struct

#: A header longer than this is not a header (the safetensors format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_file_problem(folder: str) -> str | None:
    """The first damaged or missing weight file of the model in ``folder``, as "file: what is wrong", or None."""
    index_path = os.path.join(folder, SAFETENSORS_INDEX)
    names = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as index_file:
                names_in_index = sorted(set(json.load(index_file)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return f"{SAFETENSORS_INDEX}: not a readable shard index ({type(error).__name__}: {error})"
        missing = [name for name in names_in_index if name not in names]
        if missing:
            return f"{missing[0]}: named by {SAFETENSORS_INDEX} but missing from the folder ({len(missing)} shard(s) missing)"
        names = names_in_index
    for name in names:
        problem = safetensors_problem(os.path.join(folder, name))
        if problem:
            return f"{name}: {problem}"
    return None


def safetensors_problem(path: str) -> str | None:
    """What is wrong with the safetensors file at ``path`` (truncated, corrupt header), or None."""
    size = os.path.getsize(path)
    try:
        header, data_start = read_safetensors_header(path)
        data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except HeaderError as error:
        return str(error)
    except (KeyError, TypeError, IndexError, AttributeError):
        return "corrupt header (not the JSON a safetensors file begins with)"
    if data_end > size - data_start:
        return f"truncated: {size:,} bytes, the header describes {data_start + data_end:,}"
    return None


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
