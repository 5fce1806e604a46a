"""``tandem``: one argparse parser, a subcommand for each registered command."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NoReturn, Sequence

from tandem_core.cli import CliError
from tandem_core.plugins import PluginError, import_string, registries


def _resolve(obj: Any) -> Callable[..., Any]:
    return import_string(obj) if isinstance(obj, str) else obj


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (``tandem run: --max-tokens: must be >= 1 (see --help)``),
    exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` command's options are configured (its module imported)."""
    parser = _Parser(prog="tandem", description="TandemLLM: a local inference server for coding agents")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (help, configure, run) in sorted(registries().cli_commands.items()):
        p = sub.add_parser(name, help=help, description=help)
        if name == selected:
            _resolve(configure)(p)
            p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(selected)
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
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001  (a failure no command foresaw: still one line, no traceback)
        text = " ".join(str(exc).split())
        print(f"tandem {args.command}: failed: {type(exc).__name__}: {text}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    from tandem_core.cli.main import main as _main  # the module's own identity, not __main__'s

    sys.exit(_main())
