"""The ``accelgen`` command line, made from the options each command declares (``accelgen.cli.command_options``); the
commands themselves are in ``accelgen.cli.commands``."""

from __future__ import annotations

import argparse
import textwrap
from typing import Sequence

from accelgen.cli.command_options import COMMANDS
from accelgen.common.errors import UsageError
from accelgen.common.options import Option


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, wrapped at spaces only: a folder's path in it (``/home/me/my-venv/...``) is never cut at a
    hyphen, so that it can be copied whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line (and exit status 2) instead of usage text."""

    def __init__(self, *arguments, **options):
        options.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*arguments, **options)

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


class _VersionAction(argparse.Action):
    """``accelgen --version``: accelgen's release and those of the libraries that decide what it runs, in one line
    (read from the installed distributions: nothing is imported)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **options):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print accelgen's version and those of torch, transformers and DeepSpeed, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """``accelgen 0.1.0 (torch 2.13.0+cpu, transformers 5.24.0, deepspeed not installed, Python 3.11.9)``."""
    import platform
    from importlib import metadata

    def version(distribution: str) -> str:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return "not installed"

    libraries = ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "deepspeed"))
    return f"accelgen {version('accelgen')} ({libraries}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accelgen", description="Static-shape LLM text generation on any accelerator.")
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    made = {}
    for name, (summary, options) in COMMANDS.items():
        made[name] = commands.add_parser(name, help=summary)
        add_options(made[name], options)
    # score is run's job with its rows scored: every option of run that decides nothing of a score takes run's default
    own = {action.dest for action in made["score"]._actions}
    made["score"].set_defaults(**{**{action.dest: action.default for action in made["run"]._actions
                                     if action.dest not in own and action.dest != "help"}, "max_new_tokens": 1})
    return parser


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Declare ``options`` to ``parser`` in their order, each in its group's section (made as it first comes)."""
    groups: dict[str, argparse._ActionsContainer] = {"": parser}
    exclusive: dict[str, argparse._ActionsContainer] = {}
    for option in options:
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        container = groups[option.group]
        if option.exclusive:
            if option.group not in exclusive:
                exclusive[option.group] = container.add_mutually_exclusive_group()
            container = exclusive[option.group]
        option.add_to(container)
