"""A CPU run keeps the memory its passes free for the next ones: passes of varying shape, as a job's prefill passes are,
pay the kernel for fresh pages once, not at every pass (glibc's malloc told so by the CPU plugin; host_allocator.py).

Each measurement is a process of its own: the same seeded passes, with and without a model loaded on the CPU by
``accelgen.load``; its page faults (``ru_minflt``) and the pages it gained (``statm``'s resident) over four rounds of
them. Memory kept: every page faulted in stays the process's, the two counts agree. Memory given back: the faults are
many times the pages kept (the same pages faulted in again at every pass). Both hold in every run, whatever the heap's
layout; the count of faults alone varies with it."""

import json
import subprocess
import sys

import pytest

from accelgen_cpu.host_allocator import is_ours_to_set

PASSES = r"""
import json, random, resource, sys
import torch
if sys.argv[1] != "plain":
    import accelgen
    accelgen.load(sys.argv[1], device="cpu", dtype="float32")
def resident_pages():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1])
draw = random.Random(0)
def passes():
    for _ in range(25):
        n = draw.randrange(2 << 20, 6 << 20)  # floats: 8 to 24 MiB a temporary, four alive at once, as a pass makes
        a = torch.ones(n); b = a * 2; c = a + b; d = b * c
        del a, b, c, d
faults, resident = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, resident_pages()
for _ in range(4):
    draw.seed(0)
    passes()
print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, resident_pages() - resident]))
"""


def faults_and_pages_kept(model: str, environment: dict) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", PASSES, model], env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    faults, kept = json.loads(done.stdout.splitlines()[-1])
    return faults, kept


@pytest.fixture
def glibc_environment(cli_environment) -> dict:
    environment = {name: value for name, value in cli_environment.items()
                   if name not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")}
    if not is_ours_to_set(environment):
        pytest.skip("this C library is not glibc: the CPU plugin leaves its malloc as it is")
    return environment


def test_passes_of_varying_shape_reuse_the_memory_freed_before_them(tiny_model_folder, glibc_environment):
    faults, kept = faults_and_pages_kept("plain", glibc_environment)
    assert faults > 3 * kept  # without the plugin's setting: 4 KiB pages given back and faulted in again, pass after pass
    faults, kept = faults_and_pages_kept(str(tiny_model_folder("llama")), glibc_environment)
    assert faults <= kept + 256  # with it: each page faulted in once and kept (1 MiB for the interpreter's own)


def test_a_users_malloc_settings_are_theirs(tiny_model_folder, glibc_environment):
    # MALLOC_TRIM_THRESHOLD_ set by the user (here, glibc's own default): the plugin leaves malloc as the user set it
    users = dict(glibc_environment, MALLOC_TRIM_THRESHOLD_=str(128 << 10))
    faults, kept = faults_and_pages_kept(str(tiny_model_folder("llama")), users)
    assert faults > 3 * kept
