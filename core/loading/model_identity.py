"""A model known by its content, not its path: what a run record holds, so that a resumed run continues
only with the same model (another model placed at the same path is refused; the same model reached by
another path resumes).

A local folder is identified by its config.json's bytes and, for each weight file, its name, its size and
a hash of its first and last MiB (a different checkpoint of the same shape differs there: the first and last
tensors' values), so a 352 GB checkpoint is identified by reading about 2 MiB per file. A Hub id is
identified by the revision (commit) its config was read at: a Hub revision never changes.
"""

from __future__ import annotations

import hashlib
import os

import transformers

#: Bytes hashed at each end of every weight file.
SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def model_identity(source: str, config: transformers.PretrainedConfig) -> dict[str, str | None]:
    """``{"config_sha256", "weights_sha256", "revision"}`` of the model at ``source`` (a folder or a Hub id)."""
    if os.path.isdir(source):
        with open(os.path.join(source, "config.json"), "rb") as config_file:
            config_hash = hashlib.sha256(config_file.read()).hexdigest()
        return {"config_sha256": config_hash, "weights_sha256": weights_digest(source), "revision": None}
    config_text = config.to_json_string(use_diff=True)
    return {"config_sha256": hashlib.sha256(config_text.encode()).hexdigest(), "weights_sha256": None,
            "revision": getattr(config, "_commit_hash", None)}


def weights_digest(folder: str) -> str:
    """A digest of the weight files of ``folder``: each one's name, size, and first and last :data:`SAMPLE_BYTES`."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if not name.endswith(WEIGHT_SUFFIXES):
            continue
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as file:
            digest.update(file.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                file.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()
