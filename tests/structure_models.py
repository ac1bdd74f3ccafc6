"""A tiny model whose vocabulary cannot write some characters: for structures that need a character no token writes."""

from __future__ import annotations

from pathlib import Path

from tiny_models import SPECIAL_TOKENS, build_model, tiny_configs
from transformers import PreTrainedTokenizerFast

#: What the tokenizer is trained on: JSON strings, lists and literals, no object.
CORPUS = ['"name": "ada", [1, 2], true false null'] * 8


def model_without(folder: Path, characters: str) -> Path:
    """A tiny Llama in ``folder`` whose byte-level tokenizer has no token writing any of ``characters``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = [character for character in pre_tokenizers.ByteLevel.alphabet() if character not in characters]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet)
    backend.train_from_iterator([text for text in CORPUS if not set(text) & set(characters)], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    assert not any(set(token) & set(characters) for token in tokenizer.get_vocab())
    build_model(folder, tiny_configs(len(tokenizer))["llama"])
    tokenizer.save_pretrained(folder)
    return folder
