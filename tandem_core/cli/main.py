"""``tandem``: one argparse parser, a subcommand for each registered command."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

from tandem_core.plugins import PluginError, import_string, registries


def _resolve(obj: Any) -> Callable[..., Any]:
    return import_string(obj) if isinstance(obj, str) else obj


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="TandemLLM: a local inference server for coding agents")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help, configure, run) in sorted(registries().cli_commands.items()):
        p = sub.add_parser(name, help=help, description=help)
        _resolve(configure)(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except PluginError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 1
    try:
        rc = _resolve(args._run)(args)
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2, no traceback."""


if __name__ == "__main__":
    sys.exit(main())
