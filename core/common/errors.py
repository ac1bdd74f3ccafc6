"""Errors a user can fix, and warnings a user should see. The CLI prints each as one line: an error
with exit status 2, a warning as ``accelgen: warning: ...`` while the run goes on.

:func:`user_errors` is the one place where an exception from reading or writing the user's files (or a
library reading them for us) becomes such a line: the caller names the file and the fix, the exception
gives the reason. It converts only the exception types it is given, around the call that reads or writes,
so a bug in our own code still surfaces as one.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

#: What a broken or unreachable file raises: OSError (missing, unreadable, a full disk) and ValueError
#: (JSON, Unicode and Arrow parse errors are all ValueErrors).
FILE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError)


#: The exit status of a run that wrote only error rows (``--skip-bad-rows``): none of its rows could be completed, which
#: a script must be able to tell from success (a run with some error rows among completed ones exits 0).
EVERY_ROW_FAILED_STATUS = 3

#: The exit status when the reader of our standard output went away (``accelgen run ... | head -1``): a shell's
#: status of a process ended by SIGPIPE (128 + 13), which is what closing a pipe ends a command with by convention.
CLOSED_OUTPUT_STATUS = 141


class UsageError(Exception):
    """A mistake in what the user asked for: the message names the problem and the fix."""


class AccelgenWarning(UserWarning):
    """Something the user should know that does not stop the run; the message says what to do about it."""


class GraphCaptureWarning(AccelgenWarning):
    """The accelerator could not capture the decode step: it runs eagerly (same output, slower)."""


def interruption_in(error: BaseException) -> BaseException | None:
    """The Ctrl-C or stop signal (an exception that is no ``Exception``) that ``error`` was raised while handling,
    when a library caught it and raised its own (a compiler wraps what interrupts it); None when there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        if not isinstance(error, Exception):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def first_line(error: BaseException) -> str:
    """An exception's message as one short line, for messages that quote it (its type's name if it has none)."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def reason(error: BaseException) -> str:
    """Why ``error`` happened, in one line: the innermost cause of a wrapped error (a library's "an error
    occurred" around the parser's own message), and an OSError's text without its errno number."""
    while error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return first_line(error).rstrip(".")


@contextlib.contextmanager
def user_errors(
    what: str, fix: str, errors: tuple[type[BaseException], ...] = FILE_ERRORS,
    explain: Callable[[BaseException], str | None] = lambda error: None,
) -> Iterator[None]:
    """Re-raise an exception of the ``errors`` types raised inside as ``UsageError("{what}: {reason}: {fix}")``,
    e.g. ``with user_errors(f"Cannot read {path!r}", "pass a file written by accelgen bench"): ...``.
    ``explain(error)`` may give the whole message instead, for errors the caller knows more about."""
    try:
        yield
    except UsageError:
        raise
    except errors as error:
        raise UsageError(explain(error) or f"{what}: {reason(error)}: {fix}") from None
