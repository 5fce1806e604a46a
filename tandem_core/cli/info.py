"""``tandem plugins``, ``tandem models``, ``tandem registry``, ``tandem settings``: what is installed and known."""

from __future__ import annotations

import argparse
import json
import sys

from tandem_core import catalog
from tandem_core.plugins import loaded_plugins
from tandem_core.settings import SETTINGS


def configure_plugins(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def run_plugins(args: argparse.Namespace) -> int:
    infos = loaded_plugins()
    if args.json:
        print(json.dumps([i.__dict__ for i in infos], indent=2))
        return 0
    for i in infos:
        dist = f"{i.distribution or '-'} {i.version or ''}".strip()
        kind = " (default)" if i.default else ""
        print(f"{i.name}{kind}  [{dist}]")
        for k, items in sorted(i.registered.items()):
            print(f"    {k}: {', '.join(sorted(items))}")
    return 0


def configure_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def run_models(args: argparse.Namespace) -> int:
    from tandem_core.registry import architectures

    archs = architectures()
    rows = []
    for e in sorted(catalog.entries().values(), key=lambda e: e.id):
        local = catalog.find_local(e)
        fam = e.data.get("family", "?")
        rows.append({
            "id": e.id, "name": e.data.get("name"), "family": fam,
            "plugin": "installed" if fam in archs else f"missing ({e.data.get('plugin', '?')})",
            "local": str(local) if local else None, "default": bool(e.data.get("default")),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        mark = "*" if r["default"] else " "
        print(f"{mark} {r['id']:<20} {r['family']:<10} plugin {r['plugin']:<24} "
              f"{'present: ' + r['local'] if r['local'] else 'not present (tandem pull ' + r['id'] + ')'}")
    return 0


def configure_registry(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true", help="refuse entries whose numbers do not add up")
    g.add_argument("--schema", action="store_true", help="print the JSON schema of model.yaml")
    p.add_argument("--dir", action="append", default=None, help="check this registry folder instead")


def run_registry(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(catalog.schema(), indent=2))
        return 0
    from pathlib import Path

    dirs = [Path(d) for d in args.dir] if args.dir else None
    problems = catalog.check(dirs)
    n = len(catalog.entries(dirs))
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) in {n} entries", file=sys.stderr)
        return 1
    print(f"{n} entries, all sound")
    return 0


def configure_settings(p: argparse.ArgumentParser) -> None:
    pass


def run_settings(args: argparse.Namespace) -> int:
    from tandem_core.plugins import load_plugins

    load_plugins()
    for s in SETTINGS:
        print(f"TANDEM_{s.name}={s.default!r}  [{s.type.__name__}, {s.owner}]  {s.meaning}")
    return 0
