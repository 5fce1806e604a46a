"""``tandem corpus build|info`` (and ``tools/build_corpus.py``): make and inspect lookup corpus stores.

``build`` tokenises text files with a tokenizer — a ``tokenizer.json`` (or a folder
holding one) given by ``--tokenizer``, or the tokenizer of a registry model or
checkpoint folder given by ``--model`` — and writes one store whose header
records that tokenizer's sha256. Every file is one document; folders are read
recursively (``--glob`` picks the files); a file that is not UTF-8 text is skipped
and counted. Nothing prints the text itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tandem_core.cli import CliError

if TYPE_CHECKING:
    from tandem_core.tokenizer import HFTokenizer

__all__ = ["configure_corpus", "run_corpus", "configure_build", "run_build", "configure_info", "run_info",
           "load_tokenizer", "text_files"]


def configure_corpus(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="corpus_action", metavar="ACTION", required=True)
    configure_build(sub.add_parser("build", help="build a store from text files",
                                   description="tokenise text files into a lookup corpus store"))
    configure_info(sub.add_parser("info", help="print a store's header (and check it)",
                                  description="print a lookup corpus store's header; exit 2 if unsound"))


def run_corpus(args: argparse.Namespace) -> int:
    return run_build(args) if args.corpus_action == "build" else run_info(args)


def configure_build(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="text files or folders (read recursively)")
    p.add_argument("-o", "--out", required=True, help="the store to write (e.g. ~/.tandem/corpus/code.tlk)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", help="a tokenizer.json, or a folder holding one")
    src.add_argument("--model", help="a registry model id or a checkpoint folder: use its tokenizer")
    p.add_argument("--weights", help="the checkpoint folder, when --model is a registry id")
    p.add_argument("--glob", default="*", help="which files inside folders (default: all)")
    p.add_argument("--orders", default=None,
                   help="comma-separated n-gram orders (default: 1,2,3,4,6,8,12,16)")


def configure_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="a lookup corpus store")
    p.add_argument("--no-verify", action="store_true", help="skip the payload sha256 check")


def load_tokenizer(tokenizer: str | None = None, model: str | None = None,
                   weights: str | None = None) -> HFTokenizer:
    """An ``HFTokenizer`` from a ``tokenizer.json`` path, or from a registry model / checkpoint folder."""
    from tandem_core.tokenizer import HFTokenizer

    if tokenizer:
        p = Path(tokenizer).expanduser()
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise CliError(f"--tokenizer {tokenizer}: no tokenizer.json there")
        try:
            return HFTokenizer.from_file(p)
        except Exception as exc:  # the tokenizers library raises its own exception types
            raise CliError(f"{p}: not a readable tokenizer.json ({exc})") from exc
    from tandem_core import catalog

    try:
        _, path = catalog.resolve(model, weights)
    except catalog.ModelNotFound as exc:
        raise CliError(str(exc)) from exc
    folder = path if path.is_dir() else path.parent
    if not (folder / "tokenizer.json").is_file():
        raise CliError(f"{path}: no tokenizer.json beside the checkpoint; pass --tokenizer PATH")
    return HFTokenizer.from_dir(folder)


def text_files(inputs: list[str], pattern: str = "*") -> Iterator[Path]:
    for raw in inputs:
        p = Path(raw).expanduser()
        if p.is_dir():
            yield from (f for f in sorted(p.rglob(pattern)) if f.is_file())
        elif p.is_file():
            yield p
        else:
            raise CliError(f"{raw}: no such file or folder")


def run_build(args: argparse.Namespace) -> int:
    from tandem_drafters.corpus import build_store
    from tandem_drafters.ngram import DEFAULT_ORDERS

    tok = load_tokenizer(args.tokenizer, args.model, args.weights)
    try:
        orders = tuple(int(x) for x in args.orders.split(",")) if args.orders else DEFAULT_ORDERS
    except ValueError as exc:
        raise CliError(f"--orders {args.orders!r}: not comma-separated integers") from exc
    t0 = time.perf_counter()
    counts = {"files": 0, "skipped": 0, "tokens": 0}

    def docs() -> Iterator[list[int]]:
        for f in text_files(args.inputs, args.glob):
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                counts["skipped"] += 1
                continue
            ids = tok.encode(text)
            counts["files"] += 1
            counts["tokens"] += len(ids)
            yield ids

    try:
        out = build_store(docs(), args.out, tok.fingerprint(), orders=orders,
                          meta={"tool": "tandem corpus build", "built_at": int(time.time())})
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if counts["files"] == 0:
        out.unlink()
        raise CliError("no readable text files among the inputs; nothing written")
    dt = time.perf_counter() - t0
    print(f"{out}: {counts['files']} files ({counts['skipped']} skipped), {counts['tokens']} tokens, "
          f"{out.stat().st_size} bytes, tokenizer sha256 {tok.fingerprint()}, {dt:.2f}s")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from tandem_drafters.corpus import CorpusError, CorpusStore

    try:
        store = CorpusStore.open(args.store, verify=not args.no_verify)
    except CorpusError as exc:
        raise CliError(str(exc)) from exc
    head = {k: v for k, v in store.header.items() if k != "sections"}
    json.dump(head, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0
