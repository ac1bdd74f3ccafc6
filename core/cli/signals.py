"""How signals end a command in the user's own process (a launched rank ends at once instead, and its launcher
cleans up: ``accelgen.parallel.worker_processes``): SIGTERM and SIGHUP unwind it as Ctrl-C does, Ctrl-C never
lands inside an import, and no signal is lost in an object's finalizer (sent again once it has returned)."""

from __future__ import annotations

import builtins
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator


class Stopped(BaseException):
    """SIGTERM or SIGHUP asked the command to stop: unwound as Ctrl-C is, so that files are closed and what the
    run made for itself (offloaded weights written to --offload-folder) is removed. Not an Exception: nothing
    that handles errors may swallow it."""

    def __init__(self, signal_number: int):
        super().__init__(signal_number)
        self.signal_number = signal_number


class StopSignal:
    """The SIGTERM or SIGHUP that stopped the command, once one has (``signal_number``, else None), and whether a
    Ctrl-C was raised as KeyboardInterrupt (``interrupted``). Whatever error unwinding from either became in a library
    that caught it and raised its own (both are raised at any bytecode, inside any library's code: TorchScript's
    interpreter turns one raised in a Python operation of a traced step into a RuntimeError that keeps only its
    name), the command was stopped or interrupted, and says so."""

    def __init__(self):
        self.signal_number: int | None = None
        self.interrupted = False


@contextlib.contextmanager
def signals_stop_the_command(worker: bool) -> Iterator[StopSignal]:
    """SIGTERM and SIGHUP raise :class:`Stopped` in the user's own process (a launched rank ends at once
    instead: its launcher cleans up), and SIGINT never lands inside an import; the handlers before are put
    back after. Yields the :class:`StopSignal` that records a stop."""
    received = StopSignal()
    if worker or threading.current_thread() is not threading.main_thread():
        yield received
        return

    resend: list[threading.Timer] = []

    def stop(signal_number, frame):
        received.signal_number = signal_number
        if _inside_finalizer(frame):  # raised there, it would be printed and dropped: the run would go on
            resend.append(_send_again(signal_number))
            return
        raise Stopped(signal_number)

    before = {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGHUP)}
    interrupt = _InterruptOutsideImports(received)
    before[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    ours = {signal.SIGTERM: stop, signal.SIGHUP: stop, signal.SIGINT: interrupt}
    interrupt.watch_imports()
    try:
        yield received
    finally:
        interrupt.cancel()
        for timer in resend:
            timer.cancel()
        interrupt.stop_watching_imports()
        for number, handler in before.items():
            if signal.getsignal(number) is ours[number]:  # not one set since (a launcher ignoring a late Ctrl-C)
                signal.signal(number, handler)


#: While set (:func:`interrupts_end_at_once`), the line a Ctrl-C inside an import ends the process with, at once.
_AT_ONCE_LINE: str | None = None


@contextlib.contextmanager
def interrupts_end_at_once(line: str) -> Iterator[None]:
    """Inside the block (a command's start: its modules imported, its model's files read, nothing opened for writing
    yet), a Ctrl-C that lands inside an import prints ``line`` and ends the process at once with status 130, rather
    than waiting for the import (torch's takes seconds): nothing is left to tidy, and no half-imported library is
    ever used."""
    global _AT_ONCE_LINE
    previous, _AT_ONCE_LINE = _AT_ONCE_LINE, line
    try:
        yield
    finally:
        _AT_ONCE_LINE = previous


class _InterruptOutsideImports:
    """SIGINT's handler in the user's own process: KeyboardInterrupt, as Python's own handler raises, except
    while a module is being imported. An import cut short by KeyboardInterrupt can leave torch, numpy or a
    transformers lazy module half set up, and what imports it next then fails in ways that hide the Ctrl-C
    (a RecursionError reported as a damaged model; a run that goes on to the end). There the interrupt is
    delivered as soon as an ``import`` statement of accelgen's own or the outermost one returns (:meth:`watch_imports`:
    torch, numpy, transformers are then whole), else again a
    moment later until it lands outside any import; after ``PATIENCE_SECONDS`` it is raised wherever it lands (a
    plugin whose import never ends must still be stoppable)."""

    PATIENCE_SECONDS = 3.0

    def __init__(self, received: StopSignal):
        self.received = received  # told of each interrupt raised
        self.first_deferred: float | None = None
        self.retry: threading.Timer | None = None
        self._import = self._counted = None  # builtins.__import__ as it was before watch_imports, and ours
        self._depth = 0  # import statements of the main thread running, one inside another

    def watch_imports(self) -> None:
        """Route import statements through a counter, so that an interrupt held back by an import is raised the
        moment the outermost one returns (torch's own import takes seconds: waiting for a gap between imports
        would mostly wait for ``PATIENCE_SECONDS``)."""
        original, main_thread = builtins.__import__, threading.main_thread()

        def counted_import(*arguments, **keywords):
            if threading.current_thread() is not main_thread:
                return original(*arguments, **keywords)
            self._depth += 1
            try:
                return original(*arguments, **keywords)
            finally:
                self._depth -= 1
                if self.first_deferred is not None and _may_interrupt_after_import(sys._getframe(1), self._depth):
                    self._raise()

        self._import, self._counted, builtins.__import__ = original, counted_import, counted_import

    def stop_watching_imports(self) -> None:
        """Put ``builtins.__import__`` back as it was, unless something replaced ours since (theirs stays)."""
        if self._import is not None and builtins.__import__ is self._counted:
            builtins.__import__ = self._import
        self._import = None

    def __call__(self, signal_number, frame) -> None:
        if _AT_ONCE_LINE is not None and _importing(frame):
            print(_AT_ONCE_LINE, file=sys.stderr, flush=True)
            os._exit(130)
        now = time.monotonic()
        if _inside_finalizer(frame) or (
                _importing(frame) and (self.first_deferred is None or now - self.first_deferred < self.PATIENCE_SECONDS)):
            self.first_deferred = self.first_deferred or now
            if self.retry is None or not self.retry.is_alive():  # one interrupt pending at a time
                self.retry = _send_again(signal.SIGINT)
            return
        self._raise()

    def _raise(self) -> None:
        self.cancel()
        self.received.interrupted = True
        raise KeyboardInterrupt

    def cancel(self) -> None:
        """Deliver no interrupt still pending (the handler is no longer this one's, or the command is over)."""
        self.first_deferred = None
        if self.retry is not None:
            self.retry.cancel()


def _may_interrupt_after_import(caller, depth: int) -> bool:
    """Whether an interrupt may be raised where ``caller`` has just finished an import statement: outside any
    import, or in accelgen's own modules (what they imported is whole; a module of ours cut short is dropped by
    Python's import system and imported again whole by whatever asks for it)."""
    return (not depth and not _importing(caller)) or caller.f_globals.get("__name__", "").startswith("accelgen")


#: Seconds after which a signal held back (inside an import, inside a finalizer) is sent again.
RETRY_SECONDS = 0.05


def _send_again(signal_number: int) -> threading.Timer:
    """Send this process ``signal_number`` again in a moment (the started timer, to cancel)."""
    timer = threading.Timer(RETRY_SECONDS, os.kill, (os.getpid(), signal_number))
    timer.daemon = True
    timer.start()
    return timer


def _inside_finalizer(frame) -> bool:
    """Whether ``frame`` runs inside an object's ``__del__`` (garbage collection can run one at any bytecode), where
    Python prints an exception raised and drops it ("Exception ignored in ..."): a stop raised there would be lost."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside Python's import machinery (a module's code being executed as it imports)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
