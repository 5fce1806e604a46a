"""Speculation through the server: a tree-verifying model served with --spec lookup answers exactly what
the same model served with --spec off answers, greedy and seeded sampling, on 20 prompts; /health shows
the self-check, /metrics tokens per round and acceptance."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"
sys.path.insert(0, str(PLUGINS))
from replay_server import Server  # noqa: E402
from toy_tree_plugin import write_model  # noqa: E402

ENV = {"TANDEM_EXTRA_PLUGINS": "toy_tree_plugin,tandem_drafters.plugin",
       "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT), str(ROOT / "plugins" / "drafters")])}

pytestmark = pytest.mark.server  # starts processes


def prompts() -> list[str]:
    rng = random.Random(5)
    out = []
    for i in range(20):
        if i % 2:
            unit = [rng.randrange(1, 48) for _ in range(rng.randrange(2, 5))]
            ids = (unit * 6)[: rng.randrange(8, 20)]
        else:
            ids = [rng.randrange(1, 48) for _ in range(rng.randrange(3, 12))]
        out.append(" ".join(f"w{t}" for t in ids))
    return out


def price_registry(root: Path) -> Path:
    """A registry folder holding a price file for the toy (verify nearly flat in width), so the cut's choice
    does not depend on how fast this machine happens to run the toy's Python per-node verify."""
    p = root / "prices" / "replay-test" / "fp32.cpu.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"format": "tandem-prices", "version": 1, "contexts": [0, 4096], "widths": [1, 65],
                             "ms": [[1.0, 1.2], [1.0, 1.2]]}))
    return root


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = write_model(tmp_path_factory.mktemp("toytree") / "m")
    prices = price_registry(tmp_path_factory.mktemp("registry"))
    spec = Server(d, tmp_path_factory.mktemp("h1"), "--spec", "lookup", "--max-tree", "64", "--no-cache",
                  env={**ENV, "TANDEM_REGISTRY": str(prices)})
    plain = Server(d, tmp_path_factory.mktemp("h2"), "--spec", "off", "--no-cache", env=ENV)
    try:
        spec.wait_ready(90)
        plain.wait_ready(90)
        deadline = time.monotonic() + 60          # the self-check runs on a spare engine in the background
        while httpx.get(spec.url + "/health").json()["speculation"]["reason"] == "self-check running":
            assert time.monotonic() < deadline, "the self-check did not finish"
            time.sleep(0.1)
        yield spec, plain
    finally:
        spec.stop()
        plain.stop()


def answers(server, **kw) -> list[str]:
    client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60)
    out = []
    for p in prompts():
        r = client.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": p}],
                                           max_tokens=40, **kw)
        out.append(r.choices[0].message.content)
    return out


def test_health_says_speculation_is_on_after_the_selfcheck(servers):
    spec, plain = servers
    h = httpx.get(spec.url + "/health").json()["speculation"]
    assert h["enabled"] and h["drafters"] == ["lookup"] and h["selfcheck"]["ok"]
    assert h["selfcheck"]["rows"] > 0 and h["selfcheck"]["widths"] == 64 and h["max_tree"] == 63 and h["prices"] == ["file"]
    assert httpx.get(plain.url + "/health").json()["speculation"]["enabled"] is False


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.9, seed=11)], ids=["greedy", "seeded"])
def test_speculative_server_equals_plain_server(servers, kw):
    spec, plain = servers
    assert answers(spec, **kw) == answers(plain, **kw)


def test_metrics_and_log_carry_tokens_per_round(servers):
    spec, _ = servers
    answers(spec, temperature=0)
    text = httpx.get(spec.url + "/metrics").text
    tpr = float(re.search(r"^tandem_spec_tokens_per_round (\S+)$", text, re.M).group(1))
    assert tpr > 1.5, text
    assert re.search(r"^tandem_spec_explore_rounds_total \d+$", text, re.M), text
    assert re.search(r"tokens_per_round=\d+\.\d+ acceptance=\d\.\d+", spec.log_text())
