"""The plugin manager: built-in plugins first, then third-party ones from the ``accelgen`` entry points."""

from __future__ import annotations

import importlib
import os
import sys

import pluggy

from accelgen import hookspecs

#: Built-in plugins, registered by module name before entry points so installed plugins can override them.
DEFAULT_PLUGINS = ("accelgen_cpu", "accelgen_cuda", "accelgen_hpu")

ENTRY_POINT_GROUP = "accelgen"


def get_plugin_manager(*, load_entry_points: bool = True) -> pluggy.PluginManager:
    """Return a new plugin manager with the built-in plugins and (unless told not to) installed ones.

    A built-in registers under its module name, which is also its entry-point name, so pluggy skips
    the entry point instead of registering the module twice.
    """
    plugin_manager = pluggy.PluginManager("accelgen")
    plugin_manager.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        plugin_manager.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        plugin_manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    if os.environ.get("ACCELGEN_TRACE_HOOKS"):
        plugin_manager.trace.root.setwriter(sys.stderr.write)
        plugin_manager.enable_tracing()
    return plugin_manager
