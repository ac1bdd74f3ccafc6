"""Finding the accelerator a user asked for among those the plugins register, each checked as it registers."""

from __future__ import annotations

import dataclasses
import functools

from accelgen.common.errors import UsageError, first_line
from accelgen.common.settings import DTYPES, QUANTIZATION_SCHEMES
from accelgen.plugin.contract import Accelerator
from accelgen.plugin.manager import BrokenPlugin, PluginManager, package_of

AUTO_DEVICE = "auto"
#: Every member of the contract: what an accelerator that does not subclass Accelerator must have itself.
CONTRACT = tuple(member for member in vars(Accelerator) if not member.startswith("_"))


@dataclasses.dataclass
class Registry:
    """The registered accelerators by name (highest priority first), and the plugins that could not be used."""

    accelerators: dict[str, Accelerator]
    broken: list[BrokenPlugin]


def accelerator_registry(plugin_manager: PluginManager) -> Registry:
    """Ask every plugin for its accelerators, one plugin at a time, so that a plugin that raises or
    registers something broken is set aside with its reason while the others work.

    pluggy calls the most recently registered plugin first, so keeping the first registration of a name
    lets a third-party plugin replace a built-in accelerator of the same name."""
    found: dict[str, Accelerator] = {}
    broken = list(getattr(plugin_manager, "load_failures", []))
    implementations = plugin_manager.hook.accelgen_register_accelerators.get_hookimpls()
    plugins = [implementation.plugin for implementation in reversed(implementations)]
    for plugin in plugins:
        plugin_name, package = plugin_manager.get_name(plugin), package_of(plugin)
        register_one = functools.partial(_register, found, broken, plugin_name, package)
        only_this_plugin = plugin_manager.subset_hook_caller(
            "accelgen_register_accelerators", remove_plugins=[other for other in plugins if other is not plugin]
        )
        try:
            only_this_plugin(register=register_one)
        except Exception as error:  # noqa: BLE001 - a third party's hook failing must not stop the other devices
            broken.append(BrokenPlugin(plugin_name, package, f"accelgen_register_accelerators raised "
                                                             f"{type(error).__name__}: {first_line(error)}"))
    accelerators = dict(sorted(found.items(), key=lambda item: (-item[1].priority, item[0])))
    return Registry(accelerators, broken)


def registered_accelerators(plugin_manager: PluginManager) -> dict[str, Accelerator]:
    """Every usable registered accelerator by name, highest priority first."""
    return accelerator_registry(plugin_manager).accelerators


def _register(found: dict, broken: list, plugin_name: str, package: str | None, accelerator: Accelerator) -> None:
    problem = accelerator_problem(accelerator)
    if problem is not None:
        name = getattr(accelerator, "name", None)
        broken.append(BrokenPlugin(plugin_name, package, problem, (name,) if isinstance(name, str) and name else ()))
    else:
        found.setdefault(accelerator.name, accelerator)


def accelerator_problem(accelerator: object) -> str | None:
    """What is wrong with ``accelerator`` as a registered device (one sentence), or None when it can be used."""
    kind = type(accelerator).__name__
    missing = [member for member in CONTRACT if not hasattr(accelerator, member)]
    if missing:  # not a subclass of Accelerator (a subclass lacking is_available or setup cannot be created)
        return (f"registers {kind}, which lacks {', '.join(missing)}: subclass accelgen.Accelerator, "
                f"whose defaults fill in every optional member")
    name = getattr(accelerator, "name", "")
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        return f"registers {kind} with the name {name!r}: a device name is a word such as 'npu'"
    unknown_dtypes = [dtype for dtype in accelerator.supported_dtypes if dtype not in DTYPES]
    if unknown_dtypes or accelerator.default_dtype not in accelerator.supported_dtypes:
        return (f"registers {name!r} with supported_dtypes {tuple(accelerator.supported_dtypes)!r} and default_dtype "
                f"{accelerator.default_dtype!r}: the default must be one of them, each one of {', '.join(DTYPES)}")
    schemes = accelerator.quantization_schemes
    if not isinstance(schemes, (tuple, list)) or any(scheme not in QUANTIZATION_SCHEMES for scheme in schemes):
        return (f"registers {name!r} with quantization_schemes {schemes!r}: each must be one of "
                f"{', '.join(QUANTIZATION_SCHEMES)}")
    if not isinstance(accelerator.priority, int):
        return f"registers {name!r} with the priority {accelerator.priority!r}: it must be a whole number"
    return None


def availability_line(accelerator: Accelerator) -> str:
    """The name, with the reason when unavailable (``"npu (unavailable: ...)"``), for messages and listings."""
    if accelerator.is_available():
        return accelerator.name
    return f"{accelerator.name} (unavailable: {accelerator.unavailable_reason()})"


def select_accelerator(plugin_manager: PluginManager, device: str) -> Accelerator:
    """The available accelerator named ``device`` (or the best available one for ``"auto"``).

    Raises UsageError naming the known devices when the name is unknown or its hardware is absent, and
    the plugins that could not be used, when any."""
    registry = accelerator_registry(plugin_manager)
    accelerators = registry.accelerators
    if device == AUTO_DEVICE:
        for accelerator in accelerators.values():
            if accelerator.is_available():
                return accelerator
        raise UsageError(f"No available device. Known: {_known_devices(registry)}")
    if device not in accelerators:
        for plugin in registry.broken:
            if device in plugin.devices:
                raise UsageError(f"--device {device} cannot be used: plugin {plugin.line()}")
        raise UsageError(f"No plugin provides --device {device!r}. Known: {_known_devices(registry)}")
    accelerator = accelerators[device]
    if not accelerator.is_available():
        raise UsageError(f"--device {device} is not available here: {accelerator.unavailable_reason()}")
    return accelerator


def _known_devices(registry: Registry) -> str:
    """Every registered device with its availability, and the plugins that could not be used (asked only when
    an error names them: asking whether a device is available may import its vendor's software)."""
    known = ", ".join(availability_line(accelerator) for accelerator in registry.accelerators.values()) + "."
    if registry.broken:
        known += " Plugins that could not be used: " + "; ".join(plugin.line() for plugin in registry.broken) + "."
    return known


def check_dtype(accelerator: Accelerator, dtype: str | None) -> str:
    """The dtype to run with: ``dtype`` if the device supports it, else the device default if None."""
    if dtype is None:
        return accelerator.default_dtype
    if dtype not in accelerator.supported_dtypes:
        supported = ", ".join(accelerator.supported_dtypes)
        raise UsageError(f"--dtype {dtype} is not supported on {accelerator.name}; use one of: {supported}.")
    return dtype
