"""Errors a user can fix. The CLI prints them as one line and exits with status 2."""


class UsageError(Exception):
    """A mistake in what the user asked for: the message names the problem and the fix."""
