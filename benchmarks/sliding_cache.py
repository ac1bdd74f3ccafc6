"""The KV cache memory of a model with sliding-window layers: what accelgen allocates, against what rolling buffers of
the window's length would hold.

accelgen's sliding layers hold every position of their rows, as full layers do (the mask gives them their window:
docs/models.md); Hugging Face's rolling buffer holds the window's length but has one write position for the whole
batch. The model is Gemma-3-1B-shaped where the cache is concerned (26 layers, 5 sliding to 1 full, windows of 512,
one key/value head of 256 values) and small elsewhere (the cache does not depend on the other widths), with random
weights; a job of ``--rows`` rows makes a cache of ``--prompt-tokens`` + ``--new-tokens`` positions (its rows end at their
first vowel or space: the cache is allocated whole at the start, which is what is measured). Reported: the
bytes of the cache storage the job allocated (read off the engine), the same for a model whose layers are all full,
and the bytes rolling buffers would take.

    python benchmarks/sliding_cache.py [--rows 16] [--prompt-tokens 64] [--new-tokens 4032] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig

import accelgen

GEMMA3_1B_CACHE_SHAPE = dict(num_hidden_layers=26, num_key_value_heads=1, head_dim=256, sliding_window=512,
                             num_attention_heads=4, hidden_size=256, intermediate_size=512, vocab_size=4096,
                             max_position_embeddings=8192)


def cache_bytes(config_folder: Path, rows: int, prompt_tokens: int, new_tokens: int, dtype: str) -> tuple[int, int]:
    """(bytes of the cache storage a job allocated, positions per row) for the config in ``config_folder``."""
    generator = accelgen.load(str(config_folder / "config.json"), random_weights=True, device="cpu", dtype=dtype,
                              batch_size=rows, max_new_tokens=new_tokens, buckets=[prompt_tokens], stop=list("aeiou "),
                              prefix_cache=0, max_input_tokens=prompt_tokens)
    generator.generate(["Static shapes let one captured graph serve every decoded token. " * 8] * rows)
    storage = generator.runner.shapes._storage  # the engine's memory of keys and values, every layer
    return sum(buffer.numel() * buffer.element_size() for buffer in storage._buffers.values()), storage.capacity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=4032)
    parser.add_argument("--dtype", default="bfloat16")
    arguments = parser.parse_args()
    layer_types = ["full_attention" if (layer + 1) % 6 == 0 else "sliding_attention" for layer in range(26)]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, types in (("sliding", layer_types), ("all full", ["full_attention"] * 26)):
            config_folder = Path(folder) / name.replace(" ", "_")
            AutoConfig.for_model("gemma3_text", **GEMMA3_1B_CACHE_SHAPE, layer_types=types).save_pretrained(config_folder)
            results[name] = cache_bytes(config_folder, arguments.rows, arguments.prompt_tokens, arguments.new_tokens,
                                        arguments.dtype)
    allocated, positions = results["sliding"]
    per_layer_position = allocated // (26 * positions)  # one position of every row, one layer: keys and values
    sliding_layers = layer_types.count("sliding_attention")
    rolling = per_layer_position * ((26 - sliding_layers) * positions + sliding_layers * min(512, positions))
    print(json.dumps({"rows": arguments.rows, "positions": positions, "dtype": arguments.dtype,
                      "allocated_gib": round(allocated / 2**30, 3),
                      "all_full_layers_gib": round(results["all full"][0] / 2**30, 3),
                      "rolling_buffers_would_gib": round(rolling / 2**30, 3),
                      "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
