"""The central promise: greedy output is token-for-token what Hugging Face ``generate`` gives."""

import pytest
import torch
from conftest import ARCHITECTURES, PROMPTS
from transformers import AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.generation.runner import PACKED_MOST_TOKENS
from accelgen.model.architectures import architecture_of

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

MAX_NEW_TOKENS = 24


def reference_completions(folder, prompts, dtype=torch.float32, pad_to=None, **generate_options):
    """New token ids per prompt from Hugging Face ``generate`` (dynamic cache, left padding), cut after EOS.

    ``pad_to`` left-pads every prompt to that length, as our buckets do, instead of to the longest one.
    """
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype) if _new_dtype_keyword() else (
        AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype)
    )
    padding = dict(padding="max_length", max_length=pad_to) if pad_to else dict(padding=True)
    inputs = tokenizer(prompts, return_tensors="pt", return_token_type_ids=False, **padding)
    output = model.generate(
        **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        **generate_options,
    )
    completions = []
    for row in output[:, inputs.input_ids.shape[1] :].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        completions.append(row)
    return completions


def _new_dtype_keyword():
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2]) >= (4, 56)


def ours(folder, prompts, **settings):
    generator = accelgen.load(folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS, **settings)
    return [completion.completion_token_ids for completion in generator.generate(prompts)], generator


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_greedy_matches_hugging_face(tiny_model_folder, architecture, batch_size):
    folder = tiny_model_folder(architecture)
    expected = reference_completions(folder, PROMPTS)
    completions, generator = ours(folder, PROMPTS, batch_size=batch_size, graphs=False)
    assert completions == expected
    assert generator.stats.batches == -(-len(PROMPTS) // batch_size)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_an_eager_prefill_runs_the_prompts_not_their_buckets_padding(tiny_model_folder, architecture):
    """On the CPU (prefills never captured) a prefill computes its prompts' own tokens, one after another in one row,
    for a family whose tokens depend on their position ids alone (llama); for the others, the last positions of its
    bucket that its longest prompt needs, rounded up to 8, not the whole bucket: Hugging Face's tokens either way,
    with a bucket far longer than the prompts."""
    folder = tiny_model_folder(architecture)
    completions, generator = ours(folder, PROMPTS, batch_size=len(PROMPTS), buckets=(256,), graphs=False)
    assert completions == reference_completions(folder, PROMPTS)
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(folder)(PROMPTS).input_ids]
    packed = architecture_of(generator.model.config).packs_prompts
    assert packed == (architecture == "llama")
    assert generator.stats.prefill_positions == (sum(lengths) if packed else len(PROMPTS) * -(-max(lengths) // 8) * 8)


def test_prompts_of_more_tokens_than_one_packed_pass_takes_run_packed_in_several(tiny_model_folder):
    """A batch whose prompts hold more tokens than one packed row takes (``PACKED_MOST_TOKENS``) is prefilled in
    several passes, each of its prompts packed without padding (one padded pass of them all, before): Hugging Face's
    tokens."""
    folder = tiny_model_folder("llama")
    words = " ".join(PROMPTS).split()
    prompts = [" ".join(words[(row + place) % len(words)] for place in range(40 + 3 * row)) for row in range(16)]
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(folder)(prompts).input_ids]
    assert sum(lengths) > PACKED_MOST_TOKENS and max(lengths) + MAX_NEW_TOKENS <= 256  # the tiny model's positions
    completions, generator = ours(folder, prompts, batch_size=len(prompts), graphs=False)
    assert completions == reference_completions(folder, prompts)
    assert generator.stats.prefill_passes > 1 and generator.stats.prefill_positions == sum(lengths)


@pytest.mark.parametrize("architecture", ["llama", "bloom"])
def test_bfloat16_matches_hugging_face_in_bfloat16(tiny_model_folder, architecture):
    # In bfloat16, SDPA over a different number of (masked) keys rounds differently: Hugging Face's own
    # static cache departs from its dynamic cache after ~13 tokens on the llama model here, and so does
    # extra left padding. So the bfloat16 reference is Hugging Face's static cache with our 32-token
    # padding; float32 (above) matches the plain dynamic-cache generate exactly.
    folder = tiny_model_folder(architecture)
    expected = reference_completions(
        folder, PROMPTS, dtype=torch.bfloat16, pad_to=32, cache_implementation="static"
    )
    completions, _ = ours(folder, PROMPTS, batch_size=2, dtype="bfloat16", graphs=False)
    assert completions == expected


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["llama", "bloom"])
def test_compiled_decode_step_matches_hugging_face_and_is_captured_once(tiny_model_folder, architecture):
    folder = tiny_model_folder(architecture)
    expected = reference_completions(folder, PROMPTS)
    completions, generator = ours(folder, PROMPTS, batch_size=2, graphs=True)
    assert completions == expected
    # two batches of the same bucket: one capture, replayed for both
    assert generator.stats.batches == 2
    assert generator.stats.graph_captures == 1


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_compiled_and_eager_steps_draw_the_same_tokens(tiny_model_folder, architecture):
    """float32, sampled (the seeded draw runs inside the step), continuous batching, a prompt past the first bucket:
    the CPU's compiled decode step (inductor) gives the eager step's tokens. The prefill shapes run eagerly on the
    CPU whether or not the decode step is compiled."""
    folder = tiny_model_folder(architecture)
    prompts = PROMPTS + [" ".join(PROMPTS)]  # one prompt past the first bucket
    settings = dict(batch_size=2, do_sample=True, temperature=0.8, top_p=0.9, seed=7, buckets=[16, 64])
    eager, _ = ours(folder, prompts, graphs=False, **settings)
    compiled, generator = ours(folder, prompts, graphs=True, **settings)
    assert compiled == eager
    assert generator.stats.graph_captures == 1 and generator.stats.prefill_captures == 0
