"""This process's host memory (resident set), whatever the device: what loading a model costs the host,
where a model that does not fit shows first.

On Linux the peak is the kernel's high-water mark of this process's memory (VmHWM), which
:func:`restart_peak` can set back to what the process holds now, so that a peak can be taken over one phase
(loading). Not ``getrusage``'s ``ru_maxrss``: a process started by a large one inherits that one's figure
(it survives fork and exec), so each rank of a job would report at least what its launcher held.
"""

from __future__ import annotations

import resource


def resident_bytes() -> int:
    """Host memory this process holds now."""
    return _status_bytes("VmRSS") or peak_resident_bytes()


def peak_resident_bytes() -> int:
    """The most host memory this process has held since it started, or since :func:`restart_peak`."""
    return _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def system_memory() -> dict[str, int]:
    """``free_bytes`` (memory the kernel can give without swapping: MemAvailable) and ``total_bytes`` of this
    machine, where Linux tells them (else nothing)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return {"free_bytes": int(fields["MemAvailable"].split()[0]) * 1024,
                "total_bytes": int(fields["MemTotal"].split()[0]) * 1024}
    except (OSError, KeyError, ValueError):
        return {}


def restart_peak() -> None:
    """Start the peak afresh from what the process holds now (Linux; elsewhere nothing changes)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status in bytes, or None where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
