"""This process's host memory (resident set), whatever the device: what loading a model costs the host,
where a model that does not fit shows first."""

from __future__ import annotations

import os
import resource


def resident_bytes() -> int:
    """Host memory this process holds now (Linux: /proc/self/statm; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """The most host memory this process has held since it started (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
