"""Calling a causal language model the way the static pipeline needs: same inputs on every release.

The attention mask a model receives decides whether its decode step can be captured as a graph. Given
the usual 2D padding mask, a model turns it into a 4D mask with Hugging Face's mask helpers, which differ
between transformers releases, and some of which copy host data to the device on every call (5.17's
``eager_mask`` builds ``torch.tensor(0.0, device=...)``; 4.x's BLOOM builds its ALiBi slopes from host data):
nothing a CUDA graph can hold, nor one position per slot. So the core builds the 4D additive mask itself, with
device operations only, one per kind of attention layer the model has (full, or a sliding window counted in each
row's own tokens), and every release uses it as it is; a model with layers of several kinds gets a mapping by layer
type, as transformers' own models take it. The family table (``accelgen.model.architectures``) applies each family's
own changes (BLOOM's ALiBi slopes on the device, for instance). Falcon's ALiBi variant alone builds its bias from the
2D mask: it gets that mask and Hugging Face's own helpers, and runs in fixed batches.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch

from accelgen.common.errors import AccelgenWarning
from accelgen.common.settings import World
from accelgen.model.architectures import architecture_of, layer_windows
from accelgen.model.loaded_model import AdapterBuffers
from accelgen.model.shape import forward_accepts


class ModelForward:
    """``model`` called with static-shape inputs, returning the logits of the last position.

    Call it as ``forward(input_ids [B, T], attention_mask [B, L], position_ids [B, T], cache_position [T],
    cache)``: the T tokens at cache positions ``cache_position`` attend to the keys marked 1 in
    ``attention_mask`` up to their own position, and their keys and values go into ``cache``. With ``adapter_slots``
    [B], each row is computed with the LoRA adapter in that slot of the ``adapters``' buffers (slot 0, or no
    ``adapter_slots``: the base model). With ``zero_unseen_rows``, a row whose mask marks nothing (a finished row or an
    empty slot of a decode step: its output is never read) runs on zeros in place of its tokens' embeddings: in a model
    without biases they stay zeros through every layer, and a device whose kernels skip rows of zeros
    (``Accelerator.tuning.skips_zero_rows``) computes nothing for it; the other rows' values are the same.
    """

    def __init__(self, model: torch.nn.Module, world: World, dtype: torch.dtype, adapters: AdapterBuffers | None = None):
        self.model = model
        self.dtype = dtype
        self.adapters = adapters
        architecture = architecture_of(model.config)
        self.builds_4d_mask = architecture.takes_4d_mask
        self._finish_logits = architecture.finish_logits
        #: each kind of attention layer the model has, with how many latest positions its queries see
        self.windows = layer_windows(model.config)
        if architecture.make_capturable:
            architecture.make_capturable(model, world)
        self._takes_position_ids = forward_accepts(model, "position_ids")
        # newer 5.x releases (5.24; not 5.17) renamed ``past_key_values`` to ``cache``: the old name warns
        self._cache_keyword = "cache" if forward_accepts(model, "cache") else "past_key_values"
        self._takes_logits_to_keep = forward_accepts(model, "logits_to_keep")
        #: whether :meth:`packed_logits` can run this model
        self.packs_prompts = (architecture.packs_prompts and self.builds_4d_mask and self._takes_position_ids
                              and self._takes_logits_to_keep)

    def batching(self, asked: str) -> str:
        """The batching the model runs with when ``asked`` for one: fixed batches for a model whose masks Hugging
        Face builds from one position for the whole batch (slots do not share one), said in a warning."""
        if self.builds_4d_mask or asked != "continuous":
            return asked
        warnings.warn(AccelgenWarning(
            f"{self.model.config.model_type} models run in fixed batches (--batching static): their attention "
            f"masks are built by Hugging Face from one position for the whole batch, which slots do not share"),
            stacklevel=3)
        return "static"

    def __call__(self, input_ids, attention_mask, position_ids, cache_position, cache,
                 zero_unseen_rows: bool = False, adapter_slots: torch.Tensor | None = None) -> torch.Tensor:
        arguments = dict(
            attention_mask=self._masks(lambda window: additive_causal_mask(attention_mask, cache_position, self.dtype,
                                                                           window))
            if self.builds_4d_mask
            else attention_mask,
            **{self._cache_keyword: cache},
            cache_position=cache_position,
            use_cache=True,
        )
        if zero_unseen_rows:
            embeddings = self.model.get_input_embeddings()(input_ids)  # [B, T, hidden]
            arguments["inputs_embeds"] = embeddings * attention_mask.any(-1).to(embeddings.dtype)[:, None, None]
        else:
            arguments["input_ids"] = input_ids
        if self._takes_position_ids:
            arguments["position_ids"] = position_ids
        if self._takes_logits_to_keep:
            arguments["logits_to_keep"] = 1
        if self.adapters is not None and adapter_slots is not None:  # each row's adapter for each of its tokens
            adapter_slots = adapter_slots[:, None].expand(input_ids.shape)
        return self._with_adapters(adapter_slots, arguments).logits[:, -1, :]

    def packed_logits(self, input_ids, prompt_of, position_ids, ends, cache, adapter_slots=None) -> torch.Tensor:
        """The logits [k, V] of k prompts run one after another in one row (a model that ``packs_prompts``):
        input_ids [1, N] their tokens, prompt_of [N] which prompt each token is of, position_ids [1, N] each token's
        place in its prompt, ends [k] the index of each prompt's last token. Each token attends to its own prompt's
        tokens up to itself (``block_causal_mask``); their keys and values go into ``cache``; adapter_slots [k]: each
        prompt's adapter, as for a call."""
        arguments = dict(
            input_ids=input_ids,
            attention_mask=self._masks(lambda window: block_causal_mask(prompt_of, self.dtype, window)),
            **{self._cache_keyword: cache},
            cache_position=torch.arange(input_ids.shape[1], device=input_ids.device),
            use_cache=True,
            position_ids=position_ids,
            logits_to_keep=ends,
        )
        if self.adapters is not None and adapter_slots is not None:  # each prompt's adapter for each of its tokens
            adapter_slots = adapter_slots.index_select(0, prompt_of)[None]
        return self._with_adapters(adapter_slots, arguments).logits[0]

    @contextlib.contextmanager
    def final_hidden_states(self) -> Iterator[list[torch.Tensor]]:
        """A list that takes, for each call of the model inside the block, the hidden states [B, T, H] its causal-LM
        head reads (the base model's output, every position's, before the head keeps only the last): what prompt
        scores are computed from, the head applied a few positions at a time (:meth:`head_logits`)."""
        held: list[torch.Tensor] = []
        # the module whose output the head reads: the decoder where the model names one (OPT's is inside its base model)
        decoder = (self.model.get_decoder() if hasattr(self.model, "get_decoder") else None) or self.model.base_model
        hook = decoder.register_forward_hook(lambda module, inputs, output: held.append(output[0]))
        try:
            yield held
        finally:
            hook.remove()

    def head_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits [T, V] of hidden states [T, H], as the model's causal-LM head makes them: its output projection
        (this rank's, gathered, under tensor parallelism), then what the family does to them (``finish_logits``)."""
        logits = self.model.get_output_embeddings()(hidden_states[None])[0]
        return logits if self._finish_logits is None else self._finish_logits(self.model.config, logits)

    def _masks(self, mask_for: Callable[[int | None], torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        """The 4D mask (``mask_for(window)``) of a model whose layers are of one kind; a mapping {layer type: its mask}
        where they are of several (each window's mask made once)."""
        if len(self.windows) == 1:
            return mask_for(next(iter(self.windows.values())))
        by_window = {window: mask_for(window) for window in set(self.windows.values())}
        return {layer_type: by_window[window] for layer_type, window in self.windows.items()}

    def _with_adapters(self, token_slots: torch.Tensor | None, arguments: dict):
        """The model's output for ``arguments``, each token (token_slots [rows, tokens]) computed with the adapter in its
        buffer slot (0, or None for all: the base model's)."""
        if self.adapters is None:
            return self.model(**arguments)
        self.adapters.select(token_slots)
        output = self.model(**arguments)
        self.adapters.select(None)  # a pass that does not say (a cache's shape probe) is the base model's
        return output


def block_causal_mask(prompt_of: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The 4D mask [1, 1, N, N] of prompts run one after another in one row (``prompt_of`` [N]: which prompt each
    token is of, each prompt's tokens side by side): 0 where a token may attend (a token of its own prompt, at or
    before itself, and with a ``window``, fewer than that many tokens before it), the dtype's most negative value
    elsewhere. Filled once, then each prompt's causal block: a few
    passes over its N x N values where comparing every token with every other took five (the eager prefill's mask is
    made for each pass)."""
    tokens = prompt_of.shape[0]
    mask = torch.full((1, 1, tokens, tokens), torch.finfo(dtype).min, dtype=dtype, device=prompt_of.device)
    start = 0
    for length in torch.unique_consecutive(prompt_of, return_counts=True)[1].tolist():
        causal = torch.ones(length, length, dtype=torch.bool, device=prompt_of.device).tril_()
        if window is not None:
            causal.triu_(1 - window)
        mask[0, 0, start:start + length, start:start + length].masked_fill_(causal, 0)
        start += length
    return mask


def additive_causal_mask(attention_mask: torch.Tensor, cache_position: torch.Tensor, dtype: torch.dtype,
                         window: int | None = None) -> torch.Tensor:
    """The 4D mask [B, 1, T, L] for queries at ``cache_position`` [T] over keys marked in ``attention_mask``
    [B, L]: 0 where the query may attend (a real key at or before its own position, and with a ``window``, fewer
    than that many marked keys before it: a row's tokens are counted, not its cache positions), the dtype's most
    negative value elsewhere, which is what Hugging Face's eager masks hold and what SDPA adds as a bias.

    A query with nothing to attend to (a padding position of a prefill) gets a row of minima, so softmax
    spreads evenly instead of producing NaN; no real token ever attends to it."""
    key_positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    causal = key_positions[None, :] <= cache_position[:, None]  # [T, L]
    marked = attention_mask != 0
    visible = marked[:, None, None, :] & causal[None, None]  # [B, 1, T, L]
    if window is not None:
        counts = marked.cumsum(-1)  # [B, L]: marked keys up to each position
        tokens_before = counts.index_select(1, cache_position)[:, :, None] - counts[:, None, :]  # [B, T, L]
        visible &= (tokens_before < window)[:, None]
    return _additive(visible, dtype)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of ``visible`` (True where a query may attend): 0 there, the dtype's most negative value
    elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)
