"""A model checkpoint holding NaN or inf in any tensor is refused in one line before any row runs, on every way a model
loads: whole, over two ranks (each checking its own slices), offloaded to disk, from a pre-sharded folder, made int8
while loading. Before, such a checkpoint ran to exit 0 and wrote garbage (every row decoded from NaN logits).
A sound checkpoint still loads.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_error_line, one_error_line_in
from safetensors.torch import load_file, save_file

from accelgen.cli import main
from accelgen.loading.pre_sharded import MANIFEST

QUICK = ["--device", "cpu", "--max-new-tokens", "2", "--quiet", "--prompt", "Hello"]
POISONED = "model.layers.1.mlp.down_proj.weight"
FIX = "download or save the model again (every value finite), or pass another checkpoint."


def poisoned_copy(folder: Path, into: Path, tensor: str = POISONED, value: float = float("nan"), row: int = 0,
                  file: str = "model.safetensors") -> Path:
    """A copy of the model ``folder`` in ``into`` whose ``tensor`` holds ``value`` in its row ``row`` (the rest as
    saved)."""
    shutil.copytree(folder, into)
    tensors = load_file(into / file)
    tensors[tensor][row].view(-1)[0] = value
    save_file(tensors, into / file, metadata={"format": "pt"})
    return into


def refused(capsys, folder: Path, *arguments: str) -> str:
    capsys.readouterr()
    assert main(["run", *QUICK, "--model", str(folder), *arguments]) == 2
    return one_error_line(capsys)


def says_not_finite(line: str, folder: Path, tensor: str = POISONED) -> bool:
    return line == f"accelgen: error: Checkpoint {folder}'s tensor {tensor!r} holds NaN or inf: the weights are " \
        f"damaged or come from a training run that diverged; {FIX}\n"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_checkpoint_holding_nan_or_inf_is_refused_before_any_row_runs(tiny_model_folder, tmp_path, capsys, value):
    folder = poisoned_copy(tiny_model_folder("llama"), tmp_path / "poisoned", value=value)
    output = tmp_path / "rows.jsonl"
    assert says_not_finite(refused(capsys, folder, "--output", str(output)), folder)
    assert not output.exists()


def test_a_checkpoint_made_int8_while_loading_is_refused_too(tiny_model_folder, tmp_path, capsys):
    folder = poisoned_copy(tiny_model_folder("llama"), tmp_path / "poisoned")
    assert says_not_finite(refused(capsys, folder, "--quantize", "int8"), folder)


def test_a_sound_checkpoint_still_loads(tiny_model_folder, tmp_path, capsys):
    """(Random weights are not checked: test_bench runs them; the other suites check every way of loading gives the
    same tokens as before.)"""
    output = tmp_path / "rows.jsonl"
    assert main(["run", *QUICK, "--model", str(tiny_model_folder("llama")), "--output", str(output)]) == 0
    assert len(output.read_text().splitlines()) == 1


# -- offloaded ----------------------------------------------------------------------------------------------------

OFFLOAD = ["--offload", "disk", "--max-device-memory", "1MiB"]
#: A cap under which the tiny llama keeps its embedding on the device and its layers on disk.
LAYERS_ON_DISK = "400KiB"


def test_an_offloaded_run_refuses_a_tensor_it_keeps_on_the_device(tiny_model_folder, tmp_path, capsys):
    folder = poisoned_copy(tiny_model_folder("llama"), tmp_path / "poisoned", tensor="model.embed_tokens.weight")
    assert says_not_finite(refused(capsys, folder, *OFFLOAD), folder, "model.embed_tokens.weight")


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]])
def test_an_offloaded_run_refuses_a_tensor_it_writes_to_its_offload_folder(tiny_model_folder, tmp_path, capsys, quantize):
    folder = poisoned_copy(tiny_model_folder("llama"), tmp_path / "poisoned")
    offload_folder = tmp_path / "offload"
    line = refused(capsys, folder, "--offload", "disk", "--max-device-memory", LAYERS_ON_DISK, "--offload-folder",
                   str(offload_folder), *quantize)
    assert says_not_finite(line, folder)


def test_an_offloaded_run_refuses_a_tensor_it_reads_in_place_from_the_checkpoint(tiny_model_folder, tmp_path, capsys):
    """Offloaded weights read in place are not read while loading: each is checked the first time it is brought to
    the device, in the first forward pass, before any row is written."""
    folder = poisoned_copy(tiny_model_folder("llama"), tmp_path / "poisoned")
    output = tmp_path / "rows.jsonl"
    line = refused(capsys, folder, "--offload", "disk", "--max-device-memory", LAYERS_ON_DISK, "--output", str(output))
    assert says_not_finite(line, folder)
    assert not output.exists()


# -- pre-sharded --------------------------------------------------------------------------------------------------

def test_accelgen_shard_refuses_a_checkpoint_holding_nan(tiny_model_folder, tmp_path, capsys):
    folder = poisoned_copy(tiny_model_folder("llama"), tmp_path / "poisoned")
    output = tmp_path / "sharded"
    capsys.readouterr()
    assert main(["shard", "--device", "cpu", "--model", str(folder), "--world-size", "1", "--dtype", "float32",
                 "--output", str(output)]) == 2
    assert says_not_finite(one_error_line(capsys), folder)
    assert not output.exists()


def test_a_pre_sharded_checkpoint_holding_nan_is_refused(tiny_model_folder, tmp_path, capsys):
    sharded = tmp_path / "sharded"
    assert main(["shard", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--world-size", "1",
                 "--dtype", "float32", "--output", str(sharded)]) == 0
    assert (sharded / MANIFEST).is_file()
    rank_file = "rank-00000-of-00001-part-00000.safetensors"
    folder = poisoned_copy(sharded, tmp_path / "poisoned", value=float("inf"), file=rank_file)
    assert says_not_finite(refused(capsys, folder, "--dtype", "float32"), folder)


# -- two ranks ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_each_rank_refuses_the_slice_it_holds(tiny_model_folder, tmp_path, cli_environment):
    """The NaN lies in the last output row of a column-parallel weight: in rank 1's slice only."""
    pytest.importorskip("deepspeed")
    tensor = "model.layers.0.self_attn.q_proj.weight"
    folder = poisoned_copy(tiny_model_folder("llama"), tmp_path / "poisoned", tensor=tensor, row=-1)
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", *QUICK, "--world-size", "2", "--model",
                             str(folder)], env=cli_environment, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr
    line = one_error_line_in(result.stderr)
    assert f"Checkpoint {folder}'s tensor {tensor!r} holds NaN or inf" in line and line.endswith(FIX + "\n")
