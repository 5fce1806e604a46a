"""Serves the toy tree runner (a tree-verifying toy model, ``toy_tree_runner``) through the hooks, for server speculation tests.

The checkpoint is a directory with ``config.json`` (``{"architectures": ["ToyTreeForTest"], "vocab": V,
"seed": S}``) and a word-level ``tokenizer.json`` of ``w0 .. w{V-1}`` (``w0`` ends a turn).
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch


@hookimpl
def tandem_architectures(register):
    register(Arch("toytree", ("ToyTreeForTest",), ("toytree",), "toy_tree_plugin:read_config",
                  "tandem-toytree", "toy_tree_plugin:serve"))


def read_config(raw):
    return dict(raw)


def write_model(d: Path, vocab: int = 48, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["ToyTreeForTest"], "vocab": vocab, "seed": seed}))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["w0"])
    tok.save(str(d / "tokenizer.json"))
    return d


def serve(args, ctx):
    from toy_tree_runner import toy_tree_engine

    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer

    d = Path(args.path)
    cfg = json.loads((d / "config.json").read_text())
    eng = toy_tree_engine(vocab=cfg["vocab"], seed=cfg["seed"], max_context=args.max_context)
    tok = HFTokenizer.from_file(d / "tokenizer.json", eos_tokens=["w0"])
    ctx.mark("engine")
    return Served(args.model_id, eng, tok, chat_template="{% for m in messages %}{{ m.content }} {% endfor %}",
                  tool_format="none", stop_ids=tok.eos_token_ids, info={"weights": str(d)},
                  spawn=lambda: toy_tree_engine(vocab=cfg["vocab"], seed=cfg["seed"], max_context=args.max_context))
