"""What one option of accelgen is: its name, what it takes, its default, its help and its check, declared once.

The declarations are tables of :class:`Option`: the run's settings in ``accelgen.common.run_options`` (the Python
API's keywords), the command line's own options in ``accelgen.cli.command_options``. From them come the command
line (``accelgen.cli.parser``), the keywords ``accelgen.load`` and ``accelgen.generate`` take, the check of each
value whichever way it came in (:meth:`Option.check`) and the option tables of docs/options.md
(``accelgen.cli.option_tables``). A command that takes an option with other words or another default takes it
``option.but(help=...)``: its name, its values and its check stay the declaration's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

from accelgen.common.errors import UsageError
from accelgen.common.value_ranges import RANGES, Range, option_name

#: What an option takes on the command line (``Option.kind``).
KINDS = (
    "value",  # one value after the flag
    "switch",  # the flag alone sets it (store_true)
    "repeated",  # the flag once per value (append)
    "yes-no",  # --flag / --no-flag; absent: the default (argparse.BooleanOptionalAction)
    "numbers",  # comma-separated numbers, each in the option's range (--buckets 32,64,128)
    "arguments",  # one or more words after the command, no flag (accelgen compare FILES)
)


@dataclasses.dataclass(frozen=True)
class Option:
    """One option, declared once. ``name`` is its Python keyword and the parsed argument's name (``max_new_tokens``
    for ``--max-new-tokens``); ``help`` says what it does, ``{default}`` standing for its default; a numeric option's
    range is ``accelgen.common.value_ranges.RANGES``' entry of its name (or ``numbers``) and is added to its help."""

    name: str
    help: str
    default: Any = None
    kind: str = "value"
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # the command line's text to the value (raising ArgumentTypeError)
    metavar: str | None = None
    bare_value: Any = None  # with ``bare``: the value of the flag given alone (``--ray`` without an address)
    bare: bool = False
    flag: str = ""  # "": the name's (``--max-new-tokens``)
    dest: str = ""  # the parsed argument's name where the command line's value is not the setting's (a FILE, not text)
    group: str = ""  # the section of --help and of the docs' table it is in ("": the command's own options)
    exclusive: bool = False  # at most one of the group's exclusive options may be given
    required: bool = False
    numbers: Range | None = None  # "": the range of its name's RANGES entry, if any
    range_in_help: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"option {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def but(self, **changes) -> Option:
        """This option as a command takes it: other words, another default or group; the same name and check."""
        return dataclasses.replace(self, **changes)

    @property
    def option(self) -> str:
        """Its flag: ``--max-new-tokens`` (the name of the words an ``arguments`` option takes)."""
        return self.flag or (self.name if self.kind == "arguments" else option_name(self.name))

    @property
    def value_range(self) -> Range | None:
        """The range of its numbers: ``numbers``, else its name's entry of RANGES unless it parses its own text."""
        if self.numbers is not None or self.parse is not None or self.kind not in ("value", "numbers"):
            return self.numbers
        return RANGES.get(self.name)

    @property
    def shown_default(self) -> str:
        """Its default as help and docs write it: ``1,8,32`` for numbers, ``''`` when it has none."""
        if self.default is None or self.kind in ("switch", "repeated"):
            return ""
        if isinstance(self.default, (tuple, list)):
            return ",".join(map(str, self.default))
        return str(self.default)

    def described(self) -> str:
        """Its help as --help shows it: the words, the default in them, the range after them."""
        text = self.help.replace("{default}", self.shown_default)
        if self.range_in_help and self.kind == "value" and self.value_range is not None:
            text = f"{text}; {self.value_range.describe()}"
        return text

    def takes(self) -> str:
        """What follows the flag, in words, for the docs: ``continuous, static``; a range; ``FILE``; nothing."""
        if self.kind in ("switch", "yes-no"):
            return ""
        if self.kind == "arguments":
            return f"{self.name.upper()}..."
        if self.choices:
            return ", ".join(self.choices)
        if self.value_range is not None:
            listed = "comma-separated, each " if self.kind == "numbers" else ""
            return listed + self.value_range.describe()
        return self.metavar or self.name.upper()

    def check(self, value: Any) -> None:
        """Raise UsageError, naming the flag, when ``value`` (from Python, a file or the command line) is not one this
        option takes: out of its range, or not one of its choices. None: not set."""
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise UsageError(f"{self.option} must be one of {', '.join(self.choices)} (got {value!r}).")
        if self.value_range is not None:
            self.value_range.check_each(self.option, value)

    def add_to(self, parser: argparse.ArgumentParser | argparse._ActionsContainer) -> None:
        """Declare this option to an argparse parser (or one of its groups)."""
        if self.kind == "arguments":
            parser.add_argument(self.name, nargs="+", help=self.described())
            return
        keywords: dict[str, Any] = {"dest": self.dest or self.name, "help": self.described()}
        if self.kind == "switch":
            keywords["action"] = "store_true"
        elif self.kind == "yes-no":
            keywords.update(action=argparse.BooleanOptionalAction, default=self.default)
        else:
            # argparse appends to a copy of a list default: a fresh list for each parser
            keywords["default"] = list(self.default) if self.kind == "repeated" and self.default is not None else self.default
            if self.kind == "repeated":
                keywords["action"] = "append"
            kept = self.value_range
            keywords["type"] = (kept.parse_list if self.kind == "numbers" else kept.parse) if kept else self.parse
            if self.choices is not None:
                keywords["choices"] = self.choices
            if self.metavar is not None:
                keywords["metavar"] = self.metavar
            if self.bare:
                keywords.update(nargs="?", const=self.bare_value)
            if self.required:
                keywords["required"] = True
        parser.add_argument(self.option, **{key: value for key, value in keywords.items() if value is not None})


def json_object_text(flag: str, what: str = "template variables", example: str = '{"enable_thinking": false}'):
    """The ``parse`` of an option holding a JSON object (of ``what``, such as ``example``)."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError as error:
            raise UsageError(f"{flag} is not JSON ({error}): give a JSON object, e.g. '{example}'.") from None
        if not isinstance(value, dict):
            raise UsageError(f"{flag} must be a JSON object of {what}, e.g. '{example}'.")
        return value

    return parse
