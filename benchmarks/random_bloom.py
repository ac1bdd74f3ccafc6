"""The model the benchmarks measure: a BLOOM of a given shape with seeded random weights.

Decode speed does not depend on weight values, so a random BLOOM-560m-shaped model measures what
the real one would, without downloading it. ``SHAPES`` names the shapes the published benchmarks use.
"""

from __future__ import annotations

import argparse

import torch
from transformers import BloomConfig, BloomForCausalLM

#: Shapes of real checkpoints: layers, hidden size, attention heads, vocabulary.
SHAPES = {
    "bloom-560m": dict(layers=24, hidden=1024, heads=16, vocab=250880),
    "bloomz-7b1": dict(layers=30, hidden=4096, heads=32, vocab=250880),
}


def add_shape_arguments(parser: argparse.ArgumentParser, default_shape: str = "bloom-560m") -> None:
    """--layers / --hidden / --heads / --vocab, defaulting to the shape named ``default_shape`` in SHAPES."""
    defaults = SHAPES[default_shape]
    parser.add_argument("--layers", type=int, default=defaults["layers"])
    parser.add_argument("--hidden", type=int, default=defaults["hidden"])
    parser.add_argument("--heads", type=int, default=defaults["heads"])
    parser.add_argument("--vocab", type=int, default=defaults["vocab"])


def random_bloom(
    arguments: argparse.Namespace, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> BloomForCausalLM:
    """A seeded random BLOOM of the shape in ``arguments``, built directly on ``device`` in ``dtype``
    (a 7B model never passes through host memory or float32)."""
    torch.manual_seed(0)
    config = BloomConfig(
        hidden_size=arguments.hidden, n_layer=arguments.layers, n_head=arguments.heads, vocab_size=arguments.vocab
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = BloomForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def describe_shape(arguments: argparse.Namespace) -> str:
    return f"BLOOM {arguments.layers} layers, hidden {arguments.hidden}, {arguments.heads} heads, vocab {arguments.vocab}"
