"""accelgen: static-shape LLM text generation on any accelerator a plugin provides."""

from accelgen.api import generate, load
from accelgen.errors import UsageError
from accelgen.generator import Completion, Generator
from accelgen.hookspecs import Accelerator, hookimpl
from accelgen.plugins import get_plugin_manager

__all__ = [
    "Accelerator",
    "Completion",
    "Generator",
    "UsageError",
    "generate",
    "get_plugin_manager",
    "hookimpl",
    "load",
]
__version__ = "0.1.0"
