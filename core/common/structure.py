"""What a completion may be held to: a JSON Schema, any JSON object, a regular expression or a list of choices.

A :class:`Structure` is plain data, made here from what the user gives (a flag's value, a dataset column's
value, an OpenAI batch request's ``response_format``) and checked as far as that can be done without the grammar
engine: the engine's own check (what it supports) is ``accelgen.generation.grammars.structure_problem``. Each
maker raises ValueError whose message is a clause saying what is wrong ("is not JSON (...)"); the caller names
the flag or the row.
"""

from __future__ import annotations

import dataclasses
import json
import re

#: The kinds of structure, as the run record and the engine adapter name them.
KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclasses.dataclass(frozen=True)
class Structure:
    """One constraint: ``kind`` (of :data:`KINDS`) and ``text``, the schema as compact JSON (its keys in the order
    given: a schema's property order is the order the object is written in), the pattern, or the choices as a JSON
    list. Equal structures compile once."""

    kind: str
    text: str

    @property
    def flag(self) -> str:
        """The ``accelgen run`` option that asks for this kind of structure for every row."""
        return {"json_schema": "--json-schema", "json_object": "--json", "regex": "--regex", "choice": "--choice"}[self.kind]

    def describe(self) -> str:
        """The constraint as a short phrase, for messages."""
        shown = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return {"json_schema": f"JSON schema {shown}", "json_object": "any JSON object", "regex": f"regex {shown!r}",
                "choice": f"choices {shown}"}[self.kind]


#: What ``--json`` holds a completion to.
JSON_OBJECT = Structure("json_object", '{"type":"object"}')

#: The deepest a schema's JSON may nest (objects and lists in each other): deeper than any schema written by hand, and
#: within what the grammar engine reads (it refuses about 128) and Python's JSON reader (its recursion limit).
MOST_SCHEMA_DEPTH = 100


def schema_value(text: str | bytes) -> object:
    """The JSON value of a schema's text. ValueError when it is not JSON or nests deeper than :data:`MOST_SCHEMA_DEPTH`
    (said before it is read, which would exhaust Python's recursion)."""
    if _text_depth(text.decode("utf-8", "replace") if isinstance(text, bytes) else text) > MOST_SCHEMA_DEPTH:
        raise ValueError(_TOO_DEEP)
    try:
        return json.loads(text)
    except ValueError as error:
        raise ValueError(f"is not JSON ({str(error).splitlines()[0]})") from None


def schema_structure(schema: object) -> Structure:
    """A JSON Schema given as an object (a dict, or ``true``: anything) or as its JSON text. ValueError when it is
    not JSON, not an object, ``false`` (which nothing matches) or nested deeper than :data:`MOST_SCHEMA_DEPTH`."""
    if isinstance(schema, (str, bytes)):
        schema = schema_value(schema)
    elif _value_depth(schema) > MOST_SCHEMA_DEPTH:
        raise ValueError(_TOO_DEEP)
    if schema is True:
        schema = {}
    if schema is False:
        raise ValueError("is the schema false, which no completion matches")
    if not isinstance(schema, dict):
        raise ValueError(f"is {_json_type(schema)}, not a JSON Schema (an object such as {{\"type\": \"object\", ...}})")
    return Structure("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


def regex_structure(pattern: object) -> Structure:
    """A regular expression the whole completion matches. ValueError when it is not a non-empty text."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("is empty: give a regular expression the whole completion must match")
    return Structure("regex", pattern)


def choice_structure(choices: object) -> Structure:
    """One of ``choices`` (texts), exactly. ValueError when there are none, or one is empty or not a text."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("is empty: give at least one text the completion may be")
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"has {choice!r}, which is not a text of at least one character")
    return Structure("choice", json.dumps(list(choices), ensure_ascii=False))


def job_structure(json_schema: object = None, json_object: bool = False, regex: str | None = None,
                  choices: object = None) -> Structure | None:
    """The structure a whole run's completions are held to (``--json-schema``, ``--json``, ``--regex``, ``--choice``),
    None when none is asked for. ValueError naming the flag: a value that cannot be one, or several flags at once."""
    given = [(flag, value, make) for flag, value, make in (
        ("--json-schema", json_schema, schema_structure), ("--json", json_object or None, lambda _: JSON_OBJECT),
        ("--regex", regex, regex_structure), ("--choice", choices, choice_structure)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(flag for flag, *_ in given)} each hold the completion to a structure: pass "
                         f"one of them")
    if not given:
        return None
    flag, value, make = given[0]
    try:
        return make(value)
    except ValueError as error:
        raise ValueError(f"{flag} {error}") from None


def response_format_structure(response_format: object) -> Structure | None:
    """The structure of an OpenAI request's ``response_format``: ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}``, ``{"type": "json_object"}``, or ``{"type": "text"}`` (None). ValueError saying what is
    wrong with it."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise ValueError(f"response_format {response_format!r} is not served: give type text, json_object or json_schema")
    described = response_format.get("json_schema")
    if not isinstance(described, dict) or "schema" not in described:
        raise ValueError("response_format json_schema must hold {\"name\", \"schema\", \"strict\"} with the schema in "
                         "\"schema\"")
    try:
        return schema_structure(described["schema"])
    except ValueError as error:
        raise ValueError(f"response_format's schema {error}") from None


_TOO_DEEP = f"nests deeper than {MOST_SCHEMA_DEPTH} levels (objects and lists within each other), more than a schema needs"


def _text_depth(text: str) -> int:
    """How deep the objects and lists of a JSON text nest (brackets inside strings not counted)."""
    depth = deepest = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in "]}":
            depth -= 1
    return deepest


def _value_depth(value: object) -> int:
    """How deep the dicts and lists of ``value`` nest, counted without recursion."""
    deepest, waiting = 0, [(value, 1)]
    while waiting:
        value, depth = waiting.pop()
        if isinstance(value, (dict, list, tuple)):
            deepest = max(deepest, depth)
            if deepest > MOST_SCHEMA_DEPTH:
                return deepest
            waiting.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def _json_type(value: object) -> str:
    """``value``'s JSON type, with an article ("a list", "a number")."""
    return {list: "a list", str: "a text", type(None): "null", bool: "a boolean"}.get(type(value), "a number")
