"""Calibration passes: the forward passes over a shipped text on which a scheme that quantizes activations
(``--quantize fp8``) measures their ranges before it converts the model.

The text (``calibration.txt``) mixes prose, dialogue, code, JSON, SQL, numbers and several scripts, so that
the measured ranges cover more than one kind of input. It is cut into windows of ``length`` tokens, so every
pass has one static shape (lazy-mode devices compile it once), and every rank of a tensor-parallel job runs the
same passes (its layers' collectives need all ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from accelgen.model.shape import forward_accepts

CALIBRATION_TEXT = Path(__file__).parent / "calibration.txt"


def calibration_windows(tokenizer: PreTrainedTokenizerBase, length: int, windows: int) -> torch.Tensor:
    """At most ``windows`` consecutive windows of ``length`` tokens of the calibration text, [windows, length]
    (fewer when the text is shorter; the text is repeated when it gives less than one window)."""
    tokens = tokenizer(CALIBRATION_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    while len(tokens) < length:
        tokens = tokens + tokens
    count = min(windows, len(tokens) // length)
    return torch.tensor(tokens[: count * length]).view(count, length)


def calibration_pass(
    tokenizer: PreTrainedTokenizerBase, device: torch.device, mark_step: Callable[[], None], *,
    length: int = 128, windows: int = 8, batch_size: int = 4,
) -> Callable[[torch.nn.Module], None]:
    """A function that runs a model over the calibration windows, ``batch_size`` at a time, without a cache;
    ``mark_step`` follows every pass (the device's, as after the generator's own passes). The text is read and
    tokenized when it is called: a scheme that does not calibrate costs nothing."""

    @torch.no_grad()
    def calibrate(model: torch.nn.Module) -> None:
        keep_last = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
        for batch in calibration_windows(tokenizer, length, windows).split(batch_size):
            input_ids = batch.to(device)
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False, **keep_last)
            mark_step()

    return calibrate
