"""Every call the core makes into a plugin's code goes through :func:`call_plugin`: whatever the plugin does
(raises, calls ``sys.exit`` or ``os._exit``, raises KeyboardInterrupt, hangs) comes back as a :class:`PluginFailure` naming
the plugin, its package and the call, or as a line saying what the command is still waiting for; what it
changed for the whole process (warnings filters, standard streams, working directory, SIGINT) is put back.

A plugin's accelerators answer the core's listing questions (``is_available`` and its siblings) through
:func:`guard_listing_members`, so that one broken device cannot end ``accelgen devices`` or a run on another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

from accelgen.common.errors import AccelgenWarning, UsageError
from accelgen.plugin.contract import Accelerator

#: Names plugins to leave out, separated by commas: an entry point's name, a built-in's module name
#: (``accelgen_hpu``), an installed package's name, or ``*`` for every installed (non built-in) plugin.
SKIP_VARIABLE = "ACCELGEN_SKIP_PLUGINS"
#: Seconds a call into a plugin may take before the user is told which plugin the command waits for.
NOTICE_AFTER_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class PluginOrigin:
    """Which plugin some code belongs to: its name in the plugin manager and ``distribution version``."""

    plugin: str
    package: str | None

    def named(self) -> str:
        return f"plugin {self.plugin} ({self.package or 'package unknown'})"

    def fix(self) -> str:
        """What the user can do about a plugin that misbehaves: uninstall it (if it is not accelgen's own) or skip it."""
        distribution = (self.package or "").split(" ")[0]
        uninstall = f"uninstall {distribution} or " if distribution and distribution != "accelgen" else ""
        return f"{uninstall}set {SKIP_VARIABLE}={self.plugin}"


class PluginFailure(UsageError):
    """A call into a plugin ended with an exception (any, SystemExit included). The message is one line:
    the plugin, its package, the call, what happened, and the fix; ``problem`` is the call and what happened."""

    def __init__(self, origin: PluginOrigin, call: str, error: BaseException):
        self.origin, self.error = origin, error
        self.did = what_it_did(error)
        self.problem = f"{call} {self.did}"
        super().__init__(f"{origin.named()}: {self.problem}: {origin.fix()} to run without it")


class PluginExit(BaseException):
    """What ``os._exit(status)`` raises when a plugin's code calls it inside :func:`call_plugin`: that call would end
    the process at once, without a word and without running anything after it (every command, ``accelgen devices``
    included), where the plugin is to be set aside like any other that fails. A BaseException, like SystemExit, so
    that the plugin's own ``except Exception`` does not swallow it."""

    def __init__(self, status: object):
        super().__init__(status)
        self.status = status


def what_it_did(error: BaseException) -> str:
    """``raised ValueError: ...``, ``called sys.exit(3)`` or ``called os._exit(3)``."""
    if isinstance(error, PluginExit):
        return f"called os._exit({_safely(lambda: repr(error.status), '...')})"
    if isinstance(error, SystemExit):
        return f"called sys.exit({_safely(lambda: repr(error.code), '...')})"
    return f"raised {error_text(error)}"


def error_text(error: BaseException) -> str:
    """``ValueError: its message's first line`` (the type alone when it has none), read so that an exception
    whose own ``__str__`` misbehaves cannot break the report of it."""
    text = _safely(lambda: str(error).strip(), "")
    kind = type(error).__name__
    return f"{kind}: {text.splitlines()[0][:300]}" if text else kind


def call_plugin(origin: PluginOrigin, call: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, a call into ``origin``'s code described as ``call`` (``npu.is_available()``),
    or PluginFailure when it raises anything. A Ctrl-C of the user's during the call still stops the program
    (KeyboardInterrupt, exit 130), even when the plugin catches it; after NOTICE_AFTER_SECONDS a warning line
    says which plugin the command is waiting for; what of the process the plugin changed is put back."""
    with _notice_when_slow(origin, call), _threads_left_running(origin, call), _process_state_kept(), \
            _exit_raises(), _user_interrupts() as interrupted:
        try:
            result = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - anything a third party's code does is reported, not fatal
            _stop_if_the_user_interrupted(error, interrupted)
            raise PluginFailure(origin, call, error) from None
    if interrupted:  # the plugin swallowed the user's Ctrl-C
        raise KeyboardInterrupt
    return result


@contextlib.contextmanager
def _exit_raises() -> Iterator[None]:
    """While a plugin's code runs, ``os._exit`` (and ``posix._exit``, the same function) raises :class:`PluginExit`
    when the plugin calls it. It still ends the process when the core's own code calls it (an interrupt while a
    plugin imports: ``accelgen.cli.signals``), and in a process forked meanwhile (a child's way to end)."""
    import posix

    real_exit, process = os._exit, os.getpid()

    def exit_or_raise(status):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if os.getpid() != process or caller == "accelgen" or caller.startswith("accelgen."):
            real_exit(status)
        raise PluginExit(status)

    os._exit = posix._exit = exit_or_raise
    try:
        yield
    finally:
        if os._exit is exit_or_raise:
            os._exit = real_exit
        if posix._exit is exit_or_raise:
            posix._exit = real_exit


@contextlib.contextmanager
def _threads_left_running(origin: PluginOrigin, call: str) -> Iterator[None]:
    """Warn about threads the call started and left running that Python waits for at exit (not daemons): the
    command would finish its work, then never end."""
    before = set(threading.enumerate())
    yield
    left = [thread.name for thread in threading.enumerate() if thread not in before and not thread.daemon]
    if left:
        warnings.warn(AccelgenWarning(
            f"{origin.named()}: {call} started thread(s) {', '.join(left)}, which keep accelgen from exiting until "
            f"they end; if it does not exit, press Ctrl-C, then {origin.fix()}"), stacklevel=4)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Put back what a plugin may change for the whole process while it imports or answers (plugins must have no
    side effects at import): the warnings filters (``simplefilter("error")`` would turn our warnings into
    crashes, ``"ignore"`` would hide them), ``sys.stdout`` and ``sys.stderr``, and the working directory
    (relative paths the user gave are read and written after plugins load)."""
    streams = sys.stdout, sys.stderr
    directory = _safely(os.getcwd, "")
    try:
        with warnings.catch_warnings():
            yield
    finally:
        sys.stdout, sys.stderr = streams
        if directory and _safely(os.getcwd, "") != directory:
            os.chdir(directory)


def _stop_if_the_user_interrupted(error: BaseException, interrupted: list[int] | None) -> None:
    if interrupted or (interrupted is None and isinstance(error, KeyboardInterrupt)):
        raise KeyboardInterrupt from None


@contextlib.contextmanager
def _user_interrupts() -> Iterator[list[int] | None]:
    """Tell a KeyboardInterrupt the user caused (SIGINT: Ctrl-C, ``kill -INT``) from one the plugin raises itself.

    Python raises KeyboardInterrupt for SIGINT from its handler; we put a handler in front of it that notes the
    signal, then calls it. A KeyboardInterrupt with no signal noted came from the plugin's own ``raise`` (also
    where SIGINT is ignored, or ends the process without one, as in a launched rank). Yields the list of signals
    noted, or None where the handler cannot be read or set (outside the main thread, or one set outside Python):
    every KeyboardInterrupt is then taken for the user's. A plugin that replaces the SIGINT handler during the
    call blinds the check for the rest of the call; the core's handler is put back afterwards."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield None
        return
    previous = signal.getsignal(signal.SIGINT)
    received: list[int] = []

    def note_then_interrupt(signal_number, frame):
        received.append(signal_number)
        previous(signal_number, frame)

    if callable(previous):
        signal.signal(signal.SIGINT, note_then_interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _notice_when_slow(origin: PluginOrigin, call: str) -> Iterator[None]:
    """Warn once, from a timer thread, when the call has not returned after NOTICE_AFTER_SECONDS."""
    timer = threading.Timer(NOTICE_AFTER_SECONDS, lambda: warnings.warn(AccelgenWarning(
        f"still waiting for {call} of {origin.named()} after {NOTICE_AFTER_SECONDS:.0f} s; if it never "
        f"finishes, press Ctrl-C, then {origin.fix()}"), stacklevel=1))
    timer.daemon = True  # a plugin that never returns must not also keep the process from exiting
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _safely(read: Callable[[], str], fallback: str) -> str:
    try:
        return read()
    except BaseException:  # noqa: BLE001 - a hostile exception's __str__ or __repr__
        return fallback


# -- an accelerator's listing members ------------------------------------------------------------------------


class ListingGuard:
    """Stands in front of the members the core calls on every registered accelerator to list devices and pick
    one. A failed call gives an answer that keeps the command going: ``is_available()`` False, with the failure
    as the ``unavailable_reason()`` (so choosing that device is refused in one line naming the plugin);
    ``device_count()`` 0 and ``describe()`` the contract's defaults, each with one warning line."""

    MEMBERS = ("is_available", "unavailable_reason", "device_count", "describe")

    def __init__(self, accelerator: Any, name: str, origin: PluginOrigin):
        if not hasattr(accelerator, "__dict__"):
            raise TypeError(f"{type(accelerator).__name__} has no __dict__ (__slots__): subclass accelgen.Accelerator")
        self.accelerator, self.name, self.origin = accelerator, name, origin
        self.failure: PluginFailure | None = None  # why is_available() could not answer, if it could not
        self.warned: set[str] = set()  # the members whose failure has been shown: one warning line each
        # the plugin's own members; those of an earlier guard when the accelerator was registered before
        earlier = getattr(vars(accelerator).get("is_available"), "__self__", None)
        self.plugin_members = (earlier.plugin_members if isinstance(earlier, ListingGuard)
                               else {member: getattr(accelerator, member) for member in self.MEMBERS})

    def install(self) -> None:
        """Put the guard's members in front of the accelerator's own (instance attributes shadow methods)."""
        for member in self.MEMBERS:
            object.__setattr__(self.accelerator, member, getattr(self, member))

    def _call(self, member: str, check: Callable[[Any], Any]) -> Any:
        def call_and_check():
            return check(self.plugin_members[member]())

        return call_plugin(self.origin, f"{self.name}.{member}()", call_and_check)

    def is_available(self) -> bool:
        try:
            return self._call("is_available", bool)
        except PluginFailure as failure:
            self.failure = failure
            return False

    def unavailable_reason(self) -> str:
        if self.failure is not None:
            return str(self.failure)
        try:
            return self._call("unavailable_reason", lambda reason: " ".join(str(reason).split())[:500])
        except PluginFailure as failure:
            return str(failure)

    def device_count(self) -> int:
        try:
            return self._call("device_count", _whole_number)
        except PluginFailure as failure:
            self._warn_once("device_count", f"{failure}; counting 0 {self.name} devices")
            return 0

    def describe(self) -> dict[str, Any]:
        try:
            return self._call("describe", _mapping)
        except PluginFailure as failure:
            self._warn_once("describe", f"{failure}; reporting no facts about {self.name}")
            return Accelerator.describe(self.accelerator)

    def _warn_once(self, member: str, message: str) -> None:
        if member not in self.warned:
            self.warned.add(member)
            warnings.warn(AccelgenWarning(message), stacklevel=3)


def guard_listing_members(accelerator: Any, name: str, origin: PluginOrigin) -> ListingGuard:
    """Guard ``accelerator``'s listing members (see :class:`ListingGuard`) and return the guard."""
    guard = ListingGuard(accelerator, name, origin)
    guard.install()
    return guard


def _whole_number(count: Any) -> int:
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise TypeError(f"returned {count!r}, not a number of devices")
    return count


def _mapping(facts: Any) -> dict[str, Any]:
    """The facts, when they are a dict a benchmark's JSON result can hold."""
    if not isinstance(facts, dict):
        raise TypeError(f"returned {type(facts).__name__}, not a dict")
    json.dumps(facts)  # TypeError naming what cannot be written (an object, a set)
    return facts
