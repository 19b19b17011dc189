"""The one exception type for mistakes a user can fix (bad flag, wrong path, mismatched run).

Why a dedicated type: the CLI prints a :class:`UserError` as one line (problem + fix) with exit code 2,
while every other exception -- a real bug -- keeps its full traceback. Catching bare ``ValueError`` or
``KeyError`` for that purpose hid genuine bugs behind one-line messages.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""


class UsageError(UserError, ValueError):
    """A bad input value: a flag, an option, a parameter, or the data a command was pointed at.

    Also a :class:`ValueError`, so library callers that validate with ``except ValueError`` keep working,
    while the CLI prints it as one line like any :class:`UserError`.
    """


class MissingInput(UserError, FileNotFoundError):
    """A file or directory the command needs is not there; the message says which stage makes it."""
