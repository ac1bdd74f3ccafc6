"""A dataset job as a CTranslate2 or OpenVINO user writes it: read the rows, tokenize, generate in batches, write one
JSON line per row. Run as a process of its own (its start to its exit is the user's clock); the model was converted
or exported beforehand (``cpu_peers.convert``), as such a user converts once and runs many jobs.

    python peer_job.py ct2 --model DIR/ct2-int8 --tokenizer DIR --rows rows.jsonl --output out.jsonl --max-new-tokens 128

Sampling as accelgen's defaults with ``--do-sample``: temperature 1, no top-k, no top-p; a row ends at any token of
the original model's generation config's ``eos_token_id`` (the workload's ending set) or at ``--max-new-tokens``. Threads:
``OMP_NUM_THREADS`` (1 when unset). It prints one JSON line: the generation's own seconds (model loaded, the
warm-engine clock), the rows, and the kept tokens (each row's new tokens up to its end).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine", choices=("ct2", "ov"))
    parser.add_argument("--model", required=True, help="the converted model's folder")
    parser.add_argument("--tokenizer", required=True, help="the original model's folder: its tokenizer and generation config")
    parser.add_argument("--rows", required=True, help="a JSONL file of rows with a 'prompt' text")
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--precision", default="float32", help="OpenVINO's inference precision: float32, bfloat16, int8")
    arguments = parser.parse_args()
    from transformers import AutoTokenizer

    folder, original = Path(arguments.model), Path(arguments.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(original)
    ending = json.loads((original / "generation_config.json").read_text())["eos_token_id"]
    ending = ending if isinstance(ending, list) else [ending]
    prompts = [json.loads(line)["prompt"] for line in Path(arguments.rows).read_text().splitlines() if line.strip()]
    prompt_ids = [tokenizer(prompt).input_ids for prompt in prompts]
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    generate = (ctranslate2_generate if arguments.engine == "ct2" else openvino_generate)(folder, tokenizer, ending,
                                                                                          threads, arguments)
    started = time.perf_counter()
    outputs = generate(prompt_ids)
    seconds = time.perf_counter() - started
    kept = [_kept(tokens, set(ending)) for tokens in outputs]
    with open(arguments.output, "w", encoding="utf-8") as output:
        for index, (prompt, tokens) in enumerate(zip(prompts, kept)):
            output.write(json.dumps({"index": index, "prompt": prompt, "completion": tokenizer.decode(tokens),
                                     "completion_tokens": len(tokens)}) + "\n")
    print(json.dumps({"engine_seconds": seconds, "rows": len(prompts), "kept_tokens": sum(map(len, kept)),
                      "prompt_tokens": sum(map(len, prompt_ids))}))


def ctranslate2_generate(folder: Path, tokenizer, ending: list[int], threads: int, arguments):
    import ctranslate2

    model = ctranslate2.Generator(str(folder), device="cpu", intra_threads=threads)
    end_tokens = tokenizer.convert_ids_to_tokens(ending)

    def generate(prompt_ids: list[list[int]]) -> list[list[int]]:
        tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in prompt_ids]
        results = model.generate_batch(tokens, max_batch_size=arguments.batch_size, max_length=arguments.max_new_tokens,
                                       sampling_topk=0, end_token=end_tokens, include_prompt_in_result=False)
        return [result.sequences_ids[0] for result in results]

    return generate


def openvino_generate(folder: Path, tokenizer, ending: list[int], threads: int, arguments):
    import torch
    from optimum.intel import OVModelForCausalLM
    from transformers import GenerationConfig

    precision = {"float32": "f32", "bfloat16": "bf16"}.get(arguments.precision)
    model = OVModelForCausalLM.from_pretrained(folder, ov_config={
        "INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": "",
        **({"INFERENCE_PRECISION_HINT": precision} if precision else {})})
    config = GenerationConfig(max_new_tokens=arguments.max_new_tokens, do_sample=True, top_k=0, eos_token_id=ending,
                              pad_token_id=0)

    def generate(prompt_ids: list[list[int]]) -> list[list[int]]:
        outputs = []
        for start in range(0, len(prompt_ids), arguments.batch_size):  # padded batches, left-padded
            batch = prompt_ids[start : start + arguments.batch_size]
            longest = max(map(len, batch))
            ids = torch.tensor([[0] * (longest - len(ids)) + ids for ids in batch])
            mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in batch])
            outputs += model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, longest:].tolist()
        return outputs

    return generate


def _kept(tokens: list[int], ending: set[int]) -> list[int]:
    """A row's new tokens up to its end (the ending token kept), padding after it dropped."""
    for position, token in enumerate(tokens):
        if token in ending:
            return tokens[: position + 1]
    return tokens


if __name__ == "__main__":
    main()
