"""The drafter contract: requirements checked against the target and refused by name; the hook."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem_core.drafter import (
    Drafter,
    DrafterMismatch,
    Proposal,
    Requirements,
    TargetInfo,
    build_drafter,
    check_target,
)
from tandem_core.engine import Capabilities
from tandem_core.plugins import hookimpl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "plugins" / "drafters") not in sys.path:  # the plugin's source tree, installed or not
    sys.path.insert(0, str(ROOT / "plugins" / "drafters"))

TARGET = TargetInfo(hidden_layers=(1, 31, 62), embedding=True, head=True, tokenizer="a" * 64,
                    vocab_size=248320, name="qwen3.8-27b")


def test_a_matching_drafter_passes():
    check_target("block", Requirements(hidden_layers=(1, 31), embedding=True, head=True, tokenizer="a" * 64,
                                       vocab_size=248320), TARGET)
    check_target("lookup", Requirements(), TargetInfo())


@pytest.mark.parametrize("req,names", [
    (Requirements(hidden_layers=(1, 40, 50)), ["hidden layer(s) [40, 50]", "[1, 31, 62]"]),
    (Requirements(tokenizer="b" * 64), ["tokenizer sha256 " + "b" * 64, "the target's is " + "a" * 64]),
    (Requirements(vocab_size=151936), ["vocab_size 151936", "248320"]),
])
def test_a_mismatch_is_refused_naming_the_drafter_and_the_item(req, names):
    with pytest.raises(DrafterMismatch) as e:
        check_target("dflash2", req, TARGET)
    msg = str(e.value)
    assert "drafter 'dflash2'" in msg and "'qwen3.8-27b'" in msg
    for n in names:
        assert n in msg


def test_every_missing_item_is_named_at_once():
    bare = TargetInfo(hidden_layers=(), embedding=False, head=False, tokenizer=None, vocab_size=10)
    with pytest.raises(DrafterMismatch) as e:
        req = Requirements(hidden_layers=(3,), embedding=True, head=True, tokenizer="c" * 64)
        check_target("mtp", req, bare)
    msg = str(e.value)
    for n in ("hidden layer(s) [3]", "the embedding", "the head", "the target's is unknown"):
        assert n in msg


def test_target_info_from_capabilities():
    caps = Capabilities(tree=True, hidden_layers=(2, 5))
    t = TargetInfo.of(caps, tokenizer="f" * 64, vocab_size=1000, name="m")
    assert t.hidden_layers == (2, 5) and t.embedding and t.head and t.vocab_size == 1000


class NeedsLayer9:
    """A drafter that reads hidden layer 9 (for the hook test)."""

    name = "needs9"

    def __init__(self, target: TargetInfo, **options: object) -> None:
        self.options = options

    def requires(self) -> Requirements:
        return Requirements(hidden_layers=(9,))

    def begin(self, prompt_ids):
        pass

    def propose(self, context_ids, max_nodes):
        return Proposal.empty(self.name)

    def accepted(self, tokens):
        pass

    def reset(self):
        pass


class _InTestPlugin:
    @hookimpl
    def tandem_drafters(self, register):
        register("needs9", f"{__name__}:NeedsLayer9")


def test_build_drafter_through_the_hook_checks_the_target(fresh_plugins, monkeypatch):
    monkeypatch.setenv("TANDEM_DISABLE_ENTRYPOINTS", "1")
    fresh_plugins.register_plugin(_InTestPlugin(), "in-test-drafter")
    d = build_drafter("needs9", TargetInfo(hidden_layers=(9,)), depth=3)
    assert isinstance(d, Drafter) and d.options == {"depth": 3}
    with pytest.raises(DrafterMismatch, match=r"drafter 'needs9'.*hidden layer\(s\) \[9\]"):
        build_drafter("needs9", TargetInfo(hidden_layers=(1, 2)))
    with pytest.raises(KeyError, match="no drafter 'nope' registered; known: needs9"):
        build_drafter("nope", TARGET)


def test_the_drafters_plugin_registers_lookup_and_the_corpus_command(fresh_plugins, monkeypatch):
    monkeypatch.setenv("TANDEM_DISABLE_ENTRYPOINTS", "1")
    monkeypatch.setenv("TANDEM_EXTRA_PLUGINS", "tandem_drafters.plugin")
    reg = fresh_plugins.registries()
    assert reg.drafters["lookup"] == "tandem_drafters.lookup:LookupDrafter"
    assert "corpus" in reg.cli_commands
    d = build_drafter("lookup", TARGET, corpus="")
    assert isinstance(d, Drafter)
    assert d.requires() == Requirements()  # no corpus: it reads nothing of the target


def test_the_plugin_imports_nothing_heavy():
    import subprocess

    code = ("import sys; sys.path.insert(0, %r); import tandem_drafters.plugin; "
            "print(sorted(m for m in ('torch', 'numpy', 'tandem_drafters.lookup') if m in sys.modules))"
            % str(ROOT / "plugins" / "drafters"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_drafter_that_drives_an_mtp_head_is_refused_without_one():
    check_target("mtp", Requirements(mtp=True), TargetInfo(mtp=1))
    with pytest.raises(DrafterMismatch, match=r"drafter 'mtp' cannot draft for target 'm': it needs an MTP head"):
        check_target("mtp", Requirements(mtp=True), TargetInfo(name="m"))
    assert TargetInfo.of(Capabilities(tree=True, mtp=2), tokenizer=None, vocab_size=10).mtp == 2
