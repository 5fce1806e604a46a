"""``tandem pull [MODEL]``: fetch a registry model's weights (the default model when none is named)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

__all__ = ["configure_pull", "run_pull"]


def configure_pull(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a registry model id (tandem models lists them); default: the default model",
    )
    parser.add_argument(
        "--force", action="store_true", help="fetch again even when a verified copy is present"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


class _Bar:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, out: TextIO, enabled: bool) -> None:
        self.out, self.enabled = out, enabled
        self.last = 0.0
        self.what = ""

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if what == self.what and now - self.last < 0.1 and done < total:
            return
        self.last, self.what = now, what
        if total > 0:
            frac = min(1.0, done / total)
            bar = "#" * int(frac * 30)
            line = f"\r{what:>8} [{bar:<30}] {done / 2**20:7.1f}/{total / 2**20:.1f} MiB"
        else:
            line = f"\r{what:>8} ..."
        self.out.write(line)
        self.out.flush()

    def close(self) -> None:
        if self.enabled and self.what:
            self.out.write("\n")
            self.out.flush()


def run_pull(args: argparse.Namespace) -> int:
    from tandem_core import catalog
    from tandem_core.cli.main import CliError
    from tandem_core.pull import PullError, local_path, pull, pull_drafters

    try:
        e = catalog.entry(args.model) if args.model else catalog.default_entry()
    except (catalog.ModelNotFound, catalog.RegistryError) as exc:
        raise CliError(str(exc)) from None
    present = None if args.force else local_path(e.data)
    bar = _Bar(sys.stderr, enabled=not args.quiet and sys.stderr.isatty())
    try:
        if present is not None:
            print(f"{e.id}: already present and verified at {present}")
        else:
            path = pull(e.data, progress=bar, force=args.force)
            bar.close()
            print(f"{e.id}: {path}")
        for name, folder in pull_drafters(e.data, e.path.parent, progress=bar, force=args.force).items():
            bar.close()
            print(f"{e.id}: drafter {name}: {folder}")
    except PullError as exc:
        bar.close()
        raise CliError(str(exc)) from None
    bar.close()
    return 0
