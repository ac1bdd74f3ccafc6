"""Older forms of the plugin contract that an accelerator may still use for a stated time: each is read as today's
form, and the registry says once, in a deprecation line, what the plugin author writes instead and until when the old
form is accepted. docs/plugins.md keeps the contract's changelog; a form is removed from here once its date passes."""

from __future__ import annotations

import dataclasses

from accelgen.plugin.contract import Tuning

#: Tuning's knobs were members of the accelerator itself until this date (the contract's change that made them
#: fields of ``Accelerator.tuning``).
TUNING_MOVED_ON = "2026-11-27"
#: The last day an accelerator setting a tuning knob on itself is accepted; after it, such a plugin is refused.
OLD_TUNING_ACCEPTED_UNTIL = "2027-03-31"


def knobs_set_on_itself(accelerator: object) -> dict[str, object]:
    """The Tuning fields ``accelerator`` sets as members of its own (the contract's form before TUNING_MOVED_ON),
    with their values, in Tuning's order. Reading them runs the plugin's code (they may be properties)."""
    return {field.name: getattr(accelerator, field.name) for field in dataclasses.fields(Tuning)
            if hasattr(accelerator, field.name)}


#: What each kind of knob (its field's annotation in Tuning) may hold, and the words saying so.
_KINDS = {
    "bool": (lambda value: isinstance(value, bool), "True or False"),
    "int": (lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a whole number >= 0"),
    "float": (lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
              "a number >= 0"),
}


def wrong_kind(knobs: dict[str, object]) -> str | None:
    """The first knob whose value is not of its field's kind, as ``name=value: it must be ...``; None when all fit."""
    kinds = {field.name: _KINDS[str(field.type)] for field in dataclasses.fields(Tuning)}
    for name, value in knobs.items():
        fits, kind = kinds[name]
        if not fits(value):
            return f"{name}={value!r}: it must be {kind}"
    return None


def read_as_tuning(accelerator: object, knobs: dict[str, object]) -> None:
    """Give ``accelerator`` the tuning its own knobs say, over the tuning it has (a subclass of another device keeps its
    parent's other knobs). Raises AttributeError where the accelerator does not let its ``tuning`` be set."""
    accelerator.tuning = dataclasses.replace(accelerator.tuning, **knobs)


def deprecation(plugin: str, kind: str, knobs: dict[str, object]) -> str:
    """The deprecation line's words for a plugin (``plugin npu (npu-plugin 0.1)``) whose accelerator class ``kind``
    sets ``knobs`` on itself."""
    settings = ", ".join(f"{name}={value!r}" for name, value in knobs.items())
    return (f"{plugin} sets {', '.join(knobs)} on {kind} itself, the contract's form before {TUNING_MOVED_ON}: write "
            f"tuning = accelgen.Tuning({settings}) in the class instead (docs/plugins.md, 'Changes to the contract'); "
            f"the old form is read until {OLD_TUNING_ACCEPTED_UNTIL} and refused after it")
