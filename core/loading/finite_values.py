"""Whether weights hold only finite values: one NaN or inf in a checkpoint's tensor (or an adapter's) turns every row
it reaches into garbage that still looks like a result, so such weights are refused when they load.

A tensor is checked where it already is (on the device, after its copy), by one reduction (``torch.aminmax``: a NaN
makes both NaN, an inf is the largest or the smallest value), which costs one read of memory the load has just
written and no allocation the size of the tensor. The results stay on their devices until the end of a load: one host
read per device, however many tensors.
"""

from __future__ import annotations

import torch

from accelgen.common.errors import UsageError


def values_are_read(source) -> bool:
    """Whether the weight source ``source`` gives values read from a checkpoint, which are checked; random weights
    (``RandomWeights.drawn_at_random``, for benchmarks) are not."""
    return not getattr(source, "drawn_at_random", False)


def finite_flag(values: torch.Tensor) -> torch.Tensor | None:
    """A 0-dimensional boolean on ``values``'s device, true when every value is finite; None when nothing can be
    other (an integer or boolean tensor, an empty one)."""
    if not values.is_floating_point() or values.numel() == 0:
        return None
    return torch.stack(torch.aminmax(values)).isfinite().all()


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value of ``values`` is finite (a host read: for a tensor checked alone)."""
    flag = finite_flag(values)
    return flag is None or bool(flag)


def first_not_finite(flags: dict[str, torch.Tensor | None]) -> str | None:
    """The first name (in ``flags``' order) whose flag (``finite_flag``) is false, or None: one host read per device."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, flag in flags.items():
        if flag is not None:
            by_device.setdefault(flag.device, []).append((name, flag))
    bad = set()
    for named in by_device.values():
        finite = torch.stack([flag for _, flag in named]).tolist()
        bad.update(name for (name, _), ok in zip(named, finite) if not ok)
    return next((name for name in flags if name in bad), None)


def refuse_not_finite(source, flags: dict[str, torch.Tensor | None]) -> None:
    """Raise UsageError when a flag (``finite_flag``) of a tensor read from the checkpoint ``source`` (a weight source,
    ``accelgen.loading.weight_sources``; ``flags`` by the model's names) is false, naming the first as it is stored."""
    not_finite = first_not_finite(flags)
    if not_finite is not None:
        stored_name = getattr(source, "stored_name", lambda name: name)(not_finite)
        raise UsageError(f"Checkpoint {source.where}'s tensor {stored_name!r} holds NaN or inf: the weights are damaged "
                         f"or come from a training run that diverged; download or save the model again (every value "
                         f"finite), or pass another checkpoint.")
