"""Layer 9: the ``accelgen`` command line: the parser, the commands, what the terminal shows.

``python -m accelgen.cli`` runs it too (every launched rank does); see ``accelgen.cli.__main__``. ``main`` (the command
line called from Python) and ``script`` (the ``accelgen`` script: ``main`` in a process of its own) are imported when
first asked for, so that a rank imports nothing before it is tied to its launcher."""

from __future__ import annotations

__all__ = ["main", "script"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'accelgen.cli' has no attribute {name!r}")
    from accelgen.cli import commands

    return getattr(commands, name)
