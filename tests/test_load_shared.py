"""A third, made-up model family starts through the one loader with no edit under tandem_core/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem_core.engine import Engine
from tandem_core.loader import load_served
from tandem_core.serving import ServeArgs

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"


def write_toy(d: Path, vocab: int = 12, hidden: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    save_file({"embed": embed, "head": head}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["ToyForCausalLM"], "model_type": "toy",
                                               "vocab_size": vocab, "hidden_size": hidden}))
    words = ["<eos>"] + [f"w{i}" for i in range(1, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(d / "tokenizer.json"))
    return embed, head


def reference_greedy(embed, head, ids, n):
    out, seq = [], list(ids)
    for _ in range(n):
        h = embed[torch.tensor(seq)].mean(0)
        nxt = int((h @ head.T).argmax())
        if nxt == 0:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


@pytest.fixture
def toy_plugin(fresh_plugins, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    import toy_model_plugin

    fresh_plugins.register_plugin(toy_model_plugin, "toy")
    return toy_model_plugin


def test_third_model_through_the_loader(tmp_path, toy_plugin):
    embed, head = write_toy(tmp_path / "toy")
    served = load_served(str(tmp_path / "toy"), args=ServeArgs("x", tmp_path, max_context=64))
    assert isinstance(served.engine, Engine)
    assert served.info["architecture"] == "toy" and served.info["plugin"] == "tandem-toy"
    assert [s for s, _ in served.info["load_stages"]] == ["resolve", "weights"]
    eng = served.engine
    logits = eng.forward(torch.tensor([1, 2, 3]), all_logits=True)
    want = torch.stack([embed[[1]].mean(0), embed[[1, 2]].mean(0), embed[[1, 2, 3]].mean(0)]) @ head.T
    torch.testing.assert_close(logits, want)
    snap = eng.state.clone()
    eng.forward(torch.tensor([4]))
    eng.state.restore(snap)
    assert eng.kv.length == 3
    torch.testing.assert_close(eng.forward(torch.tensor([4])), (embed[[1, 2, 3, 4]].mean(0) @ head.T)[None])


@pytest.mark.server
def test_third_model_runs_from_the_command_line(tmp_path):
    embed, head = write_toy(tmp_path / "toy")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(PLUGINS), "TANDEM_EXTRA_PLUGINS": "toy_model_plugin",
           "TANDEM_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "run", "--model", str(tmp_path / "toy"),
                        "--ids", "1,2,3", "--max-tokens", "6", "--print-ids"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    got = [int(x) for x in r.stdout.strip().splitlines()[-1].split(",") if x]
    assert got == reference_greedy(embed, head, [1, 2, 3], 6)


def test_core_names_no_model_and_sniffs_no_engine():
    """No model plugin named under tandem_core/, and no engine probed with hasattr/isinstance: capabilities are
    read from ``caps`` (``supports_tree``/``supports_resume``). The conformance suite (tandem_core/testing/) is
    test support whose job is to check an engine against the protocols, so it may ``isinstance`` them."""
    bad = re.compile(r"tandem_qwen38|tandem_llama|Qwen38Engine|LlamaEngine|hasattr\((eng|engine|model)\b"
                     r"|isinstance\((eng|engine)\b")
    offenders = []
    for path in (ROOT / "tandem_core").rglob("*.py"):
        if path.parent.name == "testing":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if bad.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
