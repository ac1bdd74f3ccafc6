"""The small test accelerators and the plugin that registers them, shared by the test files.

Import them as ``from accelerators import CapturingCpu, plugin_manager_with`` (conftest.py puts tests/ on
``sys.path``). A test that needs a device to behave differently subclasses :class:`CapturingCpu` and overrides
the one method it is about (usually ``capture``), instead of writing a whole accelerator again.
"""

import dataclasses

import accelgen
from accelgen.plugin.manager import get_plugin_manager
from accelgen_cpu import CpuAccelerator


class CapturingCpu(CpuAccelerator):
    """The CPU accelerator, except that it captures the decode step and the prefill shapes of every run by default
    (so captures are counted) and its capture is the plain step, which a replay runs: fast, and the same output as
    the eager run."""

    tuning = dataclasses.replace(CpuAccelerator.tuning, captures_by_default=True, capture_pays_after_steps=0,
                                 captures_prefill=True)

    def capture(self, step, example_inputs, run):
        return step


class RegisteringPlugin:
    """A plugin object registering the accelerators it is given, as an installed plugin would."""

    def __init__(self, *accelerators):
        self.accelerators = accelerators

    @accelgen.hookimpl
    def accelgen_register_accelerators(self, register):
        for accelerator in self.accelerators:
            register(accelerator)


def plugin_manager_with(*accelerators):
    """A fresh plugin manager with the built-in plugins, then a plugin registering ``accelerators``
    (each replaces the built-in accelerator of its name, as an installed plugin would)."""
    plugin_manager = get_plugin_manager(load_entry_points=False)
    plugin_manager.register(RegisteringPlugin(*accelerators))
    return plugin_manager


class RefillingCpu(CpuAccelerator):
    """The CPU accelerator, except that a slot freed while rows run takes the next row at the next look, as on a device
    whose prefill passes cost nothing beyond their prompts' work (the plain continuous policy)."""

    tuning = dataclasses.replace(CpuAccelerator.tuning, prefill_pass_steps=0)
