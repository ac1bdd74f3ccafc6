"""The core's own decode step compiled ahead of time by AOTInductor, in place of ``torch.jit.trace``, in a whole job: the
evidence for the trace's successor (RESULTS-log.md, "The traced step's successor").

Two jobs of ``accelgen run`` on one random Llama and dataset, each a process: one as the CPU plugin runs it (the step
traced), one in which the plugin's tracer is replaced, for this process only, by ``torch.export.export(step, buffers,
strict=True)``, ``aoti_compile_and_package`` and ``aoti_load_package``, the package's constants then handed the step's
own tensors (``load_constants(..., user_managed=True)``: the weights and the cache the engine writes, not copies
baked into the package). Printed: each job's decode ms per step (``--details``), the seconds to make the compiled step,
and whether every row's tokens are the same.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/aot_decode_step.py
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/aot_decode_step.py --quantize int8
    OMP_NUM_THREADS=1 python benchmarks/aot_decode_step.py --layers 8 --hidden 512 --rows 64 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there one all we their").split()


def compiled_step(step, inputs, scratch: str):
    """``step`` exported and compiled by AOTInductor over ``inputs``, its constants the step's own tensors."""
    import torch

    started = time.perf_counter()
    before = [tensor.clone() for tensor in inputs]
    program = torch.export.export(step, tuple(inputs), strict=True)
    for tensor, value in zip(inputs, before):  # what export's runs of the step wrote, undone
        tensor.copy_(value)
    package = torch._inductor.aoti_compile_and_package(program, package_path=f"{scratch}/step-{id(step)}.pt2")
    compiled = torch._inductor.aoti_load_package(package)
    state = dict(step.named_parameters()) | dict(step.named_buffers())
    names = compiled.get_constant_fqns()
    # Tensors the step reads but does not hold as its state (export's "_tensor_constant"s) stay the package's copies:
    # right for what no one writes (the int8 layers' product scales, kept in closures), wrong for anything written.
    own = [name for name in names if name not in state]
    compiled.load_constants({name: state[name] for name in names if name in state}, check_full_update=False,
                            user_managed=True)
    print(f"compiled step made in {time.perf_counter() - started:.1f} s; {len(names) - len(own)} constants the step's "
          f"own tensors, {len(own)} copies in the package", file=sys.stderr)
    return compiled


def worker(arguments: list[str], scratch: str) -> int:
    """``accelgen run arguments`` with the CPU plugin's tracer replaced by :func:`compiled_step` (a step it cannot
    compile runs as it is, as a step the tracer refuses does: the failure is printed)."""
    import accelgen_cpu

    def compile_or_say(step, inputs):
        try:
            return compiled_step(step, inputs, scratch)
        except Exception as error:
            print(f"no compiled step: {type(error).__name__}: {str(error).strip().splitlines()[0][:300]}",
                  file=sys.stderr)
            raise

    accelgen_cpu.traced = compile_or_say
    from accelgen.cli import main as accelgen_main

    return accelgen_main(["run", *arguments])


def job(folder: Path, model: Path, rows: Path, kind: str, arguments) -> tuple[float, float | None, list]:
    """(decode ms per step, seconds to make the compiled step or None, each row's token ids) of one job."""
    output = folder / f"out-{kind}.jsonl"
    run = ["--device", "cpu", "--model", str(model), "--dataset", str(rows), "--column", "prompt", "--output",
           str(output), "--overwrite", "--max-new-tokens", str(arguments.max_new_tokens), "--ignore-eos",
           "--batch-size", str(arguments.batch_size), "--quiet", "--details",
           *(["--quantize", arguments.quantize] if arguments.quantize else [])]
    command = ([sys.executable, __file__, "--worker", str(folder), *run] if kind == "aot"
               else [sys.executable, "-m", "accelgen.cli", "run", *run])
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        sys.exit(f"the {kind} job failed: {finished.stderr.strip().splitlines()[-3:]}")
    step_ms = float(re.search(r"decode ([\d.]+) ms/step", finished.stderr)[1])
    made = re.search(r"compiled step made in ([\d.]+) s; (.*)", finished.stderr)
    if made:
        print(f"{kind}: {made[2]}")
    failure = re.search(r"no compiled step: .*", finished.stderr)
    if kind == "aot" and failure:
        print(failure[0])
    tokens = [json.loads(line)["completion_token_ids"] for line in output.read_text().splitlines()]
    return step_ms, (float(made[1]) if made else None), tokens


def build(folder: Path, arguments) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from accelgen.common.settings import DEFAULT_MODEL
    from accelgen.loading.model_files import load_tokenizer

    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=arguments.hidden,
                         intermediate_size=arguments.hidden * 8 // 3, num_hidden_layers=arguments.layers,
                         num_attention_heads=arguments.hidden // 64, num_key_value_heads=arguments.hidden // 64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = folder / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    draw = random.Random(0)
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": " ".join(draw.choice(WORDS) for _ in range(draw.randint(3, 40)))})
                            + "\n" for _ in range(arguments.rows)))
    return model, rows


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[3:], sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quantize", choices=["int8"], help="both jobs with --quantize int8")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model, rows = build(folder, arguments)
        traced_ms, _, traced_tokens = job(folder, model, rows, "traced", arguments)
        aot_ms, made_s, aot_tokens = job(folder, model, rows, "aot", arguments)
    same = sum(left == right for left, right in zip(traced_tokens, aot_tokens))
    print(f"{arguments.rows} rows, batch {arguments.batch_size}, {arguments.max_new_tokens} new tokens, "
          f"{arguments.layers} layers x {arguments.hidden}, {arguments.quantize or 'float32'}")
    made = "the step ran as it is" if made_s is None else f"compiled step made in {made_s:.1f} s"
    print(f"decode ms/step: traced {traced_ms:.2f}, AOTInductor job {aot_ms:.2f} ({made})")
    print(f"rows with the same tokens: {same} of {len(traced_tokens)}")


if __name__ == "__main__":
    main()
