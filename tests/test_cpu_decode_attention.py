"""The CPU's attention for one query per row (plugins/cpu/decode_attention.py) computes what SDPA computes: grouped
query heads, additive and boolean masks, float32 and bfloat16. Token-for-token parity of whole runs with Hugging
Face ``generate`` (which uses SDPA) is in test_parity.py, on the families that take this attention."""

import pytest
import torch
from conftest import PROMPTS

import accelgen
from accelgen_cpu.decode_attention import NAME, decode_attention


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("key_heads", [8, 2])
@pytest.mark.parametrize("boolean_mask", [False, True])
@pytest.mark.parametrize("unseen_tail", [0, 15])
def test_one_query_per_row_attends_as_sdpa_does(dtype, tolerance, key_heads, boolean_mask, unseen_tail):
    """``unseen_tail``: the cache's last positions seen by no row (a static cache is longer than its rows: they must
    add nothing); the rows end at different positions before them."""
    torch.manual_seed(0)
    rows, heads, positions, size = 3, 8, 40, 16
    query = torch.randn(rows, heads, 1, size, dtype=dtype)
    key, value = (torch.randn(rows, key_heads, positions, size, dtype=dtype) for _ in range(2))
    seen = torch.rand(rows, 1, 1, positions) < 0.6
    for row in range(rows):  # each row sees its own token, the last it sees
        own = positions - 1 - unseen_tail - 4 * row
        seen[row, ..., own], seen[row, ..., own + 1:] = True, False
    mask = seen if boolean_mask else torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    groups = heads // key_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask, scale=0.3)
    ours = decode_attention(query, key, value, mask, 0.3)
    assert ours.shape == expected.shape and ours.dtype == dtype
    assert torch.allclose(ours.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_models_whose_attention_goes_through_transformers_interface_decode_with_it(tiny_model_folder):
    generator = accelgen.load(tiny_model_folder("llama"), device="cpu", max_new_tokens=4)
    assert generator.model.config._attn_implementation == NAME
    assert len(generator.generate(PROMPTS)[0].completion_token_ids) == 4
