"""The plugin manager: built-in plugins first, then third-party ones from the ``accelgen`` entry points.

Entry points are loaded one at a time, each through ``accelgen.plugin.isolation.call_plugin``: one that fails
to import (raises anything, calls ``sys.exit``) is remembered with its error (``accelgen devices`` lists it,
``--device`` errors name it, other commands warn) and the others still load, instead of the whole command
failing or the plugin vanishing without a word; one that takes long to import is named while the command waits.

``ACCELGEN_SKIP_PLUGINS=name,...`` leaves plugins out: an entry point's name, a built-in's module name, an
installed package's name, or ``*`` for every installed plugin that is not built in.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import sys

import pluggy

from accelgen.plugin import contract as hookspecs
from accelgen.plugin.isolation import SKIP_VARIABLE, PluginFailure, PluginOrigin, call_plugin, error_text

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
    """pluggy's plugin manager, which also remembers the entry points that failed to load and the plugins
    the user left out with ACCELGEN_SKIP_PLUGINS."""

    def __init__(self):
        super().__init__("accelgen")
        self.load_failures: list[BrokenPlugin] = []
        self.skipped: list[str] = []


def get_plugin_manager(*, load_entry_points: bool = True) -> PluginManager:
    """Return a new plugin manager with the built-in plugins and (unless told not to) installed ones.

    A built-in registers under its module name, which is also its entry-point name, so its entry point
    is skipped instead of registering the module twice.
    """
    plugin_manager = PluginManager()
    plugin_manager.add_hookspecs(hookspecs)
    skip = _plugins_to_skip()
    for module_name in DEFAULT_PLUGINS:
        if _normalized(module_name) in skip:
            plugin_manager.skipped.append(module_name)
            plugin_manager.set_blocked(module_name)  # and its entry point with it
        else:
            plugin_manager.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        _load_entry_points(plugin_manager, skip)
    if os.environ.get("ACCELGEN_TRACE_HOOKS"):
        plugin_manager.trace.root.setwriter(sys.stderr.write)
        plugin_manager.enable_tracing()
    return plugin_manager


def _plugins_to_skip() -> set[str]:
    return {_normalized(name.strip()) for name in os.environ.get(SKIP_VARIABLE, "").split(",") if name.strip()}


def _load_entry_points(plugin_manager: PluginManager, skip: set[str]) -> None:
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if plugin_manager.has_plugin(entry_point.name) or plugin_manager.is_blocked(entry_point.name):
            continue
        distribution = entry_point.dist.name if entry_point.dist is not None else None
        if skip & {"*", _normalized(entry_point.name), _normalized(distribution)}:
            plugin_manager.skipped.append(entry_point.name)
            continue
        origin = PluginOrigin(entry_point.name, _distribution_line(entry_point.dist))
        try:
            call_plugin(origin, "the import", _load_and_register, plugin_manager, entry_point)
        except PluginFailure as failure:
            plugin_manager.load_failures.append(BrokenPlugin(origin.plugin, origin.package, _load_problem(failure)))


def _load_and_register(plugin_manager: PluginManager, entry_point: importlib.metadata.EntryPoint) -> None:
    """Import the plugin, then register it: pluggy reads every attribute of the plugin, which runs its code too."""
    plugin_manager.register(entry_point.load(), name=entry_point.name)


def _normalized(name: str | None) -> str | None:
    """A package's name as pip compares them (``Accelgen_Foo`` is ``accelgen-foo``)."""
    return None if name is None else name.lower().replace("_", "-").replace(".", "-")


def _load_problem(failure: PluginFailure) -> str:
    """``cannot be loaded: ModuleNotFoundError: ...`` (the import's own error), or what else its import did
    (``called sys.exit(3)``, ``raised KeyboardInterrupt``)."""
    if not isinstance(failure.error, Exception):
        return f"cannot be loaded: its import {failure.did}"
    return f"cannot be loaded: {error_text(failure.error)}"


def package_of(plugin: object) -> str | None:
    """``distribution version`` of the installed package that holds ``plugin`` (a module or an object)."""
    module = getattr(plugin, "__name__", None) if isinstance(plugin, type(sys)) else type(plugin).__module__
    if not isinstance(module, str):  # a plugin that set its own __name__ or __module__ to something else
        return None
    for distribution in _distributions_by_top_level_module().get(module.split(".")[0], []):
        return f"{distribution} {importlib.metadata.version(distribution)}"
    return None


@functools.cache
def _distributions_by_top_level_module() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed package's metadata: once


def _distribution_line(distribution) -> str | None:
    if distribution is None or not distribution.name:  # no METADATA, or one without a Name
        return None
    return f"{distribution.name} {distribution.version}"

