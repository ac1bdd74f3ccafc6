"""Tiny random-weight models and a locally trained tokenizer, saved like Hub checkpoints.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few sentences, and each
model is built from its config with seeded random weights, then saved with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as transformers_logging

# save_pretrained's "Writing model shards" bar (transformers 5.x) would land in the stderr of whichever test first
# builds a model, and break that test's one-line check depending on the order the tests run in.
transformers_logging.disable_progress_bar()

CORPUS = [
    "DeepSpeed is a machine learning framework for training and inference of large models.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Static shapes let one captured graph serve every decoded token of a batch.",
    "Hello world, this is a small corpus for a tiny tokenizer used in tests.",
    "In the beginning God created the heaven and the earth.",
    "Tensor parallelism splits each layer across devices and adds the partial results.",
]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def build_tokenizer(folder: Path, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on CORPUS, saved in ``folder`` (tokenizer.json)."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def tiny_configs(vocab_size: int) -> dict:
    """One small config per architecture family the pipeline must match Hugging Face on."""
    common = dict(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return {
        "bloom": BloomConfig(hidden_size=64, n_layer=2, n_head=4, **common),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common),
        "llama": LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, **common,
        ),
        "opt": OPTConfig(
            hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
            max_position_embeddings=256, **common,
        ),
        "falcon": FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **common),
    }


def build_model(folder: Path, config, seed: int = 0) -> Path:
    """Save a random-weight model for ``config`` in ``folder`` (safetensors) and return the folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(folder, safe_serialization=True)
    return folder
