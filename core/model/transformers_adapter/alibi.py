"""BLOOM's ALiBi bias from slopes computed once, for the heads this rank holds.

Hugging Face builds the bias in every forward pass from the attention mask, and transformers 4.x builds
the per-head slopes there from host data (``torch.tensor(..., device=...)``): a host-to-device copy in
every decode step, which no CUDA graph can hold. Here the slopes are computed once, with Hugging Face's
own function (so the values are its values), kept on the device, and the bias is built from them with
device operations only. Under tensor parallelism a rank holds heads ``[rank * H/N, (rank + 1) * H/N)``
and adds only their slopes. The bias itself is Hugging Face's, value for value: per head, the slope
times each key's position among the row's real tokens.
"""

from __future__ import annotations

import functools

import torch

from accelgen.common.settings import World

#: Marks a model whose ``build_alibi_tensor`` is already ours.
_INSTALLED = "_accelgen_alibi_slopes"


def use_rank_alibi(model: torch.nn.Module, world: World) -> None:
    """Make a BLOOM model build its ALiBi bias from this rank's slopes (idempotent)."""
    transformer = model.transformer
    if hasattr(transformer, _INSTALLED):
        return
    total_heads = model.config.n_head
    heads_per_rank = total_heads // world.size
    own_slopes = _hugging_face_slopes(total_heads)[world.rank * heads_per_rank : (world.rank + 1) * heads_per_rank]
    slopes_by_device: dict[torch.device, torch.Tensor] = {}
    setattr(transformer, _INSTALLED, own_slopes)
    transformer.build_alibi_tensor = functools.partial(
        _alibi_bias, slopes=own_slopes, slopes_by_device=slopes_by_device
    )


def _alibi_bias(attention_mask, num_heads, dtype, *, slopes: torch.Tensor, slopes_by_device: dict):
    """The bias [B * heads, 1, L] for ``attention_mask``: the 2D mask [B, L] (1 = real token), or the 4D
    additive mask [B, 1, T, L] the static pipeline hands the model, whose last query row attends to exactly
    the real tokens (the last prompt token in a prefill, the decoded token in a decode step).

    ``num_heads`` (the unsharded count Hugging Face passes) is ignored: the slopes say how many this rank has.
    The slopes reach the mask's device in the first call (a prefill, never a captured step) and stay there."""
    if attention_mask.dim() == 4:
        attention_mask = (attention_mask[:, 0, -1, :] == 0).long()
    if attention_mask.device not in slopes_by_device:
        slopes_by_device[attention_mask.device] = slopes.to(attention_mask.device)
    device_slopes = slopes_by_device[attention_mask.device]
    batch_size, key_length = attention_mask.shape
    positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]  # [B, 1, L]
    alibi = device_slopes[..., None] * positions  # [B, heads, L]
    return alibi.reshape(batch_size * device_slopes.shape[0], 1, key_length).to(dtype)


def _hugging_face_slopes(heads: int) -> torch.Tensor:
    """The float32 slope of each head [heads], as Hugging Face's ``build_alibi_tensor`` computes them: its
    bias at key position 1 of a two-token row is the slope itself."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones((1, 2), dtype=torch.long), heads, torch.float32)  # [heads, 1, 2]
    return bias[:, 0, 1].clone()
