"""Pre-sharded checkpoints: a folder that ``accelgen shard`` wrote for one world size and dtype, in which
each rank's tensors (exactly the parameters that rank holds) are in files of their own, so that a rank
opens only its files and reads them whole: no slicing, no bytes of other ranks' parts.

    accelgen-shards.json                    the manifest: format version, world size, dtype, weight scheme
                                            (``quantize``: int8 layers hold ``weight`` in int8 and ``weight_scale``), source model,
                                            accelgen and DeepSpeed versions, each rank's files
    config.json, tokenizer files            as save_pretrained writes them (the model loads by its folder)
    rank-00000-of-00008-part-00000.safetensors ...

The manifest is written last and the folder renamed into place at the end (``accelgen.jobs.shard_job``): a
folder without a complete manifest is never taken for a pre-sharded model.
"""

from __future__ import annotations

import json
import os

from accelgen.common.errors import UsageError

MANIFEST = "accelgen-shards.json"
FORMAT = "accelgen pre-sharded checkpoint"
FORMAT_VERSION = 1


def rank_file_name(rank: int, world_size: int, part: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}-part-{part:05d}.safetensors"


def read_manifest(folder: str) -> dict | None:
    """The manifest of the pre-sharded checkpoint in ``folder``, or None when ``folder`` is not one.
    Raises UsageError when it is unreadable or of a newer format than this accelgen reads."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as manifest_file:
            manifest = json.load(manifest_file)
        version = manifest["format_version"]
        if manifest.get("format") != FORMAT or not isinstance(version, int):
            raise ValueError("not an accelgen manifest")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{path} is damaged ({type(error).__name__}: {error}): shard the model again (accelgen shard).") from None
    if version > FORMAT_VERSION:
        raise UsageError(
            f"{folder!r} was sharded by a newer accelgen ({manifest.get('accelgen_version')}, format {version}; this one "
            f"reads format {FORMAT_VERSION}): upgrade accelgen, or shard the model again with this one."
        )
    return manifest


def missing_rank_file(folder: str, manifest: dict) -> str | None:
    """A file the manifest names that ``folder`` lacks, as a sentence, or None."""
    for rank, files in enumerate(manifest["rank_files"]):
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                return f"{name}: rank {rank}'s file, named by {MANIFEST}, is missing"
    return None


def check_sharded_for(folder: str, manifest: dict, world_size: int, dtype: str, quantize: str | None = None) -> None:
    """Raise UsageError when the folder was sharded for another world size, dtype or weight scheme than the run's."""
    sharded_quantize = manifest.get("quantize")  # absent from folders sharded before quantization existed
    sharded_for = f"--world-size {manifest['world_size']} --dtype {manifest['dtype']}" + (
        f" --quantize {sharded_quantize}" if sharded_quantize else "")
    if manifest["world_size"] != world_size:
        raise UsageError(f"{folder!r} is sharded for {sharded_for}, not --world-size {world_size}: run it with "
                         f"--world-size {manifest['world_size']}, or shard the original model for {world_size} rank(s).")
    if manifest["dtype"] != dtype:
        raise UsageError(f"{folder!r} is sharded for {sharded_for}, not --dtype {dtype}: run it with "
                         f"--dtype {manifest['dtype']}, or shard the original model in {dtype}.")
    if sharded_quantize != quantize:
        asked = f"--quantize {quantize}" if quantize else "full-precision weights"
        fix = f"add --quantize {sharded_quantize}" if sharded_quantize else "drop --quantize"
        raise UsageError(f"{folder!r} is sharded for {sharded_for}, not {asked}: {fix}, or shard the original "
                         f"model {'with --quantize ' + quantize if quantize else 'without --quantize'}.")


def rank_files(folder: str, manifest: dict, rank: int) -> list[str]:
    """Paths of the files holding rank ``rank``'s tensors."""
    return [os.path.join(folder, name) for name in manifest["rank_files"][rank]]


def write_manifest(folder: str, world_size: int, dtype: str, rank_files_by_rank: list[list[str]], source: dict,
                   quantize: str | None = None) -> None:
    """Write the manifest (the last file a complete folder gets). ``source``: the model sharded (its name,
    identity and parameter bytes), recorded for people and reports; ``quantize``: the linear layers' scheme."""
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world_size, "dtype": dtype,
        "quantize": quantize,
        "source": source, "accelgen_version": _version("accelgen"), "deepspeed_version": _version("deepspeed"),
        "rank_files": rank_files_by_rank,
    }
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as manifest_file:
        json.dump(manifest, manifest_file, indent=1)
        manifest_file.flush()
        os.fsync(manifest_file.fileno())


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
