"""The fields of a PEFT adapter's ``adapter_config.json`` that accelgen reads, each checked for its type and range before
any of them is used: a value PEFT would never write (``lora_alpha`` null or a text, a rank of 0, a pattern that is not a
regular expression) is one line naming the field, never a TypeError from the arithmetic that reads it.

What each field must be follows PEFT's ``LoraConfig``; a field left out takes PEFT's default.
"""

from __future__ import annotations

import json
import math
import re
from typing import Callable

#: PEFT's default ``lora_alpha``.
DEFAULT_ALPHA = 8
#: The longest a value is shown in a message.
SHOWN_LENGTH = 80


def is_number(value: object) -> bool:
    """A finite JSON number that a float holds (true and false are not numbers here)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # a whole number beyond any float
        return False


def is_rank(value: object) -> bool:
    """A whole number from 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_modules(value: object) -> bool:
    """PEFT's ``target_modules``: a module name (or pattern), a list of them, or null."""
    return value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(name, str) for name in value))


#: field -> (what a value must hold, what that is in words); null or absent is PEFT's default for each
FIELD_CHECKS: dict[str, tuple[Callable[[object], bool], str]] = {
    "peft_type": (lambda value: isinstance(value, str), "a text (LORA)"),
    "bias": (lambda value: isinstance(value, str), "a text ('none')"),
    "r": (is_rank, "a whole number from 1"),
    "lora_alpha": (is_number, "a finite number"),
    "use_rslora": (lambda value: value is None or isinstance(value, bool), "true or false"),
    "fan_in_fan_out": (lambda value: value is None or isinstance(value, bool), "true or false"),
    "target_modules": (_is_modules, "a module name, a list of them or null"),
    "base_model_name_or_path": (lambda value: value is None or isinstance(value, str), "a text or null"),
    "rank_pattern": (lambda value: value is None or isinstance(value, dict), "an object of module name patterns"),
    "alpha_pattern": (lambda value: value is None or isinstance(value, dict), "an object of module name patterns"),
}
#: pattern field -> (what each of its values must hold, in words)
PATTERN_VALUES = {"rank_pattern": (is_rank, "a whole number from 1"), "alpha_pattern": (is_number, "a finite number")}


def shown(value: object) -> str:
    """``value`` as a message shows it: as JSON writes it (the file's own words), cut short."""
    text = json.dumps(value)
    return text if len(text) <= SHOWN_LENGTH else text[: SHOWN_LENGTH - 3] + "..."


def config_problem(config: dict) -> str | None:
    """What in ``config`` (a parsed ``adapter_config.json``) is not what PEFT writes, as ``has FIELD VALUE, and it must
    be ...``; None when every field read is sound."""
    for field, (holds, what) in FIELD_CHECKS.items():
        if field in config and not holds(config[field]):
            return f"{field} is {shown(config[field])}, and it must be {what}"
    for field, (holds, what) in PATTERN_VALUES.items():
        for pattern, value in (config.get(field) or {}).items():
            try:
                re.compile(_matching(pattern))
            except (re.error, RecursionError, OverflowError) as error:
                return f"{field}'s {shown(pattern)} is not a regular expression ({error})"
            if not holds(value):
                return f"{field}'s {shown(pattern)} is {shown(value)}, and it must be {what}"
    return None


def matching_pattern(patterns: dict | None, module: str) -> str | None:
    """The first of PEFT's per-module ``patterns`` (``rank_pattern``, ``alpha_pattern``) matching the end of
    ``module``'s name, or None."""
    return next((pattern for pattern in patterns or {} if re.match(_matching(pattern), module)), None)


def by_pattern(patterns: dict | None, module: str, default: float) -> float:
    """PEFT's per-module value: that of the first of ``patterns`` matching ``module``, else ``default``."""
    pattern = matching_pattern(patterns, module)
    return default if pattern is None else patterns[pattern]


def _matching(pattern: str) -> str:
    """The regular expression of a module name pattern, as PEFT matches it: the end of the name, after a dot."""
    return rf"(.*\.)?({pattern})$"
