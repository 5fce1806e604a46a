"""The ``tandem`` command and its subcommands."""


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status ``exit_code`` (2: a usage error), no traceback."""

    exit_code = 2


class LoadFailed(CliError):
    """The model could not be loaded, or the server cannot start: one line naming the file and the field, exit 1."""

    exit_code = 1
