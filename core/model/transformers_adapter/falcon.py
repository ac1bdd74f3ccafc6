"""Falcon's multi-query attention without host copies (transformers 4.55 and 5.x)."""

from __future__ import annotations

import types

import torch

from accelgen.common.settings import World


def split_multi_query_heads_by_slicing(model: torch.nn.Module, world: World) -> None:
    """Falcon's multi-query attention splits its fused projection with ``fused_qkv[..., [-2], :]``: indexing
    with a Python list, which copies the index from the host on every call (transformers 4.55 and 5.x).
    Slices select the same values without it."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    for module in model.modules():
        if isinstance(module, FalconAttention) and module.multi_query and not module.new_decoder_architecture:
            module._split_heads = types.MethodType(_split_heads_by_slicing, module)


def _split_heads_by_slicing(self, fused_qkv: torch.Tensor):
    """fused_qkv [B, T, (H + 2) * D] -> query [B, T, H, D], key [B, T, 1, D], value [B, T, 1, D]."""
    batch_size, seq_length, _ = fused_qkv.shape
    fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
    return fused_qkv[..., :-2, :], fused_qkv[..., -2:-1, :], fused_qkv[..., -1:, :]
