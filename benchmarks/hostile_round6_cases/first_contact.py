"""First contact: a new user's first commands, as the README writes them or as a newcomer types them (a Hub model
without a network, a folder that is not there, the benchmark with its defaults, a chart)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hostile_round6_cases.common import Outcome, accelgen, outcome_of

REPOSITORY = Path(__file__).resolve().parents[2]


def _readme_lines(start: str) -> list[list[str]]:
    """The words of each README line that starts with ``start`` (comments left out)."""
    return [shlex.split(line, comments=True) for line in (REPOSITORY / "README.md").read_text().splitlines()
            if line.startswith(start)]


def case_readme_compare(folder: Path) -> Outcome:
    """The README's bench and compare lines (bench kept short: 4 tokens, 1 run): the table has figures, not '-'."""
    bench = _readme_lines("accelgen bench")[0][1:]
    shortened = [*bench, "--max-new-tokens", "4", "--runs", "1", "--warmup-runs", "0"]
    measured = accelgen(*shortened, cwd=folder)
    if measured.status != 0:
        return measured
    compare = _readme_lines("accelgen compare")[0][1:]
    files = [str(REPOSITORY / word) if (REPOSITORY / word).exists() else word for word in compare]
    completed = subprocess.run([sys.executable, "-m", "accelgen.cli", *files], cwd=folder, capture_output=True,
                               text=True, timeout=300)
    lines = completed.stdout.splitlines()
    rule = next((number for number, line in enumerate(lines) if line.startswith("---")), len(lines))
    rows = [re.split(r"\s{2,}", line.strip())[3:] for line in lines[rule + 1:] if line.strip() and line[0] != "*"]
    compared = [row for row in rows if sum(cell != "-" for cell in row) >= 2]  # figures of two machines side by side
    outcome = outcome_of(completed.returncode, completed.stderr)
    return Outcome(outcome.status, outcome.said, f"{' '.join(compare[:3])}...: {len(compared)} of {len(rows)} rows "
                                                 f"compare two machines")


def case_hub_model_without_a_network(folder: Path) -> Outcome:
    """The Quick start's Hub model with no network (HF_ENDPOINT unreachable, empty cache): one line at once naming it."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("HF_")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(folder / "hf-home"), TRANSFORMERS_VERBOSITY="error")
    started = time.perf_counter()
    outcome = accelgen("run", "--model", "bigscience/bloomz-560m", "--prompt", "Translate to French: cheese",
                       env=env, timeout=120)
    seconds = time.perf_counter() - started
    outcome.note = f"{seconds:.1f} s{' (over 15 s: too slow)' if seconds > 15 else ''}" + (
        ", suggests --trust-remote-code" if "trust-remote-code" in outcome.said else "") + (
        f", {outcome.note}" if outcome.note else "")
    return outcome


def case_local_model_that_does_not_exist(folder: Path) -> Outcome:
    """The Quick start's ./my-model where there is none: one line pointing to the built-in model (omit --model)."""
    return accelgen("run", "--model", "./my-model", "--prompt", "hi", cwd=folder)


def case_bench_with_its_defaults(folder: Path) -> Outcome:
    """accelgen bench --device cpu with its defaults: it says what it does as it goes (first line within seconds)."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "accelgen.cli", "bench", "--device", "cpu"], cwd=folder,
                               env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error"),
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, first_after = [], None
    for line in process.stderr:
        first_after = first_after if first_after is not None else time.perf_counter() - started
        lines.append(line.rstrip("\n"))
    status = process.wait(timeout=900)
    total = time.perf_counter() - started
    outcome = outcome_of(status, "\n".join(lines))
    return Outcome(status, outcome.said, f"{len(lines)} lines, the first after {first_after or 0:.1f} s, "
                                         f"all in {total:.1f} s; first: {lines[0][:80] if lines else '-'}")


def case_compare_plot(folder: Path) -> Outcome:
    """accelgen compare FILE --plot chart.png: the chart is written and its path said."""
    published = REPOSITORY / "results" / "published" / "bloomz-7b1-gaudi2-a100-gaudi1.json"
    outcome = accelgen("compare", str(published), "--plot", "chart.png", cwd=folder)
    outcome.note = "chart.png written" if (folder / "chart.png").exists() else "no chart.png"
    return outcome
