"""Errors of the library API, each with the exit status its command uses.

Every function of ``prism.app`` raises a ``PrismError`` for a problem the
caller can fix (a bad option, a run that cannot be read, a trace that breaks
the rules); its text names the file, rank, group or value and says what to
do. The command line prints ``prism COMMAND: TEXT`` and exits with
``exit_code``. Anything else that escapes is a bug in Prism.
"""

from __future__ import annotations


class PrismError(Exception):
    """A problem with the caller's input; ``exit_code`` is what the CLI exits with."""

    exit_code = 2


class UsageError(PrismError):
    """Bad options or an input that cannot be read at all (exit status 2)."""

    exit_code = 2


class InconsistentTraceError(PrismError):
    """The run reads, but its records contradict each other (exit status 1)."""

    exit_code = 1
