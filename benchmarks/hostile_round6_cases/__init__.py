"""The cases of hostile-input round 6 (issue 73), one module per area, each case run as a user types it."""
