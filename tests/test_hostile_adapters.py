"""Hostile LoRA adapters (issue 73, round 6): an adapter holding NaN or inf is refused in one line before the model
loads, and no value of one buffer slot can reach the rows of another; an adapter named as ``--served-model-name`` names
the model is refused; every field read from ``adapter_config.json`` is checked for its type and range; a batch request
naming what the run does not serve is told of both fixes, the adapter's first."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from conftest import one_error_line
from lora_adapters import build_adapters
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import accelgen
from accelgen.adapters.adapter_set import AdapterSet
from accelgen.cli import main
from accelgen.common.errors import UsageError
from accelgen.common.settings import AdapterSettings

MAX_NEW_TOKENS = 6
TEXTS = ["DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps", "In the beginning God"]
#: Twelve rows cycling the base model and three adapters, the third of which is the one a case spoils.
CYCLE = [None, "a0", "a1", "bad"] * 3


@pytest.fixture(scope="module")
def llama_adapters(tiny_model_folder, tmp_path_factory):
    folder = tiny_model_folder("llama")
    return folder, build_adapters(folder, tmp_path_factory.mktemp("hostile-lora"), "llama")


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading the model fails the test: each refusal must come before."""
    def loading(*arguments, **options):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("accelgen.jobs.completion_job.load_request", loading)


def run(*arguments) -> int:
    return main(["run", "--device", "cpu", "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet", *map(str, arguments)])


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def copy_of(adapters, tmp_path, name: str = "a2"):
    folder = tmp_path / f"copy-of-{name}"
    shutil.copytree(adapters[name], folder)
    return folder


def spoiled(adapters, tmp_path, value: float, tensor_part: str = "lora_B"):
    """A copy of adapter a2 whose first ``tensor_part`` matrix (by name) holds ``value`` at one place; its tensor's name."""
    folder = copy_of(adapters, tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    name = sorted(tensor for tensor in tensors if tensor_part in tensor)[0]
    tensors[name][0, 0] = value
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder, name


def twelve_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": TEXTS[number % len(TEXTS)], "adapter": name}) + "\n"
                            for number, name in enumerate(CYCLE)))
    return path


# -- an adapter holding NaN or inf -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("skip_bad_rows", [False, True], ids=["stop", "skip-bad-rows"])
def test_an_adapter_holding_nan_or_inf_is_refused_before_the_model_loads(llama_adapters, tmp_path, capsys,
                                                                         nothing_loads, value, skip_bad_rows):
    """Every row used to come out as pad tokens, the base model's and the sound adapters' too: the adapter is named on
    the command line, so the command is refused, with or without --skip-bad-rows, and the output is left alone."""
    folder, adapters = llama_adapters
    bad, tensor = spoiled(adapters, tmp_path, value)
    output = tmp_path / "out.jsonl"
    assert run("--model", folder, "--dataset", twelve_rows(tmp_path), "--lora-column", "adapter",
               "--lora", f"a0={adapters['a0']}", "--lora", f"a1={adapters['a1']}", "--lora", f"bad={bad}",
               *(["--skip-bad-rows"] if skip_bad_rows else []), "--output", output) == 2
    line = one_error_line(capsys)
    assert f"--lora bad={bad}: the adapter's adapter_model.safetensors holds NaN or inf in {tensor!r}" in line
    assert line.endswith("train or save the adapter again (every value finite).\n")
    assert not output.exists()


def test_an_adapter_merged_into_the_weights_holding_nan_is_refused_too(llama_adapters, tmp_path, capsys, nothing_loads):
    folder, adapters = llama_adapters
    bad, tensor = spoiled(adapters, tmp_path, math.nan, "lora_A")
    assert run("--model", folder, "--prompt", "Hello", "--lora", bad) == 2
    assert f"--lora '{bad}': the adapter's adapter_model.safetensors holds NaN or inf in {tensor!r}" in one_error_line(capsys)


def test_an_adapter_beyond_the_range_of_the_runs_dtype_is_refused(llama_adapters, tmp_path, capsys, nothing_loads):
    """A value finite in the file but beyond the dtype's range once scaled (or cast) would be inf in the buffers."""
    folder, adapters = llama_adapters
    big, tensor = spoiled(adapters, tmp_path, 3e38)  # times the layer's scaling, 3: beyond float32
    assert run("--model", folder, "--prompt", "Hello", "--lora", f"big={big}") == 2
    assert one_error_line(capsys) == (f"accelgen: error: --lora big={big}: the adapter holds values beyond float32's "
                                      f"range in {tensor!r} (largest 9e+38 after its scaling): train the adapter again.\n")
    wide, tensor = spoiled(adapters, tmp_path / "wide", 1e6, "lora_A")
    settings = AdapterSettings(named=(("wide", str(wide)),))
    adapter_set = AdapterSet(settings)
    adapter_set.check_fits(AutoConfig.from_pretrained(folder), "bfloat16")
    with pytest.raises(UsageError, match=re.escape(f"beyond float16's range in {tensor!r} (largest 1e+06): run in "
                                                   f"--dtype float32 or bfloat16, or train the adapter again.")):
        adapter_set.check_fits(AutoConfig.from_pretrained(folder), "float16")


def test_a_bad_value_in_one_buffer_slot_never_reaches_the_rows_of_another(llama_adapters):
    """Rows of the base model and of adapter a0 come out the same whether or not a free buffer slot holds NaN and inf
    in its A matrices: each token keeps its own adapter's columns by selection, not by multiplying the others by 0."""
    folder, adapters = llama_adapters
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=4, graphs=False,
                              lora=[f"a0={adapters['a0']}", f"a1={adapters['a1']}"], max_loras=2)
    names = [None, "a0", None, "a0"]

    def tokens():
        return [completion.completion_token_ids for completion in generator.generate(TEXTS, adapters=names)]

    before = tokens()
    slot = generator.adapter_slots.place("a0", set())[0]
    free = 3 - slot  # the slot a0 does not hold
    for layer in generator.loaded.adapters.layers.values():
        rank, inputs = generator.loaded.adapters.rows.rank, layer.lora_a.shape[1]
        planted = torch.full((rank, inputs), math.nan, dtype=layer.lora_a.dtype)
        planted[0] = math.inf
        layer.write_slot(free, planted, torch.zeros(layer.lora_b.shape[0], rank, dtype=layer.lora_b.dtype))
    assert tokens() == before
    assert any(token != 0 for row in before for token in row)


# -- names ----------------------------------------------------------------------------------------------------------

def batch_file(tmp_path, models: list[str]):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{number}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": TEXTS[number % len(TEXTS)], "model": model}}) + "\n"
                            for number, model in enumerate(models)))
    return path


def test_an_adapter_named_as_a_served_model_name_is_refused(llama_adapters, tmp_path, capsys, nothing_loads):
    """The adapter used to take every request naming the served model: which one a request means cannot be told."""
    folder, adapters = llama_adapters
    requests = batch_file(tmp_path, ["gpt-4o-mini", "a0"])
    assert run("--model", folder, "--dataset", requests, "--lora", f"gpt-4o-mini={adapters['a0']}",
               "--served-model-name", "gpt-4o-mini", "--output", tmp_path / "out.jsonl") == 2
    assert one_error_line(capsys).rstrip("\n") == (
        "accelgen: error: --lora gpt-4o-mini=... and --served-model-name 'gpt-4o-mini' give one name to an adapter and "
        "to the model: a request naming 'gpt-4o-mini' would not say which it means; rename the adapter or the served "
        "model.")


def test_a_request_naming_what_the_run_does_not_serve_is_told_of_an_adapter_first(llama_adapters, tmp_path):
    folder, adapters = llama_adapters
    requests = batch_file(tmp_path, ["a0", "a3"])
    output = tmp_path / "out.jsonl"
    assert run("--model", folder, "--dataset", requests, "--lora", f"a0={adapters['a0']}", "--output", output) == 0
    lines = rows_of(output)
    assert lines[0]["error"] is None
    assert lines[1]["error"]["message"] == (
        f"asks for model 'a3', and this run serves {str(folder)!r} and LoRA adapters 'a0': pass --lora a3=PATH to "
        f"serve an adapter under that name, or pass --served-model-name 'a3' to serve it with this model")


# -- adapter_config.json ---------------------------------------------------------------------------------------------

def with_config(**fields):
    def change(folder):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return change


def nested_deep(folder):
    (folder / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("change, message", [
    (with_config(lora_alpha=None), "lora_alpha is null, and it must be a finite number"),
    (with_config(lora_alpha="8"), "lora_alpha is \"8\", and it must be a finite number"),
    (with_config(lora_alpha=math.nan), "lora_alpha is NaN, and it must be a finite number"),
    (with_config(lora_alpha=True), "lora_alpha is true, and it must be a finite number"),
    (with_config(r="2"), "r is \"2\", and it must be a whole number from 1"),
    (with_config(r=0), "r is 0, and it must be a whole number from 1"),
    (with_config(r=5), "r is 5, and the matrices of 'model.layers.0.mlp.gate_proj' have rank 2"),
    (with_config(rank_pattern={"down_proj": 4}),
     "rank_pattern's \"down_proj\" is 4, and the matrices of 'model.layers.0.mlp.down_proj' have rank 3"),
    (with_config(target_modules=7), "target_modules is 7, and it must be a module name, a list of them or null"),
    (with_config(target_modules=["q_proj", 3]), "target_modules is \\[\"q_proj\", 3\\], and it must be"),
    (with_config(base_model_name_or_path=["x"]), "base_model_name_or_path is \\[\"x\"\\], and it must be a text or null"),
    (with_config(fan_in_fan_out="yes"), "fan_in_fan_out is \"yes\", and it must be true or false"),
    (with_config(use_rslora="true"), "use_rslora is \"true\", and it must be true or false"),
    (with_config(alpha_pattern=[1]), "alpha_pattern is \\[1\\], and it must be an object of module name patterns"),
    (with_config(alpha_pattern={"down_proj": "9"}), "alpha_pattern's \"down_proj\" is \"9\", and it must be a finite number"),
    (with_config(alpha_pattern={"(": 9}), "alpha_pattern's \"\\(\" is not a regular expression"),
    (with_config(rank_pattern={"down_proj": 3.5}), "rank_pattern's \"down_proj\" is 3.5, and it must be a whole number from 1"),
    (with_config(peft_type=["LORA"]), "peft_type is \\[\"LORA\"\\], and it must be a text"),
    (with_config(bias={"all": 1}), "bias is \\{\"all\": 1\\}, and it must be a text"),
    (nested_deep, "adapter_config.json cannot be read: .*nested too deep"),
], ids=["alpha-null", "alpha-text", "alpha-nan", "alpha-bool", "r-text", "r-zero", "r-not-the-tensors",
        "rank-pattern-not-the-tensors", "targets-number",
        "targets-mixed", "base-list", "fan-text", "rslora-text", "alpha-pattern-list", "alpha-pattern-text",
        "alpha-pattern-regex", "rank-pattern-float", "peft-type-list", "bias-object", "nested-deep"])
def test_each_field_of_adapter_config_is_checked(llama_adapters, tmp_path, capsys, nothing_loads, change, message):
    folder, adapters = llama_adapters
    bad = copy_of(adapters, tmp_path)
    change(bad)
    assert run("--model", folder, "--prompt", "Hello", "--lora", f"bad={bad}") == 2
    line = one_error_line(capsys)
    assert line.startswith(f"accelgen: error: --lora bad={bad}: the adapter's adapter_config.json ")
    assert re.search(message, line), line
    assert "save the adapter again with PEFT" in line or "cannot be read" in line
