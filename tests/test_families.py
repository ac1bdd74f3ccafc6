"""The family matrix: every causal-LM family of the installed transformers either runs token for token as Hugging Face
``generate`` does (the families of ``accelgen.model.architectures``, as tiny random checkpoints that keep what sets
each apart: sliding windows shorter than the prompts, layers of mixed kinds, query/key norms, soft-capping, experts
stored one by one) or is refused in one line before anything loads."""

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import one_error_line
from family_models import EXPERT_FAMILIES, FAMILIES, FAMILY_SETTINGS, WINDOW, build_family_model, skip_unless_installed
from test_quantization import quantized_logits_error
from tiny_models import PAD_ID, tiny_configs
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.cli import main
from accelgen.model.architectures import ARCHITECTURES, architecture_of
from accelgen.quantization.int8_layer import Int8Linear

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

MAX_NEW_TOKENS = 16
RELEASE = tuple(int(part) for part in transformers.__version__.split(".")[:2])
RELEASE_4 = RELEASE < (5, 0)
#: Four prompts of 2 to 23 tokens (most longer than a sliding layer's window), run together in mixed batches.
PROMPTS = [
    "DeepSpeed is a machine learning framework",
    "Hello",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun",
    "Static shapes let",
]
#: Prompts sharing a beginning of more than two blocks of the prefix store (16 tokens each).
SHARED = "Tensor parallelism splits each layer across devices and adds the partial results. In the beginning"
SHARED_PROMPTS = [f"{SHARED} God created the heaven", f"{SHARED} the quick brown fox", f"{SHARED} hello world",
                  f"{SHARED} static shapes let one captured graph serve"]


def hugging_face_one_at_a_time(folder, prompts, max_new_tokens=MAX_NEW_TOKENS) -> list[list[int]]:
    """Greedy new token ids of ``generate`` for each prompt alone (no padding), float32, not stopped at EOS."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dtype_keyword = "torch_dtype" if RELEASE_4 else "dtype"
    model = AutoModelForCausalLM.from_pretrained(folder, **{dtype_keyword: torch.float32})
    rows = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt", return_token_type_ids=False)
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD_ID,
                                eos_token_id=None)
        rows.append(output[0, inputs.input_ids.shape[1]:].tolist())
    return rows


def ours(folder, prompts, **settings):
    generator = accelgen.load(str(folder), device="cpu", dtype="float32", max_new_tokens=MAX_NEW_TOKENS,
                              ignore_eos=True, **settings)
    return [completion.completion_token_ids for completion in generator.generate(prompts)], generator


def test_every_family_of_the_table_is_in_the_matrix():
    """A family added to the table without a tiny model here would run without any test having shown it right."""
    assert set(ARCHITECTURES) <= set(FAMILY_SETTINGS) | set(tiny_configs(384))


def causal_lm_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("family", causal_lm_families())
def test_a_family_outside_the_table_is_refused_in_one_line_before_anything_loads(family, tmp_path, capsys):
    try:
        AutoConfig.for_model(family).save_pretrained(tmp_path)  # a config alone: neither weights nor tokenizer
    except Exception as error:  # noqa: BLE001 - a family whose config needs arguments cannot be built from it alone
        pytest.skip(f"{family}'s config cannot be built without arguments ({type(error).__name__})")
    model_type = json.loads((tmp_path / "config.json").read_text())["model_type"]  # gpt-sw3's is gpt2
    if model_type in ARCHITECTURES:
        pytest.skip(f"{family}: {model_type} models are in the table, their parity is checked below")
    assert main(["run", "--device", "cpu", "--model", str(tmp_path), "--prompt", "Hello"]) == 2
    message = one_error_line(capsys)
    assert f"{model_type} models are not among the model families accelgen has checked" in message
    assert "refused" in message and "docs/models.md" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_hugging_faces_one_prompt_at_a_time_and_in_mixed_batches(tiny_model_folder, family):
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    expected = hugging_face_one_at_a_time(folder, PROMPTS)
    alone, _ = ours(folder, PROMPTS, batch_size=1)
    assert alone == expected
    mixed, generator = ours(folder, PROMPTS, batch_size=4)  # continuous batching, the CPU's packed prompts
    assert mixed == expected
    assert generator.run.batching == "continuous"
    # the CPU's traced decode step; before 5.24 Gemma 2's soft-capped attention (transformers' SDPA function) reads a
    # shape as a Python value, and 4.55's experts loop over the experts a batch takes, which a trace cannot hold: those
    # steps run as they are there (docs/models.md)
    untraced = (RELEASE < (5, 24) and family == "gemma2") or (RELEASE < (5, 0) and family in EXPERT_FAMILIES)
    if not untraced:
        assert generator.stats.step_traces > 0 and generator.stats.trace_failure is None
    if architecture_of(generator.model.config).packs_prompts:  # its prompts ran packed, without padding
        assert generator.stats.prefill_positions == generator.stats.prompt_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_reuse_and_chunked_prefill_give_hugging_faces_tokens(tiny_model_folder, family):
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    expected = hugging_face_one_at_a_time(folder, SHARED_PROMPTS)
    reused, generator = ours(folder, SHARED_PROMPTS, batch_size=2, prefix_cache="4MiB", prefill_chunk=WINDOW * 2)
    assert reused == expected
    assert generator.stats.reused_tokens > 0
    assert generator.stats.prefill_passes > generator.stats.prefills


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_tokens_are_the_same_at_batch_1_and_batch_4(tiny_model_folder, family):
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    settings = dict(do_sample=True, seed=7, temperature=0.8)
    alone, _ = ours(folder, PROMPTS, batch_size=1, **settings)
    together, _ = ours(folder, PROMPTS, batch_size=4, **settings)
    assert together == alone
    assert alone != ours(folder, PROMPTS, batch_size=1)[0]  # sampled, not greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_weights_stay_within_their_rounding_and_give_the_same_tokens_alone_and_in_mixed_batches(
        tiny_model_folder, tmp_path, family):
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    bounded = folder
    if family in EXPERT_FAMILIES:
        # a token's choice of experts is a step function of its values: rounding may change it, and its logits by
        # more than any bound; with every expert taken there is no choice, and the bound holds
        bounded = build_family_model(tmp_path / family, family, len(AutoTokenizer.from_pretrained(folder)),
                                     num_experts_per_tok=4)
        AutoTokenizer.from_pretrained(folder).save_pretrained(bounded)
    assert 0 < quantized_logits_error(str(bounded), "cpu", "int8") < 0.05  # the bound test_quantization.py explains
    alone, generator = ours(folder, PROMPTS, batch_size=1, quantize="int8")
    mixed, _ = ours(folder, PROMPTS, batch_size=4, quantize="int8")
    assert mixed == alone
    assert any(isinstance(module, Int8Linear) for module in generator.model.modules())


#: A branch on a model's family: ``model_type == ...``, ``!=``, ``in``, ``.startswith(...)``.
FAMILY_BRANCH = re.compile(r"model_type\s*(==|!=|in\b|not\s+in\b)|model_type\s*\.\s*startswith")


def family_branches(text: str) -> list[int]:
    """The numbers of the lines of ``text`` that branch on a model's family."""
    return [number for number, line in enumerate(text.splitlines(), 1) if FAMILY_BRANCH.search(line)]


def test_nothing_but_the_table_branches_on_a_models_family():
    root = Path(__file__).resolve().parent.parent
    table = root / "core" / "model" / "architectures.py"
    sources = [path for folder in ("core", "plugins") for path in sorted((root / folder).rglob("*.py")) if path != table]
    assert len(sources) > 100
    found = [f"{path.relative_to(root)}:{number}" for path in sources for number in family_branches(path.read_text())]
    assert found == []
    # the check can fail: a planted branch is found
    assert family_branches('x = 1\nif model.config.model_type == "qwen2":\n    pass\n') == [2]
    assert family_branches("if config.model_type in ('gemma2', 'gemma3'):") == [1]


def test_a_checkpoint_quantized_by_another_method_is_refused_in_one_line(tiny_model_folder, tmp_path, capsys):
    """gpt-oss is published with its experts in MXFP4 (others in GPTQ, AWQ, FP8...): tensors of other names and
    shapes, which accelgen does not read."""
    folder = tiny_model_folder("llama")
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    assert main(["run", "--device", "cpu", "--model", str(tmp_path), "--prompt", "Hello"]) == 2
    assert "quantized by mxfp4, which accelgen does not read" in one_error_line(capsys)


def test_docs_models_names_every_family_of_the_table():
    page = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    assert [family for family in ARCHITECTURES if f"| `{family}` |" not in page] == []


def test_experts_stored_one_by_one_offload_through_a_folder_and_not_in_place(tiny_model_folder, tmp_path, capsys):
    """Mixtral's experts are put together while loading (transformers 5.x): offloaded to disk they are written once
    to the folder given; read in place they cannot be, which is one line."""
    skip_unless_installed("mixtral")
    folder = str(tiny_model_folder("mixtral"))
    expected, _ = ours(folder, PROMPTS, batch_size=2)
    generator = accelgen.load(folder, device="cpu", dtype="float32", max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                              offload="disk", max_device_memory=700_000, offload_folder=str(tmp_path))
    assert generator.loaded.placement.disk_bytes > 0
    assert [completion.completion_token_ids for completion in generator.generate(PROMPTS)] == expected
    status = main(["run", "--device", "cpu", "--model", folder, "--prompt", "Hello", "--offload", "disk",
                   "--max-device-memory", "700000", "--max-new-tokens", str(MAX_NEW_TOKENS), "--quiet"])
    if RELEASE_4:  # 4.55 stores each expert under the model's name
        assert status == 0
    else:
        assert status == 2 and "stored in parts put together while loading" in one_error_line(capsys)


def test_a_model_running_code_of_its_own_is_refused_and_runs_as_transformers_family_without_it(tiny_model_folder,
                                                                                               tmp_path, capsys):
    """A Hub model may bring its own modeling code (``auto_map``): what it computes is not the table's family's."""
    folder = tiny_model_folder("llama")
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    arguments = ["run", "--device", "cpu", "--model", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "4"]
    assert main([*arguments, "--trust-remote-code"]) == 2
    assert "runs code of its own (--trust-remote-code)" in one_error_line(capsys)
    assert main([*arguments, "--quiet"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen3_moe"])
def test_the_compiled_decode_step_gives_hugging_faces_tokens(tiny_model_folder, family):
    """The step a long job compiles on the CPU (inductor), for a family of each kind: a sliding window in one mask,
    layers of two kinds (a mapping of masks, soft-capping), experts."""
    skip_unless_installed(family)
    folder = tiny_model_folder(family)
    compiled, generator = ours(folder, PROMPTS, batch_size=4, graphs=True)
    assert compiled == hugging_face_one_at_a_time(folder, PROMPTS)
    if not (RELEASE_4 and family in EXPERT_FAMILIES):  # 4.55's experts loop over those a batch takes: run as they are
        assert generator.stats.graph_captures == 1
