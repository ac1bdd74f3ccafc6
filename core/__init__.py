"""accelgen: static-shape LLM text generation on any accelerator a plugin provides.

The names below are loaded when first used, so that ``import accelgen`` (and ``accelgen --help``) does not
import torch and transformers before they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelgen.common.errors import UsageError
    from accelgen.generation.generator import Generator
    from accelgen.generation.text import Completion
    from accelgen.plugin.contract import Accelerator, Tuning, hookimpl
    from accelgen.plugin.manager import get_plugin_manager
    from accelgen.session.api import generate, load

#: Each public name and the module that holds it.
_EXPORTS = {
    "Accelerator": "accelgen.plugin.contract",
    "hookimpl": "accelgen.plugin.contract",
    "Tuning": "accelgen.plugin.contract",
    "get_plugin_manager": "accelgen.plugin.manager",
    "UsageError": "accelgen.common.errors",
    "Completion": "accelgen.generation.text",
    "Generator": "accelgen.generation.generator",
    "generate": "accelgen.session.api",
    "load": "accelgen.session.api",
}

__all__ = ["Accelerator", "Completion", "Generator", "Tuning", "UsageError", "generate", "get_plugin_manager", "hookimpl",
           "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'accelgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value
