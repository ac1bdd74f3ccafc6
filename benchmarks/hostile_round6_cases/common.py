"""What every case of the round uses: run ``accelgen`` as a user does (its own process, the built-in model unless a
case says otherwise, no network) and say how it ended in one line.

A case is a function ``case_<name>(folder: Path) -> Outcome`` in an area module of this package: it builds what it
needs under ``folder`` (a fresh empty folder), runs the command and returns its :class:`Outcome`. Its docstring's
first line says what the user does and what should happen.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

#: The quick run every case starts from: the built-in model, two new tokens, no progress lines.
QUICK = ["run", "--device", "cpu", "--max-new-tokens", "2", "--quiet"]


@dataclasses.dataclass
class Outcome:
    """How a command ended: its exit status, what it last said on stderr (its error line), and a note the case adds
    (what its output file holds, whether a traceback was printed)."""

    status: int
    said: str
    note: str = ""

    def line(self) -> str:
        note = f" [{self.note}]" if self.note else ""
        return f"exit {self.status}: {self.said}{note}"


def environment(**extra: str) -> dict:
    """The environment of a case's command: offline, quiet libraries, plus ``extra``."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
                **extra)


def accelgen(*arguments: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 900) -> Outcome:
    """``accelgen ARGUMENTS`` run to its end in its own process."""
    completed = subprocess.run([sys.executable, "-m", "accelgen.cli", *arguments], cwd=cwd,
                               env=env or environment(), capture_output=True, text=True, timeout=timeout)
    return outcome_of(completed.returncode, completed.stderr)


def outcome_of(status: int, stderr: str) -> Outcome:
    """The Outcome of a command that ended with ``status`` having said ``stderr``."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("accelgen: error:")]
    said = (errors or lines or ["(nothing on stderr)"])[-1]
    return Outcome(status, said[:400], "TRACEBACK" if "Traceback" in stderr else "")


def rows_of(output: Path) -> list[dict]:
    """The JSON lines an output file holds (none when it was not written)."""
    if not output.exists():
        return []
    return [json.loads(line) for line in output.read_text().splitlines() if line.strip()]


def error_rows_note(output: Path) -> str:
    """``N rows, K error rows`` of an output file, for a case's note."""
    rows = rows_of(output)
    return f"{len(rows)} rows, {sum(1 for row in rows if row.get('error'))} error rows"
