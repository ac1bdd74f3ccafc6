"""accelgen: static-shape LLM text generation on any accelerator a plugin provides."""

from accelgen.common.errors import UsageError
from accelgen.generation.generator import Completion, Generator
from accelgen.plugin.contract import Accelerator, hookimpl
from accelgen.plugin.manager import get_plugin_manager
from accelgen.session.api import generate, load

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
