"""Hostile input, round 6 (issue 73): every case of the round run as a user types it, each case's outcome printed
as one row (its exit status and what it said). The tests in tests/ assert the same outcomes; this script shows them.

    python benchmarks/hostile_round6.py                 # every case
    python benchmarks/hostile_round6.py --area rows     # one area's cases
    python benchmarks/hostile_round6.py -k surrogate    # cases whose name holds a word
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import hostile_round6_cases  # noqa: E402


def cases(area: str | None, word: str | None):
    """(area, name, function) of each case asked for, areas in alphabetical order, cases in the order written."""
    for module_info in sorted(pkgutil.iter_modules(hostile_round6_cases.__path__), key=lambda info: info.name):
        if module_info.name == "common" or (area and module_info.name != area):
            continue
        module = importlib.import_module(f"hostile_round6_cases.{module_info.name}")
        functions = [(name, function) for name, function in vars(module).items()
                     if name.startswith("case_") and inspect.isfunction(function)]
        for name, function in sorted(functions, key=lambda item: item[1].__code__.co_firstlineno):
            if not word or word in name:
                yield module_info.name, name.removeprefix("case_"), function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--area", help="only this area's cases (a module of benchmarks/hostile_round6_cases)")
    parser.add_argument("-k", dest="word", help="only cases whose name holds this word")
    arguments = parser.parse_args()
    print("| area | case | what should happen | outcome | seconds |\n|---|---|---|---|---:|")
    for area, name, function in cases(arguments.area, arguments.word):
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"hostile-{name}-") as folder:
            try:
                outcome = function(Path(folder)).line()
            except Exception as error:  # noqa: BLE001 -- a case that could not be run is shown, and the others still run
                outcome = f"the case itself failed: {type(error).__name__}: {error}"
        expected = (inspect.getdoc(function) or "").splitlines()[0] if function.__doc__ else ""
        print(f"| {area} | {name} | {expected} | {outcome.replace('|', '/')} | {time.perf_counter() - started:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
