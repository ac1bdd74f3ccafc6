"""Today's model families on the CPU against Llama: kept tokens/s of a Qwen2-, a Mistral- and a Mixtral-shaped model
against a Llama of the same widths, in the same run, interleaved round by round (the order reversed every other round,
so that none always runs after the same one), medians reported.

Each family is a random-weight checkpoint of the same widths (``--hidden`` 512, ``--layers`` 8, ``--heads`` 8,
``--kv-heads`` 4, ``--intermediate`` 1408, ``--vocab`` 4096 by default), built from its config with transformers' Auto
classes, seeded, saved with ``save_pretrained`` (safetensors) beside the built-in model's tokenizer (nothing is
downloaded); untied heads and the same position limit for all:

    llama    LlamaConfig: the reference every ratio is taken to
    qwen2    Qwen2Config: Llama's layers with biases on the query, key and value projections, as the family has them
    mistral  MistralConfig with a sliding window of ``--sliding-window`` (256) positions: shorter than long prompts, so
             the model runs with its sliding-window masks; this workload's rows (a prompt of at most 40 words and
             ``--max-new-tokens``) fit inside it unless the cap is raised past it
    mixtral  MixtralConfig: ``--experts`` (4) experts, ``--experts-per-token`` (2) of them per token, each expert's
             intermediate width ``--intermediate`` / ``--experts-per-token`` (704), so that the MLP parameters a token
             uses equal the Llama's

The prompts are dataset_throughput.py's (``--prompts``, 64 of 3 to 40 words of the tokenizer's vocabulary, seeded),
other words each round (a warm engine's store of prompt prefixes must not find the round before's), the same for every
family within a round; every row generates ``--max-new-tokens`` tokens (ignore EOS), so every family does the same work.
Two figures per family, both printed:

    user's clock  the wall time of a whole ``accelgen run --device cpu --model FOLDER --dataset rows.jsonl --batch-size 16
                  --max-new-tokens N --ignore-eos --output out.jsonl --overwrite`` in a process of its own, everything
                  else its default (inductor's cache empty, so any compile or capture the job chooses is on the clock),
                  over the round's prompts; kept tokens are the completion tokens the output holds. The plugin's kernels and accelgen's bytecode
                  are built once before any round, off the clock, as cpu_user_clock.py does.
    warm engine   ``accelgen.load(FOLDER, device="cpu", batch_size=16, max_new_tokens=N, ignore_eos=True)`` once per
                  family, one ``generate`` of prompts of their own off the clock (captures, compile, allocator), then
                  ``generate(prompts)`` of the round's prompts timed each round.

Reported per family: median kept tokens/s on each clock, its ratio to Llama's, marked within 10% or not; for a family
with experts also the ratio per active parameter: tokens/s x the parameters a token uses (attention, norms, router,
embeddings, head, and ``--experts-per-token`` of ``--experts`` experts: the experts' tensors scaled by that share) over
Llama's tokens/s x Llama's parameters.

    python benchmarks/families.py                                    # 4 families, 3 rounds, 64 new tokens, 1 thread
    python benchmarks/families.py --families llama,mixtral --threads 2
    python benchmarks/families.py --rounds 1 --max-new-tokens 8 --layers 2 --hidden 128 --intermediate 352 --prompts 16
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

import torch
from cpu_user_clock import compile_bytecode
from dataset_throughput import build_workload, output_rows
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

import accelgen
from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer

FAMILIES = ("llama", "qwen2", "mistral", "mixtral")
REFERENCE = "llama"
#: A family runs "as fast as Llama" when its ratio to Llama's tokens/s is this close to 1.
CLOSE_ENOUGH = 0.10


def family_config(family: str, arguments, tokenizer):
    """The config of ``family`` at the widths asked for, with the tokenizer's special tokens."""
    sizes = dict(vocab_size=arguments.vocab, hidden_size=arguments.hidden, num_hidden_layers=arguments.layers,
                 num_attention_heads=arguments.heads, num_key_value_heads=arguments.kv_heads,
                 intermediate_size=arguments.intermediate, max_position_embeddings=arguments.positions,
                 tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    if family == "mistral":
        sizes["sliding_window"] = arguments.sliding_window
    if family == "mixtral":  # each expert the share of Llama's MLP that keeps a token's active MLP parameters equal
        sizes |= dict(num_local_experts=arguments.experts, num_experts_per_tok=arguments.experts_per_token,
                      intermediate_size=arguments.intermediate // arguments.experts_per_token)
    return AutoConfig.for_model(family, **sizes)


def active_parameters(model: torch.nn.Module) -> tuple[int, float]:
    """(all the model's parameters, those one token uses): an expert's tensors count by the share of experts a token
    is sent to; everything else (attention, norms, router, embeddings, head) whole."""
    config = model.config
    share = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_local_experts", 1)
    counted = [(parameter.numel(), ".experts." in name) for name, parameter in model.named_parameters()]
    return sum(count for count, _ in counted), sum(count * (share if expert else 1) for count, expert in counted)


def build_family(family: str, folder: Path, arguments, tokenizer) -> tuple[int, float]:
    """``family``'s random-weight checkpoint saved in ``folder`` with the tokenizer; its (all, active) parameters."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, arguments, tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return active_parameters(model)


def user_clock_job(folder: Path, dataset: Path, scratch: Path, arguments) -> tuple[float, int]:
    """Wall seconds of one ``accelgen run`` over ``dataset`` as a user types it, from its start to its exit, and the
    completion tokens its output holds."""
    output = scratch / f"out-{folder.name}.jsonl"
    environment = dict(os.environ, OMP_NUM_THREADS=str(arguments.threads), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_VERBOSITY="error",
                       TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=scratch / "inductor"))  # any compile on the clock
    command = [str(Path(sys.executable).parent / "accelgen"), "run", "--device", "cpu", "--model", str(folder),
               "--dataset", str(dataset), "--batch-size", str(arguments.batch_size),
               "--max-new-tokens", str(arguments.max_new_tokens), "--ignore-eos", "--output", str(output), "--overwrite"]
    started = time.perf_counter()
    job = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=arguments.job_timeout)
    seconds = time.perf_counter() - started
    if job.returncode:
        raise SystemExit(f"accelgen run of {folder.name} failed (exit {job.returncode}):\n{job.stderr[-3000:]}")
    return seconds, sum(len(row["completion_token_ids"]) for row in output_rows(output))


def warm_engine(folder: Path, warm_up_prompts: list[str], arguments):
    """``folder`` loaded once and warmed by one run of ``warm_up_prompts``; a run of a round's prompts: (seconds,
    completion tokens)."""
    generator = accelgen.load(str(folder), device="cpu", batch_size=arguments.batch_size,
                              max_new_tokens=arguments.max_new_tokens, ignore_eos=True)
    generator.generate(warm_up_prompts)  # captures, compile, allocator: off the clock

    def run(prompts: list[str]) -> tuple[float, int]:
        started = time.perf_counter()
        completions = generator.generate(prompts)
        seconds = time.perf_counter() - started
        return seconds, sum(len(completion.completion_token_ids) for completion in completions)

    return run


def closeness(ratio: float) -> str:
    """``ratio`` to Llama's, and whether it is within :data:`CLOSE_ENOUGH` of 1 (else which way it is off)."""
    if abs(ratio - 1) <= CLOSE_ENOUGH:
        verdict = f"within {CLOSE_ENOUGH:.0%}"
    else:
        verdict = f"{'slower' if ratio < 1 else 'faster'} by more than {CLOSE_ENOUGH:.0%}"
    return f"{ratio:.2f}x, {verdict}"


def report(results: dict, parameters: dict, arguments) -> None:
    """The Markdown table: per family, each clock's median kept tokens/s and its ratio to Llama's."""
    print(f"\n{arguments.prompts} prompts of 3-40 words (other words each round), batch {arguments.batch_size}, "
          f"{arguments.max_new_tokens} new tokens a row (ignore EOS); {arguments.layers} layers x {arguments.hidden}, "
          f"{arguments.heads} heads ({arguments.kv_heads} key/value), intermediate {arguments.intermediate}, vocabulary "
          f"{arguments.vocab}; float32 on cpu, {arguments.threads} thread(s) a job, {torch.get_num_threads()} in the warm "
          f"engines, {os.cpu_count()} cores; medians of {arguments.rounds} round(s), load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print("| family | parameters (a token uses) | user's clock kept tokens/s | job s | vs llama | warm engine kept tokens/s "
          "| vs llama | per active parameter vs llama (user's clock / warm engine) | kept tokens a run |")
    print("|---|---:|---:|---:|---|---:|---|---|---:|")
    medians = {family: {clock: statistics.median(tokens / seconds for seconds, tokens in runs[clock])
                        for clock in ("user", "warm")} for family, runs in results.items()}
    reference_parameters = parameters[REFERENCE][0]
    for family, runs in results.items():
        total, active = parameters[family]
        ratios = {clock: medians[family][clock] / medians[REFERENCE][clock] for clock in ("user", "warm")}
        per_parameter = ""
        if active != total:  # experts: only some of the weights work for each token
            per_parameter = " / ".join(closeness(ratios[clock] * active / reference_parameters) for clock in ("user", "warm"))
        kept = {tokens for clock in ("user", "warm") for _, tokens in runs[clock]}
        print(f"| {family} | {total / 1e6:.2f} M ({active / 1e6:.2f} M) | {medians[family]['user']:,.0f} | "
              f"{statistics.median(seconds for seconds, _ in runs['user']):.2f} | {closeness(ratios['user'])} | "
              f"{medians[family]['warm']:,.0f} | {closeness(ratios['warm'])} | {per_parameter} | "
              f"{', '.join(f'{count:,}' for count in sorted(kept))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}; "
                                                                        f"{REFERENCE} among them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each job, torch's threads here")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1408, help="the MLP's width (Mixtral: over its experts)")
    parser.add_argument("--vocab", type=int, default=4096, help="at least the built-in tokenizer's vocabulary")
    parser.add_argument("--positions", type=int, default=2048, help="every family's max_position_embeddings")
    parser.add_argument("--sliding-window", type=int, default=256, help="Mistral's window")
    parser.add_argument("--experts", type=int, default=4, help="Mixtral's experts")
    parser.add_argument("--experts-per-token", type=int, default=2, help="Mixtral's experts per token")
    parser.add_argument("--work-dir", help="where the models, rows and outputs go (default: a temporary folder)")
    parser.add_argument("--job-timeout", type=float, default=1800, help="seconds one accelgen run may take")
    arguments = parser.parse_args()
    families = arguments.families.split(",")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {', '.join(sorted(unknown))}; the families are {', '.join(FAMILIES)}")
    if REFERENCE not in families:
        parser.error(f"--families needs {REFERENCE}: every ratio is taken to it")
    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    if arguments.vocab < len(tokenizer):
        parser.error(f"--vocab {arguments.vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    torch.set_num_threads(arguments.threads)
    transformers_logging.disable_progress_bar()  # save_pretrained's bar, once per family, between the progress lines
    subprocess.run([str(Path(sys.executable).parent / "accelgen"), "devices", "--prepare"], check=True,
                   capture_output=True)  # the kernels built once per machine, off every clock
    compile_bytecode(None)

    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(arguments.work_dir or temporary)
        (scratch / "inductor").mkdir(parents=True, exist_ok=True)
        # dataset_throughput's prompts of each round (-1: the warm-up's); the small model it saves beside them is not used
        workload = argparse.Namespace(hidden=64, layers=1, heads=1, workload="varied", mean_length=40,
                                      prompts=arguments.prompts, prefix_tokens=0, long_tokens=0)
        prompts_of, _ = build_workload(workload, scratch / "prompts")
        parameters, engines = {}, {}
        for family in families:
            parameters[family] = build_family(family, scratch / family, arguments, tokenizer)
            engines[family] = warm_engine(scratch / family, prompts_of(-1), arguments)
        results = {family: {"user": [], "warm": []} for family in families}
        dataset = scratch / "rows.jsonl"
        for round_number in range(arguments.rounds):
            prompts = prompts_of(round_number)
            dataset.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in prompts), encoding="utf-8")
            for family in families if round_number % 2 == 0 else families[::-1]:  # each goes first and last alike
                results[family]["user"].append(user_clock_job(scratch / family, dataset, scratch, arguments))
                results[family]["warm"].append(engines[family](prompts))
                (job_seconds, _), (engine_seconds, _) = results[family]["user"][-1], results[family]["warm"][-1]
                print(f"round {round_number + 1} {family}: job {job_seconds:.1f} s, warm engine {engine_seconds:.2f} s "
                      f"(load average {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    report(results, parameters, arguments)


if __name__ == "__main__":
    main()
