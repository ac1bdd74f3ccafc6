"""Which decode steps this machine has compiled before: a mark per model shape and run settings, kept inside
inductor's own cache folder (so that the marks go when that cache goes), written when a step compiles and read when a
job decides whether to compile its step.

Compiling costs far less when inductor's cache holds the step (its graphs and C++ are loaded, not made again):
seconds instead of tens of seconds (RESULTS-log.md, "Compiled decode step on the CPU"). A job whose step this machine
has compiled before pays for its compile after far fewer steps (``CpuAccelerator.warm_capture_pays_after_steps``).
The mark decides only whether a step is compiled; a compiled step and an eager one give the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from accelgen.common.settings import RunSettings

#: The folder of marks inside inductor's cache folder.
MARKS = "accelgen-compiled-steps"


def step_key(config, run: RunSettings, threads: str) -> str:
    """What a decode step's compiled code depends on: the model's shape (its config's plain values, not its name or
    path), the run settings that shape the step, torch's release, and ``threads`` (a fixed count the kernels were made
    for, or "any" where they read it at each call)."""
    import torch

    shape = {name: value for name, value in sorted(config.to_dict().items())
             if not name.startswith("_") and name not in _NOT_SHAPE and isinstance(value, (int, float, str, bool))}
    settings = (run.dtype, run.quantize, run.batch_size, run.max_new_tokens, run.buckets, run.sampling.do_sample,
                run.logprobs, run.constrained, run.num_samples > 1 or run.rows_choose,
                run.lora.named, run.lora.max_loras, run.lora.max_lora_rank)  # adapters' buffers are in the step
    text = json.dumps([shape, repr(settings), torch.__version__, threads], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


#: Config values that name or describe a checkpoint without changing its step.
_NOT_SHAPE = frozenset({"name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
                        "attn_implementation", "use_cache", "return_dict", "output_attentions", "output_hidden_states"})


def inductor_cache_folder() -> Path:
    """Inductor's cache folder, as it finds it (``TORCHINDUCTOR_CACHE_DIR``, else its default), made nowhere."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).absolute()


def compiled_before(key: str) -> bool:
    """Whether a step of ``key`` compiled on this machine, into the inductor cache in use now."""
    return (inductor_cache_folder() / MARKS / key).is_file()


def mark_compiled(key: str) -> None:
    """Remember that a step of ``key`` compiled into the cache in use now; a cache that cannot be written is left
    unmarked (the next job decides as for a cold cache)."""
    folder = inductor_cache_folder() / MARKS
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / key).touch()
    except OSError:
        pass
