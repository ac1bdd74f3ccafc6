"""Dataset jobs on the user's clock: ``accelgen run`` typed as a user types it, against CTranslate2 (and OpenVINO, when
asked) run the same way, each job a process of its own timed from its start to its exit (imports, loading, the
kernels' load, any compile, every row written), contenders interleaved round by round, medians.

Shapes (``--shapes``; each a random-weight Llama of 4 layers x 256, dataset_throughput.py's model, its generation
config ending a row at any token of an "ending set" so that sampled completions end after about the shape's mean):

    short-200     200 rows, prompts of 3 to 40 words, completions of mean ~40 tokens (cap 128)
    short-4000    4,000 rows, as short-200 (long enough for accelgen's compile to be its default)
    long-200      200 rows, completions of mean ~200 tokens (cap 512)
    long-4000     4,000 rows, as long-200 (not run by default: about 800,000 tokens a job)
    prompts-200   200 rows, prompts of 300 to 1,000 tokens, completions of mean ~20 tokens (cap 64): prompt-heavy

Contenders (``--contenders``):

    accelgen_float32_cold, accelgen_int8_cold   ``accelgen run --device cpu --model M --dataset rows.jsonl --column
                                                prompt --output out.jsonl --batch-size 16 --max-new-tokens CAP
                                                --do-sample --seed 0`` (int8: ``--quantize int8``), everything else
                                                its default; inductor's cache empty (a fresh TORCHINDUCTOR_CACHE_DIR):
                                                a compile, when the job gets one, costs its whole price
    accelgen_float32_warm, accelgen_int8_warm   the same with the cache an earlier job of the same model and settings
                                                filled (one run of the job with ``--graphs``, off the clock)
    accelgen_float32_eager, accelgen_int8_eager the same job run eagerly (``--no-graphs``): what a first job on a fresh
                                                machine must never be slower than
    ct2_float32, ct2_int8                       peer_job.py ct2 (CTranslate2's Generator, generate_batch, batches of 16)
    ov_float32, ov_int8                         peer_job.py ov (OpenVINO through optimum-intel, batches of 16)

With ``--baseline-path DIR``, each accelgen contender may also run as ``base_<name>``: the same command with
accelgen imported from DIR (a folder holding ``accelgen`` and ``accelgen_cpu``, copied from the commit before a change),
interleaved with the others, so that a change is measured against the code before it in the same run. The code before
runs as ``python -m accelgen.cli`` (what ``accelgen`` runs, found on the path the script installed here may not name).

The peers' models are converted before any round (``cpu_peers.convert``), off the clock, as a user converts once.
The plugin's C++ kernels are built before any round too (``accelgen devices --prepare``, as an image or a first job
does once per machine): "cold" is a cold compile cache, not a machine that never built its kernels. So is accelgen's
bytecode (``compileall``, as pip's install or a first job writes it; an environment with PYTHONDONTWRITEBYTECODE set
would otherwise compile every module again in every job, where the peers' packages hold theirs from pip).

Every contender runs with ``OMP_NUM_THREADS=--threads`` (the user's choice; accelgen keeps it, CTranslate2 and OpenVINO
take it as their threads). Reported per contender: kept tokens/s on the user's clock (each row's new tokens up to its
end, the ending token counted; the prompt-heavy shape counts prompt tokens too), the seconds of the job, and beside it
the warm-engine figure: the same tokens over the generation's own seconds, model loaded and any compile left out.

``--load-at F``: a busy process (one core) arrives at F x the contender's quiet seconds of the same round after the
job starts, and stays to its end (the shared machine; each round then runs every contender quiet, then loaded).

    python benchmarks/cpu_user_clock.py --peers-python .venv-peers/bin/python --threads 1
    python benchmarks/cpu_user_clock.py --peers-python .venv-peers/bin/python --threads 2 --shapes short-200 --load-at 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

#: name: (rows, mean completion tokens, cap, prompt tokens (low, high) or None for 3 to 40 words)
SHAPES = {"short-200": (200, 40, 128, None), "short-4000": (4000, 40, 128, None), "long-200": (200, 200, 512, None),
          "long-4000": (4000, 200, 512, None), "prompts-200": (200, 20, 64, (300, 1000))}
DEFAULT_SHAPES = ("short-200", "short-4000", "long-200", "prompts-200")
CONTENDERS = ("accelgen_float32_cold", "accelgen_float32_warm", "accelgen_float32_eager", "accelgen_int8_cold",
              "accelgen_int8_warm", "accelgen_int8_eager", "ct2_float32", "ct2_int8")
BATCH = 16


def prepare(shape: str, scratch: Path) -> Path:
    """The shape's model folder, with its rows (``rows.jsonl``: one ``prompt`` text each) beside the model files."""
    from dataset_throughput import build_workload

    from accelgen.loading.model_files import load_tokenizer

    rows, mean, _, prompt_tokens = SHAPES[shape]
    folder = scratch / shape
    workload = argparse.Namespace(hidden=256, layers=4, heads=8, workload="long-prompt" if prompt_tokens else "varied",
                                  mean_length=mean, prompts=rows, prefix_tokens=0, long_tokens=0)
    prompts_of, _ = build_workload(workload, folder)
    prompts = prompts_of(1) if not prompt_tokens else long_prompts(load_tokenizer(str(folder)), rows, prompt_tokens)
    with open(folder / "rows.jsonl", "w", encoding="utf-8") as rows_file:
        rows_file.writelines(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts)
    return folder


def long_prompts(tokenizer, rows: int, tokens: tuple[int, int]) -> list[str]:
    """``rows`` texts of words of the vocabulary, each ``tokens`` long (a seeded length in that range)."""
    words = [word for word in (tokenizer.decode([token]).strip() for token in range(len(tokenizer))) if word.isalpha()]
    draw = random.Random(7)
    prompts = []
    for _ in range(rows):
        target = draw.randint(*tokens)
        text = " ".join(draw.choice(words) for _ in range(target))
        ids = tokenizer(text, add_special_tokens=False).input_ids[: target - 1]  # the tokenizer adds its BOS
        prompts.append(tokenizer.decode(ids))
    return prompts


def command_of(name: str, folder: Path, output: Path, arguments) -> list[str]:
    """The command a user types for contender ``name``."""
    engine, precision = name.removeprefix("base_").split("_")[:2]
    cap = str(SHAPES[folder.name][2])
    if engine == "accelgen":
        accelgen = [sys.executable, "-m", "accelgen.cli"] if name.startswith("base_") else [str(Path(sys.executable).parent / "accelgen")]
        return [*accelgen, "run", "--device", "cpu", "--model", str(folder), "--dataset", str(folder / "rows.jsonl"),
                "--column", "prompt", "--output", str(output), "--overwrite", "--batch-size", str(BATCH),
                "--max-new-tokens", cap, "--do-sample", "--seed", "0", *(["--quantize", "int8"] if precision == "int8" else []),
                *(["--no-graphs"] if name.endswith("_eager") else [])]
    return [arguments.peers_python, str(HERE / "peer_job.py"), engine, "--model", str(folder / f"{engine}-{precision}"),
            "--tokenizer", str(folder), "--rows", str(folder / "rows.jsonl"), "--output", str(output), "--batch-size", str(BATCH),
            "--max-new-tokens", cap, "--precision", precision]


def measure(name: str, folder: Path, caches: Path, arguments, load_after: float | None = None,
            fill: bool = False) -> dict:
    """One job of contender ``name``: its seconds on the user's clock, its kept (and prompt) tokens, its engine seconds;
    ``load_after``: a busy process starts that many seconds after the job, ended when the job ends; ``fill``: the run
    that fills a warm contender's cache, its step compiled whatever its length (``--graphs``)."""
    output = folder / f"out-{name}.jsonl"
    environment = dict(os.environ, OMP_NUM_THREADS=str(arguments.threads), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_VERBOSITY="error")
    if not _is_peer(name):
        cache = caches / f"{folder.name}-{name}" if name.endswith("_warm") else Path(tempfile.mkdtemp(dir=caches))
        environment["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    if name.startswith("base_"):
        environment["PYTHONPATH"] = arguments.baseline_path
    started = time.perf_counter()
    command = command_of(name, folder, output, arguments) + (["--graphs"] if fill else [])
    job = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    load = None
    if load_after is not None:
        try:
            job.wait(timeout=load_after)
        except subprocess.TimeoutExpired:
            load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    stdout, stderr = job.communicate(timeout=arguments.worker_timeout)
    seconds = time.perf_counter() - started
    if load is not None:
        load.kill()
        load.wait()
    if job.returncode:
        raise SystemExit(f"{name} on {folder.name} failed (exit {job.returncode}):\n{stderr[-3000:]}")
    return {"seconds": seconds, **job_figures(name, output, stdout, stderr)}


def job_figures(name: str, output: Path, stdout: str, stderr: str) -> dict:
    """Kept tokens, prompt tokens and the engine's own seconds, from the job's output file and what it printed."""
    if _is_peer(name):
        return json.loads(stdout.strip().splitlines()[-1])
    from dataset_throughput import output_rows

    kept = prompt_tokens = 0
    for row in output_rows(output):
        kept += len(row["completion_token_ids"]) + (row["finish_reason"] == "eos")
        prompt_tokens += row["prompt_token_count"]
    record = json.loads(Path(f"{output}.run.json").read_text()).get("last_run")
    if record is not None:  # the run record keeps the run's figures (the short summary leaves them out)
        generate, captures, capture = record["generate_seconds"], record["graph_captures"], record["capture_seconds"]
    else:  # code from before the run record kept them (--baseline-path): its summary line said them
        summary = re.search(r"new tokens in ([\d.]+) s.*?graph captures: (\d+)(?: \(([\d.]+) s\))?", stderr)
        generate, captures, capture = float(summary[1]), int(summary[2]), float(summary[3] or 0)
    return {"kept_tokens": kept, "prompt_tokens": prompt_tokens, "engine_seconds": generate - capture,
            "captures": captures, "capture_seconds": capture}


def _is_peer(name: str) -> bool:
    return name.split("_")[0] in ("ct2", "ov")


def rate(run: dict, shape: str, clock: str) -> float:
    tokens = run["kept_tokens"] + (run["prompt_tokens"] if SHAPES[shape][3] else 0)
    return tokens / run[clock]


def run_shape(shape: str, scratch: Path, arguments) -> None:
    from cpu_peers import convert

    folder = prepare(shape, scratch)
    names = arguments.contenders.split(",")
    peers = sorted({"_".join(name.split("_")[:2]) for name in names if _is_peer(name)})
    if peers:
        convert(folder, arguments.peers_python, peers)
    caches = scratch / "inductor"
    caches.mkdir(exist_ok=True)
    for name in names:  # the warm caches filled, off the clock, by a job of the same model and settings that compiled
        if name.endswith("_warm"):
            measure(name, folder, caches, arguments, fill=True)
    runs = {(name, loaded): [] for name in names for loaded in ([False, True] if arguments.load_at else [False])}
    for round_number in range(arguments.rounds):
        for name in names:
            quiet = measure(name, folder, caches, arguments)
            runs[name, False].append(quiet)
            line = f"round {round_number + 1} {shape} {name}: {quiet['seconds']:.1f} s"
            if arguments.load_at:
                loaded = measure(name, folder, caches, arguments, load_after=arguments.load_at * quiet["seconds"])
                runs[name, True].append(loaded)
                line += f", loaded {loaded['seconds']:.1f} s"
            print(f"{line} (load average {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    report(shape, runs, arguments)


def report(shape: str, runs: dict, arguments) -> None:
    rows, mean, cap, prompt_tokens = SHAPES[shape]
    unit = "prompt + kept tokens/s" if prompt_tokens else "kept tokens/s"
    print(f"\n{shape}: {rows} rows, completions of mean ~{mean} (cap {cap}), batch {BATCH}, {arguments.threads} "
          f"thread(s), medians of {arguments.rounds}, load average {os.getloadavg()[0]:.1f} at the end")
    loaded = "| loaded, user's clock | loaded / quiet | loaded, warm engine " if arguments.load_at else ""
    print(f"| contender | {unit}, user's clock | job s | warm engine | kept tokens {loaded}|")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if arguments.load_at else ""))
    for name in dict.fromkeys(name for name, _ in runs):
        quiet = runs[name, False]
        user = statistics.median(rate(run, shape, "seconds") for run in quiet)
        cells = [f"{user:,.0f}", f"{statistics.median(run['seconds'] for run in quiet):.2f}",
                 f"{statistics.median(rate(run, shape, 'engine_seconds') for run in quiet):,.0f}",
                 f"{statistics.median(run['kept_tokens'] for run in quiet):,}"]
        if arguments.load_at:
            under_load = statistics.median(rate(run, shape, "seconds") for run in runs[name, True])
            engine = statistics.median(rate(run, shape, "engine_seconds") for run in runs[name, True])
            cells += [f"{under_load:,.0f}", f"{under_load / user:.2f}x", f"{engine:,.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def compile_bytecode(baseline_path: str | None) -> None:
    """accelgen's modules (and the code before's) compiled to bytecode, off every clock, as an install or a user's
    first job leaves them: where the environment forbids writing it (PYTHONDONTWRITEBYTECODE, as some sandboxes set),
    every job would compile its hundred-odd modules again, where the peers' packages, installed by pip, hold theirs."""
    import compileall
    import importlib.util

    folders = [Path(baseline_path)] if baseline_path else []
    for package in ("accelgen", "accelgen_cpu", "accelgen_cuda", "accelgen_hpu"):
        spec = importlib.util.find_spec(package)
        if spec is not None:
            folders += [Path(location) for location in spec.submodule_search_locations or []]
    for folder in folders:
        compileall.compile_dir(str(folder), quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers-python", help="the Python of the peers' virtual environment (cpu_peers.py says how)")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-at", type=float, help="a busy process arrives at this share of the quiet job's seconds")
    parser.add_argument("--baseline-path", help="a folder holding the accelgen and accelgen_cpu packages of the code before")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds one job may take")
    arguments = parser.parse_args()
    unknown = set(arguments.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {', '.join(sorted(unknown))}; the shapes are {', '.join(SHAPES)}")
    if any(name.startswith("base_") for name in arguments.contenders.split(",")) and not arguments.baseline_path:
        parser.error("base_* contenders need --baseline-path")
    if any(_is_peer(name) for name in arguments.contenders.split(",")) and not arguments.peers_python:
        parser.error("ct2_* and ov_* need --peers-python (see cpu_peers.py's instructions), or leave them out with "
                     "--contenders")
    subprocess.run([str(Path(sys.executable).parent / "accelgen"), "devices", "--prepare"], check=True,
                   capture_output=True)  # the kernels built once per machine, off every clock
    compile_bytecode(arguments.baseline_path)
    with tempfile.TemporaryDirectory() as scratch:
        for shape in arguments.shapes.split(","):
            run_shape(shape, Path(scratch), arguments)


if __name__ == "__main__":
    main()
