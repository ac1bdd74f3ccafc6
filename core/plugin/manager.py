"""The plugin manager: built-in plugins first, then third-party ones from the ``accelgen`` entry points.

Entry points are loaded one at a time: one that fails to import is remembered with its error (``accelgen
devices`` lists it, ``--device`` errors name it) and the others still load, instead of the whole
command failing or the plugin vanishing without a word.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import sys

import pluggy

from accelgen.common.errors import first_line
from accelgen.plugin import contract as hookspecs

#: Built-in plugins, registered by module name before entry points so installed plugins can override them.
DEFAULT_PLUGINS = ("accelgen_cpu", "accelgen_cuda", "accelgen_hpu")

ENTRY_POINT_GROUP = "accelgen"


@dataclasses.dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that could not be used: which one, from which package, and why (one sentence)."""

    plugin: str
    package: str | None
    problem: str
    devices: tuple[str, ...] = ()  # the device names it tried to register, when known

    def line(self) -> str:
        return f"{self.plugin} ({self.package or 'package unknown'}): {self.problem}"


class PluginManager(pluggy.PluginManager):
    """pluggy's plugin manager, which also remembers the entry points that failed to load."""

    def __init__(self):
        super().__init__("accelgen")
        self.load_failures: list[BrokenPlugin] = []


def get_plugin_manager(*, load_entry_points: bool = True) -> PluginManager:
    """Return a new plugin manager with the built-in plugins and (unless told not to) installed ones.

    A built-in registers under its module name, which is also its entry-point name, so its entry point
    is skipped instead of registering the module twice.
    """
    plugin_manager = PluginManager()
    plugin_manager.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        plugin_manager.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        _load_entry_points(plugin_manager)
    if os.environ.get("ACCELGEN_TRACE_HOOKS"):
        plugin_manager.trace.root.setwriter(sys.stderr.write)
        plugin_manager.enable_tracing()
    return plugin_manager


def _load_entry_points(plugin_manager: PluginManager) -> None:
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if plugin_manager.has_plugin(entry_point.name) or plugin_manager.is_blocked(entry_point.name):
            continue
        package = _distribution_line(entry_point.dist)
        try:
            plugin_manager.register(entry_point.load(), name=entry_point.name)
        except Exception as error:  # noqa: BLE001 - any failure of a third party's code: recorded, shown, not fatal
            plugin_manager.load_failures.append(
                BrokenPlugin(entry_point.name, package, f"cannot be loaded: {type(error).__name__}: {first_line(error)}")
            )


def package_of(plugin: object) -> str | None:
    """``distribution version`` of the installed package that holds ``plugin`` (a module or an object)."""
    module = plugin.__name__ if isinstance(plugin, type(sys)) else type(plugin).__module__
    for distribution in _distributions_by_top_level_module().get(module.split(".")[0], []):
        return f"{distribution} {importlib.metadata.version(distribution)}"
    return None


@functools.cache
def _distributions_by_top_level_module() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed package's metadata: once


def _distribution_line(distribution) -> str | None:
    return f"{distribution.name} {distribution.version}" if distribution is not None else None

