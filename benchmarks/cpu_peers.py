"""accelgen on the CPU against the engines a CPU user turns to: CTranslate2, OpenVINO (through optimum-intel) and
Hugging Face, on the same checkpoints, prompts and token ids, with the same number of threads.

Two jobs:

    dataset  dataset completion: dataset_throughput.py's workload (a 4-layer, hidden-256 random Llama; prompts of 3
             to 40 words; sampled completions ending at an "ending set" of tokens, about --mean-length long), batch
             16: kept tokens per second of generation (the model loaded before the clock starts)
    decode   batch 1: a 16-token prompt and --decode-tokens greedy tokens (no end) on 8 layers of TinyLlama's widths
             (hidden 2048, 32 heads, 4 key/value heads; about 0.5B parameters): ms per decoded token, and the first
             token's time (a run of one new token)

Contenders (each measurement a process of its own; contenders interleaved round by round; medians):

    accelgen_float32,                 accelgen (continuous batching); int8: int8 weights, rows quantized as they come
    accelgen_bfloat16, accelgen_int8  (bfloat16 activations).
                                      The dataset job's decode step compiled (--graphs), as a dataset job long enough
                                      for the compile to pay gets it by default: the 192 rows stand for such a job, the
                                      compile made in the warm-up, off the clock (as OpenVINO compiles its model at
                                      load); the batch-1 job eager, as a one-prompt run is
    hf_float32                        Hugging Face: generate_batch() for the dataset, generate() at batch 1
    ct2_float32, ct2_bfloat16,        CTranslate2 Generator (converted with ct2-transformers-converter)
    ct2_int8
    ov_float32, ov_bfloat16, ov_int8  OpenVINO through optimum-intel (exported with optimum-cli; int8: weight-only).
                                      OpenVINO computes in bfloat16 wherever the CPU has bfloat16 instructions,
                                      float32 models included, unless told otherwise: ov_float32 is told to compute
                                      in float32 (INFERENCE_PRECISION_HINT f32), ov_bfloat16 in bfloat16, so that
                                      each row of the table computes in the precision it names; ov_int8 keeps
                                      OpenVINO's default (bfloat16 activations on such a CPU)

The peers run in a virtual environment of their own, never the test suite's:

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install torch==2.13.0 ctranslate2 "optimum-intel[openvino]"
    .venv-peers/bin/pip uninstall -y torchvision   # pulled in built for another torch: it breaks transformers' imports
    python benchmarks/cpu_peers.py --peers-python .venv-peers/bin/python                 # both jobs, 1 thread
    python benchmarks/cpu_peers.py --peers-python .venv-peers/bin/python --jobs dataset --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
CONTENDERS = ("accelgen_float32", "accelgen_bfloat16", "accelgen_int8", "hf_float32", "ct2_float32", "ct2_bfloat16",
              "ct2_int8", "ov_float32", "ov_bfloat16", "ov_int8")
#: OpenVINO's inference precision for each contender (None: its own default)
OPENVINO_PRECISION = {"float32": "f32", "bfloat16": "bf16", "int8": None}
PROMPT_TOKENS = 16


# -- the work, written once for every contender -----------------------------------------------------------------


def prepare(job: str, scratch: Path, arguments) -> Path:
    """The job's model folder and its ``work.json`` (token ids of the prompts, the ending set, the settings)."""
    import torch
    from dataset_throughput import build_workload
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer

    folder = scratch / job
    if job == "dataset":
        workload = argparse.Namespace(hidden=256, layers=4, heads=8, workload="varied", mean_length=arguments.mean_length,
                                      prompts=arguments.prompts, prefix_tokens=0, long_tokens=0)
        prompts_of, ending = build_workload(workload, folder)
        tokenizer = load_tokenizer(str(folder))
        prompts = [tokenizer(prompt).input_ids for prompt in prompts_of(0)]
        work = {"prompts": prompts, "ending": ending, "max_new_tokens": arguments.max_new_tokens,
                "batch_size": arguments.batch_size}
    else:
        tokenizer = load_tokenizer(str(DEFAULT_MODEL))
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        GenerationConfig(eos_token_id=None, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
                         ).save_pretrained(folder)
        prompt = list(range(100, 100 + PROMPT_TOKENS))
        work = {"prompts": [prompt], "ending": [], "max_new_tokens": arguments.decode_tokens, "batch_size": 1}
    (folder / "work.json").write_text(json.dumps(work))
    return folder


def convert(folder: Path, peers_python: str, names: list[str]) -> None:
    """The peers' own forms of the checkpoint, beside it: ``ct2-float32``, ``ct2-int8``, ``ov-float32``, ...
    (OpenVINO's bfloat16 is its float32 export, computed in bfloat16)."""
    bin_folder = Path(peers_python).parent
    for name in names:
        engine, precision = name.split("_")
        target = folder / f"{engine}-{precision}"
        if engine == "ct2":
            command = [str(bin_folder / "ct2-transformers-converter"), "--model", str(folder), "--output_dir",
                       str(target), "--quantization", precision, "--force"]
        elif engine == "ov":
            command = [str(bin_folder / "optimum-cli"), "export", "openvino", "--model", str(folder), "--task",
                       "text-generation-with-past", "--weight-format", "int8" if precision == "int8" else "fp32",
                       str(target)]
        else:
            continue
        subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def half_billion_model(folder: str | None, scratch: Path, peers_python: str | None, peers: list[str]) -> Path:
    """The decode job's 0.5B model in ``folder`` (built there when it holds none; in ``scratch`` without one), with the
    peers' converted forms of it that it lacks (for cpu_load.py and cpu_dataset_job.py, which keep it between runs)."""
    import shutil

    kept = Path(folder) if folder else None
    if kept is None or not (kept / "config.json").is_file():
        made = prepare("decode", scratch, argparse.Namespace(decode_tokens=1))
        kept = Path(shutil.move(str(made), str(kept))) if kept else made
    if peers:
        convert(kept, peers_python, [name for name in peers if not (kept / name.replace("_", "-")).exists()])
    return kept


# -- one measurement, in a worker process -----------------------------------------------------------------------


def kept_length(tokens: list[int], ending: set[int]) -> int:
    for position, token in enumerate(tokens):
        if token in ending:
            return position + 1
    return len(tokens)


def run_worker(name: str, folder: Path, new_tokens: int | None) -> dict:
    """Generate the work once to warm up, then once on the clock: generation seconds and kept tokens. The warm-up is
    the whole work with each prompt's tokens reversed: the same lengths, so that a compiled step has met every shape
    the run meets (accelgen's slots grow with the longest prompt met) before the clock starts, and other beginnings,
    so that no engine finds the prompts on the clock already computed: accelgen keeps prompts' 16-token blocks for
    reuse, and warmed up on the same prompts its timed run found most of them stored, which a real job, each prompt
    once, never does (RESULTS-log.md, "Twelfth run")."""
    work = json.loads((folder / "work.json").read_text())
    ending = set(work["ending"])
    max_new = new_tokens or work["max_new_tokens"]
    generate = GENERATORS[name.split("_")[0]](name, folder, work, max_new)
    generate([prompt[::-1] for prompt in work["prompts"]])
    started = time.perf_counter()
    outputs = generate(work["prompts"])
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "kept_tokens": sum(kept_length(tokens, ending) for tokens in outputs)}


def accelgen_generator(name, folder, work, max_new):
    import accelgen

    int8 = name.endswith("int8")
    generator = accelgen.load(str(folder), device="cpu", dtype="float32" if name.endswith("float32") else "bfloat16",
                              quantize="int8" if int8 else None, batch_size=work["batch_size"], max_new_tokens=max_new,
                              do_sample=bool(work["ending"]), seed=0, ignore_eos=not work["ending"],
                              graphs=True if work["ending"] else None)

    def generate(prompts):  # the token ids the other contenders get (a text's round trip may give others)
        return [tokens for tokens, _ in generator.generate_token_ids(prompts)]

    return generate


def hugging_face_generator(name, folder, work, max_new):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sampled = bool(work["ending"])
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=0 if sampled else max_new, do_sample=sampled,
                              top_k=0, eos_token_id=work["ending"] or None, pad_token_id=0)

    def generate(prompts):
        with torch.no_grad():
            if len(prompts) == 1:
                output = model.generate(torch.tensor(prompts), generation_config=config)
                return [output[0, len(prompts[0]):].tolist()]
            outputs = model.generate_batch(inputs=prompts, generation_config=config)
            return [output.generated_tokens for output in outputs.values()]

    return generate


def ctranslate2_generator(name, folder, work, max_new):
    import ctranslate2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    model = ctranslate2.Generator(str(folder / name.replace("_", "-")), device="cpu", intra_threads=threads)
    ending = [tokenizer.convert_ids_to_tokens(token) for token in work["ending"]]
    sampled = bool(ending)

    def generate(prompts):
        tokens = [tokenizer.convert_ids_to_tokens(prompt) for prompt in prompts]
        results = model.generate_batch(tokens, max_batch_size=work["batch_size"], max_length=max_new,
                                       min_length=0 if sampled else max_new, sampling_topk=0 if sampled else 1,
                                       end_token=ending or [], include_prompt_in_result=False)
        return [result.sequences_ids[0] for result in results]

    return generate


def openvino_generator(name, folder, work, max_new):
    import torch
    from optimum.intel import OVModelForCausalLM
    from transformers import GenerationConfig

    threads = os.environ.get("OMP_NUM_THREADS", "1")
    precision = OPENVINO_PRECISION[name.split("_")[1]]
    model = OVModelForCausalLM.from_pretrained(folder / name.replace("_", "-"), ov_config={
        "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": "",
        **({"INFERENCE_PRECISION_HINT": precision} if precision else {})})
    sampled = bool(work["ending"])
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=0 if sampled else max_new, do_sample=sampled,
                              top_k=0, eos_token_id=work["ending"] or None, pad_token_id=0)

    def generate(prompts):
        outputs = []
        for start in range(0, len(prompts), work["batch_size"]):  # padded batches, left-padded
            batch = prompts[start : start + work["batch_size"]]
            longest = max(len(prompt) for prompt in batch)
            ids = torch.tensor([[0] * (longest - len(prompt)) + prompt for prompt in batch])
            mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in batch])
            output = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            outputs += output[:, longest:].tolist()
        return outputs

    return generate


GENERATORS = {"accelgen": accelgen_generator, "hf": hugging_face_generator, "ct2": ctranslate2_generator,
              "ov": openvino_generator}


# -- the run ----------------------------------------------------------------------------------------------------


def measure(name: str, folder: Path, arguments, new_tokens: int | None = None) -> dict:
    python = sys.executable if name.split("_")[0] in ("accelgen", "hf") else arguments.peers_python
    threads = str(arguments.threads)
    environment = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    command = [python, str(Path(__file__).resolve()), "--worker", name, "--folder", str(folder)]
    if new_tokens is not None:
        command += ["--new-tokens", str(new_tokens)]
    result = _run_worker_process(command, environment, arguments.worker_timeout)
    if result.returncode:  # Hugging Face's generate_batch has failed, and hung, once in a while: once more
        print(f"{name} failed (exit {result.returncode}); measuring it again", file=sys.stderr)
        result = _run_worker_process(command, environment, arguments.worker_timeout)
    if result.returncode:
        raise SystemExit(f"{name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _run_worker_process(command: list[str], environment: dict, timeout: float) -> subprocess.CompletedProcess:
    """The worker's run; one that runs past ``timeout`` seconds is killed and counts as failed (exit -9)."""
    try:
        return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr or ""
        return subprocess.CompletedProcess(command, -9, "", f"{stderr}\nkilled after {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers-python", help="the Python of the peers' virtual environment (CTranslate2, OpenVINO)")
    parser.add_argument("--jobs", default="dataset,decode")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mean-length", type=int, default=40)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--worker-timeout", type=float, default=600, help="seconds one measurement may take")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(run_worker(arguments.worker, Path(arguments.folder), arguments.new_tokens)))
        return
    names = arguments.contenders.split(",")
    peers = [name for name in names if name.split("_")[0] in ("ct2", "ov")]
    if peers and not arguments.peers_python:
        parser.error(f"{', '.join(peers)} need --peers-python (see this script's instructions), or leave them out "
                     f"with --contenders")
    with tempfile.TemporaryDirectory() as scratch:
        for job in arguments.jobs.split(","):
            folder = prepare(job, Path(scratch), arguments)
            if peers:
                convert(folder, arguments.peers_python, peers)
            figures = {name: [] for name in names}
            for _ in range(arguments.rounds):
                for name in names:
                    if job == "dataset":
                        run = measure(name, folder, arguments)
                        figures[name].append((run["kept_tokens"] / run["seconds"],))
                    else:
                        whole, first = measure(name, folder, arguments), measure(name, folder, arguments, new_tokens=1)
                        per_token = 1000 * (whole["seconds"] - first["seconds"]) / (whole["kept_tokens"] - 1)
                        figures[name].append((per_token, 1000 * first["seconds"]))
            report(job, figures, arguments)


def report(job: str, figures: dict, arguments) -> None:
    print(f"\n{job}, {arguments.threads} thread(s), medians of {arguments.rounds} round(s)")
    if job == "dataset":
        print(f"{arguments.prompts} rows, batch {arguments.batch_size}, sampled, cap {arguments.max_new_tokens}")
        print("| contender | kept tokens/s |\n|---|---:|")
        for name, rows in figures.items():
            print(f"| {name} | {statistics.median(row[0] for row in rows):,.0f} |")
    else:
        print(f"batch 1, {PROMPT_TOKENS}-token prompt, {arguments.decode_tokens} greedy tokens")
        print("| contender | ms/token | first token ms |\n|---|---:|---:|")
        for name, rows in figures.items():
            print(f"| {name} | {statistics.median(row[0] for row in rows):.1f} | "
                  f"{statistics.median(row[1] for row in rows):.0f} |")


if __name__ == "__main__":
    main()
