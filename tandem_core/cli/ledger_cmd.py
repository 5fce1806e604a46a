"""``tandem ledger``: the last rows of the usage ledger and their sums (counts, times and costs; no text).

``--by model`` or ``--by day`` sums every row of the ledger by model or by day (requests, tokens, cost, errors,
mean time to first token and decode rate); without it the last ``-n`` rows are listed, then their totals.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from tandem_core.cli.main import CliError, positive_int

__all__ = ["configure_ledger", "run_ledger"]


def configure_ledger(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger", help="the ledger file (default: $TANDEM_HOME/ledger.sqlite)")
    p.add_argument("-n", "--last", type=positive_int, default=20, help="how many rows (default 20)")
    p.add_argument("--by", choices=["model", "day"], help="sum every row by model or by day instead of listing rows")
    p.add_argument("--json", action="store_true", help="print JSON lines")


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def run_ledger(args: argparse.Namespace) -> int:
    from tandem_core.server.ledger import Ledger, default_path

    path = Path(args.ledger).expanduser() if args.ledger else default_path()
    if not path.exists():
        raise CliError(f"no ledger at {path} (it is written by `tandem serve` and `tandem-dash`)")
    ledger = Ledger(path)
    try:
        if getattr(args, "by", None):
            return _sums(ledger, args.by, args.json)
        rows = ledger.last(args.last)
        if args.json:
            for r in rows:
                print(json.dumps(asdict(r)))
            return 0
        head = (f"{'time':<19} {'request':<34} {'model':<20} {'backend':<10} {'endpoint':<11} {'status':>6} "
                f"{'prompt':>7} {'compl':>6} {'finish':<10} {'ttft s':>7} {'tok/s':>7} {'queue s':>7} {'cost':>10}")
        print(head)
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.ts))
            print(f"{when:<19} {r.request_id:<34} {r.model[:20]:<20} {r.backend[:10]:<10} {r.endpoint:<11} "
                  f"{r.status:>6} {r.prompt_tokens:>7} {r.completion_tokens:>6} {r.finish_reason:<10} "
                  f"{_f(r.ttft_s, '7.3f')} {_f(r.decode_tps, '7.1f')} {r.queued_s:>7.2f} {r.cost:>10.6f}"
                  + (f"  (max_tokens {r.capped_from} capped to {r.max_tokens})" if r.capped_from else "")
                  + ("  (tokens counted)" if r.counted else ""))
        print(f"{len(rows)} rows: {sum(r.prompt_tokens for r in rows)} prompt and "
              f"{sum(r.completion_tokens for r in rows)} completion tokens, cost {sum(r.cost for r in rows):.6f}")
        return 0
    finally:
        ledger.close()


def _sums(ledger: object, by: str, as_json: bool) -> int:
    groups = ledger.summary(by)        # type: ignore[attr-defined]
    total = ledger.summary(None)       # type: ignore[attr-defined]
    if as_json:
        for g in groups:
            print(json.dumps({"by": by, **asdict(g)}))
        for t in total:
            print(json.dumps({"by": "total", **asdict(t)}))
        return 0
    print(f"{by:<24} {'requests':>8} {'prompt':>10} {'completion':>10} {'cost':>12} {'errors':>6} "
          f"{'ttft s':>7} {'tok/s':>7}")
    for g in groups + [type(g)(key="total", **{k: v for k, v in asdict(g).items() if k != "key"})
                       for g in total]:
        print(f"{g.key[:24]:<24} {g.requests:>8} {g.prompt_tokens:>10} {g.completion_tokens:>10} {g.cost:>12.6f} "
              f"{g.errors:>6} {_f(g.mean_ttft_s, '7.3f')} {_f(g.mean_decode_tps, '7.1f')}")
    return 0
