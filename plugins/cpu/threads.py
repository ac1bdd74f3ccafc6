"""How many threads a CPU process computes with, and how its threads wait: chosen from the machine as it is when
the run starts, not inherited.

torch starts one OpenMP thread per core and, with the GNU OpenMP runtime, each thread spins at every barrier
before it sleeps. On a machine other processes share, a spinning thread waits for a core that another process
holds: the decode step of a small model went from 11 ms (one thread) to 93 ms (two threads, two cores, a load of
about 5). So a process counts the cores it may use (its CPU affinity, its cgroup's quota), measures how many other
processes keep busy, shares what is left with the other ranks of its job on the node, and computes with that many
threads. The wait policy (``OMP_WAIT_POLICY``) is read once, when the OpenMP runtime loads with torch: the launcher
sets it for the ranks it starts (passive on a shared machine), a single process keeps what it was started with.
A value the user set (``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``) is kept: the user's threads are the most a run computes
with (``most_threads``), fewer while other processes keep cores busy (``load_follower``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

#: Set by the launcher on the ranks it starts when it chose their ``OMP_NUM_THREADS`` (the user had not): a rank
#: may then choose again once its model has loaded, from the machine as it is then.
CHOSEN_BY_LAUNCHER = "ACCELGEN_CPU_THREADS_CHOSEN"
#: Seconds over which the launcher measures how busy the machine is before it starts the ranks.
LAUNCH_SAMPLE_SECONDS = 0.1
#: Cores other processes keep busy at or above which the machine counts as shared (threads wait passively).
SHARED_AT_BUSY_CORES = 0.5


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    """The threads a process computes with, and what they were chosen from."""

    threads: int
    cores: int  # cores this process may run on
    busy_elsewhere: float  # cores other processes kept busy while measured
    ranks_here: int  # processes of the job on this node, sharing the cores
    user_set: bool = False  # OMP_NUM_THREADS was the user's: kept as it is

    def describe(self) -> str:
        """The phrase the run's summary shows, e.g. ``1 thread of 2 cores, 1.9 kept busy by other processes``."""
        threads = f"{self.threads} thread{'' if self.threads == 1 else 's'}"
        if self.user_set:
            return f"{threads}: your OMP_NUM_THREADS"
        said = [f"{threads} of {self.cores} core{'' if self.cores == 1 else 's'}"]
        said += [f"{self.busy_elsewhere:.1f} kept busy by other processes"] if self.busy_elsewhere >= 0.05 else []
        said += [f"shared by {self.ranks_here} ranks"] if self.ranks_here > 1 else []
        return ", ".join(said)


def choose_threads(cores: int, busy_elsewhere: float, ranks_here: int = 1) -> int:
    """Threads for one of ``ranks_here`` processes sharing ``cores``, ``busy_elsewhere`` of them kept busy by other
    processes: the idle cores split evenly, at least one thread."""
    idle = cores - math.floor(busy_elsewhere + 0.5)
    return max(1, idle // max(1, ranks_here))


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, lowered to its cgroup's CPU quota where one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota() -> float | None:
    """Cores the cgroup's CPU quota allows (cgroup v2 ``cpu.max``, else v1 ``cfs_quota_us``), None when unlimited."""
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as limit:
            quota, period = limit.read().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", encoding="ascii") as quota_file, \
                open("/sys/fs/cgroup/cpu/cpu.cfs_period_us", encoding="ascii") as period_file:
            quota, period = int(quota_file.read()), int(period_file.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class CpuTimes:
    """A reading of the busy time of this process's cores and of this process itself, in clock ticks."""

    taken_at: float
    cores_busy: int
    own_busy: int

    @classmethod
    def now(cls) -> CpuTimes | None:
        """Read them (None where /proc cannot be read: then nothing is measured)."""
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                busy = 0
                for line in stat:
                    name, *ticks = line.split()
                    if name.startswith("cpu") and name != "cpu" and (cores is None or int(name[3:]) in cores):
                        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(tick) for tick in ticks[:8])
                        busy += user + nice + system + irq + softirq + steal
            with open("/proc/self/stat", encoding="ascii") as own:
                fields = own.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        return cls(time.monotonic(), busy, int(fields[11]) + int(fields[12]))  # utime, stime: all its threads

    def busy_elsewhere_since(self, earlier: CpuTimes, ranks_here: int = 1) -> float:
        """Cores kept busy by other processes between ``earlier`` and this reading: all busy time less this
        process's, and less as much again for each other rank of the job (they load as this one does)."""
        seconds = self.taken_at - earlier.taken_at
        if seconds <= 0:
            return 0.0
        ticks = os.sysconf("SC_CLK_TCK")
        others = (self.cores_busy - earlier.cores_busy) - ranks_here * (self.own_busy - earlier.own_busy)
        return max(0.0, others / ticks / seconds)


def busy_elsewhere_now(seconds: float = LAUNCH_SAMPLE_SECONDS) -> float:
    """Cores other processes keep busy, measured over ``seconds`` (0 where it cannot be measured)."""
    first = CpuTimes.now()
    time.sleep(seconds)
    second = CpuTimes.now()
    return 0.0 if first is None or second is None else second.busy_elsewhere_since(first)


def launch_environment(processes_per_node: int) -> dict[str, str]:
    """For the ranks a launcher starts on this node: their OpenMP threads (the idle cores split between them) and,
    on a machine other processes keep busy, threads that sleep at once at a barrier instead of spinning there.
    Only what the user left unset."""
    users_threads = os.environ.get("OMP_NUM_THREADS")
    if users_threads is not None and ("OMP_WAIT_POLICY" in os.environ or _leading_number(users_threads, 2) < 2):
        return {}  # nothing left to choose (one thread never waits at a barrier): no measuring
    busy = busy_elsewhere_now()
    threads = choose_threads(usable_cores(), busy, processes_per_node)
    environment = {}
    if users_threads is None:
        environment.update({"OMP_NUM_THREADS": str(threads), CHOSEN_BY_LAUNCHER: "1"})
    else:
        threads = _leading_number(users_threads, threads)
    if "OMP_WAIT_POLICY" not in os.environ and busy >= SHARED_AT_BUSY_CORES and threads > 1:
        environment["OMP_WAIT_POLICY"] = "PASSIVE"
    return environment


def most_threads(ranks_here: int) -> int:
    """The most threads one of ``ranks_here`` processes of a job on this node computes with: the user's
    ``OMP_NUM_THREADS`` (its outer level), else its share of the cores it may use."""
    users = os.environ.get("OMP_NUM_THREADS") if CHOSEN_BY_LAUNCHER not in os.environ else None
    if users is not None:
        return max(1, _leading_number(users, 1))
    return choose_threads(usable_cores(), 0.0, ranks_here)


def _leading_number(value: str, otherwise: int) -> int:
    """The threads of the outer level in an ``OMP_NUM_THREADS`` value (``"4"``, ``"4,2"``)."""
    first = value.split(",", 1)[0].strip()
    return int(first) if first.isdigit() else otherwise


class ThreadChooser:
    """Within one process: a reading when the run starts (made with this object), then, once the model has loaded,
    ``choose`` sets torch's threads from what other processes kept busy meanwhile and returns the choice."""

    def __init__(self):
        self._start = CpuTimes.now()

    def choose(self, ranks_here: int) -> ThreadChoice:
        import torch

        cores = usable_cores()
        if "OMP_NUM_THREADS" in os.environ and CHOSEN_BY_LAUNCHER not in os.environ:
            return ThreadChoice(torch.get_num_threads(), cores, 0.0, ranks_here, user_set=True)
        now = CpuTimes.now()
        if self._start is None or now is None or now.taken_at - self._start.taken_at < LAUNCH_SAMPLE_SECONDS:
            busy = busy_elsewhere_now()  # too short a load to tell: measure now
        else:
            busy = now.busy_elsewhere_since(self._start, ranks_here)
        threads = choose_threads(cores, busy, ranks_here)
        torch.set_num_threads(threads)
        return ThreadChoice(threads, cores, busy, ranks_here)
