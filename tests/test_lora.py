"""LoRA adapters chosen row by row: each row's greedy tokens are PEFT's with its adapter, whatever the other rows of its
batch chose, however many adapters the buffers hold; one adapter merged into the weights is PEFT's merged model."""

import pytest
import torch
from conftest import PROMPTS
from family_models import FAMILIES, skip_unless_installed
from lora_adapters import build_adapters, peft_completions

import accelgen
from accelgen.adapters.lora_layer import LoraLinear
from accelgen.quantization.int8_layer import Int8Linear

MAX_NEW_TOKENS = 12
#: Rows of three adapters and the base model, mixed in one batch.
MIXED_PROMPTS = [*PROMPTS, "In the beginning God created", "Static shapes let one captured graph", "Hello world, this is"]
MIXED_NAMES = ["a0", None, "a1", "a2", "a1", "a0"]


@pytest.fixture(scope="session")
def adapters_of(tiny_model_folder, tmp_path_factory):
    """``adapters_of(architecture)``: its tiny model's folder and its three adapters (name -> folder)."""
    built = {}

    def adapters(architecture: str):
        if architecture not in built:
            folder = tiny_model_folder(architecture)
            built[architecture] = folder, build_adapters(folder, tmp_path_factory.mktemp(f"lora-{architecture}"), architecture)
        return built[architecture]

    return adapters


def named(adapters: dict) -> list[str]:
    return [f"{name}={folder}" for name, folder in adapters.items()]


def completions(generator, prompts, names) -> list[list[int]]:
    return [completion.completion_token_ids for completion in generator.generate(prompts, adapters=names)]


@pytest.mark.parametrize("architecture", ["llama", "bloom", "gpt2"])
@pytest.mark.parametrize("batching, batch_size", [("continuous", 4), ("static", 3), ("continuous", 1)])
def test_each_row_is_peft_with_its_adapter_in_batches_that_mix_them(adapters_of, architecture, batching, batch_size):
    folder, adapters = adapters_of(architecture)
    expected = peft_completions(folder, adapters, MIXED_PROMPTS, MIXED_NAMES, MAX_NEW_TOKENS)
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=batch_size, graphs=False,
                              batching=batching, lora=named(adapters))
    assert completions(generator, MIXED_PROMPTS, MIXED_NAMES) == expected
    assert expected != peft_completions(folder, adapters, MIXED_PROMPTS, [None] * len(MIXED_PROMPTS), MAX_NEW_TOKENS)
    assert generator.stats.adapter_rows == {"": 1, "a0": 2, "a1": 2, "a2": 1}
    assert generator.stats.adapter_loads == 3  # each copied in once: three buffer slots


@pytest.mark.parametrize("architecture", ["opt", "falcon", *FAMILIES])
def test_the_other_families_rows_are_peft_with_their_adapters_too(adapters_of, architecture):
    """OPT's decoder layers flatten their rows before the MLP; Falcon's fused projection is a Linear of its own; the
    families of family_models (Phi-3's fused projections, GPT-NeoX's, the attention of those with experts)."""
    skip_unless_installed(architecture)
    folder, adapters = adapters_of(architecture)
    expected = peft_completions(folder, adapters, MIXED_PROMPTS, MIXED_NAMES, MAX_NEW_TOKENS)
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=4, graphs=False,
                              lora=named(adapters))
    assert completions(generator, MIXED_PROMPTS, MIXED_NAMES) == expected


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_more_adapters_than_buffer_slots_are_copied_in_as_their_rows_come(adapters_of, architecture):
    folder, adapters = adapters_of(architecture)
    expected = peft_completions(folder, adapters, MIXED_PROMPTS, MIXED_NAMES, MAX_NEW_TOKENS)
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, graphs=False,
                              lora=named(adapters), max_loras=1, max_lora_rank=8)
    assert completions(generator, MIXED_PROMPTS, MIXED_NAMES) == expected
    assert generator.stats.adapter_loads >= 4  # a0, a1, a2, then a1 or a0 again: one slot, the least recently used out
    again = generator.stats.adapter_loads
    assert completions(generator, MIXED_PROMPTS[:1], ["a0"]) == expected[:1]  # a later call finds what the slot holds
    assert generator.stats.adapter_loads == again + (MIXED_NAMES[-1] != "a0")


@pytest.mark.slow
def test_a_compiled_decode_step_serves_every_mix_of_adapters_without_capturing_again(adapters_of):
    folder, adapters = adapters_of("llama")
    expected = peft_completions(folder, adapters, MIXED_PROMPTS, MIXED_NAMES, MAX_NEW_TOKENS)
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=3, graphs=True,
                              lora=named(adapters), max_loras=2)
    assert completions(generator, MIXED_PROMPTS, MIXED_NAMES) == expected
    assert generator.stats.graph_captures == 1 and generator.stats.adapter_loads > 3


@pytest.mark.parametrize("architecture", ["llama", "bloom", "gpt2"])
def test_one_adapter_without_a_name_is_merged_into_the_weights_as_peft_merges_it(adapters_of, architecture):
    folder, adapters = adapters_of(architecture)
    expected = peft_completions(folder, adapters, PROMPTS, ["a0"] * len(PROMPTS), MAX_NEW_TOKENS, merged=True)
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, graphs=False,
                              lora=str(adapters["a0"]))
    assert [completion.completion_token_ids for completion in generator.generate(PROMPTS)] == expected
    assert not any(isinstance(module, LoraLinear) for module in generator.model.modules())  # no cost per step


def test_int8_base_weights_keep_the_adapters_in_the_runs_dtype(adapters_of):
    folder, adapters = adapters_of("llama")
    settings = dict(device="cpu", max_new_tokens=MAX_NEW_TOKENS, graphs=False, quantize="int8", dtype="bfloat16")
    generator = accelgen.load(folder, batch_size=4, lora=named(adapters), **settings)
    mixed = completions(generator, MIXED_PROMPTS, MIXED_NAMES)
    layers = [module for module in generator.model.modules() if isinstance(module, LoraLinear)]
    assert layers and all(isinstance(layer.base, Int8Linear) and layer.lora_a.dtype == torch.bfloat16 for layer in layers)
    base_only = accelgen.load(folder, batch_size=4, **settings)
    base_rows = [ids for ids, name in zip(base_only.generate(MIXED_PROMPTS), MIXED_NAMES) if name is None]
    assert [ids for ids, name in zip(mixed, MIXED_NAMES) if name is None] == [row.completion_token_ids for row in base_rows]
    alone = accelgen.load(folder, batch_size=1, lora=named(adapters), **settings)
    assert completions(alone, MIXED_PROMPTS, MIXED_NAMES) == mixed
    assert all(row != base.completion_token_ids for row, base, name in zip(mixed, base_only.generate(MIXED_PROMPTS),
                                                                           MIXED_NAMES) if name is not None)


@pytest.mark.parametrize("architecture", ["llama", "bloom"])
def test_prefix_reuse_gives_stored_keys_only_to_rows_of_the_same_adapter(adapters_of, architecture):
    folder, adapters = adapters_of(architecture)
    shared = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 3
    prompts = [shared + end for end in ("Hello", "world", "DeepSpeed", "Tensor", "In the", "Static")]
    names = ["a0", "a1", "a0", None, "a1", None]
    expected = peft_completions(folder, adapters, prompts, names, MAX_NEW_TOKENS)
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=1, graphs=False,
                              lora=named(adapters), prefix_cache="64MiB")
    assert completions(generator, prompts, names) == expected
    assert generator.stats.prefix_hits == 3  # the second row of each adapter (and of the base) finds the first's blocks


def test_samples_and_stop_texts_of_rows_keep_their_adapters(adapters_of):
    """Several samples of a row all run with its adapter; a stop text ends a row of an adapter as any other."""
    folder, adapters = adapters_of("llama")
    sampled = dict(device="cpu", max_new_tokens=MAX_NEW_TOKENS, graphs=False, do_sample=True, seed=5, num_samples=3)
    several = accelgen.load(folder, batch_size=4, lora=named(adapters), **sampled).generate(PROMPTS, adapters=["a2"] * 3)
    alone = accelgen.load(folder, batch_size=1, lora=named(adapters), **sampled).generate(PROMPTS, adapters=["a2"] * 3)
    assert [completion.completions for completion in several] == [completion.completions for completion in alone]
    assert all(completion.adapter == "a2" for completion in several)
    greedy = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, graphs=False,
                           lora=named(adapters))
    whole = greedy.generate(PROMPTS, adapters=["a0", "a1", None])
    stop = whole[0].completion[2:5]
    stopped = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, batch_size=2, graphs=False,
                            lora=named(adapters), stop=[stop]).generate(PROMPTS, adapters=["a0", "a1", None])
    assert stopped[0].finish_reason == "stop" and whole[0].completion.startswith(stopped[0].completion)
    assert [row.completion for row in stopped[1:]] == [row.completion[: row.completion.find(stop)] if stop in row.completion
                                                        else row.completion for row in whole[1:]]


def test_a_row_naming_an_adapter_the_run_does_not_serve_is_refused_by_number(adapters_of):
    folder, adapters = adapters_of("llama")
    generator = accelgen.load(folder, device="cpu", max_new_tokens=4, graphs=False, lora=named(adapters))
    with pytest.raises(accelgen.UsageError, match=r"Prompt 1: names LoRA adapter 'a9', which this run does not serve "
                                                  r"\(it serves 'a0', 'a1', 'a2'"):
        generator.generate(PROMPTS[:2], adapters=["a0", "a9"])
    skipping = accelgen.load(folder, device="cpu", max_new_tokens=4, graphs=False, lora=named(adapters), skip_bad_rows=True)
    rows = skipping.generate(PROMPTS[:2], adapters=["a0", "a9"])
    assert rows[0].finish_reason != "error" and rows[1].finish_reason == "error" and "'a9'" in rows[1].error


def test_the_buffers_hold_max_loras_adapters_at_the_max_lora_rank(adapters_of):
    """The buffers hold the largest rank asked (--max-lora-rank) for --max-loras adapters; each adapter of a lower rank
    is padded with zeros there, its scaling folded into B."""
    folder, adapters = adapters_of("llama")
    generator = accelgen.load(folder, device="cpu", max_new_tokens=2, graphs=False, lora=named(adapters),
                              max_loras=2, max_lora_rank=16)
    layer = generator.model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(layer, LoraLinear) and tuple(layer.lora_a.shape) == (2 * 16, 128)
    assert tuple(layer.lora_b.shape) == (64, 2 * 16)
    assert generator.loaded.adapters.buffer_bytes == sum(
        (module.lora_a.numel() + module.lora_b.numel()) * 4 for module in generator.model.modules()
        if isinstance(module, LoraLinear))
