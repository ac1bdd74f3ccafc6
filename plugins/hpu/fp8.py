"""``--quantize fp8`` on Gaudi2 and later: Intel Neural Compressor's FP8 quantization, Habana's documented route.

Habana's guide ("Run Inference Using FP8") quantizes with INC in two stages: a measurement run records each
linear layer's input and weight ranges (observer ``maxabs``), then a quantization run converts those layers to
fp8 (E4M3) with scales from the measurements (``maxabs_hw``: scales the hardware applies for free). INC also
offers both stages in one process (``prepare``, calibration passes, ``finalize_calibration``, ``convert``),
which is what this module does on every load: the passes are the core's calibration text, a few seconds of
prefill, so no measurement files have to be kept beside a model, and none taken on another Gaudi generation
(whose scales differ) can be picked up by mistake. The measurements go to a temporary folder, removed after.

Activations are quantized too (fp8 matmuls, not weight-only), except the output head: its logits decide the
tokens, and INC's own examples keep ``lm_head`` in high precision. Gaudi (first generation) has no fp8.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch

from accelgen.common.errors import UsageError

#: The pip package of Intel Neural Compressor for PyTorch (what Habana's guides install for FP8).
INSTALL_HINT = "pip install neural-compressor-pt (Intel Neural Compressor, the library Habana's FP8 guide uses)"
#: INC's names for the precision the layers it does not quantize keep.
HIGH_PRECISION = {"bfloat16": "bf16", "float32": "fp32"}
#: Module names kept out of fp8 (matched as substrings by INC): the output head.
KEPT_IN_HIGH_PRECISION = ["lm_head"]


def check_fp8_generation(generation: str | None, device_name: str) -> None:
    """Raise UsageError on a card without fp8 (first-generation Gaudi)."""
    if generation == "Gaudi":
        raise UsageError(f"--quantize fp8 needs Gaudi2 or later; this card is {device_name} (first-generation Gaudi, "
                         "no fp8): drop --quantize.")


def quantize_to_fp8(model: torch.nn.Module, dtype: str, calibrate: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """The model with its linear layers (but the head) in fp8, their scales measured over ``calibrate``'s passes."""
    try:
        from neural_compressor.torch.quantization import FP8Config, convert, finalize_calibration, prepare
    except ImportError as error:
        raise UsageError(f"--quantize fp8 on hpu needs Intel Neural Compressor ({error}): {INSTALL_HINT}.") from None
    with tempfile.TemporaryDirectory(prefix="accelgen-fp8-") as folder:
        config = FP8Config(
            mode="AUTO",  # prepare() measures, convert() quantizes with what was measured
            observer="maxabs",
            scale_method="maxabs_hw",
            fp8_config="E4M3",
            hp_dtype=HIGH_PRECISION[dtype],
            blocklist={"names": KEPT_IN_HIGH_PRECISION, "types": []},
            dump_stats_path=str(Path(folder) / "measure"),
        )
        model = prepare(model, config)
        calibrate(model)
        finalize_calibration(model)
        return convert(model)
