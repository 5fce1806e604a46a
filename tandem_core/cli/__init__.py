"""The ``tandem`` command and its subcommands."""
