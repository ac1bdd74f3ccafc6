"""docs/options.md's tables, made from the options each command declares (``accelgen.cli.command_options``).

``python -m accelgen.cli.option_tables docs/options.md`` rewrites the tables between the page's two markers and keeps
the words around them, which are written by hand; ``tests/test_docs.py`` fails while the page is out of date.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from accelgen.cli.command_options import COMMANDS
from accelgen.common.options import Option
from accelgen.common.run_options import RUN_SETTINGS
from accelgen.common.settings import DEFAULT_MODEL

BEGIN = "<!-- option tables: made by `python -m accelgen.cli.option_tables docs/options.md`; edit the declarations -->"
END = "<!-- end of the option tables -->"


def option_tables() -> str:
    """Every command's options as Markdown: a section per command, a table per group of its options."""
    sections = []
    for command, (summary, options) in COMMANDS.items():
        lines = [f"## accelgen {command}", "", f"{summary[0].upper()}{summary[1:]}."]
        for group, grouped in _groups(options):
            lines += ["", f"**{group}**" if group else "**options**", "",
                      "| option | takes | default | Python keyword | what it does |", "| --- | --- | --- | --- | --- |"]
            lines += [_row(option) for option in grouped]
        sections.append("\n".join(lines))
    # --help names the demo model by its absolute path, which differs between checkouts: the page names it by its
    # place in the repository, so that it reads the same in every checkout.
    return "\n\n".join(sections).replace(str(DEFAULT_MODEL), "core/default_model")


def _groups(options: Sequence[Option]) -> list[tuple[str, list[Option]]]:
    """The options by group, the command's own first, then each group as its first option comes (as --help shows)."""
    groups: dict[str, list[Option]] = {"": []}
    for option in options:
        groups.setdefault(option.group, []).append(option)
    return [(group, grouped) for group, grouped in groups.items() if grouped]


def _row(option: Option) -> str:
    flags = f"`{option.option}`, `--no-{option.option[2:]}`" if option.kind == "yes-no" else f"`{option.option}`"
    keyword = f"`{option.name}`" if RUN_SETTINGS.get(option.name) is not None else ""
    cells = (flags, option.takes(), option.shown_default and f"`{option.shown_default}`", keyword,
             option.help.replace("{default}", option.shown_default))
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def page_with_tables(page: str) -> str:
    """``page`` (docs/options.md's text) with the tables between its markers made anew."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"the page has no markers of the option tables: put {BEGIN} and {END} where they go")
    before, rest = page.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    return f"{before}{BEGIN}\n\n{option_tables()}\n\n{END}{after}"


def main(arguments: Sequence[str]) -> int:
    if len(arguments) != 1:
        print("usage: python -m accelgen.cli.option_tables docs/options.md", file=sys.stderr)
        return 2
    page = Path(arguments[0])
    page.write_text(page_with_tables(page.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
