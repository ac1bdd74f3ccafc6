"""The file ``accelgen bench`` writes: JSON, schema ``accelgen-bench`` version :data:`SCHEMA_VERSION` (the
layout is documented in docs/bench.md, "Result files"), with the environment it was measured in. Written whole or
not at all, after each batch size of a sweep (an abort later keeps the sizes measured before it); a write
that fails prints the document instead, so a measurement is never lost. ``accelgen compare`` reads any
number of them."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from accelgen.common.errors import UsageError
from accelgen.common.output_files import check_output_file, write_whole_file

SCHEMA = "accelgen-bench"
SCHEMA_VERSION = 1


def result_document(measurement: dict[str, Any]) -> dict[str, Any]:
    """The file ``accelgen bench`` writes: one measurement (a published-results file may hold several)."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "source": "measured",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "measurements": [measurement],
    }


def environment_facts() -> dict[str, Any]:
    """Library versions, machine and the accelgen source revision, for the result file."""
    versions = {}
    for package in ("accelgen", "torch", "transformers", "deepspeed"):  # device libraries: in describe()
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        **versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "git_revision": _git_revision(),
    }


def _git_revision() -> str | None:
    """The commit accelgen runs from, when it runs from a git checkout ("+dirty" with local changes)."""
    source = Path(__file__).resolve().parent
    try:
        revision = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return revision + ("+dirty" if dirty else "")


def check_output_path(path: str, overwrite: bool) -> None:
    """Refuse, before anything is measured, an --output that cannot be written as a regular file, or that
    exists (unless ``overwrite``)."""
    check_output_file(path, "--output", "results/cpu.json", exists_ok=overwrite)


def write_result(path: str, document: dict[str, Any]) -> None:
    """Write the result file whole or not at all. A failure (a full disk) leaves the file that was there as it
    was, prints ``document`` on standard output (the measurement is not lost) and raises UsageError saying so."""

    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(document, file, indent=2)
            file.write("\n")

    try:
        write_whole_file(path, "--output", write, fix="the measurement is printed on standard output instead (save it "
                                                      "to a file once there is room); the file was left as it was")
    except UsageError:
        print_json(document)
        raise


def print_json(document: dict[str, Any]) -> None:
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()
