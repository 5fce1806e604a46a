"""``tandem ledger``: the last rows of the usage ledger (counts and times; the ledger holds no text)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from tandem_core.cli.main import CliError

__all__ = ["configure_ledger", "run_ledger"]


def configure_ledger(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger", help="the ledger file (default: $TANDEM_HOME/ledger.sqlite)")
    p.add_argument("-n", "--last", type=int, default=20, help="how many rows (default 20)")
    p.add_argument("--json", action="store_true", help="print JSON lines")


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run_ledger(args: argparse.Namespace) -> int:
    from tandem_core.server.ledger import Ledger, default_path

    path = Path(args.ledger).expanduser() if args.ledger else default_path()
    if not path.exists():
        raise CliError(f"no ledger at {path} (it is written by `tandem serve`)")
    rows = Ledger(path).last(args.last)
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
        return 0
    head = (f"{'time':<19} {'request':<34} {'model':<20} {'endpoint':<11} {'prompt':>7} {'compl':>6} "
            f"{'finish':<10} {'ttft s':>7} {'tok/s':>7} {'queue s':>7}")
    print(head)
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.ts))
        print(f"{when:<19} {r.request_id:<34} {r.model[:20]:<20} {r.endpoint:<11} {r.prompt_tokens:>7} "
              f"{r.completion_tokens:>6} {r.finish_reason:<10} {_f(r.ttft_s, '7.3f')} {_f(r.decode_tps, '7.1f')} "
              f"{r.queued_s:>7.2f}" + (f"  (max_tokens {r.capped_from} capped to {r.max_tokens})"
                                       if r.capped_from else ""))
    return 0
