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

A folder may come from anyone, so before any rank starts every key of its manifest is checked (type and value),
each rank file must be a regular file inside the folder (links resolved) under the name ``accelgen shard``
gives it, and each file's header must name the rank and world size it was written for (``RANK_METADATA``;
the files of a folder written before it existed carry none and are taken as they are).
"""

from __future__ import annotations

import json
import os
import re
import stat

from accelgen.common.errors import UsageError
from accelgen.common.settings import DTYPES, QUANTIZATION_SCHEMES

MANIFEST = "accelgen-shards.json"
FORMAT = "accelgen pre-sharded checkpoint"
FORMAT_VERSION = 1
#: The most ranks a manifest may name (``--world-size``'s own bound).
MAX_WORLD_SIZE = 65536
#: What each rank file's safetensors metadata says (the values are strings, as the format wants).
RANK_METADATA = ("accelgen_rank", "accelgen_world_size")
RANK_FILE_NAME = re.compile(r"rank-(\d+)-of-(\d+)-part-\d+\.safetensors")


def rank_file_name(rank: int, world_size: int, part: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}-part-{part:05d}.safetensors"


def rank_metadata(rank: int, world_size: int) -> dict[str, str]:
    """The metadata ``accelgen shard`` writes into each of rank ``rank``'s files."""
    return dict(zip(RANK_METADATA, (str(rank), str(world_size))))


def has_rank_metadata(header: dict) -> bool:
    """Whether a rank file's safetensors header names its rank (files sharded before it existed do not)."""
    metadata = header.get("__metadata__")
    return isinstance(metadata, dict) and any(key in metadata for key in RANK_METADATA)


def rank_metadata_problem(name: str, header: dict, required: bool) -> str | None:
    """What is wrong with the rank file ``name`` (a name the manifest gives, checked to be the one ``accelgen
    shard`` gives that rank) whose safetensors header is ``header``: it was written for another rank or world
    size (rank files renamed or swapped), or it names none while the folder's other rank files do
    (``required``); None when it agrees, or when no file of the folder names its rank (sharded before that)."""
    named = RANK_FILE_NAME.fullmatch(name)
    if named is None:
        return None
    if not has_rank_metadata(header):
        return "names no rank while the folder's other rank files do (a file replaced)" if required else None
    metadata = header["__metadata__"]
    rank, world_size = (str(int(number)) for number in named.groups())
    written_rank, written_world_size = (str(metadata.get(key))[:20] for key in RANK_METADATA)
    if (written_rank, written_world_size) == (rank, world_size):
        return None
    of_world_size = "" if written_world_size == world_size else f" of {world_size}"
    return (f"holds rank {written_rank}'s tensors of a {written_world_size}-rank split, not rank {rank}'s{of_world_size} "
            f"(a rank file renamed or swapped)")


def read_manifest(folder: str) -> dict | None:
    """The manifest of the pre-sharded checkpoint in ``folder``, or None when ``folder`` is not one.
    Raises UsageError when it is unreadable, of a newer format than this accelgen reads, or holds anything
    but what ``accelgen shard`` writes (each key checked, before any rank starts)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as manifest_file:
            manifest = json.load(manifest_file)
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep
        raise UsageError(f"{path} is damaged ({type(error).__name__}: {error}): shard the original model again "
                         f"(accelgen shard).") from None
    problem = _format_problem(manifest)
    if problem is None and manifest["format_version"] > FORMAT_VERSION:
        raise UsageError(
            f"{folder!r} was sharded by a newer accelgen ({manifest.get('accelgen_version')}, format "
            f"{manifest['format_version']}; this one reads format {FORMAT_VERSION}): upgrade accelgen, or shard the "
            f"model again with this one."
        )
    problem = problem or _content_problem(manifest)
    if problem:
        raise UsageError(f"{path} is damaged: {problem}: shard the original model again (accelgen shard).")
    return manifest


def _format_problem(manifest: object) -> str | None:
    """What keeps ``manifest`` (parsed JSON) from being an accelgen manifest of some format version, or None."""
    if not isinstance(manifest, dict):
        return f"it is {_shown(manifest)}, not a JSON object"
    if manifest.get("format") != FORMAT:
        return f'"format" is {_shown(manifest.get("format"))}, not {FORMAT!r}'
    return _key_problem(manifest, "format_version", _is_count(1, None), "a whole number from 1")


def _content_problem(manifest: dict) -> str | None:
    """What in a manifest of this format version is not what ``accelgen shard`` writes, or None."""
    is_text_or_null = lambda value: value is None or isinstance(value, str)  # noqa: E731
    checks = (  # key, test of its value, what it should be, whether every manifest has it
        ("world_size", _is_count(1, MAX_WORLD_SIZE), f"a whole number from 1 to {MAX_WORLD_SIZE}", True),
        ("dtype", lambda value: value in DTYPES, f"one of {', '.join(DTYPES)}", True),
        # absent from folders sharded before quantization existed
        ("quantize", lambda value: value is None or value in QUANTIZATION_SCHEMES,
         f"null or one of {', '.join(QUANTIZATION_SCHEMES)}", False),
        ("source", lambda value: isinstance(value, dict), "an object", False),
        ("accelgen_version", is_text_or_null, "a version or null", False),
        ("deepspeed_version", is_text_or_null, "a version or null", False),
    )
    for key, valid, expected, required in checks:
        problem = _key_problem(manifest, key, valid, expected, required)
        if problem:
            return problem
    world_size = manifest["world_size"]
    problem = _key_problem(manifest, "rank_files", lambda value: _is_names_by_rank(value, world_size),
                           f"a list of {world_size} list(s) of file names")
    if problem:
        return problem
    for rank, names in enumerate(manifest["rank_files"]):
        for part, name in enumerate(names):
            if _leaves_folder(name):
                return f"names rank {rank}'s file {name!r}, outside the folder (accelgen reads only files inside it)"
            if name != rank_file_name(rank, world_size, part):
                return (f"names rank {rank}'s file {name!r}, not {rank_file_name(rank, world_size, part)!r} as "
                        f"accelgen shard names it")
    return None


def _key_problem(manifest: dict, key: str, valid, expected: str, required: bool = True) -> str | None:
    """What is wrong with ``manifest[key]``: absent (when ``required``), or not ``valid`` (``expected`` says
    what it should be); None when it is fine."""
    if key not in manifest:
        return f'it lacks "{key}"' if required else None
    if not valid(manifest[key]):
        return f'"{key}" is {_shown(manifest[key])}, not {expected}'
    return None


def _is_count(lowest: int, highest: int | None):
    """A test of a JSON value: a whole number (not a boolean) from ``lowest`` to ``highest`` (None: no bound)."""
    return lambda value: (isinstance(value, int) and not isinstance(value, bool) and value >= lowest
                          and (highest is None or value <= highest))


def _is_names_by_rank(value: object, world_size: int) -> bool:
    """Whether ``value`` is ``world_size`` non-empty lists of strings (each rank's file names)."""
    return (isinstance(value, list) and len(value) == world_size and all(
        isinstance(names, list) and names and all(isinstance(name, str) for name in names) for names in value))


def _leaves_folder(name: str) -> bool:
    """Whether the file name ``name``, joined to a folder, is a path outside it (absolute, or through '..')."""
    parts = name.replace("\\", "/").split("/")
    return os.path.isabs(name) or ".." in parts


def _shown(value: object) -> str:
    """A JSON value as a message quotes it: short, with its Python type's name."""
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} (a {type(value).__name__})"


def missing_rank_file(folder: str, manifest: dict) -> str | None:
    """A rank file the manifest names that ``folder`` lacks, that is not a regular file (a pipe would block
    the reader, a device never ends), or that is a link to a file outside the folder, as a sentence; or None."""
    real_folder = os.path.realpath(folder)
    for rank, files in enumerate(manifest["rank_files"]):
        for name in files:
            path = os.path.join(folder, name)
            try:
                mode = os.stat(path).st_mode
            except OSError:
                return f"{name}: rank {rank}'s file, named by {MANIFEST}, is missing"
            if not stat.S_ISREG(mode):
                return f"{name}: rank {rank}'s file is not a regular file (a pipe, a device or a folder)"
            target = os.path.realpath(path)
            if os.path.commonpath([real_folder, target]) != real_folder:
                return f"{name}: rank {rank}'s file is a link to {target!r}, outside the folder"
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
        "source": source, "accelgen_version": package_version("accelgen"), "deepspeed_version": package_version("deepspeed"),
        "rank_files": rank_files_by_rank,
    }
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as manifest_file:
        json.dump(manifest, manifest_file, indent=1)
        manifest_file.flush()
        os.fsync(manifest_file.fileno())


def package_version(distribution: str) -> str | None:
    """The installed release of ``distribution``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
