#!/usr/bin/env python
"""Build a lookup drafter corpus store from text files (the same as ``tandem corpus build``).

    python tools/build_corpus.py --tokenizer path/to/tokenizer.json -o code.tlk src/ docs/
    python tools/build_corpus.py --model qwen3.8-27b -o code.tlk src/

Serve with it: ``TANDEM_LOOKUP_CORPUS=code.tlk tandem serve ...``. A store built with
another tokenizer than the served model's is refused at load, naming both fingerprints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    try:
        import tandem_drafters  # noqa: F401  (installed: use it)
    except ImportError:  # a checkout without `pip install plugins/drafters`: use the source tree
        sys.path.insert(0, str(ROOT / "plugins" / "drafters"))
    from tandem_drafters.corpus_cli import configure_build, run_build

    from tandem_core.cli import CliError

    p = argparse.ArgumentParser(prog="build_corpus.py",
                                description="tokenise text files into a lookup corpus store")
    configure_build(p)
    args = p.parse_args(argv)
    try:
        return run_build(args)
    except CliError as exc:
        print(f"build_corpus.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
