"""int8 weights kept between loads: a model quantized to int8 in one process is written once, as it loaded, into a
cache folder, and the next load of the same checkpoint in the same dtype reads the int8 values and scales from there
instead of reading and quantizing the full-precision weights (on a 0.5B model the quantization is most of an int8
load: benchmarks/RESULTS-log.md, "A second load from kept int8 weights").

An entry is a pre-sharded checkpoint of one rank (``accelgen.loading.pre_sharded``: its manifest and rank files, no
config or tokenizer, which come from the checkpoint), in ``<cache>/<key>/``. The key is a digest of what made it: the
checkpoint's identity (``accelgen.loading.model_identity``: its config's bytes and a digest of its weight files, or
its Hub revision), the model's class, the dtype, whether the head is int8 too, and the releases of transformers and
accelgen and :data:`ENTRY_REVISION` (bumped whenever the values quantization gives, or the names it writes, change).

- **Checked when read**: the manifest (every key), the rank files' presence and headers (a file cut short, a header
  rewritten), and the key the manifest was written for. An entry that fails is removed, said in one line, and the
  model loads from its checkpoint (and is kept again).
- **Written whole or not at all**: into a staging folder renamed into place at the end; what a process killed while
  writing left is removed by a later write.
- **Bounded**: at most ``ACCELGEN_WEIGHTS_CACHE_GB`` gigabytes (:data:`DEFAULT_BOUND_GB`) in all, the entries used
  longest ago removed first (never one used in the last :data:`IN_USE_SECONDS`: a run may be reading it); a model
  larger than the bound, or than the disk's free space leaves room for, is not kept.
- **Removed when stale**: an entry of a checkpoint whose files have changed since (same place, another identity), and
  any entry not used for :data:`UNUSED_DAYS` days, when another is written.

``ACCELGEN_WEIGHTS_CACHE`` names the folder (default: ``$XDG_CACHE_HOME/accelgen/int8-weights``, else
``~/.cache/accelgen/int8-weights``), or ``off``. A folder that cannot be written costs the run nothing but a line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import transformers

from accelgen.common.errors import AccelgenWarning, UsageError, reason
from accelgen.common.groups import consecutive_groups
from accelgen.loading.aligned_safetensors import save_aligned
from accelgen.loading.checkpoint_files import CheckpointFolder
from accelgen.loading.pre_sharded import (
    MANIFEST,
    check_sharded_for,
    missing_rank_file,
    package_version,
    rank_file_name,
    rank_files,
    rank_metadata,
    read_manifest,
    write_manifest,
)
from accelgen.loading.weight_sources import SafetensorsWeights

FOLDER_VARIABLE = "ACCELGEN_WEIGHTS_CACHE"
BOUND_VARIABLE = "ACCELGEN_WEIGHTS_CACHE_GB"
DEFAULT_BOUND_GB = 32.0
#: Bumped whenever an entry's values or names for a given checkpoint would change (``quantize_rows``, the layers made
#: int8, the names they are written under): entries of another revision are never read.
ENTRY_REVISION = 1
#: An entry used this recently is never removed to make room: a run may be reading it.
IN_USE_SECONDS = 3600
#: Entries not used for this many days are removed when another is written.
UNUSED_DAYS = 30
#: What a write leaves free on the cache's disk, at least: this share of it.
FREE_SHARE_LEFT = 0.05
#: The largest rank file an entry is written in (a larger model takes several).
MAX_FILE_BYTES = 4 << 30
STAGING_PREFIX = ".staging-"
SCHEME = "int8"


@dataclasses.dataclass(frozen=True)
class KeptWeights:
    """The cache entry of one checkpoint in one dtype and int8 form: ``folder`` (``<cache>/<key>``), read or written
    (:meth:`files`, :meth:`keep`)."""

    folder: Path
    bound_bytes: int
    dtype: str
    #: what the manifest records of the source: the checkpoint's place and identity, the key
    source: dict

    @property
    def root(self) -> Path:
        return self.folder.parent

    def weights(self, base_model_prefix: str) -> SafetensorsWeights | None:
        """The entry's tensors, as a weight source over its rank files whose headers were read to check them, when it
        is there and sound (used now: stamped); None when it is not there, or was damaged (then removed, in one
        line)."""
        if not (self.folder / MANIFEST).is_file():
            return None
        folder = CheckpointFolder(str(self.folder))
        manifest, problem = self._checked_manifest(folder)
        if problem is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            warnings.warn(AccelgenWarning(
                f"The int8 weights kept in {self.folder} were damaged ({problem}): removed; the model loads from its "
                f"checkpoint and is kept again"), stacklevel=2)
            return None
        with contextlib.suppress(OSError):  # a cache another user owns, read-only: read all the same
            os.utime(self.folder / MANIFEST)
        return SafetensorsWeights(rank_files(str(self.folder), manifest, 0), base_model_prefix, where=str(self.folder),
                                  read_header=folder.header)

    def _checked_manifest(self, folder: CheckpointFolder) -> tuple[dict | None, str | None]:
        """(the entry's manifest, what is wrong with the entry or None); ``folder`` reads (and keeps) the headers."""
        try:
            manifest = read_manifest(str(self.folder))
        except UsageError:
            return None, f"its {MANIFEST} is not one accelgen writes"
        try:
            check_sharded_for(str(self.folder), manifest, 1, self.dtype, SCHEME)
        except UsageError:
            return manifest, "its manifest names another dtype or weight scheme"
        if (manifest.get("source") or {}).get("key") != self.source["key"]:
            return manifest, "its manifest names another model"
        return manifest, missing_rank_file(str(self.folder), manifest) or folder.problem(manifest["rank_files"][0])

    def keep(self, model: torch.nn.Module) -> bool:
        """Write ``model``'s parameters (int8 layers as values and scales, the rest in the run's dtype) as this entry,
        making room first; False where it is not kept (larger than the bound or the disk's room, or a write that
        failed: said in one line)."""
        parameters = dict(model.named_parameters())
        size = sum(parameter.numel() * parameter.element_size() for parameter in parameters.values())
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not self._make_room(size):
                return False
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.root))
        except OSError as error:
            self._say_not_kept(error)
            return False
        try:
            names = self._write(parameters, staging)
            write_manifest(str(staging), 1, self.dtype, [names], self.source, quantize=SCHEME)
            os.rename(staging, self.folder)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            if not (self.folder / MANIFEST).is_file():  # else another process kept the same weights first
                self._say_not_kept(error)
                return False
        return True

    @staticmethod
    def _write(parameters: dict[str, torch.Tensor], folder: Path) -> list[str]:
        """Write ``parameters`` into ``folder`` as rank files of at most :data:`MAX_FILE_BYTES`; their names."""
        names = []
        for group in consecutive_groups(list(parameters.items()), lambda item: item[1].numel() * item[1].element_size(),
                                     MAX_FILE_BYTES):
            names.append(rank_file_name(0, 1, len(names)))
            save_aligned({name: parameter.detach() for name, parameter in group}, str(folder / names[-1]),
                         rank_metadata(0, 1))
        return names

    def _make_room(self, size: int) -> bool:
        """Remove what is stale, then the entries used longest ago until ``size`` more bytes fit the bound; whether
        they fit (the bound, and the disk's free space less :data:`FREE_SHARE_LEFT`)."""
        now = time.time()
        entries = []
        for folder in self.root.iterdir():
            if folder.name.startswith(STAGING_PREFIX):  # a write that was killed, long ago
                if now - _modified(folder) > 86400:
                    shutil.rmtree(folder, ignore_errors=True)
                continue
            used = _modified(folder / MANIFEST)
            if folder == self.folder or not used:
                continue
            stale = now - used > UNUSED_DAYS * 86400 or _of_changed_checkpoint(folder, self.source)
            if stale:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                entries.append((used, folder, _folder_bytes(folder)))
        held = sum(entry_bytes for _, _, entry_bytes in entries)
        for used, folder, entry_bytes in sorted(entries):
            if held + size <= self.bound_bytes or now - used < IN_USE_SECONDS:
                break
            shutil.rmtree(folder, ignore_errors=True)
            held -= entry_bytes
        disk = shutil.disk_usage(self.root)
        return held + size <= self.bound_bytes and disk.free - size >= FREE_SHARE_LEFT * disk.total

    def _say_not_kept(self, error: OSError) -> None:
        warnings.warn(AccelgenWarning(
            f"The int8 weights could not be kept for the next load in {self.root} ({reason(error)}): set "
            f"{FOLDER_VARIABLE} to a folder that can be written, or to off"), stacklevel=3)


def kept_int8_weights(location: str, identity_of: Callable[[], dict], model: torch.nn.Module, dtype: str,
                      head: bool) -> KeptWeights | None:
    """The cache entry of the checkpoint at ``location`` (whose identity ``identity_of()`` reads, where the cache is on)
    loaded into ``model``'s class in ``dtype`` with int8 layers (``head``: its head too); None where the cache is off,
    or the checkpoint is not known by its content (a Hub id whose revision was not read)."""
    root = cache_root()
    if root is None:
        return None
    identity = identity_of()
    if not (identity.get("weights_sha256") or identity.get("revision")):
        return None
    made_of = {"identity": identity, "model_class": type(model).__name__, "dtype": dtype, "scheme": SCHEME,
               "int8_head": head, "transformers": transformers.__version__, "accelgen": package_version("accelgen"),
               "revision": ENTRY_REVISION}
    key = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]
    source = {"location": os.path.abspath(location) if os.path.isdir(location) else location, "identity": identity,
              "key": key}
    return KeptWeights(root / key, bound_bytes(), dtype, source)


def cache_root() -> Path | None:
    """The cache's folder (not made here), or None where ``ACCELGEN_WEIGHTS_CACHE`` is ``off`` or the bound is 0."""
    named = os.environ.get(FOLDER_VARIABLE, "").strip()
    if named.lower() == "off" or bound_bytes() <= 0:
        return None
    if named:
        return Path(named).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "accelgen" / "int8-weights"


def bound_bytes() -> int:
    """``ACCELGEN_WEIGHTS_CACHE_GB`` in bytes (:data:`DEFAULT_BOUND_GB` when unset); UsageError naming a value that is
    not a number of gigabytes."""
    text = os.environ.get(BOUND_VARIABLE, "").strip()
    try:
        gigabytes = float(text) if text else DEFAULT_BOUND_GB
    except ValueError:
        gigabytes = -1.0
    if not gigabytes >= 0 or gigabytes == float("inf"):
        raise UsageError(f"{BOUND_VARIABLE}={text!r} is not a number of gigabytes: set it to one (0 keeps no int8 "
                         f"weights), or unset it for {DEFAULT_BOUND_GB:g}.")
    return int(gigabytes * 1e9)


def _of_changed_checkpoint(folder: Path, source: dict) -> bool:
    """Whether the entry in ``folder`` was kept for the checkpoint at ``source``'s place when its files were others."""
    try:
        kept = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("source") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return kept.get("location") == source["location"] and kept.get("identity") != source["identity"]


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
