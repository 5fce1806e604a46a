"""The ``tandem`` command and its subcommands."""


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2, no traceback."""
