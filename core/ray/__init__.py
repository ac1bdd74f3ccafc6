"""accelgen on a Ray cluster: ``accelgen run --ray`` (``accelgen.ray.cluster_job``), and from Python a Ray Data stage.

- :class:`Completions`: a callable class for ``ray.data.Dataset.map_batches``, one engine per actor; its constructor
  takes ``accelgen.load``'s keywords (``accelgen.ray.batch_columns`` says which columns a batch holds in and out).
- :func:`complete_dataset`: a dataset completed by N such replicas, each asking Ray for its resources as Ray says them.

Ray is imported only when these are used (``pip install "accelgen[ray]"``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelgen.ray.batch_columns import Completions, complete_dataset

_EXPORTS = {"Completions": "accelgen.ray.batch_columns", "complete_dataset": "accelgen.ray.batch_columns"}
__all__ = ["Completions", "complete_dataset"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'accelgen.ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
