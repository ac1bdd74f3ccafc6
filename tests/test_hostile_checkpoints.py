"""Hostile checkpoints, pre-sharded folders and `accelgen shard` outputs, as an attacker (or an accident) makes
them: each is refused with one ``accelgen: error:`` line, exit status 2 and no traceback, before any rank starts,
and nothing the user had is changed (byte for byte) or read from outside the model's folder.

Most cases run ``accelgen.cli.main`` in this process; a full disk (a file size limit for one process, a small
tmpfs for a two-rank shard job) and a two-rank shard job need real processes.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import one_error_line
from safetensors.torch import load_file, save_file

from accelgen.cli import main
from accelgen.loading.pre_sharded import MANIFEST

QUICK = ["--device", "cpu", "--max-new-tokens", "2", "--quiet", "--prompt", "Hello"]
RANK_0_OF_1 = "rank-00000-of-00001-part-00000.safetensors"


@pytest.fixture(autouse=True)
def _never_hang():
    """A refusal must come at once: a read from a pipe that blocks fails the test instead of hanging it."""
    def hung(signum, frame):
        raise TimeoutError("the command blocked (reading a pipe?)")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def fails(capsys, *arguments: str) -> str:
    capsys.readouterr()  # what fixtures printed
    assert main(list(arguments)) == 2
    return one_error_line(capsys)


def run_fails(capsys, folder: Path, *arguments: str) -> str:
    return fails(capsys, "run", *QUICK, "--model", str(folder), *arguments)


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (links as where they point), to compare byte for byte."""
    return {str(path.relative_to(folder)): os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_symlink() or path.is_file()}


def shard_arguments(model: Path, output: str, world_size: int = 1) -> list[str]:
    return ["shard", "--device", "cpu", "--model", str(model), "--world-size", str(world_size), "--dtype", "float32",
            "--output", output]


@pytest.fixture(scope="module")
def sharded_for_one(tiny_model_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded") / "opt-1"
    assert main(shard_arguments(tiny_model_folder("opt"), str(folder))) == 0
    return folder


@pytest.fixture
def sharded_copy(sharded_for_one, tmp_path) -> Path:
    """A copy of a folder sharded for one rank, that a test may damage."""
    return Path(shutil.copytree(sharded_for_one, tmp_path / "sharded"))


def edit_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps(change(manifest)))


# -- 1. pre-sharded manifests naming files outside their folder --------------------------------------------------

@pytest.mark.parametrize("name", ["../secret.safetensors", "../../secret.safetensors", "{outside}/secret.safetensors",
                                  "sub/../../secret.safetensors"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(sharded_copy, tmp_path, capsys, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    for secret in (tmp_path / "secret.safetensors", outside / "secret.safetensors", tmp_path.parent / "secret.safetensors"):
        shutil.copy(sharded_copy / RANK_0_OF_1, secret)  # loads as weights, if it is ever opened
    name = name.format(outside=outside)
    edit_manifest(sharded_copy, lambda manifest: {**manifest, "rank_files": [[name]]})
    error = run_fails(capsys, sharded_copy)
    assert f"names rank 0's file {name!r}, outside the folder" in error
    assert error.endswith("shard the original model again (accelgen shard).\n")


def test_a_rank_file_linked_to_a_file_outside_its_folder_is_refused(sharded_copy, tmp_path, capsys):
    secret = tmp_path / "secret.safetensors"
    shutil.move(sharded_copy / RANK_0_OF_1, secret)
    (sharded_copy / RANK_0_OF_1).symlink_to(secret)
    error = run_fails(capsys, sharded_copy)
    assert f"{RANK_0_OF_1}: rank 0's file is a link to {str(secret)!r}, outside the folder" in error


# -- 2. manifests missing keys, or holding values of the wrong type ---------------------------------------------

@pytest.mark.parametrize("change, message", [
    (lambda manifest: {key: value for key, value in manifest.items() if key != "world_size"}, 'lacks "world_size"'),
    (lambda manifest: {**manifest, "world_size": "1"}, "\"world_size\" is '1' (a str), not a whole number from 1"),
    (lambda manifest: {**manifest, "world_size": True}, '"world_size" is True (a bool), not a whole number from 1'),
    (lambda manifest: {**manifest, "world_size": 0}, '"world_size" is 0 (a int), not a whole number from 1'),
    (lambda manifest: {**manifest, "dtype": 32}, '"dtype" is 32 (a int), not one of float32, bfloat16, float16'),
    (lambda manifest: {**manifest, "dtype": "float64"}, "\"dtype\" is 'float64' (a str), not one of float32"),
    (lambda manifest: {**manifest, "quantize": ["int8"]}, "\"quantize\" is ['int8'] (a list), not null or one of int8, fp8"),
    (lambda manifest: {key: value for key, value in manifest.items() if key != "rank_files"}, 'lacks "rank_files"'),
    (lambda manifest: {**manifest, "rank_files": "x"}, "\"rank_files\" is 'x' (a str), not a list of 1 list(s) of file names"),
    (lambda manifest: {**manifest, "rank_files": [[], []]}, '"rank_files" is [[], []] (a list), not a list of 1 list(s)'),
    (lambda manifest: {**manifest, "rank_files": [[]]}, '"rank_files" is [[]] (a list), not a list of 1 list(s) of file names'),
    (lambda manifest: {**manifest, "rank_files": [[7]]}, '"rank_files" is [[7]] (a list), not a list of 1 list(s) of file names'),
    (lambda manifest: {**manifest, "rank_files": [["model.safetensors"]]},
     f"names rank 0's file 'model.safetensors', not {RANK_0_OF_1!r} as accelgen shard names it"),
    (lambda manifest: {**manifest, "format_version": "1"}, "\"format_version\" is '1' (a str), not a whole number from 1"),
    (lambda manifest: {**manifest, "source": 5}, '"source" is 5 (a int), not an object'),
    (lambda manifest: [manifest], "is [{"),
])
def test_a_manifest_missing_a_key_or_holding_a_wrong_type_is_one_line(sharded_copy, capsys, change, message):
    edit_manifest(sharded_copy, change)
    before = contents(sharded_copy)
    error = run_fails(capsys, sharded_copy)
    assert f"{sharded_copy / MANIFEST} is damaged: " in error and message in error
    assert contents(sharded_copy) == before


def test_a_world_size_written_as_text_is_not_taken_for_a_number(sharded_copy, capsys):
    """Before: "sharded for --world-size 1 ..., not --world-size 1"."""
    edit_manifest(sharded_copy, lambda manifest: {**manifest, "world_size": "1"})
    assert "not --world-size" not in run_fails(capsys, sharded_copy)


# -- 3. rank files renamed or swapped ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded_for_two(tiny_model_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded") / "llama-2"
    environment = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", *shard_arguments(tiny_model_folder("llama"), str(folder), 2)],
                            env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return folder


def test_swapped_rank_files_are_refused_before_any_rank_starts(sharded_for_two, tmp_path, capsys):
    folder = Path(shutil.copytree(sharded_for_two, tmp_path / "swapped"))
    rank_0, rank_1 = (folder / f"rank-0000{rank}-of-00002-part-00000.safetensors" for rank in (0, 1))
    assert load_file(rank_0).keys() == load_file(rank_1).keys()  # same names, other halves: only the header tells
    rank_0.rename(tmp_path / "rank-0"), rank_1.rename(rank_0), (tmp_path / "rank-0").rename(rank_1)
    error = run_fails(capsys, folder, "--world-size", "2")  # refused here: no rank was launched
    assert f"{rank_0.name}: holds rank 1's tensors of a 2-rank split, not rank 0's (a rank file renamed or swapped)" in error


def test_a_rank_file_stripped_of_its_rank_beside_one_that_names_it_is_refused(sharded_for_two, tmp_path, capsys):
    folder = Path(shutil.copytree(sharded_for_two, tmp_path / "stripped"))
    rank_1 = folder / "rank-00001-of-00002-part-00000.safetensors"
    save_file(load_file(rank_1), rank_1)  # no metadata
    error = run_fails(capsys, folder, "--world-size", "2")
    assert f"{rank_1.name}: names no rank while the folder's other rank files do (a file replaced)" in error


def test_a_rank_file_of_another_world_size_is_refused(sharded_copy, sharded_for_two, capsys):
    shutil.copy(sharded_for_two / "rank-00000-of-00002-part-00000.safetensors", sharded_copy / RANK_0_OF_1)
    error = run_fails(capsys, sharded_copy)
    assert f"{RANK_0_OF_1}: holds rank 0's tensors of a 2-rank split, not rank 0's of 1" in error


def test_a_folder_sharded_before_rank_files_named_their_rank_still_loads(sharded_copy, capsys):
    path = sharded_copy / RANK_0_OF_1
    metadata = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])["__metadata__"]
    assert {"accelgen_rank": "0", "accelgen_world_size": "1"}.items() <= metadata.items()
    save_file(load_file(path), path)  # as accelgen shard wrote it before: no metadata
    capsys.readouterr()
    assert main(["run", *QUICK, "--model", str(sharded_copy)]) == 0


# -- 4. shard outputs that would delete what accelgen did not write ------------------------------------------------

@pytest.fixture
def source_model(tiny_model_folder, tmp_path) -> Path:
    """A model folder inside a folder of the user's, with a file of its own beside it."""
    (tmp_path / "mine.txt").write_text("the user's")
    return Path(shutil.copytree(tiny_model_folder("opt"), tmp_path / "models" / "opt"))


@pytest.mark.parametrize("output, message", [
    (lambda model: model, "holds the model being sharded"),
    (lambda model: model.parent, "holds the model being sharded"),
    (lambda model: model.parent.parent, "holds the model being sharded"),
    (lambda model: Path(f"{model}/"), "holds the model being sharded"),
    (lambda model: model / "..", "holds the model being sharded"),
])
def test_shard_never_replaces_the_folder_of_the_model_it_reads(source_model, tmp_path, capsys, output, message):
    before = contents(tmp_path)
    error = fails(capsys, *shard_arguments(source_model, str(output(source_model))), "--overwrite")
    assert message in error and "pass another --output" in error
    assert contents(tmp_path) == before


def test_shard_replaces_only_a_folder_it_wrote(source_model, tmp_path, capsys):
    output = tmp_path / "out"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    error = fails(capsys, *shard_arguments(source_model, str(output)), "--overwrite")
    assert f"--output {str(output)!r} is a folder accelgen shard did not write (it has no {MANIFEST})" in error
    assert (output / "notes.txt").read_text() == "mine"


def test_shard_never_removes_a_folder_of_the_users_named_as_its_staging_folder(source_model, tmp_path, capsys):
    staging = tmp_path / "out.partial"
    staging.mkdir()
    (staging / "mine.txt").write_text("the user's")
    for overwrite in ([], ["--overwrite"]):
        error = fails(capsys, *shard_arguments(source_model, str(tmp_path / "out")), *overwrite)
        assert f"{str(staging)!r} exists and accelgen shard did not make it" in error
    assert (staging / "mine.txt").read_text() == "the user's" and not (tmp_path / "out").exists()


def test_replacing_an_output_keeps_every_other_folder(source_model, tmp_path, capsys):
    """`<output>.replaced` (the name the replaced folder once took) is the user's; a trailing slash is no
    different from none."""
    output = tmp_path / "out"
    (tmp_path / "out.replaced").mkdir()
    (tmp_path / "out.replaced" / "mine.txt").write_text("the user's")
    for _ in range(2):
        assert main(shard_arguments(source_model, f"{output}/") + ["--overwrite"]) == 0
        assert (output / MANIFEST).is_file() and not Path(f"{output}.partial").exists()
    assert (tmp_path / "out.replaced" / "mine.txt").read_text() == "the user's"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine.txt", "models", "out", "out.replaced"]
    capsys.readouterr()
    assert main(["run", *QUICK, "--model", str(output)]) == 0


# -- 5. outputs that cannot be written -----------------------------------------------------------------------------

def test_an_output_under_proc_is_one_line(source_model, capsys):
    error = fails(capsys, *shard_arguments(source_model, "/proc/accelgen-shards"))
    assert "Cannot write --output '/proc/accelgen-shards'" in error


def test_a_full_disk_while_sharding_leaves_no_folder(source_model, tmp_path, cli_environment):
    output = tmp_path / "out"
    limit = (source_model / "model.safetensors").stat().st_size // 2  # a rank file is larger

    def limit_file_size() -> None:  # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    before = contents(tmp_path)
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", *shard_arguments(source_model, str(output))],
                            env=cli_environment, capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"accelgen: error: Cannot write --output {str(output)!r}: File too large")
    assert contents(tmp_path) == before and not output.exists() and not Path(f"{output}.partial").exists()


def run_on_a_small_disk(disk: Path, size: int, command: list[str], environment: dict) -> tuple[subprocess.CompletedProcess,
                                                                                                list[str]]:
    """Run ``command`` with a real filesystem of ``size`` bytes (a tmpfs, which fails a write past its size with
    ENOSPC, "No space left on device", as a full disk does) mounted on ``disk``; what it printed, and the names
    left on that disk after it. The mount lives in a mount namespace of the command's own (``unshare --mount
    --map-root-user``: no root needed where user namespaces are allowed), so nothing outside sees it and it goes
    with the command, whatever happens to the test. Skips the test where such a mount is not permitted."""
    mount = ["unshare", "--mount", "--map-root-user", "--", "mount", "-t", "tmpfs", "-o", "size=4096", "tmpfs", str(disk)]
    try:
        probe = subprocess.run(mount, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("unshare (util-linux) is not installed: a small disk cannot be mounted for this test")
    if probe.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted in a private mount namespace here: {probe.stderr.strip()}")
    left = disk.parent / f"{disk.name}-left.txt"
    script = 'mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 99; shift 2; "$@"; status=$?; ls -A "$DISK" > "$LEFT"; exit $status'
    result = subprocess.run(["unshare", "--mount", "--map-root-user", "--", "sh", "-c", script, "sh", str(size), str(disk),
                             *command], env=dict(environment, DISK=str(disk), LEFT=str(left)), capture_output=True,
                            text=True, timeout=200)
    assert result.returncode != 99, result.stderr
    return result, left.read_text().split()


@pytest.mark.slow
def test_a_full_disk_under_a_two_rank_shard_is_one_line_naming_the_rank_and_gives_the_disk_back(source_model, tmp_path,
                                                                                                cli_environment):
    """A disk with room for one rank's file, not two: the rank that comes second fails with ENOSPC while the other
    waits for it in a collective, which then fails too (its peer is gone). The job ends in the failing rank's one
    line, no traceback from the other, and the staging folder is removed: the disk is as empty as before."""
    disk = tmp_path / "disk"
    disk.mkdir()
    output = disk / "out"
    size = (source_model / "model.safetensors").stat().st_size  # a rank file holds half the model and more
    result, left = run_on_a_small_disk(disk, size, [sys.executable, "-m", "accelgen.cli",
                                                    *shard_arguments(source_model, str(output), 2)], cli_environment)
    assert result.returncode == 2, result.stderr
    # (a rank may also say it waits for the other to build DeepSpeed's extension, the first time: not an error)
    ours = [line for line in result.stderr.splitlines() if line.startswith("accelgen: error")]
    assert len(ours) == 1 and re.fullmatch(
        rf"accelgen: error: Cannot write --output {re.escape(repr(str(output)))} \(rank [01]\): No space left on device: "
        r"the checkpoint was not written; free space on that disk, or pass another --output, and run again\.", ours[0]), \
        result.stderr
    assert "Traceback" not in result.stderr and "[rank" not in result.stderr and "gloo" not in result.stderr, result.stderr
    assert left == []  # neither out nor out.partial: the space is given back


# -- 6. weight files that are not what they claim ------------------------------------------------------------------

class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran-code",))


def pickle_that_runs_code(folder: Path) -> None:
    torch.save({"model.decoder.embed_tokens.weight": torch.zeros(2), "extra": RunsCode()}, folder / "pytorch_model.bin")


def truncated_pickle(folder: Path) -> None:
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    os.truncate(folder / "pytorch_model.bin", (folder / "pytorch_model.bin").stat().st_size // 2)


@pytest.mark.parametrize("damage, message", [
    (pickle_that_runs_code, "pytorch_model.bin was refused: loading it would run code (posix.system): convert it to "
                            "safetensors"),
    (truncated_pickle, "has a damaged weight file: pytorch_model.bin: truncated"),
    (lambda folder: os.mkfifo(folder / "pytorch_model.bin"), "holds 'pytorch_model.bin', which is not a regular file"),
    (lambda folder: (folder / "pytorch_model.bin").mkdir(), "pytorch_model.bin: not a regular file"),
    (lambda folder: (folder / "pytorch_model.bin").symlink_to("/dev/zero"), "holds 'pytorch_model.bin', which is not a regular"),
])
def test_a_pickle_checkpoint_that_is_not_one_is_refused(tiny_model_folder, tmp_path, capsys, monkeypatch, damage, message):
    folder = Path(shutil.copytree(tiny_model_folder("opt"), tmp_path / "model"))
    damage(folder)
    (folder / "model.safetensors").unlink()
    monkeypatch.chdir(tmp_path)
    before = contents(tmp_path)
    error = run_fails(capsys, folder)
    assert message in error
    assert contents(tmp_path) == before and not (tmp_path / "ran-code").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
@pytest.mark.parametrize("make", [
    lambda path: os.mkfifo(path), lambda path: path.symlink_to("/dev/zero"),
])
def test_a_file_of_a_model_folder_that_is_a_pipe_or_a_device_is_refused(tiny_model_folder, tmp_path, capsys, name, make):
    folder = Path(shutil.copytree(tiny_model_folder("opt"), tmp_path / "model"))
    (folder / name).unlink()
    make(folder / name)
    error = run_fails(capsys, folder)
    assert f"holds {name!r}, which is not a regular file (a pipe or a device)" in error


def rewrite_header(path: Path, change) -> None:
    """Rewrite the safetensors file at ``path`` with ``change(header)`` applied to its first tensor's entry."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    change(header[next(name for name in header if name != "__metadata__")])
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


@pytest.mark.parametrize("change, message", [
    (lambda entry: entry.update(data_offsets=[-64, entry["data_offsets"][1]]),
     "its shape and data_offsets are not whole numbers from 0"),
    (lambda entry: entry.update(shape="x"), "its shape and data_offsets are not whole numbers from 0"),
    (lambda entry: entry.update(shape=[entry["shape"][0] * 2, *entry["shape"][1:]]), "bytes, its offsets span"),
    (lambda entry: entry.update(shape=[10**12, 10**12]), "bytes, its offsets span"),
    (lambda entry: entry.update(dtype="F8_E4M3"), "has dtype 'F8_E4M3', which accelgen does not read"),
])
def test_a_safetensors_header_describing_bytes_it_does_not_hold_is_refused(tiny_model_folder, tmp_path, capsys, change,
                                                                          message):
    """Before: a negative offset read the header's own bytes as weights, silently; a wrong shape was a traceback."""
    folder = Path(shutil.copytree(tiny_model_folder("opt"), tmp_path / "model"))
    rewrite_header(folder / "model.safetensors", change)
    error = run_fails(capsys, folder)
    assert "has a damaged weight file: model.safetensors: " in error and message in error


def test_a_weight_file_that_is_a_folder_is_refused(tiny_model_folder, tmp_path, capsys):
    folder = Path(shutil.copytree(tiny_model_folder("opt"), tmp_path / "model"))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    assert "model.safetensors: not a regular file" in run_fails(capsys, folder)


def test_a_rank_file_that_is_a_pipe_is_refused(sharded_copy, capsys):
    (sharded_copy / RANK_0_OF_1).unlink()
    os.mkfifo(sharded_copy / RANK_0_OF_1)
    assert f"holds {RANK_0_OF_1!r}, which is not a regular file" in run_fails(capsys, sharded_copy)


def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(tiny_model_folder, tmp_path, capsys):
    folder = Path(shutil.copytree(tiny_model_folder("opt"), tmp_path / "model"))
    shutil.move(folder / "model.safetensors", tmp_path / "secret.safetensors")
    names = load_file(tmp_path / "secret.safetensors").keys()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "../secret.safetensors" for name in names}}))
    error = run_fails(capsys, folder)
    assert "model.safetensors.index.json: not a readable shard index" in error and "'../secret.safetensors'" in error
