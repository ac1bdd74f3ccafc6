"""Model checkpoints: a checkpoint whose weights hold NaN or inf (a damaged file, a training run that diverged).

Each case runs over a copy of the built-in model (``core/default_model``) with one value of one tensor spoiled.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hostile_round6_cases.common import QUICK, accelgen, rows_of

BUILT_IN = Path(__file__).resolve().parents[2] / "core" / "default_model"
SPOILED_TENSOR = "transformer.h.1.mlp.dense_4h_to_h.weight"


def _spoiled_model(folder: Path, value: float) -> Path:
    """A copy of the built-in model whose ``SPOILED_TENSOR`` holds ``value`` at one place."""
    import torch  # noqa: F401 -- safetensors' torch tensors
    from safetensors.torch import load_file, save_file

    model = Path(shutil.copytree(BUILT_IN, folder / "model"))
    tensors = load_file(model / "model.safetensors")
    tensors[SPOILED_TENSOR][0, 0] = value
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


def case_nan_checkpoint(folder: Path):
    """A checkpoint with a NaN in one weight: refused in one line before any row runs (was exit 0, garbage rows)."""
    output = folder / "rows.jsonl"
    outcome = accelgen(*QUICK, "--model", str(_spoiled_model(folder, float("nan"))), "--prompt", "Hello",
                       "--prompt", "The quick brown fox", "--output", str(output))
    outcome.note = ", ".join(filter(None, [outcome.note, f"{len(rows_of(output))} rows written"]))
    return outcome
