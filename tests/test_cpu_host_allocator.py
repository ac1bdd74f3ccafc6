"""A CPU run keeps the memory its passes free for the next ones: passes of varying shape, as a job's prefill passes are,
pay the kernel for fresh pages once, not at every pass (glibc's malloc told so by the CPU plugin; host_allocator.py).

Each measurement is a process of its own: the same seeded passes, with and without a model loaded on the CPU by
``accelgen.load``, their page faults counted (``ru_minflt``) after one pass of the same shapes."""

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
draw = random.Random(0)
def passes():
    for _ in range(50):
        n = draw.randrange(1 << 18, 6 << 20)  # floats: 1 to 24 MiB of temporaries, as a pass of varying length makes
        a = torch.ones(n); b = a * 2; c = a + b
        del a, b, c
passes()
draw.seed(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
passes()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def page_faults(model: str, environment: dict) -> int:
    done = subprocess.run([sys.executable, "-c", PASSES, model], env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def glibc_environment(cli_environment) -> dict:
    environment = {name: value for name, value in cli_environment.items()
                   if name not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")}
    if not is_ours_to_set(environment):
        pytest.skip("this C library is not glibc: the CPU plugin leaves its malloc as it is")
    return environment


def test_passes_of_varying_shape_reuse_the_memory_freed_before_them(tiny_model_folder, glibc_environment):
    plain = page_faults("plain", glibc_environment)
    on_cpu = page_faults(str(tiny_model_folder("llama")), glibc_environment)
    # the same passes: 4 KiB pages of up to 72 MiB of temporaries each, fresh from the kernel without the plugin's
    # setting at most passes; with it, only where the heap grows past its largest yet
    assert plain > 20_000
    assert on_cpu < plain / 5


def test_a_users_malloc_settings_are_theirs(tiny_model_folder, glibc_environment):
    # MALLOC_TRIM_THRESHOLD_ set by the user (here, glibc's own default): the plugin leaves malloc as the user set it
    users = dict(glibc_environment, MALLOC_TRIM_THRESHOLD_=str(128 << 10))
    assert page_faults(str(tiny_model_folder("llama")), users) > page_faults("plain", glibc_environment) / 2
