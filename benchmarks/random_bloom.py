"""The model the benchmarks measure: a BLOOM of a given shape with seeded random weights.

Decode speed does not depend on weight values, so a random BLOOM-560m-shaped model measures what
the real one would, without downloading it.
"""

from __future__ import annotations

import argparse

import torch
from transformers import BloomConfig, BloomForCausalLM


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--layers / --hidden / --heads / --vocab, defaulting to BLOOM-560m's shape."""
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=250880)


def random_bloom(arguments: argparse.Namespace) -> BloomForCausalLM:
    torch.manual_seed(0)
    config = BloomConfig(
        hidden_size=arguments.hidden, n_layer=arguments.layers, n_head=arguments.heads, vocab_size=arguments.vocab
    )
    return BloomForCausalLM(config).eval()


def describe_shape(arguments: argparse.Namespace) -> str:
    return f"BLOOM {arguments.layers} layers, hidden {arguments.hidden}, {arguments.heads} heads, vocab {arguments.vocab}"
