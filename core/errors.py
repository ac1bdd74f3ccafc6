"""Errors a user can fix, and warnings a user should see. The CLI prints each as one line: an error
with exit status 2, a warning as ``accelgen: warning: ...`` while the run goes on."""


class UsageError(Exception):
    """A mistake in what the user asked for: the message names the problem and the fix."""


class AccelgenWarning(UserWarning):
    """Something the user should know that does not stop the run; the message says what to do about it."""


class GraphCaptureWarning(AccelgenWarning):
    """The accelerator could not capture the decode step: it runs eagerly (same output, slower)."""
