"""Plugins across a contract change and plugins that name their device badly, installed as pip would leave them (a
module and its ``.dist-info`` with an ``accelgen`` entry point, in a folder on PYTHONPATH)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hostile_round6_cases.common import QUICK, Outcome, accelgen, environment, outcome_of

#: A third-party device written for the contract before ``accelgen.Tuning``: its knobs on the class.
LAST_MONTHS_PLUGIN = """
import torch
import accelgen

class LastMonthsNpu(accelgen.Accelerator):
    name = "oldnpu"
    captures_by_default = True
    capture_pays_after_steps = 0

    def is_available(self):
        return True

    def setup(self, world):
        return torch.device("cpu")

    def capture(self, step, example_inputs, run):
        return step

@accelgen.hookimpl
def accelgen_register_accelerators(register):
    register(LastMonthsNpu())
"""

BADLY_NAMED_PLUGIN = """
import torch
import accelgen

class BadlyNamed(accelgen.Accelerator):
    name = {name!r}

    def is_available(self):
        return True

    def setup(self, world):
        return torch.device("cpu")

@accelgen.hookimpl
def accelgen_register_accelerators(register):
    register(BadlyNamed())
"""


def installed(folder: Path, source: str) -> dict:
    """The environment of a command that finds the plugin package ``accelgen-thirdparty 0.1`` holding ``source``."""
    site = folder / "site"
    metadata = site / "accelgen_thirdparty-0.1.dist-info"
    metadata.mkdir(parents=True)
    (site / "accelgen_thirdparty.py").write_text(source)
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: accelgen-thirdparty\nVersion: 0.1\n")
    (metadata / "entry_points.txt").write_text("[accelgen]\nthirdparty = accelgen_thirdparty\n")
    (metadata / "top_level.txt").write_text("accelgen_thirdparty\n")
    (metadata / "RECORD").write_text("")
    return environment(PYTHONPATH=str(site))


def case_old_contract_plugin(folder: Path) -> Outcome:
    """A plugin setting captures_by_default on its class (last month's contract): the run ends, one deprecation line."""
    env = installed(folder, LAST_MONTHS_PLUGIN)
    output = folder / "out.jsonl"
    command = [*QUICK, "--prompt", "hi", "--output", str(output)]
    command[command.index("cpu")] = "oldnpu"
    completed = subprocess.run([sys.executable, "-m", "accelgen.cli", *command], env=env, capture_output=True,
                               text=True, timeout=900)
    outcome = outcome_of(completed.returncode, completed.stderr)
    warnings = [line for line in completed.stderr.splitlines() if line.startswith("accelgen: warning:")]
    rows = len(output.read_text().splitlines()) if output.exists() else 0
    return Outcome(outcome.status, warnings[0][:400] if warnings else outcome.said,
                   f"{len(warnings)} warning line(s), {rows} row(s) written" + (", TRACEBACK" if outcome.note else ""))


def case_device_named_with_a_colon(folder: Path) -> Outcome:
    """A plugin registering the device 'cuda:0', then --device cuda:0: refused in one line naming the plugin."""
    env = installed(folder, BADLY_NAMED_PLUGIN.format(name="cuda:0"))
    command = [*QUICK, "--prompt", "hi"]
    command[command.index("cpu")] = "cuda:0"
    return accelgen(*command, env=env)


def case_device_named_with_a_space(folder: Path) -> Outcome:
    """A plugin registering the device 'my device', then accelgen devices: listed as broken, the others available."""
    env = installed(folder, BADLY_NAMED_PLUGIN.format(name="my device"))
    completed = subprocess.run([sys.executable, "-m", "accelgen.cli", "devices"], env=env, capture_output=True,
                               text=True, timeout=900)
    broken = [line for line in completed.stdout.splitlines() if line.startswith("broken")]
    available = [line.split()[0] for line in completed.stdout.splitlines() if " available" in line]
    return Outcome(completed.returncode, broken[0][:400] if broken else "(no broken line)",
                   f"available: {', '.join(available)}")
