"""A real ``accelgen run`` killed mid-way, for the tests that resume one."""

import signal
import subprocess
import time


def kill_after_rows(command: list[str], output, environment: dict, rows: int = 5, timeout: float = 120) -> int:
    """Start ``command`` (which writes ``output``), SIGKILL it once ``output`` holds ``rows`` lines, and return
    how many complete lines it had written."""
    run = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < rows):
        time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    return output.read_text().count("\n")
