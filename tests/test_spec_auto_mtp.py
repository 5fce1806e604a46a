"""``--spec auto`` drafts with the engine's MTP head where the head pays for itself (``mtp_pays``): the engine has a
head and its draft steps are CUDA graph replays, or it runs on the CPU; never an eager head on a GPU (launch-bound
on the H200: a depth-3 round costs two thirds of a decode step). Named drafters stay as given."""

from __future__ import annotations

import pytest

from conftest_qwen38 import load_engine, qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.engine import Capabilities
from tandem_core.server.speculation import SpecOptions, build_speculation, mtp_pays, parse_spec, resolve_drafters


@pytest.mark.parametrize("caps, pays", [
    (Capabilities(tree=True, mtp=1, device="cuda:0", mtp_graphs=True), True),
    (Capabilities(tree=True, mtp=1, device="cuda:0", mtp_graphs=False), False),
    (Capabilities(tree=True, mtp=1, device="cpu"), True),
    (Capabilities(tree=True, mtp=0, device="cpu"), False),
    (Capabilities(tree=True, mtp=0, device="cuda", mtp_graphs=True), False),
], ids=["cuda-graphs", "cuda-eager", "cpu", "cpu-no-head", "cuda-no-head"])
def test_auto_adds_mtp_where_the_head_pays(caps, pays):
    assert mtp_pays(caps) is pays
    want = ("lookup", "mtp") if pays else ("lookup",)
    assert resolve_drafters(parse_spec("auto"), "no-such-model", caps) == want
    assert resolve_drafters(parse_spec("lookup"), "no-such-model", caps) == ("lookup",)
    assert resolve_drafters(parse_spec("mtp,auto"), "no-such-model", caps) == ("mtp", "lookup")
    assert resolve_drafters(parse_spec("auto"), "no-such-model") == ("lookup",)     # no engine: no head


@pytest.mark.parametrize("which, drafters", [("mtp", ["lookup", "mtp"]), ("text", ["lookup"])])
def test_the_server_default_drafts_with_the_checkpoints_head(qwen38_ckpts, which, drafters):  # noqa: F811
    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer

    path = getattr(qwen38_ckpts, which).path
    engine = load_engine(path)
    served = Served("tiny-qwen38", engine, HFTokenizer.from_dir(path), chat_template="")
    spec = build_speculation(served, [engine], SpecOptions(selfcheck=False))
    assert spec.enabled and list(spec.drafters) == drafters
    assert [d.name for d in spec.per_engine[0].drafters] == drafters
