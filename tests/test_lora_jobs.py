"""LoRA adapters through the command line: a dataset column or a batch request's ``model`` chooses each row's adapter,
outputs resume exactly and are pinned to the adapters' content, and every mistake with adapters is one line, exit
status 2, found before the model loads, the output left as it was."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import one_error_line, one_error_line_in
from killed_runs import kill_after_rows
from lora_adapters import build_adapters, lora_configs, peft_completions, save_adapter
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from test_conversations import CONVERSATIONS, TEMPLATE, template_ids
from tiny_models import build_model, tiny_configs
from transformers import AutoTokenizer

from accelgen.adapters.adapter_files import AdapterFiles
from accelgen.cli import main

MAX_NEW_TOKENS = 10
TEXTS = ["DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps", "In the beginning God",
         "Static shapes let one", "Tensor parallelism splits each layer", "Hello world, this is"]
CHOSEN = ["a0", None, "a1", "a2", "", "a0", "a1"]  # "" and None: the base model


@pytest.fixture(scope="module")
def llama_adapters(tiny_model_folder, tmp_path_factory):
    folder = tiny_model_folder("llama")
    return folder, build_adapters(folder, tmp_path_factory.mktemp("lora-jobs"), "llama")


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": text, "adapter": name}) + "\n" for text, name in zip(TEXTS, CHOSEN)))
    return path


def lora_options(adapters: dict) -> list[str]:
    return [option for name, folder in adapters.items() for option in ("--lora", f"{name}={folder}")]


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def run(*arguments) -> int:
    return main(["run", "--device", "cpu", "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet", *map(str, arguments)])


def test_a_dataset_column_chooses_each_rows_adapter(llama_adapters, dataset, tmp_path, capsys):
    folder, adapters = llama_adapters
    output = tmp_path / "out.jsonl"
    assert run("--model", folder, "--dataset", dataset, "--lora-column", "adapter", *lora_options(adapters),
               "--batch-size", "3", "--output", output, "--details") == 0
    names = [name or None for name in CHOSEN]
    rows = rows_of(output)
    assert [row["completion_token_ids"] for row in rows] == peft_completions(folder, adapters, TEXTS, names, MAX_NEW_TOKENS)
    assert [row.get("adapter") for row in rows] == names
    summary = capsys.readouterr().err
    assert "LoRA: 3 adapters in 3 buffer slots" in summary and "3 loads; rows: base 2, a0 2, a1 2, a2 1" in summary
    record = json.loads((tmp_path / "out.jsonl.run.json").read_text())
    assert sorted(record["lora"]) == ["a0", "a1", "a2"] and set(record["lora"]["a0"]) == {"config_sha256", "weights_sha256"}


def test_conversations_keep_their_rows_adapters(llama_adapters, tmp_path):
    folder, adapters = llama_adapters
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    names = ["a0", None, "a2", "a1"]
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": messages, "adapter": name}) + "\n"
                            for messages, name in zip(CONVERSATIONS, names)))
    output = tmp_path / "out.jsonl"
    assert run("--model", folder, "--dataset", rows, "--column", "messages", "--lora-column", "adapter",
               "--chat-template", template, *lora_options(adapters), "--batch-size", "2", "--output", output) == 0
    prompts = [template_ids(folder, messages, TEMPLATE) for messages in CONVERSATIONS]
    expected = peft_completions(folder, adapters, prompts, names, MAX_NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == expected
    assert [row.get("adapter") for row in rows_of(output)] == names


def test_a_row_held_to_its_schema_keeps_its_adapter(llama_adapters, tmp_path):
    """A dataset row may bring its own JSON Schema (--schema-column) and its adapter: both are its slot's state."""
    pytest.importorskip("llguidance")
    folder, adapters = llama_adapters
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rows = tmp_path / "rows.jsonl"
    chosen = [("a0", schema), (None, schema), ("a1", None), ("a2", schema)]  # the first two: one prompt, two models
    texts = [TEXTS[0], TEXTS[0], TEXTS[2], TEXTS[3]]
    rows.write_text("".join(json.dumps({"text": text, "adapter": name, "schema": held}) + "\n"
                            for text, (name, held) in zip(texts, chosen)))
    outputs = []
    for batch_size in ("3", "1"):
        outputs.append(tmp_path / f"out-{batch_size}.jsonl")
        assert run("--model", folder, "--dataset", rows, "--lora-column", "adapter", "--schema-column", "schema",
                   *lora_options(adapters), "--batch-size", batch_size, "--output", outputs[-1]) == 0
    lines = rows_of(outputs[0])
    assert [line.get("adapter") for line in lines] == [name for name, _ in chosen]
    assert all(line["completion"].startswith('{"a":') for line, (_, held) in zip(lines, chosen) if held)
    assert [line["completion_token_ids"] for line in lines] == [line["completion_token_ids"] for line in rows_of(outputs[1])]
    assert lines[0]["completion"] != lines[1]["completion"]  # the same prompt and schema, another adapter


def test_a_killed_run_resumes_exactly_and_refuses_adapters_of_other_content(llama_adapters, dataset, tmp_path,
                                                                            cli_environment, capsys):
    folder, adapters = llama_adapters
    many = tmp_path / "many.jsonl"
    many.write_text(dataset.read_text() * 6)
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(folder), "--dataset",
               str(many), "--lora-column", "adapter", *lora_options(adapters), "--max-loras", "2", "--batch-size", "2",
               "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet"]
    resumed, whole = tmp_path / "resumed.jsonl", tmp_path / "whole.jsonl"
    kept = kill_after_rows([*command, "--output", str(resumed)], resumed, cli_environment, rows=8)
    assert 8 <= kept < 42
    for output in (resumed, whole):
        finished = subprocess.run([*command, "--output", str(output)], env=cli_environment, capture_output=True, text=True,
                                  timeout=300)
        assert finished.returncode == 0, finished.stderr
    assert resumed.read_text() == whole.read_text()
    other = tmp_path / "other-a1"
    shutil.copytree(adapters["a2"], other)
    before = whole.read_text()
    assert run("--model", folder, "--dataset", many, "--lora-column", "adapter", "--lora", f"a0={adapters['a0']}",
               "--lora", f"a1={other}", "--lora", f"a2={adapters['a2']}", "--max-loras", "2", "--batch-size", "2",
               "--output", whole) == 2
    assert "lora" in one_error_line(capsys) and whole.read_text() == before


def test_a_batch_request_names_its_adapter_by_model(llama_adapters, tmp_path):
    folder, adapters = llama_adapters
    requests = tmp_path / "requests.jsonl"
    asked = [("Hello", "a1"), ("The quick brown fox jumps", None), ("In the beginning God", "a0"),
             ("Hello", "gpt-4o"), ("Static shapes let one", str(folder))]
    requests.write_text("".join(json.dumps({"custom_id": f"r{number}", "method": "POST", "url": "/v1/completions",
                                            "body": {"prompt": prompt, **({"model": model} if model else {})}}) + "\n"
                                for number, (prompt, model) in enumerate(asked)))
    output = tmp_path / "out.jsonl"
    assert run("--model", folder, "--dataset", requests, *lora_options(adapters), "--output", output) == 0
    lines = rows_of(output)
    names = ["a1", None, "a0", None, None]
    expected = peft_completions(folder, adapters, [prompt for prompt, _ in asked], names, MAX_NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for line, tokens, name in zip(lines, expected, names):
        if line["error"] is None:
            body = line["response"]["body"]
            assert body["model"] == (name or str(folder))
            assert body["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    assert lines[3]["response"] is None and "LoRA adapters 'a0', 'a1', 'a2'" in lines[3]["error"]["message"]


def test_a_served_model_name_and_the_adapters_names_are_served_side_by_side(llama_adapters, tmp_path):
    """A file written for another service (--served-model-name) may name adapters too: each request is completed by
    what it names, and a name neither serves is refused naming both."""
    folder, adapters = llama_adapters
    requests = tmp_path / "requests.jsonl"
    asked = [("Hello", "gpt-4o-mini"), ("In the beginning God", "a0"), ("Hello", "gpt-4o")]
    requests.write_text("".join(json.dumps({"custom_id": f"r{number}", "method": "POST", "url": "/v1/completions",
                                            "body": {"prompt": prompt, "model": model}}) + "\n"
                                for number, (prompt, model) in enumerate(asked)))
    output = tmp_path / "out.jsonl"
    assert run("--model", folder, "--dataset", requests, *lora_options(adapters), "--served-model-name", "gpt-4o-mini",
               "--output", output) == 0
    lines = rows_of(output)
    expected = peft_completions(folder, adapters, ["Hello", "In the beginning God"], [None, "a0"], MAX_NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for line, tokens, model in zip(lines, expected, ["gpt-4o-mini", "a0"]):
        assert line["response"]["body"]["model"] == model
        assert line["response"]["body"]["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    assert lines[2]["response"] is None
    assert lines[2]["error"]["message"] == ("asks for model 'gpt-4o', and this run serves 'gpt-4o-mini' "
                                            "(--served-model-name) and LoRA adapters 'a0', 'a1', 'a2': pass "
                                            "--lora gpt-4o=PATH to serve an adapter under that name, or add "
                                            "--served-model-name 'gpt-4o' to serve it")


def test_bench_spreads_its_rows_over_the_adapters_and_reports_them(llama_adapters, tmp_path, capsys):
    folder, adapters = llama_adapters
    result = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--model", str(folder), *lora_options(adapters), "--batch-sizes", "3",
                 "--max-new-tokens", "4", "--runs", "1", "--warmup-runs", "0", "--output", str(result)]) == 0
    measured = json.loads(result.read_text())["measurements"][0]
    assert measured["lora"]["adapters"] == ["a0", "a1", "a2"] and measured["results"][0]["lora_rows"] == {"a0": 1, "a1": 1, "a2": 1}
    assert "LoRA rows a0 1, a1 1, a2 1, 3 loads" in capsys.readouterr().err


# -- mistakes: one line each, before the model loads ----------------------------------------------------------------

@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading the model fails the test: each mistake must be found before."""
    def loading(*arguments, **options):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("accelgen.jobs.completion_job.load_request", loading)


def damaged(adapters, tmp_path, change) -> str:
    """A copy of adapter a0, ``change``d (given its folder)."""
    folder = tmp_path / "damaged"
    shutil.copytree(adapters["a0"], folder)
    change(folder)
    return str(folder)


def edit_config(**fields):
    def change(folder):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return change


def renamed_tensors(old: str, new: str):
    def change(folder):
        tensors = load_file(folder / "adapter_model.safetensors")
        save_file({name.replace(old, new): tensor for name, tensor in tensors.items()}, folder / "adapter_model.safetensors")
    return change


def truncated(folder):
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


@pytest.mark.parametrize("change, message", [
    (lambda folder: shutil.rmtree(folder), " folder '.*damaged' does not exist: pass a folder holding adapter_config.json"),
    (lambda folder: (folder / "adapter_config.json").unlink(), " folder '.*' has no adapter_config.json: pass a folder written by PEFT"),
    (lambda folder: (folder / "adapter_config.json").write_text("{not json"), "'s adapter_config.json cannot be read: Expecting"),
    (lambda folder: (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin"),
     " folder '.*' has no adapter_model.safetensors \\(it holds .*adapter_model.bin\\)"),
    (truncated, " weights are damaged \\(adapter_model.safetensors: truncated"),
    (edit_config(peft_type="IA3"), " is a PEFT IA3 adapter, not LoRA"),
    (edit_config(use_dora=True), " uses weight-decomposed LoRA \\(DoRA\\) \\(use_dora is True\\)"),
    (edit_config(bias="all"), " trains biases \\(bias 'all'\\)"),
    (renamed_tensors("mlp.down_proj", "norm"), " adapts 'model.layers.0.norm', which this model does not have"),
    (renamed_tensors("layers.0.mlp.down_proj", "norm"), " adapts 'model.norm', a LlamaRMSNorm: accelgen adapts linear layers"),
    (renamed_tensors("model.layers.0.mlp.down_proj", "lm_head"), " adapts the output head 'lm_head'"),
    (renamed_tensors("lora_A.weight", "lora_magnitude_vector"), " holds '.*lora_magnitude_vector.*', which is not a LoRA"),
], ids=["missing", "no-config", "bad-config", "pickle-only", "truncated", "not-lora", "dora", "bias", "no-such-module",
        "a-norm", "the-head", "variant-tensor"])
def test_an_adapter_accelgen_cannot_run_is_one_line(llama_adapters, tmp_path, capsys, nothing_loads, change, message):
    folder, adapters = llama_adapters
    path = damaged(adapters, tmp_path, change)
    output = tmp_path / "kept.jsonl"
    output.write_text("kept\n")
    assert run("--model", folder, "--prompt", "Hello", "--lora", f"bad={path}", "--output", output) == 2
    assert re.search(f"--lora bad={path}: the adapter{message}", one_error_line(capsys))
    assert output.read_text() == "kept\n"


def test_adapters_of_another_model_or_rank_are_one_line(tiny_model_folder, llama_adapters, tmp_path, capsys, nothing_loads):
    folder, adapters = llama_adapters
    config = tiny_configs(384)["llama"]
    config.intermediate_size = 96
    other_model = build_model(tmp_path / "wider", config)
    wider = save_adapter(other_model, tmp_path / "wider-lora", lora_configs("llama")["a0"], seed=1)
    assert run("--model", folder, "--prompt", "Hello", "--lora", f"w={wider}") == 2
    assert ("adapts 'model.layers.0.mlp.down_proj' as 96 -> 64 features, and this model's is 128 -> 64: it was trained "
            "on another model") in one_error_line(capsys)
    bloom = build_adapters(tiny_model_folder("bloom"), tmp_path / "bloom", "bloom")["a0"]
    assert run("--model", folder, "--prompt", "Hello", "--lora", f"b={bloom}") == 2
    assert "adapts 'transformer.h.0.mlp.dense_4h_to_h', which this model does not have" in one_error_line(capsys)
    assert run("--model", folder, "--prompt", "Hello", *lora_options(adapters), "--max-lora-rank", "4") == 2
    assert f"--lora a1={adapters['a1']}: the adapter has rank 8, above --max-lora-rank 4: raise --max-lora-rank to 8." \
        in one_error_line(capsys)
    embedding = save_adapter(folder, tmp_path / "embedding", LoraConfig(r=2, target_modules=["embed_tokens"]), seed=2)
    assert run("--model", folder, "--prompt", "Hello", "--lora", f"e={embedding}") == 2
    assert f"--lora e={embedding}: the adapter adapts 'model.embed_tokens', an embedding: accelgen adapts linear layers " \
        "only." in one_error_line(capsys)


@pytest.mark.parametrize("options, message", [
    (["--lora", "a0={a0}", "--lora", "a0={a1}"], "--lora a0=... is given twice"),
    (["--lora", "llama={a0}"], "--lora llama=... is named as the model is"),
    (["--lora", "{a0}", "--lora", "a1={a1}"], "--lora PATH without a name is merged into the weights for every row, and goes alone"),
    (["--lora-column", "adapter"], "--lora-column names each row's adapter among those given by name"),
    (["--lora", "a0={a0}", "--lora-column", "missing"], "--lora-column 'missing' is not in the dataset"),
    (["--lora", "a0={a0}", "--lora-column", "number"], "--lora-column 'number' holds numbers"),
    (["--lora", "a0={a0}", "--lora-column", "adapter"], "row 2, column 'adapter', names LoRA adapter 'a1', which this run "
                                                        "does not serve \\(it serves 'a0', and the base model"),
    (["--max-loras", "2"], "--max-loras sizes the buffers of named adapters"),
    (["--lora", "a0={a0}", "--offload", "cpu"], "--lora cannot go with --offload"),
    (["--lora", "a0="], "--lora 'a0=' names no adapter folder"),
])
def test_a_mistake_with_adapters_is_one_line(llama_adapters, tmp_path, capsys, nothing_loads, options, message):
    folder, adapters = llama_adapters
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": text, "adapter": name, "number": 3}) + "\n" for text, name in zip(TEXTS, CHOSEN)))
    options = [option.format(**adapters) for option in options]
    assert run("--model", folder, "--dataset", rows, *options) == 2
    assert re.search(message, one_error_line(capsys))


def test_a_hub_adapter_that_cannot_be_reached_is_one_line(llama_adapters, cli_environment):
    folder, _ = llama_adapters
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(folder),
                             "--prompt", "Hello", "--lora", "a0=owner/no-such-adapter"], env=cli_environment,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Cannot load LoRA adapter 'owner/no-such-adapter'" in one_error_line_in(result.stderr)


def test_an_unknown_adapter_in_a_row_is_an_error_row_with_skip_bad_rows(llama_adapters, dataset, tmp_path):
    folder, adapters = llama_adapters
    output = tmp_path / "out.jsonl"
    assert run("--model", folder, "--dataset", dataset, "--lora-column", "adapter", "--lora", f"a0={adapters['a0']}",
               "--skip-bad-rows", "--output", output) == 0
    rows = rows_of(output)
    assert [row["finish_reason"] == "error" for row in rows] == [name in ("a1", "a2") for name in CHOSEN]
    assert rows[2]["error"].startswith("names LoRA adapter 'a1', which this run does not serve")


def test_each_layer_keeps_its_peft_scaling_and_rank(llama_adapters):
    """rsLoRA (alpha / sqrt(r)) and a per-module rank and alpha are PEFT's: the tokens of tests/test_lora.py check
    them whole; here, each layer's scaling and rank as read from the adapter's files."""
    folder, adapters = llama_adapters
    a1, a2 = AdapterFiles("a1", str(adapters["a1"])), AdapterFiles("a2", str(adapters["a2"]))
    assert a1.layers["model.layers.0.self_attn.q_proj"].scaling == pytest.approx(4 / 8 ** 0.5)
    assert a2.layers["model.layers.0.mlp.down_proj"].scaling == pytest.approx(9 / 3)
    assert a2.layers["model.layers.0.mlp.up_proj"].scaling == pytest.approx(4 / 2) and a2.rank == 3
    assert torch.equal(a2.matrices()["model.layers.0.mlp.up_proj"][0], load_file(
        adapters["a2"] / "adapter_model.safetensors")["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"])
