"""A real-sized dataset job on the CPU, on the user's clock (process start to exit, the model's load, every build and
compile included): accelgen's command line against a CTranslate2 script and an OpenVINO (optimum-intel) script doing
the same job, on the 0.5B Llama of cpu_peers.py's decode job (8 layers of TinyLlama's widths, float32 checkpoint),
each precision against each.

Shapes (--shape; prompts are runs of words of benchmarks/text/psalms.txt, drawn with a fixed seed):

    completions  48 rows of 8 to 150 words, 64 new tokens each (greedy, no end), batch 16
    prompts      48 rows of 100 to 300 words, 16 new tokens each (greedy, no end), batch 16: the prompts' prefill is
                 most of the work

Contenders, each run a process of its own, taking turns round by round (medians):

    accelgen_float32, accelgen_int8   ``accelgen run --model M --dataset rows.jsonl --output out.jsonl
                                      --max-new-tokens N --batch-size 16 --ignore-eos [--quantize int8]``, its defaults
                                      otherwise. With --cold, the caches a first job on a machine lacks are emptied
                                      before each run (the int8 weights kept between loads; inductor's compiled steps);
                                      the C++ kernels, built once per machine and torch, are kept
    ct2_float32, ct2_int8             a script: load the converted model (converted once, before the clock), tokenize,
                                      ``generate_batch(max_batch_size=16)``, detokenize, write JSON lines
    ov_float32, ov_int8               a script: ``OVModelForCausalLM.from_pretrained`` (compiled at load), batches of
                                      16 left-padded rows through ``generate``, detokenize, write JSON lines;
                                      ov_float32 computes in float32 (INFERENCE_PRECISION_HINT f32), ov_int8 as OpenVINO
                                      chooses (bfloat16 activations where the CPU has them)

    python benchmarks/cpu_dataset_job.py --peers-python /work/venv-peers/bin/python --shape completions --threads 1
    python benchmarks/cpu_dataset_job.py --peers-python /work/venv-peers/bin/python --shape prompts --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
CONTENDERS = ("accelgen_float32", "accelgen_int8", "ct2_float32", "ct2_int8", "ov_float32", "ov_int8")
#: words per prompt (smallest, largest) and new tokens per row
SHAPES = {"completions": ((8, 150), 64), "prompts": ((100, 300), 16)}
ROWS, BATCH = 48, 16

PEER_JOB = r"""
import json, os, sys
name, folder, rows_path, output, new_tokens, threads = sys.argv[1:7]
new_tokens, engine, precision = int(new_tokens), *name.split("_")
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(folder)
texts = [json.loads(line)["text"] for line in open(rows_path, encoding="utf-8")]
prompts = [tokenizer(text).input_ids for text in texts]
if engine == "ct2":
    import ctranslate2
    model = ctranslate2.Generator(os.path.join(folder, f"ct2-{precision}"), device="cpu", intra_threads=int(threads))
    results = model.generate_batch([tokenizer.convert_ids_to_tokens(prompt) for prompt in prompts], max_batch_size=16,
                                   max_length=new_tokens, min_length=new_tokens, sampling_topk=1,
                                   include_prompt_in_result=False)
    completions = [result.sequences_ids[0] for result in results]
else:
    import torch
    from optimum.intel import OVModelForCausalLM
    from transformers import GenerationConfig
    config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": ""}
    if precision == "float32":
        config["INFERENCE_PRECISION_HINT"] = "f32"
    model = OVModelForCausalLM.from_pretrained(os.path.join(folder, f"ov-{precision}"), ov_config=config)
    generation = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    completions = []
    for start in range(0, len(prompts), 16):
        batch = prompts[start : start + 16]
        longest = max(len(prompt) for prompt in batch)
        ids = torch.tensor([[0] * (longest - len(prompt)) + prompt for prompt in batch])
        mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in batch])
        completions += model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)[:, longest:].tolist()
with open(output, "w", encoding="utf-8") as out:
    for index, tokens in enumerate(completions):
        out.write(json.dumps({"index": index, "completion": tokenizer.decode(tokens), "tokens": len(tokens)}) + "\n")
"""


def write_rows(path: Path, words: tuple[int, int]) -> None:
    """``ROWS`` prompts of runs of words of psalms.txt, each of a length drawn between ``words`` (seeded)."""
    text = (HERE / "text" / "psalms.txt").read_text(encoding="utf-8").split()
    draw = random.Random(0)
    with open(path, "w", encoding="utf-8") as rows:
        for _ in range(ROWS):
            length = draw.randint(*words)
            start = draw.randrange(len(text) - length)
            rows.write(json.dumps({"text": " ".join(text[start : start + length])}) + "\n")


def run_job(name: str, folder: Path, rows: Path, scratch: Path, arguments, new_tokens: int) -> float:
    """One job, process start to exit: seconds (its output checked: every row, with the tokens asked for)."""
    engine, precision = name.split("_")
    output = scratch / f"{name}.jsonl"
    output.unlink(missing_ok=True)
    environment = dict(os.environ, OMP_NUM_THREADS=str(arguments.threads), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_VERBOSITY="error", ACCELGEN_WEIGHTS_CACHE=str(scratch / "kept-int8"))
    if engine == "accelgen":
        if arguments.cold:
            shutil.rmtree(scratch / "kept-int8", ignore_errors=True)
            shutil.rmtree(scratch / "inductor", ignore_errors=True)
        environment["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
        command = [sys.executable, "-m", "accelgen.cli", "run", "--model", str(folder), "--dataset", str(rows),
                   "--output", str(output), "--max-new-tokens", str(new_tokens), "--batch-size", str(BATCH),
                   "--ignore-eos", "--quiet", *(["--quantize", "int8"] if precision == "int8" else [])]
    else:
        command = [arguments.peers_python, "-c", PEER_JOB, name, str(folder), str(rows), str(output), str(new_tokens),
                   str(arguments.threads)]
    started = time.perf_counter()
    result = subprocess.run(command, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"{name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    written = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    if len(written) != ROWS:
        raise SystemExit(f"{name} wrote {len(written)} rows of {ROWS}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers-python", help="the Python of the peers' virtual environment (CTranslate2, OpenVINO)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--shape", choices=SHAPES, default="completions")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="accelgen without the caches a first job lacks")
    parser.add_argument("--folder", help="the 0.5B model's folder, kept between runs (default: built in a scratch folder)")
    arguments = parser.parse_args()
    names = arguments.contenders.split(",")
    peers = [name for name in names if not name.startswith("accelgen")]
    if peers and not arguments.peers_python:
        raise SystemExit("--peers-python is needed for " + ", ".join(peers))
    scratch = Path(tempfile.mkdtemp(prefix="cpu-dataset-job-"))
    try:
        sys.path.insert(0, str(HERE))
        from cpu_peers import half_billion_model

        folder = half_billion_model(arguments.folder, scratch, arguments.peers_python, peers)
        words, new_tokens = SHAPES[arguments.shape]
        rows = scratch / "rows.jsonl"
        write_rows(rows, words)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for round_number in range(arguments.rounds):
            for name in names:
                seconds[name].append(run_job(name, folder, rows, scratch, arguments, new_tokens))
            print(f"round {round_number + 1}: " + ", ".join(f"{name} {runs[-1]:.1f} s" for name, runs in seconds.items()),
                  file=sys.stderr, flush=True)
        medians = {name: statistics.median(runs) for name, runs in seconds.items()}
        print(f"\n{arguments.shape}: {ROWS} rows of {words[0]}-{words[1]} words, {new_tokens} new tokens each, batch "
              f"{BATCH}; {arguments.threads} thread(s){', accelgen cold' if arguments.cold else ''}; medians of "
              f"{arguments.rounds}\n")
        print("| contender | job, s | accelgen's speed against it |")
        print("| --- | ---: | ---: |")
        for name, median in medians.items():
            precision = name.split("_")[1]
            ours = medians.get(f"accelgen_{precision}")
            ratio = "" if ours is None or name.startswith("accelgen") else f"{median / ours:.2f}x"
            print(f"| {name} | {median:.1f} | {ratio} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
