"""Everything accelgen does because of how a transformers release or a model family's code behaves, in one place.

Each workaround names the releases or families it is for, so that it can be dropped when they are:

- ``DTYPE_KEYWORD``: transformers 4.56 renamed ``from_pretrained``/``from_config``'s ``torch_dtype`` to ``dtype``.
- :mod:`.static_cache`: Hugging Face's ``StaticCache`` on every supported release. 4.55 allocates every layer up
  front from the config (wrong head counts for multi-query and tensor-parallel models: each layer is sized from
  one probe forward pass); >= 4.56 allocates each layer on its first write (a cache must be written once before
  a decode step is captured, since a capture cannot allocate); >= 4.56 makes sliding-window layers rolling buffers
  with one write position per batch, which accelgen replaces by full layers (the mask gives the window). The memory
  of every cache comes from one
  :class:`~.static_cache.CacheStorage`. The slot step writes each row of the cache at its own position
  (``write_each_row_at``), and a prefill writes its prompts into chosen rows through a view of the cache
  (``prompt_rows``): the named operation, no flag read by a patched method.
- :mod:`.forward`: the model called with static-shape inputs. Hugging Face's mask helpers differ by release and
  some copy host data on every call (5.17's ``eager_mask``; 4.x BLOOM's ALiBi slopes), which no captured graph
  can hold, so for the families of ``accelgen.model.architectures`` the core builds the 4D additive mask itself.
  newer transformers 5.x releases (5.24 here; not 5.17) renamed the forward's ``past_key_values`` to ``cache``
  (the old name warns, and goes in 5.40).
- :mod:`.alibi`: BLOOM (4.x builds its ALiBi slopes from host data in every forward pass; under tensor
  parallelism each rank must add only its own heads' slopes).
- :mod:`.falcon`: Falcon's multi-query head split indexes with a Python list, a host copy on every call
  (4.55 and 5.x).
- Checkpoints that transformers >= 5 renames or fuses while loading (GPT-NeoX's ``embed_out``, experts stored one by
  one) are read through its own conversions by ``accelgen.loading.checkpoint_conversions``, beside the weight
  sources it wraps.
"""

from __future__ import annotations

import transformers

_RELEASE = tuple(int(part) for part in transformers.__version__.split(".")[:2])

#: The keyword ``from_pretrained`` and ``from_config`` take the dtype by (renamed in transformers 4.56).
DTYPE_KEYWORD = "dtype" if _RELEASE >= (4, 56) else "torch_dtype"
