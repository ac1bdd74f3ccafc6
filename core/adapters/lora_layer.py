"""A linear layer with the LoRA adapters of fixed-size device buffers added, each token computed with its own adapter,
in shapes that never depend on which adapters the tokens chose: a captured step serves every mix.

The buffers of one layer stack ``slots`` adapters of rank up to ``rank`` as C = slots x rank columns, both stored as
a linear layer's weight [out, in]: ``lora_a`` [C, in] holds adapter s's A in rows (s - 1) x rank to s x rank (its rank
r first, zeros after), ``lora_b`` [out, C] its B (times its scaling) in those columns. Buffer slot 0 is the base
model's: no columns. A forward pass computes every column, keeps each token's own adapter's (a mask, [M, C] over the
pass's M tokens, true in the columns of other adapters, whose values are replaced by zeros) and multiplies back:

    y = base(x) + where(mask, 0, x @ lora_a^T) @ lora_b^T

The other adapters' columns are replaced, not multiplied by 0: a value that is NaN or inf in another adapter's product
(0 x inf is NaN) never reaches a token. B's values are finite (``adapter_files`` refuses an adapter holding NaN or inf,
``adapter_set`` one beyond the run's dtype), so the zeros add exact zeros through every other adapter's B.

Each product is the device's own over its layout of the buffer where it has one (``Accelerator.linear_layout``: a few
rows times a small weight is where a general product does worst), else torch's.

so a token of the base model (slot 0) adds exact zeros. This is how vLLM's Gaudi backend computes mixed batches of
adapters (a mask over stacked adapters, no gather); punica and S-LoRA gather each token's own matrices instead, which
reads each token's adapter again and costs more than the masked product while fewer adapters are resident than rows
decoded (benchmarks/RESULTS-log.md, "LoRA: masked products against gathered ones").

Under tensor parallelism the buffers are split as their layer is: a column-parallel layer's ``lora_b`` holds this
rank's outputs; a row-parallel layer's ``lora_a`` this rank's inputs, and its low-rank output is added to the layer's
partial output before the one sum over the ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from accelgen.plugin.contract import LinearLayout


class AdapterRows:
    """Which buffer slot each token of the next forward pass is computed with, shared by a model's LoRA layers: the
    mask of the columns each token leaves out (true in the other adapters'), [rows, tokens, C] as most layers see the
    tokens and [M, C] as the others do (M = rows x tokens: OPT's MLP sees them flattened), or None (every token the base
    model's, nothing added)."""

    def __init__(self, slots: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.slots, self.rank, self.dtype = slots, rank, dtype
        self.column_slots = torch.arange(1, slots + 1, device=device).repeat_interleave(rank)  # [C] each column's slot
        self.mask: torch.Tensor | None = None
        self.flat_mask: torch.Tensor | None = None

    def select(self, token_slots: torch.Tensor | None) -> None:
        """The tokens of the next forward pass, token_slots [rows, tokens], computed with the adapters of those buffer
        slots; None: all with the base model."""
        self.mask = None if token_slots is None else token_slots[..., None] != self.column_slots
        self.flat_mask = None if self.mask is None else self.mask.view(-1, self.mask.shape[-1])


@dataclasses.dataclass(frozen=True)
class RowParallelParts:
    """A row-parallel layer taken apart: its ``partial`` product (x [..., in / N] -> [..., out]), the ``all_reduce``
    (in place) that sums it over the ranks, and its ``bias``, added after."""

    partial: Callable[[torch.Tensor], torch.Tensor]
    all_reduce: Callable[[torch.Tensor], None]
    bias: torch.Tensor | None


class LoraLinear(torch.nn.Module):
    """``base`` (any module computing x W^T (+ bias): whole, split over ranks, int8, laid out by the device) with the
    adapters of its buffers added, each token's own (:class:`AdapterRows`). ``row_parallel``: the base's parts when its
    partial outputs are summed over ranks (the low-rank output joins them before the sum)."""

    def __init__(self, base: torch.nn.Module, rows: AdapterRows, in_features: int, out_features: int,
                 device: torch.device, row_parallel: RowParallelParts | None = None,
                 lay_out: Callable[[torch.Tensor], LinearLayout | None] = lambda weight: None):
        super().__init__()
        self.base, self.rows, self.row_parallel = base, rows, row_parallel
        columns = rows.slots * rows.rank
        self.register_buffer("lora_a", torch.zeros(columns, in_features, dtype=rows.dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(out_features, columns, dtype=rows.dtype, device=device), persistent=False)
        self.layouts = (lay_out(self.lora_a), lay_out(self.lora_b))  # the device's, or None: torch's products
        # the layouts' tensors, this layer's state too: a step traced by a device holds them as its module's, freed with
        # it, not as constants of its graph, which torch keeps until the process ends (DecodeStep)
        held = {id(self.lora_a), id(self.lora_b)}  # a layout may keep the buffer it lays out: registered once
        for which, layout in zip("ab", self.layouts):
            for name, value in vars(layout).items() if layout is not None else ():
                if isinstance(value, torch.Tensor) and id(value) not in held:
                    self.register_buffer(f"layout_{which}_{name}", value, persistent=False)
                    held.add(id(value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.rows.mask
        if self.row_parallel is None:
            output = self.base(x)
            return output if mask is None else self._with_low_rank(output, x, mask)
        output = self.row_parallel.partial(x)
        if mask is not None:
            output = self._with_low_rank(output, x, mask)
        self.row_parallel.all_reduce(output)
        return output if self.row_parallel.bias is None else output + self.row_parallel.bias

    def _with_low_rank(self, output: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``output`` [..., out] plus each token's own adapter's output for x [..., in] (the ``mask`` of its tokens, as
        :class:`AdapterRows` shapes it), in as few operations as the products allow (each one's dispatch costs as much
        as a small product)."""
        layout_a, layout_b = self.layouts
        if layout_a is None or layout_b is None:
            low_rank = torch.mm(x.reshape(-1, x.shape[-1]), self.lora_a.t()).masked_fill_(self.rows.flat_mask, 0)
            return torch.addmm(output.reshape(-1, output.shape[-1]), low_rank, self.lora_b.t()).view(output.shape)
        low_rank = layout_a.product(x)  # [..., C]
        return output.add_(layout_b.product(low_rank.masked_fill_(mask if x.dim() == mask.dim() else self.rows.flat_mask, 0)))

    def write_slot(self, slot: int, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> None:
        """Put an adapter in buffer slot ``slot`` (1 and up): a [r, in] and b [out, r] (this rank's parts, its scaling in
        b), or zeros (an adapter that leaves this layer alone)."""
        block = slice((slot - 1) * self.rows.rank, slot * self.rows.rank)
        self.lora_a[block].zero_()
        self.lora_b[:, block].zero_()
        if a is not None:
            rank = a.shape[0]
            self.lora_a[block][:rank].copy_(a)
            self.lora_b[:, block][:, :rank].copy_(b)
        for layout in self.layouts:
            if layout is not None:
                layout.refresh()

    def extra_repr(self) -> str:
        return (f"slots={self.rows.slots}, rank={self.rows.rank}, in_features={self.lora_a.shape[1]}, "
                f"out_features={self.lora_b.shape[0]}")
