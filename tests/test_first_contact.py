"""A new user's first commands, tried as they are written: the README's examples do what they say, a model that
cannot be reached or found says so promptly in one line with the way on, ``bench`` says what it is doing as it goes
and ``compare --plot`` says where it wrote the chart."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from accelgen.loading.random_weights import built_in_config_name

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def shell_lines(text: str) -> list[list[str]]:
    """The words of each command line of the text's ``sh`` blocks, comments left out."""
    lines, in_block = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = line.strip() in ("```sh", "```shell", "```bash")
            continue
        if in_block and line.strip():
            lines.append(shlex.split(line, comments=True))
    return lines


def option(words: list[str], name: str, default: str | None = None) -> str | None:
    return words[words.index(name) + 1] if name in words else default


def rows_of_result_file(path: Path) -> set[tuple[str, int]]:
    """(model, batch size) of every measured row of a result file."""
    document = json.loads(path.read_text())
    return {(measurement["model"]["name"], row["batch_size"])
            for measurement in document["measurements"] for row in measurement["results"]}


def rows_of_bench_line(words: list[str]) -> set[tuple[str, int]]:
    """(model, batch size) of every row the ``accelgen bench`` line measures."""
    model = option(words, "--model-config") or option(words, "--model")
    model = built_in_config_name(model) or model
    return {(model, int(size)) for size in option(words, "--batch-sizes", "1").split(",")}


def test_the_readmes_compare_examples_compare_what_they_measure():
    lines = shell_lines(README.read_text())
    measured = {option(words, "--output"): rows_of_bench_line(words)
                for words in lines if words[:2] == ["accelgen", "bench"] and "--output" in words}
    compares = [words for words in lines if words[:2] == ["accelgen", "compare"]]
    assert compares  # the README shows compare
    for words in compares:
        files = [word for word in words[2:] if word.endswith(".json")]
        assert len(files) >= 2, words  # a comparison of something with something
        rows = [measured[file] if file in measured else rows_of_result_file(ROOT / file) for file in files]
        for file, file_rows in zip(files[1:], rows[1:]):
            assert rows[0] & file_rows, f"{file} measures {sorted(file_rows)}, {files[0]} {sorted(rows[0])}: no cell"
