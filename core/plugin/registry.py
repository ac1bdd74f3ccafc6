"""Finding the accelerator a user asked for among those the plugins register, each checked as it registers
and asked through ``accelgen.plugin.isolation`` (a misbehaving plugin is named, never fatal to the others)."""

from __future__ import annotations

import dataclasses
import functools
import warnings

from accelgen.common.errors import AccelgenWarning, UsageError
from accelgen.common.settings import DTYPES, QUANTIZATION_SCHEMES
from accelgen.plugin.contract import Accelerator, Tuning
from accelgen.plugin.isolation import (
    SKIP_VARIABLE,
    ListingGuard,
    PluginFailure,
    PluginOrigin,
    call_plugin,
    guard_listing_members,
)
from accelgen.plugin.manager import BrokenPlugin, PluginManager, package_of
from accelgen.plugin.old_forms import deprecation, knobs_set_on_itself, read_as_tuning, wrong_kind

AUTO_DEVICE = "auto"
#: Every member of the contract: what an accelerator that does not subclass Accelerator must have itself.
CONTRACT = tuple(member for member in vars(Accelerator) if not member.startswith("_"))


@dataclasses.dataclass
class Registry:
    """The registered accelerators by name (highest priority first), the plugins that could not be used, the
    guards in front of each accelerator's listing members, the plugins ACCELGEN_SKIP_PLUGINS left out, and by device
    name what its plugin writes in an older form of the contract (``accelgen.plugin.old_forms``)."""

    accelerators: dict[str, Accelerator]
    broken: list[BrokenPlugin]
    guards: dict[str, ListingGuard] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    deprecated: dict[str, str] = dataclasses.field(default_factory=dict)


def accelerator_registry(plugin_manager: PluginManager) -> Registry:
    """Ask every plugin for its accelerators, one plugin at a time and each call through ``call_plugin``, so
    that a plugin that raises (anything, SystemExit included) or registers something broken is set aside
    with its reason while the others work. Each accelerator's listing members are guarded the same way.

    pluggy calls the most recently registered plugin first, so keeping the first registration of a name
    lets a third-party plugin replace a built-in accelerator of the same name."""
    found: dict[str, tuple[int, ListingGuard]] = {}  # device name: its priority, the guard of its accelerator
    deprecated: dict[str, str] = {}  # device name: what its plugin writes in an older form of the contract
    broken = list(getattr(plugin_manager, "load_failures", []))
    implementations = plugin_manager.hook.accelgen_register_accelerators.get_hookimpls()
    plugins = [implementation.plugin for implementation in reversed(implementations)]
    for plugin in plugins:
        origin = PluginOrigin(plugin_manager.get_name(plugin), package_of(plugin))
        register_one = functools.partial(_register, found, deprecated, broken, origin)
        only_this_plugin = plugin_manager.subset_hook_caller(
            "accelgen_register_accelerators", remove_plugins=[other for other in plugins if other is not plugin]
        )
        try:
            returned = call_plugin(origin, "accelgen_register_accelerators", only_this_plugin, register=register_one)
        except PluginFailure as failure:
            broken.append(BrokenPlugin(origin.plugin, origin.package, failure.problem))
            continue
        if returned:  # pluggy collects what hooks return: this one returned something instead of registering it
            broken.append(BrokenPlugin(origin.plugin, origin.package, _returned_instead(returned)))
    ranked = sorted(found.items(), key=lambda item: (-item[1][0], item[0]))
    return Registry({name: guard.accelerator for name, (_, guard) in ranked}, broken,
                    {name: guard for name, (_, guard) in ranked}, list(getattr(plugin_manager, "skipped", [])),
                    {name: line for name, line in deprecated.items() if name in found})


def registered_accelerators(plugin_manager: PluginManager) -> dict[str, Accelerator]:
    """Every usable registered accelerator by name, highest priority first."""
    return accelerator_registry(plugin_manager).accelerators


def _returned_instead(returned: list) -> str:
    """The problem of a hook that returned its accelerators (or anything) instead of passing them to ``register``."""
    what = ", ".join(type(value).__name__ for value in returned)
    return (f"its accelgen_register_accelerators hook returned {what} instead of calling register(accelerator) for "
            f"each accelerator: nothing of it was registered")


def _register(found: dict, deprecated: dict, broken: list, origin: PluginOrigin, accelerator: Accelerator) -> None:
    """The ``register`` callback a plugin calls. Reading the accelerator's members runs the plugin's code (they
    may be properties), so the check goes through ``call_plugin`` too."""
    try:
        problem = call_plugin(origin, f"registering {type(accelerator).__name__}", _add_if_usable, found, deprecated,
                              origin, accelerator)
    except PluginFailure as failure:
        problem = failure.problem
    if problem is not None:
        name = _name_if_readable(accelerator)
        broken.append(BrokenPlugin(origin.plugin, origin.package, problem, (name,) if name else ()))


def _add_if_usable(found: dict, deprecated: dict, origin: PluginOrigin, accelerator: Accelerator) -> str | None:
    problem = accelerator_problem(accelerator)
    if problem is None and accelerator.name not in found:
        if knobs := knobs_set_on_itself(accelerator):  # the contract's form before Tuning: read, for a stated time
            try:
                read_as_tuning(accelerator, knobs)
            except AttributeError:
                return (f"registers {type(accelerator).__name__} setting {', '.join(knobs)} on itself, and its tuning "
                        f"cannot be set from them: write tuning = accelgen.Tuning(...) in the class")
            deprecated[accelerator.name] = deprecation(origin.named(), type(accelerator).__name__, knobs)
        found[accelerator.name] = (accelerator.priority, guard_listing_members(accelerator, accelerator.name, origin))
    return problem


def _name_if_readable(accelerator: Accelerator) -> str | None:
    """The device name the accelerator declares, for errors about it; None when it has none it can give."""
    try:
        name = accelerator.name
    except BaseException:  # noqa: BLE001 - a property that raised already: its failure is what gets reported
        return None
    return name if isinstance(name, str) and name else None


def accelerator_problem(accelerator: object) -> str | None:
    """What is wrong with ``accelerator`` as a registered device (one sentence), or None when it can be used."""
    kind = type(accelerator).__name__
    missing = [member for member in CONTRACT if not hasattr(accelerator, member)]
    if missing:  # not a subclass of Accelerator (a subclass lacking is_available or setup cannot be created)
        return (f"registers {kind}, which lacks {', '.join(missing)}: subclass accelgen.Accelerator, "
                f"whose defaults fill in every optional member")
    tuning = getattr(accelerator, "tuning", None)
    if not isinstance(tuning, Tuning):
        return f"registers {kind} with tuning {tuning!r}: it must be an accelgen.Tuning"
    if problem := wrong_kind(knobs_set_on_itself(accelerator)):  # the old form, read as the tuning while accepted
        return f"registers {kind} setting {problem} (a field of accelgen.Tuning)"
    name = getattr(accelerator, "name", "")
    if not is_one_word(name):
        return f"registers {kind} with the name {name!r}: a device name is one word of letters, digits, '_' and '-'"
    if name == AUTO_DEVICE:
        return f"registers {kind} with the name {name!r}, which --device keeps for the best available device"
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


def is_one_word(name: object) -> bool:
    """Whether ``name`` can be a device's name: one word of letters, digits, '_' and '-', as ``--device`` takes it."""
    return isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum()


def availability_line(accelerator: Accelerator) -> str:
    """The name, with the reason when unavailable (``"npu (unavailable: ...)"``), for messages and listings."""
    if accelerator.is_available():
        return accelerator.name
    return f"{accelerator.name} (unavailable: {accelerator.unavailable_reason()})"


def select_accelerator(plugin_manager: PluginManager, device: str, here: bool = True) -> Accelerator:
    """The available accelerator named ``device`` (or the best available one for ``"auto"``); with ``here`` False, the
    one named whether or not this machine has its hardware (a job whose ranks run on other machines, which check).

    Raises UsageError naming the known devices when the name is unknown or its hardware is absent, and
    the plugins that could not be used, when any. Once a device is chosen, each plugin that could not be
    used is named in one warning line."""
    registry = accelerator_registry(plugin_manager)
    accelerator = _chosen(registry, device) if here or device == AUTO_DEVICE else _named(registry, device)
    _warn_about_plugins_left_out(registry)
    warn_about_old_forms(registry, [accelerator.name])
    return accelerator


def warn_about_old_forms(registry: Registry, devices: list[str]) -> None:
    """One deprecation line for each of ``devices`` whose plugin writes an older form of the contract."""
    for device in devices:
        if device in registry.deprecated:
            warnings.warn(AccelgenWarning(registry.deprecated[device]), stacklevel=3)


def _named(registry: Registry, device: str) -> Accelerator:
    if device not in registry.accelerators:
        return _chosen(registry, device)  # its error line
    return registry.accelerators[device]


def _chosen(registry: Registry, device: str) -> Accelerator:
    accelerators = registry.accelerators
    if device == AUTO_DEVICE:
        for accelerator in accelerators.values():
            if accelerator.is_available():
                return accelerator
        raise UsageError(f"No available device. Known: {_known_devices(registry)}")
    if device not in accelerators:
        for plugin in registry.broken:
            if device in plugin.devices:
                raise UsageError(f"--device {_shown(device)} cannot be used: plugin {plugin.line()}")
        raise UsageError(f"No plugin provides --device {device!r}. Known: {_known_devices(registry)}")
    accelerator = accelerators[device]
    if not accelerator.is_available():
        raise UsageError(f"--device {device} is not available here: {accelerator.unavailable_reason()}")
    return accelerator


def _shown(device: str) -> str:
    """``device`` as an error line shows it: as typed when it is one word, else quoted (a newline stays in its line)."""
    return device if is_one_word(device) else repr(device)


def _warn_about_plugins_left_out(registry: Registry) -> None:
    """One warning line for each plugin that could not be used, and each device whose ``is_available()`` failed
    (skipped by ``--device auto``)."""
    left_out = [(PluginOrigin(plugin.plugin, plugin.package), plugin.problem) for plugin in registry.broken]
    left_out += [(guard.failure.origin, guard.failure.problem) for guard in registry.guards.values() if guard.failure]
    for origin, problem in left_out:
        warnings.warn(AccelgenWarning(f"{origin.named()} is left out: {problem} ({origin.fix()} to stop this "
                                      f"warning)"), stacklevel=3)


def _known_devices(registry: Registry) -> str:
    """Every registered device with its availability, and the plugins that could not be used or were left out
    (asked only when an error names them: asking whether a device is available may import its vendor's software)."""
    known = ", ".join(availability_line(accelerator) for accelerator in registry.accelerators.values()) + "."
    if registry.broken:
        known += " Plugins that could not be used: " + "; ".join(plugin.line() for plugin in registry.broken) + "."
    if registry.skipped:
        known += f" Left out by {SKIP_VARIABLE}: {', '.join(registry.skipped)}."
    return known


def check_dtype(accelerator: Accelerator, dtype: str | None) -> str:
    """The dtype to run with: ``dtype`` if the device supports it, else the device default if None."""
    if dtype is None:
        return accelerator.default_dtype
    if dtype not in accelerator.supported_dtypes:
        supported = ", ".join(accelerator.supported_dtypes)
        raise UsageError(f"--dtype {dtype} is not supported on {accelerator.name}; use one of: {supported}.")
    return dtype
