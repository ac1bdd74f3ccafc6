"""Layer 7: the ``accelgen`` command line: the parser, the commands, what the terminal shows.

``python -m accelgen.cli`` runs it too (every launched rank does); see ``accelgen.cli.__main__``."""

from accelgen.cli.commands import main

__all__ = ["main"]
