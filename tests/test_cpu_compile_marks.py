"""The CPU decides whether a job compiles its decode step from what this machine has compiled before: a step its
compile cache holds pays after far fewer steps than one compiled from nothing. The decision never changes tokens
(test_capture.py: compiled steps give the eager tokens); here only the decision, from marks in a cache of the test's."""

import dataclasses

import pytest

from accelgen.common.settings import AdapterSettings
from accelgen.session.request import build_request
from accelgen_cpu.compile_marks import MARKS, compiled_before, mark_compiled, step_key


@pytest.fixture
def request_here(tiny_model_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return build_request(tiny_model_folder("llama"), device="cpu", batch_size=4, max_new_tokens=16, do_sample=True)


def test_a_step_compiled_before_pays_after_fewer_steps(request_here):
    cpu, config, run, world = request_here.accelerator, request_here.model.config(), request_here.run, request_here.world
    assert cpu.capture_pays_after(config, run, world) == cpu.tuning.capture_pays_after_steps
    mark_compiled(step_key(config, run, "1"))
    assert cpu.capture_pays_after(config, run, world) == cpu.warm_capture_pays_after_steps
    assert cpu.warm_capture_pays_after_steps < cpu.tuning.capture_pays_after_steps
    # another step shape, or the same compiled for threads read at each call, was not compiled
    assert cpu.capture_pays_after(config, dataclasses.replace(run, batch_size=8), world) == cpu.tuning.capture_pays_after_steps
    with_adapters = dataclasses.replace(run, lora=AdapterSettings(named=(("a", "./a-lora"),), max_loras=1))
    assert cpu.capture_pays_after(config, with_adapters, world) == cpu.tuning.capture_pays_after_steps
    assert not compiled_before(step_key(config, run, "any"))


def test_a_job_decides_from_the_marks(request_here, monkeypatch):
    config, run = request_here.model.config(), request_here.run
    warm = request_here.accelerator.warm_capture_pays_after_steps
    rows = -(-warm // run.max_new_tokens) * run.batch_size  # rows that take that many decode steps at most
    assert request_here.capture_decided(rows).run.use_graphs is False  # not even at most: compiled from nothing
    mark_compiled(step_key(config, run, "1"))
    later = request_here.capture_decided(rows)  # may pay: left to its rows, which may end early
    assert later.run.use_graphs is None and later.capture_later.pays_after_steps == warm
    assert request_here.capture_decided(rows - run.batch_size).run.use_graphs is False
    every_token = dataclasses.replace(request_here, run=dataclasses.replace(run, ignore_eos=True))
    assert every_token.capture_decided(rows).run.use_graphs is True  # every row's length known: decided now
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # two threads: kernels that read them at each call, not marked yet
    assert request_here.capture_decided(rows).run.use_graphs is False


def test_an_unwritable_cache_is_left_unmarked(request_here, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "file"))
    mark_compiled("key")  # no error
    assert not (tmp_path / "file" / MARKS).exists()
