"""PEFT LoRA adapters of the tiny test models, made here with PEFT itself (nothing downloaded), and PEFT's own
generation with them: the reference accelgen's rows are checked against.

PEFT starts B at zeros (an adapter that changes nothing); these draw B at random, so that every adapter changes the
model's tokens. The three adapters of a model differ in rank, scaling (one with rsLoRA, one with a per-module rank and
alpha) and in the layers they adapt.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

#: The linear layers of each family's decoder an adapter may adapt: attention's, then the MLP's.
TARGETS = {
    "llama": (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
    "bloom": (["query_key_value", "dense"], ["dense_h_to_4h", "dense_4h_to_h"]),
    "gpt2": (["c_attn", "c_proj"], ["c_fc", "c_proj"]),
    "opt": (["q_proj", "k_proj", "v_proj", "out_proj"], ["fc1", "fc2"]),
    "falcon": (["query_key_value", "dense"], ["dense_h_to_4h", "dense_4h_to_h"]),
    "phi3": (["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"]),
    "gpt_neox": (["query_key_value", "dense"], ["dense_h_to_4h", "dense_4h_to_h"]),
}
#: Families laid out as Llama is; those with experts adapt their attention only (their experts are no linear layers).
TARGETS.update({family: TARGETS["llama"] for family in (
    "mistral", "qwen2", "qwen3", "granite", "smollm3", "gemma2", "gemma3_text", "olmo2")})
TARGETS.update({family: (TARGETS["llama"][0], ["o_proj"]) for family in ("mixtral", "qwen3_moe", "gpt_oss")})


def lora_configs(architecture: str) -> dict[str, LoraConfig]:
    """Three adapters' configs: rank 4 on every layer; rank 8 with rsLoRA on attention; rank 2 on the MLP, with one
    layer kind at rank 3 and its own alpha."""
    attention, mlp = TARGETS[architecture]
    return {
        "a0": LoraConfig(r=4, lora_alpha=8, target_modules=sorted(set(attention + mlp))),
        "a1": LoraConfig(r=8, lora_alpha=4, use_rslora=True, target_modules=attention),
        "a2": LoraConfig(r=2, lora_alpha=4, target_modules=mlp, rank_pattern={mlp[-1]: 3}, alpha_pattern={mlp[-1]: 9}),
    }


def save_adapter(model_folder: Path, folder: Path, config: LoraConfig, seed: int) -> Path:
    """A PEFT adapter of ``config`` over the model in ``model_folder``, B drawn at random (seeded), saved in ``folder``."""
    torch.manual_seed(seed)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_folder), config)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    peft.save_pretrained(folder)
    return folder


def build_adapters(model_folder: Path, root: Path, architecture: str) -> dict[str, Path]:
    """The three adapters of :func:`lora_configs`, by name, saved under ``root``."""
    return {name: save_adapter(model_folder, root / name, config, seed)
            for seed, (name, config) in enumerate(lora_configs(architecture).items())}


def peft_completions(model_folder: Path, adapters: dict[str, Path], prompts: list[str | list[int]],
                     names: list[str | None], max_new_tokens: int, merged: bool = False) -> list[list[int]]:
    """PEFT's greedy tokens for each prompt (a text, or token ids) alone with its adapter (None: the base model), cut
    after EOS; ``merged``:
    with the model of ``merge_and_unload()`` of each prompt's adapter."""
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    base = AutoModelForCausalLM.from_pretrained(model_folder)  # float32, as saved
    peft = None
    for name, folder in adapters.items():
        peft = PeftModel.from_pretrained(base, folder, adapter_name=name) if peft is None else peft
        if name not in peft.peft_config:
            peft.load_adapter(folder, adapter_name=name)
    completions = []
    for prompt, name in zip(prompts, names):
        if name is None:
            with peft.disable_adapter():
                model = peft
                completions.append(_greedy(model, tokenizer, prompt, max_new_tokens))
            continue
        peft.set_adapter(name)
        model = peft
        if merged:
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_folder),
                                              adapters[name]).merge_and_unload()
        completions.append(_greedy(model, tokenizer, prompt, max_new_tokens))
    return completions


def _greedy(model, tokenizer, prompt: str | list[int], max_new_tokens: int) -> list[int]:
    """The new tokens of ``prompt`` (a text, or token ids), cut after EOS."""
    if isinstance(prompt, str):
        inputs = tokenizer(prompt, return_tensors="pt", return_token_type_ids=False)
    else:
        inputs = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    row = output[0, inputs["input_ids"].shape[1]:].tolist()
    return row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
