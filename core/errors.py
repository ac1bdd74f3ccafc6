"""Errors a user can fix, and warnings a user should see. The CLI prints each as one line: an error
with exit status 2, a warning as ``accelgen: warning: ...`` while the run goes on."""


class UsageError(Exception):
    """A mistake in what the user asked for: the message names the problem and the fix."""


class AccelgenWarning(UserWarning):
    """Something the user should know that does not stop the run; the message says what to do about it."""


class GraphCaptureWarning(AccelgenWarning):
    """The accelerator could not capture the decode step: it runs eagerly (same output, slower)."""


def first_line(error: BaseException) -> str:
    """An exception's message as one short line, for messages that quote it (its type's name if it has none)."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
