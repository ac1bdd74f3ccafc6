"""Finding the accelerator a user asked for among those the plugins register."""

from __future__ import annotations

import pluggy

from accelgen.errors import UsageError
from accelgen.hookspecs import Accelerator

AUTO_DEVICE = "auto"


def registered_accelerators(plugin_manager: pluggy.PluginManager) -> dict[str, Accelerator]:
    """Every registered accelerator by name, in registration order of their plugins.

    pluggy calls the most recently registered plugin first, so keeping the first registration of a
    name lets a third-party plugin replace a built-in accelerator of the same name.
    """
    found: dict[str, Accelerator] = {}

    def register(accelerator: Accelerator) -> None:
        found.setdefault(accelerator.name, accelerator)

    plugin_manager.hook.accelgen_register_accelerators(register=register)
    return dict(sorted(found.items(), key=lambda item: (-item[1].priority, item[0])))


def availability_line(accelerator: Accelerator) -> str:
    """The name, with the reason when unavailable (``"npu (unavailable: ...)"``), for messages and listings."""
    if accelerator.is_available():
        return accelerator.name
    return f"{accelerator.name} (unavailable: {accelerator.unavailable_reason()})"


def select_accelerator(plugin_manager: pluggy.PluginManager, device: str) -> Accelerator:
    """The available accelerator named ``device`` (or the best available one for ``"auto"``).

    Raises UsageError naming the known devices when the name is unknown or its hardware is absent.
    """
    accelerators = registered_accelerators(plugin_manager)
    known = ", ".join(availability_line(accelerator) for accelerator in accelerators.values())
    if device == AUTO_DEVICE:
        for accelerator in accelerators.values():
            if accelerator.is_available():
                return accelerator
        raise UsageError(f"No available device. Known: {known}.")
    if device not in accelerators:
        raise UsageError(f"No plugin provides --device {device!r}. Known: {known}.")
    accelerator = accelerators[device]
    if not accelerator.is_available():
        raise UsageError(f"--device {device} is not available here: {accelerator.unavailable_reason()}")
    return accelerator


def check_dtype(accelerator: Accelerator, dtype: str | None) -> str:
    """The dtype to run with: ``dtype`` if the device supports it, else the device default if None."""
    if dtype is None:
        return accelerator.default_dtype
    if dtype not in accelerator.supported_dtypes:
        supported = ", ".join(accelerator.supported_dtypes)
        raise UsageError(f"--dtype {dtype} is not supported on {accelerator.name}; use one of: {supported}.")
    return dtype
