"""A real ``accelgen run`` killed mid-way, for the tests that resume one."""

import signal
import subprocess
import time


def kill_after_rows(command: list[str], output, environment: dict, rows: int = 5, timeout: float = 120,
                    watched=None) -> int:
    """Start ``command`` (which writes ``output``), SIGKILL it once ``output`` (or the file ``watched``) holds ``rows``
    lines, and return how many complete lines it had written to ``output``."""
    run = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watched = watched or output
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not watched.exists() or watched.read_text().count("\n") < rows):
        time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    return output.read_text().count("\n") if output.exists() else 0


def killed_then_resumed_and_whole(command: list[str], folder, environment: dict, rows: int = 5) -> tuple:
    """Run ``command`` (an ``accelgen run`` without --output) into ``folder/resumed.jsonl``, SIGKILL it after ``rows``
    lines, run it again to resume, and run it whole into ``folder/whole.jsonl``: the two outputs' paths and how many
    lines the killed run had written."""
    whole, resumed = folder / "whole.jsonl", folder / "resumed.jsonl"
    written = kill_after_rows([*command, "--output", str(resumed)], resumed, environment, rows=rows)
    for output in (resumed, whole):
        result = subprocess.run([*command, "--output", str(output)], env=environment, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
    return resumed, whole, written
