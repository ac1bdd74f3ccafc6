"""The CPU's attention for one query per row (plugins/cpu/decode_attention.py) computes what SDPA computes: grouped
query heads, additive and boolean masks, float32, bfloat16 and float16, in every variant of the C++ kernels this
processor executes (AVX-512, AVX2, portable), at 1 and 2 threads. Token-for-token parity of whole runs with Hugging
Face ``generate`` (which uses SDPA) is in test_parity.py, on the families that take this attention."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import KERNEL_VARIANTS, PROMPTS, loaded_variant
from family_models import skip_unless_installed
from transformers import DynamicCache

import accelgen
from accelgen.common.settings import World
from accelgen.model.transformers_adapter.forward import ModelForward
from accelgen_cpu.decode_attention import NAME, decode_attention
from accelgen_cpu.native_kernels import loaded_kernels, native_operator

pytestmark = pytest.mark.transformers_release  # its outcome depends on the transformers release: CI runs it with each

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)]


@pytest.fixture(params=["products", *KERNEL_VARIANTS])
def kernel(request, threads):
    """Each decode attention: batched products over whole cache rows, and each variant's C++ kernel over the positions
    seen (built by the session; this machine has a compiler, as inductor's CPU backend needs); at 1 and 2 threads."""
    if request.param == "products":
        return decode_attention
    return loaded_variant(request.param).operators.decode_attention


def sdpa_in_float32(query, key, value, mask, scale):
    """SDPA's attention computed in float32 (grouped heads repeated), as the reference of every dtype."""
    groups = query.shape[1] // key.shape[1]
    if mask.dtype != torch.bool:
        mask = mask.float()
    return torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1),
        attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("key_heads", [8, 2])
@pytest.mark.parametrize("boolean_mask", [False, True])
@pytest.mark.parametrize("unseen_tail", [0, 15])
@pytest.mark.parametrize("size", [20, 32, 64, 128])
def test_one_query_per_row_attends_as_sdpa_does(kernel, dtype, tolerance, key_heads, boolean_mask, unseen_tail, size):
    """``unseen_tail``: the cache's last positions seen by no row (a static cache is longer than its rows: they must
    add nothing); the rows end at different positions before them, start at different ones (the left padding of
    their prompts' buckets) and skip some between. ``size``: heads of 32, 64 and 128 values take loops of their own,
    others (a remainder past the kernel's lanes) the generic ones."""
    torch.manual_seed(0)
    rows, heads, positions = 3, 8, 40
    query = torch.randn(rows, heads, 1, size, dtype=dtype)
    key, value = (torch.randn(rows, key_heads, positions, size, dtype=dtype) for _ in range(2))
    seen = torch.rand(rows, 1, 1, positions) < 0.6
    for row in range(rows):  # each row sees its own token, the last it sees
        own = positions - 1 - unseen_tail - 4 * row
        seen[row, ..., own], seen[row, ..., own + 1:], seen[row, ..., : 5 * row] = True, False, False
    mask = seen if boolean_mask else torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    scale = size**-0.5  # as a model scales
    expected = sdpa_in_float32(query, key, value, mask, scale)
    ours = kernel(query, key, value, mask, scale)
    assert ours.shape == expected.shape and ours.dtype == dtype
    assert torch.allclose(ours.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("boolean_mask", [False, True])
def test_a_row_that_sees_nothing_gets_zero(kernel, boolean_mask):
    """A finished row or an empty slot, whose mask the decode step clears (test_decoding.py): the kernels agree on 0
    (softmax over a row of minima would attend to every position evenly, and the C++ kernel read them all)."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
    seen = torch.zeros(2, 1, 1, 12, dtype=torch.bool)
    seen[1, ..., 3:7] = True
    mask = seen if boolean_mask else torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    ours = kernel(query, key, value, mask, 0.5)
    assert bool((ours[0] == 0).all())
    expected = torch.nn.functional.scaled_dot_product_attention(query[1:], key[1:, :, 3:7], value[1:, :, 3:7], scale=0.5)
    assert torch.allclose(ours[1:], expected, atol=1e-6)


def decode_step(dtype, key_heads, size):
    """A decode step's new tokens (3 rows, 4 query heads), rotary cos and sin, cache, write positions and mask."""
    torch.manual_seed(0)
    rows, heads, positions = 3, 4, 24
    query, key, value = (torch.randn(rows, 1, count * size, dtype=dtype) for count in (heads, key_heads, key_heads))
    angles = torch.rand(rows, 1, size // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    keys, values = (torch.randn(rows, key_heads, positions, size, dtype=dtype) for _ in range(2))
    write_positions = torch.tensor([20, 9, 23])
    seen = torch.zeros(rows, 1, 1, positions, dtype=torch.bool)
    for row, (start, end) in enumerate([(4, 21), (0, 10), (6, 24)]):
        seen[row, ..., start:end] = True
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    return query, key, value, cos, sin, keys, values, write_positions, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key_heads", [4, 2])
@pytest.mark.parametrize("size", [16, 32, 64])  # 32 and 64: rotated sixteen values at a time
def test_a_decode_steps_whole_attention_is_what_transformers_computes(kernel_variant, threads, dtype, key_heads, size):
    """decode_self_attention: the new token's keys rotated as transformers' apply_rotary_pos_emb rotates them, written
    with its values at each row's own position (the cache left exactly as transformers' path leaves it, in bfloat16
    too), and the rows' queries, rotated, attending as SDPA does."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    query, key, value, cos, sin, keys, values, write_positions, mask = decode_step(dtype, key_heads, size)
    rows, heads = query.shape[0], query.shape[2] // size

    heads_of = lambda states: states.view(rows, 1, -1, size).transpose(1, 2)  # noqa: E731  [B, heads, 1, D]
    rotated_query, rotated_key = apply_rotary_pos_emb(heads_of(query), heads_of(key), cos, sin)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[torch.arange(rows), :, write_positions] = rotated_key[:, :, 0]
    expected_values[torch.arange(rows), :, write_positions] = heads_of(value)[:, :, 0]
    expected = sdpa_in_float32(rotated_query, expected_keys, expected_values, mask, 0.25).transpose(1, 2).reshape(
        rows, 1, heads * size)

    ours = kernel_variant.operators.decode_self_attention(query, key, value, cos, sin, keys, values, write_positions,
                                                          mask, 0.25)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    tolerance = dict((dtype, tolerance) for dtype, tolerance in DTYPES)[dtype]
    assert ours.shape == expected.shape and torch.allclose(ours.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("position", [-1, 24, 1000])
def test_a_write_position_outside_the_cache_is_refused_and_nothing_is_written(kernel_variant, position):
    """A row's write position past the cache (or before it) would write outside the cache's memory: the operator
    refuses it before writing anything."""
    query, key, value, cos, sin, keys, values, write_positions, mask = decode_step(torch.float32, 2, 32)
    write_positions[1] = position
    keys_before, values_before = keys.clone(), values.clone()
    with pytest.raises(RuntimeError, match=rf"write_positions\[1\] is {position}, outside the cache's 24 positions"):
        kernel_variant.operators.decode_self_attention(query, key, value, cos, sin, keys, values, write_positions, mask,
                                                       0.25)
    assert torch.equal(keys, keys_before) and torch.equal(values, values_before)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("key_heads", [4, 2])
@pytest.mark.parametrize("boolean_mask", [False, True])
@pytest.mark.parametrize("stored", [0, 8])
@pytest.mark.parametrize("size", [20, 32, 64])
def test_a_prompts_queries_attend_as_sdpa_does(kernel_variant, threads, dtype, tolerance, key_heads, boolean_mask,
                                               stored, size):
    """prompt_attention: right-aligned prompts of different lengths in a bucket (the core's causal mask over their
    padding), in the model's head layout (queries [B, H, T, D] transposed from [B, T, H, D]); ``stored``: positions
    held before the queries' own (a prefix found stored), seen by the prompts that reach back to them. Each real
    query's output is SDPA's; a padding query's, which sees nothing, is 0."""
    from accelgen.model.transformers_adapter.forward import additive_causal_mask

    torch.manual_seed(0)
    rows, heads, queries = 3, 4, 12
    lengths = [12 + stored, 7, 1]  # the first reaches back into the stored positions
    query = torch.randn(rows, queries, heads, size, dtype=dtype).transpose(1, 2)
    key, value = (torch.randn(rows, stored + queries, key_heads, size, dtype=dtype).transpose(1, 2) for _ in range(2))
    prompt_mask = torch.zeros(rows, stored + queries, dtype=torch.long)
    for row, length in enumerate(lengths):
        prompt_mask[row, stored + queries - length:] = 1
    mask = additive_causal_mask(prompt_mask, torch.arange(stored, stored + queries), dtype)  # [B, 1, T, L]
    seen = mask == 0
    scale = size**-0.5
    expected = sdpa_in_float32(query, key, value, mask, scale)
    ours = kernel_variant.operators.prompt_attention(query, key, value, seen if boolean_mask else mask, scale)
    real = seen.any(-1, keepdim=True).expand(rows, heads, queries, size)  # [B, H, T, D]: queries that see a key
    assert ours.shape == expected.shape and ours.dtype == dtype and int((~real).sum()) > 0
    assert torch.allclose(ours[real].float(), expected[real], atol=tolerance, rtol=tolerance)
    assert bool((ours[~real] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_prefills_mask_lets_each_token_see_its_own_prompt_up_to_itself(dtype):
    """block_causal_mask (the mask of prompts packed one after another in one row, which the CPU's prompt kernel
    reads): 0 where a token sees (a token of its own prompt at or before itself), the dtype's lowest elsewhere."""
    from accelgen.model.transformers_adapter.forward import block_causal_mask

    lengths = [3, 1, 7, 2]
    prompt_of = torch.cat([torch.full((length,), prompt) for prompt, length in enumerate(lengths)])
    mask = block_causal_mask(prompt_of, dtype)
    tokens = len(prompt_of)
    assert mask.shape == (1, 1, tokens, tokens) and mask.dtype == dtype
    for query in range(tokens):
        for key in range(tokens):
            sees = bool(prompt_of[query] == prompt_of[key]) and key <= query
            assert float(mask[0, 0, query, key]) == (0 if sees else torch.finfo(dtype).min), (query, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_heads", [4, 2])
@pytest.mark.parametrize("size", [32, 64, 128])
def test_a_packed_prompts_query_gets_the_same_bits_with_or_without_its_neighbours(kernel_variant, threads, dtype,
                                                                                 key_heads, size):
    """prompt_attention over prompts packed in one row (a packed prefill's block-diagonal causal mask, one prompt's
    scores with a bias): each query's output is bit for bit what the kernel gives that query alone (the kernel sums
    two queries' values in one pass where they start at one position: each query's sums must stay its own)."""
    torch.manual_seed(0)
    heads, lengths = 4, [5, 9, 1, 12]
    queries = sum(lengths)
    query = torch.randn(1, heads, queries, size, dtype=dtype)
    key, value = (torch.randn(1, key_heads, queries, size, dtype=dtype) for _ in range(2))
    mask = torch.full((1, 1, queries, queries), torch.finfo(dtype).min, dtype=dtype)
    start = 0
    for length in lengths:
        mask[0, 0, start:start + length, start:start + length] = torch.zeros(length, length, dtype=dtype).masked_fill(
            torch.ones(length, length, dtype=torch.bool).triu(1), torch.finfo(dtype).min)
        start += length
    mask[0, 0, 6:14, 5:14] += torch.linspace(-1, 1, 9, dtype=dtype) * mask[0, 0, 6:14, 5:14].eq(0)  # a bias
    operator = kernel_variant.operators.prompt_attention
    together = operator(query, key, value, mask, size**-0.5)
    for t in range(queries):
        alone = operator(query[:, :, t:t + 1], key, value, mask[:, :, t:t + 1], size**-0.5)
        assert torch.equal(together[:, :, t:t + 1], alone), t


def test_models_whose_attention_goes_through_transformers_interface_decode_with_it(tiny_model_folder):
    """Llama's attention modules do a decode step's attention in one operator, and a prefill attends with the prompt
    kernel where this processor's variant takes it (else SDPA), a call a layer (test_parity.py: the tokens are Hugging
    Face's)."""
    assert native_operator("decode_self_attention") is not None  # every variant takes it
    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", max_new_tokens=4)
    assert generator.model.config._attn_implementation == NAME
    # the first run builds the static cache, which under transformers 4.55 reads its shapes off a one-token forward
    # without a mask (SDPA's); the runs after it reuse the cache
    generator.generate(PROMPTS)
    steps_before, passes_before = generator.stats.decode_steps, generator.stats.prefill_passes
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert len(generator.generate(PROMPTS)[0].completion_token_ids) == 4
    calls = {event.key: event.count for event in profile.key_averages()}
    layers = generator.model.config.num_hidden_layers
    namespace = loaded_kernels().operators.name
    assert calls.get(f"{namespace}::decode_self_attention") == (generator.stats.decode_steps - steps_before) * layers > 0
    prompt_calls = calls.get(f"{namespace}::prompt_attention", 0)
    if native_operator("prompt_attention") is not None:
        assert prompt_calls == (generator.stats.prefill_passes - passes_before) * layers > 0
        assert "aten::scaled_dot_product_attention" not in calls
    else:  # this processor's kernels leave prompts to SDPA
        assert prompt_calls == 0 and calls.get("aten::scaled_dot_product_attention", 0) > 0


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_row_that_sees_nothing_runs_on_zeros_through_every_layer(tiny_model_folder, quantize):
    """A decode step's finished row or empty slot (its mask marks nothing) runs on zeros with the CPU
    (``skips_zero_rows``): Llama has no biases, so its logits come out 0 (every layer gave zeros, which the int8
    products and the attention compute nothing for), and the other rows' logits are what they are without it."""
    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", quantize=quantize, max_new_tokens=2)
    forward = ModelForward(generator.model, World(), generator.run.torch_dtype)
    ids, mask = torch.tensor([[5], [6], [7]]), torch.tensor([[1], [0], [1]])
    arguments = (ids, mask, torch.zeros(3, 1, dtype=torch.long), torch.tensor([0]))
    with torch.no_grad():
        plain = forward(*arguments, cache=DynamicCache())
        zeroed = forward(*arguments, cache=DynamicCache(), zero_unseen_rows=True)
    assert torch.equal(zeroed[[0, 2]], plain[[0, 2]])
    assert bool((zeroed[1] == 0).all()) and bool((plain[1] != 0).any())


def run_tiny_llama(folder, environment) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(folder),
                           "--prompt", "Hello", "--max-new-tokens", "3"], env=environment, capture_output=True, text=True,
                          timeout=600)


def test_the_kernels_are_built_once_per_machine(tiny_model_folder, cli_environment):
    """The session built them (conftest): a run loads them, says nothing of a build, and writes nothing new."""
    folder = tiny_model_folder("llama")
    builds = sorted(os.listdir(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "accelgen_cpu_kernels")))
    result = run_tiny_llama(folder, cli_environment)
    assert result.returncode == 0, result.stderr
    assert "C++ kernels" not in result.stderr
    assert sorted(os.listdir(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "accelgen_cpu_kernels"))) == builds


def test_without_a_compiler_a_run_attends_with_products_after_one_warning(tiny_model_folder, cli_environment, tmp_path):
    folder = tiny_model_folder("llama")
    environment = dict(cli_environment, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "x"))
    result = run_tiny_llama(folder, environment)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "C++ kernels" in line]  # no build announced
    assert len(warnings) == 1 and "cannot run the compiler" in warnings[0] and "install a C++ compiler" in warnings[0]
    assert "Traceback" not in result.stderr
    with_kernels = run_tiny_llama(folder, cli_environment)
    assert result.stdout == with_kernels.stdout  # the same completion, whichever kernel attended


@pytest.mark.parametrize("family, fused", [("llama", True), ("mistral", True), ("qwen2", True), ("granite", True),
                                           ("qwen3", False), ("gemma2", False)])
def test_families_whose_attention_is_llamas_take_the_whole_decode_attention_operator(tiny_model_folder, family, fused):
    """The table says whose attention is Llama's between its projections (Mistral's with its sliding window in the mask,
    Qwen2's with biases, Granite's with its own scale); Qwen3 normalizes queries and keys, Gemma 2 soft-caps: their
    modules keep their own forward. Either way the tokens are Hugging Face's (test_families.py)."""
    skip_unless_installed(family)
    assert native_operator("decode_self_attention") is not None  # every variant takes it
    generator = accelgen.load(tiny_model_folder(family), device="cpu", max_new_tokens=6, dtype="float32")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        generator.generate(PROMPTS)
    calls = {event.key: event.count for event in profile.key_averages()}
    operator_calls = calls.get(f"{loaded_kernels().operators.name}::decode_self_attention", 0)
    layers = generator.model.config.num_hidden_layers
    if fused:  # every layer of every decode step (and of the step's trace run)
        assert operator_calls >= layers * generator.stats.decode_steps > 0
    else:
        assert operator_calls == 0
