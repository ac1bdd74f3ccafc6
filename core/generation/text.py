"""Text in and out of the generator: prompts become token ids (checked, truncated), new token ids become
completions. The generator itself works on token ids only."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from accelgen.common.errors import UsageError
from accelgen.common.prompts import check_prompts


@dataclasses.dataclass
class Completion:
    """One prompt's result. ``prompt`` is the text the model saw (the kept tokens, when truncated);
    ``completion`` is the new text only; ``index`` the prompt's position (its row in a dataset)."""

    index: int
    prompt: str
    completion: str
    completion_token_ids: list[int]
    prompt_token_count: int
    finish_reason: str  # "eos" (the model ended it) or "length" (max_new_tokens reached)


class PromptCodec:
    """Encodes prompts for one model and decodes its completions, with ``tokenizer``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_input_tokens: int | None):
        self.tokenizer, self.vocab_size, self.max_input_tokens = tokenizer, vocab_size, max_input_tokens

    def encode(self, prompts: Sequence[str], first_index: int = 0) -> tuple[list[list[int]], list[bool]]:
        """Token ids per prompt, truncated to their first ``max_input_tokens`` tokens, and which prompts were
        truncated. ``first_index`` is the first prompt's number, for error messages."""
        check_prompts(prompts, first_index)
        token_ids = self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
        limit = self.max_input_tokens
        truncated = [limit is not None and len(ids) > limit for ids in token_ids]
        token_ids = [ids[:limit] for ids in token_ids] if limit is not None else token_ids
        for index, ids in enumerate(token_ids, start=first_index):
            if not ids:
                raise UsageError(f"Prompt {index} makes no tokens: give it some text (or drop that row from the dataset).")
            if max(ids) >= self.vocab_size:
                raise UsageError(
                    f"Prompt {index} has token id {max(ids)}, outside the model's vocabulary of {self.vocab_size}: "
                    f"the tokenizer does not belong to this model."
                )
        return token_ids, truncated

    def completion(self, index: int, prompt: str, prompt_token_ids: list[int], truncated: bool,
                   new_token_ids: list[int], finish_reason: str) -> Completion:
        """The completion of prompt ``index`` from its new token ids."""
        # Decode prompt and completion together so word boundaries (e.g. SentencePiece spaces) come out right.
        prompt_text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=True)
        full_text = self.tokenizer.decode(list(prompt_token_ids) + new_token_ids, skip_special_tokens=True)
        return Completion(
            index=index,
            prompt=prompt_text if truncated else prompt,  # what the model saw
            completion=full_text[len(prompt_text) :],
            completion_token_ids=new_token_ids,
            prompt_token_count=len(prompt_token_ids),
            finish_reason=finish_reason,
        )


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token id that ends a sequence: the generation config's, else the model config's or tokenizer's."""
    generation_config = getattr(model, "generation_config", None)
    for source in (generation_config, model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return []
