"""A model's load on the CPU, as a user's job pays it: accelgen's first and later loads of the 0.5B Llama of
cpu_peers.py's decode job (8 layers of TinyLlama's widths, float32 checkpoint) in float32 and int8, against CTranslate2
and OpenVINO loading their converted forms of it (converted once, before the clock, as their users do).

Each measurement is a process of its own, the contenders taking turns round by round (medians):

    accelgen_float32, accelgen_int8       ``accelgen run --model M --prompt hi --max-new-tokens 1 [--quantize int8]``:
                                          the run's own "model loaded in" figure, the process's wall time and its peak
                                          resident memory. int8 "first": the cache of kept int8 weights emptied before
                                          (quantized as it loads, then kept); "kept": read from what the last run kept
    baseline_float32, baseline_int8       the same with --baseline-pythonpath (an earlier accelgen's ``core`` and
                                          ``plugins/cpu`` on the path as ``accelgen`` and ``accelgen_cpu``)
    ct2_float32, ct2_int8                 ``ctranslate2.Generator`` of the converted model
    ov_float32, ov_int8                   optimum-intel's ``OVModelForCausalLM.from_pretrained`` (compiled at load;
                                          OpenVINO's model cache off, as a first load)

    python benchmarks/cpu_load.py --peers-python /work/venv-peers/bin/python --rounds 3
    python benchmarks/cpu_load.py --contenders accelgen_int8 --rounds 3      # accelgen alone
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
CONTENDERS = ("accelgen_float32", "accelgen_int8", "ct2_float32", "ct2_int8", "ov_float32", "ov_int8")

PEER_LOAD = r"""
import json, os, sys, time
started = time.perf_counter()
name, folder, threads = sys.argv[1], sys.argv[2], sys.argv[3]
engine, precision = name.split("_")
if engine == "ct2":
    import ctranslate2
    imported = time.perf_counter()
    model = ctranslate2.Generator(os.path.join(folder, f"ct2-{precision}"), device="cpu", intra_threads=int(threads))
else:
    from optimum.intel import OVModelForCausalLM
    imported = time.perf_counter()
    config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "CACHE_DIR": ""}
    if precision == "float32":
        config["INFERENCE_PRECISION_HINT"] = "f32"
    model = OVModelForCausalLM.from_pretrained(os.path.join(folder, f"ov-{precision}"), ov_config=config)
loaded = time.perf_counter()
print(json.dumps({"load_s": loaded - imported, "start_s": imported - started}))
"""


def measure(name: str, folder: Path, arguments, cache: Path) -> dict:
    """One load: its seconds, the process's wall seconds and peak resident bytes."""
    engine, precision = name.split("_")
    environment = dict(os.environ, OMP_NUM_THREADS=str(arguments.threads), HF_HUB_OFFLINE="1",
                       ACCELGEN_WEIGHTS_CACHE=str(cache), TRANSFORMERS_VERBOSITY="error")
    if engine in ("accelgen", "baseline"):
        command = [sys.executable, "-m", "accelgen.cli", "run", "--model", str(folder), "--prompt", "hi",
                   "--max-new-tokens", "1", *(["--quantize", "int8"] if precision == "int8" else [])]
        if engine == "baseline":
            environment["PYTHONPATH"] = arguments.baseline_path
    else:
        command = [arguments.peers_python, "-c", PEER_LOAD, name, str(folder), str(arguments.threads)]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    out, err = process.stdout.read(), process.stderr.read()
    if status:
        raise SystemExit(f"{name} failed:\n{err[-2000:]}")
    if engine in ("accelgen", "baseline"):
        load = float(re.search(r"model loaded in ([\d.]+) s", err)[1])
        kept = "kept by an earlier load" in err
    else:
        load, kept = json.loads(out.strip().splitlines()[-1])["load_s"], False
    return {"load_s": load, "wall_s": wall, "peak_bytes": usage.ru_maxrss * 1024, "kept": kept}


def baseline_path(revision: str, scratch: Path) -> str:
    """A folder holding an earlier accelgen's packages as ``accelgen`` and ``accelgen_cpu``, for PYTHONPATH."""
    tree = scratch / "baseline-tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), revision], cwd=HERE.parent, check=True,
                   capture_output=True)
    packages = scratch / "baseline-packages"
    packages.mkdir()
    (packages / "accelgen").symlink_to(tree / "core")
    (packages / "accelgen_cpu").symlink_to(tree / "plugins" / "cpu")
    return str(packages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers-python", help="the Python of the peers' virtual environment (CTranslate2, OpenVINO)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--baseline-revision", help="an earlier accelgen commit to load with too (baseline_*)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", help="the 0.5B model's folder, kept between runs (default: built in a scratch folder)")
    arguments = parser.parse_args()
    names = arguments.contenders.split(",")
    if arguments.baseline_revision:
        names += [name.replace("accelgen", "baseline") for name in names if name.startswith("accelgen")]
    peers = [name for name in names if name.split("_")[0] in ("ct2", "ov")]
    if peers and not arguments.peers_python:
        raise SystemExit("--peers-python is needed for " + ", ".join(peers))
    scratch = Path(tempfile.mkdtemp(prefix="cpu-load-"))
    try:
        sys.path.insert(0, str(HERE))
        from cpu_peers import half_billion_model

        folder = half_billion_model(arguments.folder, scratch, arguments.peers_python, peers)
        if arguments.baseline_revision:
            arguments.baseline_path = baseline_path(arguments.baseline_revision, scratch)
        figures: dict[str, list[dict]] = {}
        for round_number in range(arguments.rounds):
            for name in names:
                cache = scratch / f"cache-{name}"
                if name in ("accelgen_int8", "baseline_int8"):  # first: nothing kept; then a load reading what it kept
                    shutil.rmtree(cache, ignore_errors=True)
                    figures.setdefault(f"{name} first", []).append(measure(name, folder, arguments, cache))
                    if name == "accelgen_int8":
                        figures.setdefault(f"{name} kept", []).append(measure(name, folder, arguments, cache))
                else:
                    figures.setdefault(name, []).append(measure(name, folder, arguments, cache))
            print(f"round {round_number + 1} of {arguments.rounds} done", file=sys.stderr)
        print(f"\n{arguments.threads} thread(s), medians of {arguments.rounds}\n")
        print("| contender | load, s | process wall, s | peak resident, GB |")
        print("| --- | ---: | ---: | ---: |")
        for name, runs in figures.items():
            median = {key: statistics.median(run[key] for run in runs) for key in ("load_s", "wall_s", "peak_bytes")}
            print(f"| {name} | {median['load_s']:.2f} | {median['wall_s']:.2f} | {median['peak_bytes'] / 1e9:.2f} |")
    finally:
        if arguments.baseline_revision:
            subprocess.run(["git", "worktree", "remove", "--force", str(scratch / "baseline-tree")], cwd=HERE.parent,
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
