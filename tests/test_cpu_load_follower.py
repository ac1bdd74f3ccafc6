"""The CPU plugin's threads follow the machine's load during a run: fewer while other processes keep cores busy,
all of them again once they have gone, never more than the run's most (the user's OMP_NUM_THREADS), and it says so in
the summary. Driven here by made-up readings of /proc and a made-up clock: nothing is timed."""

import itertools
import os

import pytest
import torch

import accelgen
from accelgen_cpu.load_follower import LOOK_EVERY_SECONDS, LoadFollower
from accelgen_cpu.threads import CpuTimes

TICKS = os.sysconf("SC_CLK_TCK")
PROMPTS = ["Hello there", "DeepSpeed is a machine learning framework", "The quick brown fox", "In the beginning",
           "Static shapes let one graph serve"]


class Machine:
    """Readings of a 2-core machine on which this run keeps ``own`` cores busy and others ``others``, second by
    second as the test says."""

    def __init__(self):
        self.now, self.cores_busy, self.own_busy = 0.0, 0, 0

    def run_for(self, seconds: float, own: float, others: float) -> None:
        self.now += seconds
        self.own_busy += round(own * seconds * TICKS)
        self.cores_busy += round((own + others) * seconds * TICKS)

    def read(self) -> CpuTimes:
        return CpuTimes(self.now, self.cores_busy, self.own_busy)


def follower_on(machine: Machine, most: int = 2, threads: int = 2) -> tuple[LoadFollower, list[int]]:
    set_to = []
    follower = LoadFollower(most, 2, 1, threads, set_to.append, read=machine.read, clock=lambda: machine.now)
    return follower, set_to


def test_a_process_arriving_mid_run_takes_a_thread_and_gives_it_back_when_it_goes():
    machine = Machine()
    follower, set_to = follower_on(machine)
    machine.run_for(LOOK_EVERY_SECONDS, own=2.0, others=0.0)
    follower.after_step()
    assert set_to == [] and follower.threads == 2
    machine.run_for(LOOK_EVERY_SECONDS, own=1.33, others=0.67)  # another process arrives: three threads on two cores
    follower.after_step()
    assert set_to == [1]
    machine.run_for(LOOK_EVERY_SECONDS, own=1.0, others=1.0)  # it stays: one thread, one core each
    follower.after_step()
    assert set_to == [1]
    machine.run_for(LOOK_EVERY_SECONDS, own=1.0, others=0.0)  # it has gone
    follower.after_step()
    assert set_to == [1, 2] and follower.threads == 2
    assert follower.describe() == "1 thread while other processes kept cores busy (50% of the run)"


def test_no_look_before_its_time_and_none_without_readings():
    machine = Machine()
    follower, set_to = follower_on(machine)
    machine.run_for(LOOK_EVERY_SECONDS / 2, own=1.0, others=2.0)
    follower.after_step()
    assert set_to == [] and follower.looks == 0
    unreadable = LoadFollower(2, 2, 1, 2, set_to.append, read=lambda: None, clock=lambda: machine.now)
    machine.run_for(LOOK_EVERY_SECONDS, own=1.0, others=2.0)
    unreadable.after_step()
    assert set_to == [] and unreadable.describe() is None


def test_never_more_than_the_runs_most_and_quiet_says_nothing():
    machine = Machine()
    follower, set_to = follower_on(machine, most=2, threads=1)  # started under a load: one thread
    machine.run_for(LOOK_EVERY_SECONDS, own=1.0, others=0.0)
    follower.after_step()
    assert set_to == [2]
    machine.run_for(LOOK_EVERY_SECONDS, own=2.0, others=0.0)
    follower.after_step()
    assert set_to == [2] and follower.describe() is None  # the start's one thread is the thread choice's to say


@pytest.mark.slow
def test_a_compiled_step_whose_threads_change_between_steps_decodes_the_one_thread_tokens(tiny_model_folder, monkeypatch):
    """A run of the user's OMP_NUM_THREADS=2 on a machine whose load comes and goes at every look: its compiled decode
    step (kernels that read the threads at each call) runs at 1 and 2 threads in turn, and decodes what one eager
    thread decodes. The load is made up (readings of a 2-core machine, one look per step); the threads are torch's."""
    import accelgen_cpu

    folder = tiny_model_folder("llama")
    settings = dict(device="cpu", batch_size=4, max_new_tokens=24)
    expected = [completion.completion_token_ids
                for completion in accelgen.load(folder, graphs=False, **settings).generate(PROMPTS)]
    machine, set_to, reads, seconds = Machine(), [], [], itertools.count()  # a clock a second on at each look

    def coming_and_going() -> CpuTimes:  # another process busy over every other second; a look due at every step
        reads.append(None)
        machine.run_for(1.0, own=1.0, others=float(len(reads) % 2))
        return machine.read()

    def follower(most, cores, ranks_here, threads, set_threads):
        def set_and_note(count: int) -> None:
            set_to.append(count)
            set_threads(count)
        return LoadFollower(most, 2, ranks_here, threads, set_and_note, read=coming_and_going, clock=lambda: next(seconds))

    monkeypatch.setattr(accelgen_cpu, "LoadFollower", follower)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    threads_before = torch.get_num_threads()
    try:
        generator = accelgen.load(folder, graphs=True, **settings)
        completions = generator.generate(PROMPTS)
    finally:
        torch.set_num_threads(threads_before)
    assert generator.stats.graph_captures == 1
    assert [completion.completion_token_ids for completion in completions] == expected
    assert {1, 2} <= set(set_to) and len(set_to) >= 4  # the step ran at both counts, several times each
