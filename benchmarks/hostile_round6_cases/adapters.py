"""LoRA adapters (``--lora NAME=PATH``): an adapter holding NaN or inf, an adapter named as the served model, a config
field of the wrong type, a config nested too deep, a batch request naming an adapter the run does not serve.

Each case runs over the tests' tiny Llama and its three PEFT adapters (``tests/tiny_models.py``,
``tests/lora_adapters.py``), built once per process.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from hostile_round6_cases.common import QUICK, accelgen, error_rows_note, rows_of

TESTS = Path(__file__).resolve().parents[2] / "tests"
TEXTS = ["DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps", "In the beginning God"]
PAD_ID = 0


@functools.cache
def _model_and_adapters() -> tuple[Path, dict[str, Path]]:
    """The tiny Llama's folder and its adapters a0, a1, a2 (name -> folder), built once under a temporary folder."""
    sys.path.insert(0, str(TESTS))
    from lora_adapters import build_adapters
    from tiny_models import build_model, build_tokenizer, tiny_configs

    root = Path(tempfile.mkdtemp(prefix="hostile-adapters-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    tokenizer = build_tokenizer(root / "tokenizer")
    model = build_model(root / "llama", tiny_configs(len(tokenizer))["llama"])
    tokenizer.save_pretrained(model)
    return model, build_adapters(model, root / "adapters", "llama")


def _copy_of_a2(folder: Path) -> Path:
    copy = folder / "a2-copy"
    shutil.copytree(_model_and_adapters()[1]["a2"], copy)
    return copy


def _spoiled(folder: Path, value: float) -> Path:
    """A copy of adapter a2 whose first B matrix holds ``value`` at one place."""
    import torch  # noqa: F401 -- safetensors' torch tensors
    from safetensors.torch import load_file, save_file

    copy = _copy_of_a2(folder)
    tensors = load_file(copy / "adapter_model.safetensors")
    tensors[sorted(name for name in tensors if "lora_B" in name)[0]][0, 0] = value
    save_file(tensors, copy / "adapter_model.safetensors")
    return copy


def _twelve_rows(folder: Path) -> Path:
    path = folder / "rows.jsonl"
    cycle = [None, "a0", "a1", "third"] * 3
    path.write_text("".join(json.dumps({"text": TEXTS[number % 4], "adapter": name}) + "\n"
                            for number, name in enumerate(cycle)))
    return path


def _twelve_row_job(folder: Path, third: Path, output: Path, *extra: str):
    model, adapters = _model_and_adapters()
    return accelgen(*QUICK, "--model", str(model), "--max-new-tokens", "12", "--dataset", str(_twelve_rows(folder)),
                    "--lora-column", "adapter", "--lora", f"a0={adapters['a0']}", "--lora", f"a1={adapters['a1']}",
                    "--lora", f"third={third}", "--output", str(output), *extra)


def _all_pad_rows(output: Path) -> int:
    return sum(1 for row in rows_of(output) if set(row.get("completion_token_ids") or [PAD_ID]) == {PAD_ID})


def case_nan_adapter(folder: Path):
    """Twelve rows over the base model and three adapters, one adapter holding NaN: refused in one line naming its tensor."""
    sound = folder / "sound.jsonl"
    sound_run = _twelve_row_job(folder, _model_and_adapters()[1]["a2"], sound, "--details")
    outcome = _twelve_row_job(folder, _spoiled(folder, math.nan), folder / "out.jsonl")
    outcome.note = (f"output {'written' if (folder / 'out.jsonl').exists() else 'not written'}; the same job with a sound "
                    f"third adapter: exit {sound_run.status}, {error_rows_note(sound)}, {_all_pad_rows(sound)} all-pad")
    return outcome


def case_inf_adapter_skip_bad_rows(folder: Path):
    """The same with inf and --skip-bad-rows: the adapter is named on the command line, so the job is refused in one line."""
    outcome = _twelve_row_job(folder, _spoiled(folder, math.inf), folder / "out.jsonl", "--skip-bad-rows")
    outcome.note = f"output {'written' if (folder / 'out.jsonl').exists() else 'not written'}"
    return outcome


def _batch_file(folder: Path, models: list[str]) -> Path:
    path = folder / "requests.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{number}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": TEXTS[number % 4], "model": model}}) + "\n"
                            for number, model in enumerate(models)))
    return path


def case_adapter_named_as_served_model(folder: Path):
    """--lora gpt-4o-mini=PATH with --served-model-name gpt-4o-mini: refused in one line (which one a request means is unsaid)."""
    model, adapters = _model_and_adapters()
    return accelgen(*QUICK, "--model", str(model), "--dataset", str(_batch_file(folder, ["gpt-4o-mini", "a0"])),
                    "--lora", f"gpt-4o-mini={adapters['a0']}", "--served-model-name", "gpt-4o-mini",
                    "--output", str(folder / "out.jsonl"))


def _with_config(folder: Path, text: str):
    model, _ = _model_and_adapters()
    copy = _copy_of_a2(folder)
    (copy / "adapter_config.json").write_text(text)
    return accelgen(*QUICK, "--model", str(model), "--prompt", "Hello", "--lora", f"bad={copy}")


def case_lora_alpha_null(folder: Path):
    """adapter_config.json with lora_alpha null: one line naming the file and the field (was a TypeError)."""
    config = json.loads((_model_and_adapters()[1]["a2"] / "adapter_config.json").read_text())
    return _with_config(folder, json.dumps({**config, "lora_alpha": None}))


def case_lora_alpha_text(folder: Path):
    """adapter_config.json with lora_alpha "16": one line naming the file and the field."""
    config = json.loads((_model_and_adapters()[1]["a2"] / "adapter_config.json").read_text())
    return _with_config(folder, json.dumps({**config, "lora_alpha": "16"}))


def case_config_nested_deep(folder: Path):
    """adapter_config.json nested 100,000 deep: one line (never a RecursionError)."""
    return _with_config(folder, "[" * 100_000 + "]" * 100_000)


def case_unknown_adapter_in_batch_file(folder: Path):
    """A batch request naming adapter a3 the run does not serve: an error line suggesting --lora a3=PATH first."""
    model, adapters = _model_and_adapters()
    output = folder / "out.jsonl"
    outcome = accelgen(*QUICK, "--model", str(model), "--dataset", str(_batch_file(folder, ["a0", "a3"])),
                       "--lora", f"a0={adapters['a0']}", "--output", str(output))
    errors = [row["error"]["message"] for row in rows_of(output) if row.get("error")]
    outcome.note = f"{error_rows_note(output)}; {errors[0] if errors else 'no error line'}"
    return outcome
