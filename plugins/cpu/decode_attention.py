"""Attention on the CPU: of one query per row (a decode step), the plugin's C++ kernel, which reads only the cache
positions each row sees (``kernels/decode_attention.cpp``), or where it could not be built, two batched matrix
products and a softmax over whole cache rows; of a prompt's queries, the same kernel's loops, each query over the
positions it sees (its prompt up to itself: no padding, no later position), where SDPA computes every query of the
bucket over every position and masks.

SDPA's flash kernel for the CPU works in blocks per (row, head), which at one query are tiny products that cost
more to set up than to run: 670 us per layer for 16 rows x 8 heads over 256 cached positions, against about 450 us
here (the step of benchmarks/cpu_compile.py's model: 7.6 -> 6.5 ms compiled, 10.7 -> 9.6 eager). The function is
registered with transformers' ``AttentionInterface`` as :data:`NAME` and given to models whose attention goes through
that interface and runs SDPA; what it does not handle (soft-capping, attention sinks, no mask, prompts where the C++
kernels were not built) goes to transformers' own SDPA function. Either kernel is one operator, so that a compiled step calls it whole:
inductor otherwise rewrites the products as loops of its own, slower here.

In a continuous-batching job a row sees from its prompt's first token to its newest one, a fraction of the static
cache's length: the C++ kernel's attention over 4 layers of 16 rows seeing 72 of 192 positions took 189 us a
layer against the products' 368 (RESULTS-log.md, "Decode attention over the positions rows see").

Shapes: B rows, H query heads, K key/value heads (H = K x G), L cached positions, D head size.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from accelgen.common.static_sizes import static_shape
from accelgen.model.architectures import architecture_of
from accelgen.model.transformers_adapter.static_cache import each_row_write
from accelgen_cpu.native_kernels import native_operator

NAME = "accelgen_cpu_decode"


@torch.library.custom_op("accelgen_cpu::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [B, H, 1, D], key and value [B, K, L, D], mask [B, 1, 1, L] (additive, or True where a key is seen)
    -> [B, H, 1, D]; 0 for a row that sees nothing (a finished row, an empty slot), as the C++ kernel gives. Grouped
    query heads share their key/value head without copying it."""
    rows, heads, _, size = query.shape
    groups = heads // key.shape[1]
    grouped = query.reshape(rows, key.shape[1], groups, size)  # [B, K, G, D]: a group's queries side by side
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)  # [B, K, G, L]
    if mask.dtype == torch.bool:
        seen = mask
        scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    else:
        seen = mask > torch.finfo(mask.dtype).min / 2
        scores.add_(mask)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    weights.masked_fill_(~seen.any(-1, keepdim=True), 0)
    return torch.matmul(weights, value).reshape(rows, heads, 1, size)


@decode_attention.register_fake
def _(query, key, value, mask, scale):
    return torch.empty_like(query)


#: the kernel decode steps attend with: the C++ one once built (:func:`use_decode_attention`)
_kernel = decode_attention
#: the kernel prompts attend with: the C++ one once built; else (None) SDPA
_prompt_kernel = None


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: the output [B, T, H, D] and no weights. One query a row (a decode
    step) takes the decode kernel; a prompt's queries the C++ prompt kernel where it is built (each query reads only
    the positions it sees: none of the padding before a shorter prompt, none after itself); what neither handles goes
    to transformers' SDPA function."""
    queries, keys = static_shape(query), static_shape(key)
    mask = None if attention_mask is None else static_shape(attention_mask)
    ours = (mask is not None and len(mask) == 4 and mask[1] == 1 and mask[2] == queries[2] and queries[1] % keys[1] == 0
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None)
    kernel = _kernel if queries[2] == 1 else _prompt_kernel
    if not ours or kernel is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else queries[-1] ** -0.5
    output = kernel(query, key, value, attention_mask[..., : keys[2]], scale)
    return output.transpose(1, 2).contiguous(), None


def use_decode_attention(model: torch.nn.Module) -> bool:
    """Give ``model`` this attention for its decode steps when its attention goes through transformers'
    ``AttentionInterface`` and runs SDPA; True when it was given."""
    global _kernel, _prompt_kernel
    if not getattr(model, "_supports_attention_backend", False) or model.config._attn_implementation != "sdpa":
        return False
    _kernel = native_operator("decode_attention") or decode_attention
    _prompt_kernel = native_operator("prompt_attention")
    AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    return True


_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")  # transformers 5.x, 4.56+, 4.55
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def use_decode_self_attention(model: torch.nn.Module) -> int:
    """Give the attention modules of a model whose family's attention is Llama's (``Architecture.llama_attention``:
    between its four projections, rotary embedding, the cache write and the attention, nothing else) one C++ operator
    for a decode step's attention between its products (the C++ kernels loaded already): rotary embedding, cache
    writes and the attention, instead of some forty small operations (in a compiled step too: one operator, which
    writes the cache in place); any other call (a prefill, another cache) runs their own forward. The window of a
    sliding layer is in the mask the operator reads. Returns how many modules took it (none where this CPU's kernels
    do not take the operator)."""
    operator = native_operator("decode_self_attention")
    if operator is None or not architecture_of(model.config).llama_attention:
        return 0
    given = 0
    for module in model.modules():
        if all(isinstance(getattr(module, name, None), torch.nn.Module) for name in _PROJECTIONS) and isinstance(
                getattr(module, "layer_idx", None), int):
            module.forward = _decode_self_attention_forward(module, module.forward, operator)
            given += 1
    return given


def _decode_self_attention_forward(module: torch.nn.Module, own_forward, operator):
    def forward(*args, **kwargs):
        if args:
            return own_forward(*args, **kwargs)
        hidden_states, mask = kwargs.get("hidden_states"), kwargs.get("attention_mask")
        cache = next((kwargs[name] for name in _CACHE_KEYWORDS if kwargs.get(name) is not None), None)
        one_token = hidden_states is not None and static_shape(hidden_states)[1] == 1
        rows = each_row_write(cache, module.layer_idx) if one_token else None
        if (rows is None or mask is None or mask.dim() != 4 or static_shape(mask)[1:3] != (1, 1)
                or kwargs.get("position_embeddings") is None or rows[0].dtype != hidden_states.dtype):
            return own_forward(*args, **kwargs)
        keys, values, write_positions = rows
        cos, sin = kwargs["position_embeddings"]
        output = operator(
            module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states), cos, sin, keys,
            values, write_positions, mask[..., : keys.shape[2]], module.scaling)
        return module.o_proj(output), None

    return forward
