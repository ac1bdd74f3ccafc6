"""A Hub model's files brought into the local Hugging Face cache once per node: the node's first process
downloads (safetensors only, when the model has them), the node's other ranks wait for it and then read
the same cached files. A local folder is used as it is."""

from __future__ import annotations

import os

from accelgen.common.settings import World
from accelgen.loading.hub_reach import check_hub_reachable
from accelgen.loading.model_files import loading_errors_as_usage_errors
from accelgen.parallel.process_groups import one_process_per_node_first

#: The files a run needs besides weights: config, tokenizer (every format transformers reads), generation config.
SUPPORT_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "tokenizer*")


def checkpoint_folder(location: str, world: World, what: str = "model") -> str:
    """The local folder holding the files of the model (or ``what`` else: a LoRA adapter) at ``location`` (a folder,
    or a Hub id to download; every rank must call this)."""
    if os.path.isdir(location):
        return location
    check_hub_reachable(location, what)  # at once, not after the Hub client's retries
    with loading_errors_as_usage_errors(location, what), one_process_per_node_first(world):
        return _download(location)


def _download(hub_id: str) -> str:
    """The snapshot folder of ``hub_id`` in the cache, with its safetensors weights, or its pickle
    weights when it has none."""
    from huggingface_hub import snapshot_download

    folder = snapshot_download(hub_id, allow_patterns=[*SUPPORT_FILES, "*.safetensors"])
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        folder = snapshot_download(hub_id, allow_patterns=[*SUPPORT_FILES, "*.bin"])
    return folder
