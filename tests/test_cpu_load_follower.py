"""The CPU plugin's threads follow the machine's load during a run: fewer while other processes keep cores busy,
all of them again once they have gone, never more than the run's most (the user's OMP_NUM_THREADS), and it says so in
the summary. Driven here by made-up readings of /proc and a made-up clock: nothing is timed."""

import os

from accelgen_cpu.load_follower import LOOK_EVERY_SECONDS, LoadFollower
from accelgen_cpu.threads import CpuTimes

TICKS = os.sysconf("SC_CLK_TCK")


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
