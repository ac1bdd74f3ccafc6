"""Processes at the wrong moment on the CPU: Ctrl-C inside the traced or compiled decode step of a dataset job, the
kernels' cache in a read-only folder or holding another library, the process building the kernels killed outright,
and a job of 65,536 samples waiting for its first progress line. The tests: tests/test_hostile_interrupts.py and
tests/test_hostile_kernel_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hostile_round6_cases.common import QUICK, Outcome, environment, outcome_of, rows_of

TESTS = Path(__file__).resolve().parents[2] / "tests"


def _bloom(folder: Path, layers: int) -> Path:
    """A random-weight Bloom of ``layers`` layers with the tests' tokenizer (its GeLU runs in Python: inside a traced
    step's graph, a Python operation where a Ctrl-C lands)."""
    sys.path.insert(0, str(TESTS))
    from tiny_models import BOS_ID, EOS_ID, PAD_ID, build_model, build_tokenizer
    from transformers import BloomConfig

    tokenizer = build_tokenizer(folder)
    return build_model(folder, BloomConfig(hidden_size=256 if layers > 2 else 64, n_layer=layers, n_head=4,
                                           vocab_size=len(tokenizer), bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                           pad_token_id=PAD_ID))


def _interrupted_then_resumed(folder: Path, layers: int, rows: int, *options: str) -> Outcome:
    """A dataset job Ctrl-C'd a moment after its first two rows, then the same command run to its end."""
    model = _bloom(folder / "model", layers)
    dataset, output = folder / "rows.jsonl", folder / "out.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"Row {number} about the sea"}) + "\n" for number in range(rows)))
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(model), "--dataset",
               str(dataset), "--max-new-tokens", "48", "--output", str(output), "--quiet", *options]
    run = subprocess.Popen(command, env=environment(OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    while (not output.exists() or output.read_text().count("\n") < 2) and run.poll() is None:
        time.sleep(0.01)
    time.sleep(0.5)
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=300)
    interrupted = outcome_of(run.returncode, stderr)
    kept = len(rows_of(output))
    resumed = subprocess.run(command, env=environment(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                             timeout=900)
    indexes = [row["index"] for row in rows_of(output)]
    interrupted.note = (f"{interrupted.note} {kept} rows kept; resumed: exit {resumed.returncode}, rows "
                        f"{'0..' + str(rows - 1) + ' once each' if indexes == list(range(rows)) else indexes}").strip()
    return interrupted


def case_ctrl_c_in_the_traced_step(folder: Path) -> Outcome:
    """Ctrl-C a dataset job inside its traced decode step (a short job's): one line, exit 130; the same command resumes."""
    return _interrupted_then_resumed(folder, 16, 12)


def case_ctrl_c_in_the_compiled_step(folder: Path) -> Outcome:
    """Ctrl-C a dataset job with --graphs (its decode step compiled): one line, exit 130; the same command resumes."""
    return _interrupted_then_resumed(folder, 2, 120, "--graphs")


def _with_the_kernels(folder: Path) -> Path:
    """An extensions folder holding the user's builds of the CPU kernels (copied), for this case alone."""
    from accelgen_cpu.extension_lock import torch_extensions_root
    from accelgen_cpu.native_build import KERNELS_FOLDER, LOCK

    target = folder / "extensions"
    shutil.copytree(Path(torch_extensions_root()) / KERNELS_FOLDER, target / KERNELS_FOLDER,
                    ignore=shutil.ignore_patterns(".building-*", LOCK))
    return target


def case_read_only_extensions_folder(folder: Path) -> Outcome:
    """Run with a read-only TORCH_EXTENSIONS_DIR holding no build: torch's operations, one warning line, exit 0."""
    extensions = folder / "extensions"
    extensions.mkdir()
    mount = ["unshare", "--mount", "sh", "-c", f'mount --bind -o ro "{extensions}" "{extensions}" && exec "$@"', "sh"]
    if subprocess.run([*mount, "true"], capture_output=True).returncode != 0:  # no mount namespace: a path no folder
        (folder / "a-file").write_text("")                                     # can be made at
        extensions, mount = folder / "a-file" / "extensions", []
    ran = subprocess.run([*mount, sys.executable, "-m", "accelgen.cli", *QUICK, "--prompt", "Hello"],
                         env=environment(TORCH_EXTENSIONS_DIR=str(extensions)), capture_output=True, text=True,
                         timeout=600)
    return _warned(ran.returncode, ran.stderr, "read-only mount" if mount else "under a file")


def case_foreign_kernels_library(folder: Path) -> Outcome:
    """Replace kernels.so by another loadable library, its checksum rewritten, then run: one warning line, exit 0."""
    import torch

    from accelgen_cpu.kernel_variants import chosen_variant
    from accelgen_cpu.native_build import CHECKSUM, LIBRARY, build_folder

    extensions = _with_the_kernels(folder)
    with_it = environment(TORCH_EXTENSIONS_DIR=str(extensions))
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    try:
        build = build_folder(chosen_variant()) / LIBRARY
    finally:
        os.environ.pop("TORCH_EXTENSIONS_DIR")
        if before is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = before
    listed_before = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=with_it,
                                   capture_output=True, text=True, timeout=300).stdout
    if "built in " + str(build.parent) not in listed_before:
        return Outcome(0, "(the copied build is not this install's: run accelgen devices --prepare first)")
    shutil.copyfile(Path(torch.__file__).parent / "lib" / "libtorch_global_deps.so", build)
    data = build.read_bytes()
    build.with_name(CHECKSUM).write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    shutil.copytree(build.parent, folder / "foreign")  # the same again after devices removed it
    listed = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=with_it, capture_output=True,
                            text=True, timeout=300).stdout
    devices_says = next((line.strip() for line in listed.splitlines() if "C++ kernels" in line), "")
    shutil.rmtree(build.parent, ignore_errors=True)
    shutil.copytree(folder / "foreign", build.parent)
    ran = subprocess.run([sys.executable, "-m", "accelgen.cli", *QUICK, "--prompt", "Hello"], env=with_it,
                         capture_output=True, text=True, timeout=600)
    return _warned(ran.returncode, ran.stderr, "devices: " + ("says built" if "built in" in devices_says else
                                                               "not usable" if "not usable" in devices_says else
                                                               devices_says))


def _warned(status: int, stderr: str, note: str) -> Outcome:
    """The Outcome of a command that should have said one warning line: that line, and how many it said."""
    warnings = [line for line in stderr.splitlines() if line.startswith("accelgen: warning:")]
    outcome = outcome_of(status, stderr)
    if warnings:
        outcome.said = warnings[0][:400]
    outcome.note = f"{outcome.note} {len(warnings)} warning line(s); {note}".strip()
    return outcome


HANGING_COMPILER = """#!/bin/sh
[ "$1" = --version ] && { echo "hanging compiler 1.0"; exit 0; }
sleep 300 &
echo $$ $! >> "{pids}"
wait
"""


def case_sigkill_during_the_kernels_build(folder: Path) -> Outcome:
    """SIGKILL accelgen devices --prepare while it builds the kernels: no compiler (c++, cc1plus) left running."""
    pids, compiler = folder / "pids", folder / "c++"
    compiler.write_text(HANGING_COMPILER.replace("{pids}", str(pids)))
    compiler.chmod(0o755)
    preparing = subprocess.Popen([sys.executable, "-m", "accelgen.cli", "devices", "--prepare"],
                                 env=environment(TORCH_EXTENSIONS_DIR=str(folder / "extensions"), CXX=str(compiler)),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (pids.exists() and pids.read_text().strip()) and preparing.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    preparing.send_signal(signal.SIGKILL)
    preparing.wait()
    said = preparing.stderr.read()
    compilers = [int(pid) for pid in pids.read_text().split()] if pids.exists() else []
    time.sleep(2)
    left = [pid for pid in compilers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    outcome = outcome_of(preparing.returncode, said)
    outcome.note = f"{len(compilers)} compiler processes started, {len(left)} left running after the SIGKILL"
    return outcome


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def case_many_samples_progress(folder: Path) -> Outcome:
    """Run --num-samples 65536 without --quiet: a progress line at once, before the first samples."""
    started = time.monotonic()
    run = subprocess.Popen([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--prompt", "Hello",
                            "--num-samples", "65536", "--do-sample", "--max-new-tokens", "2"], env=environment(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = next((line.strip() for line in run.stderr if " rows, " in line), "(no progress line)")
    seconds = time.monotonic() - started
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=300)
    return Outcome(run.returncode, first, f"first progress line {seconds:.0f} s after the start")
