"""The block drafter through a real server: a tiny Llama served with ``--spec lookup,block`` (and ``--spec block``)
answers exactly what ``--spec off`` answers through the official openai client, greedy and seeded sampling;
/health lists the drafters after the self-check passed; a block drafter built for another target leaves
speculation off with the refusal named."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
from block_fixtures import random_block, write_tiny_llama
from openai import OpenAI
from replay_server import Server
from test_llama_tiny import bpe  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.server

PROMPTS = ["the quick brown fox", "hello world, hello", "def main():", "numbers 12345 and 67 and 12345 and"]


def env(block: Path) -> dict[str, str]:
    return {"TANDEM_EXTRA_PLUGINS": "tandem_llama.plugin,tandem_drafters.plugin", "TANDEM_THREADS": "1",
            "TANDEM_BLOCK_DRAFTER": str(block),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "llama"), str(ROOT / "plugins" / "drafters")])}


def settled(server: Server) -> dict:
    deadline = time.monotonic() + 90
    while True:
        h = httpx.get(server.url + "/health").json()["speculation"]
        if h["reason"] != "self-check running":
            return h
        assert time.monotonic() < deadline, "the self-check did not finish"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, bpe):  # noqa: F811
    model = write_tiny_llama(tmp_path_factory.mktemp("tinyllama") / "m", bpe)
    block = random_block(tmp_path_factory.mktemp("block") / "d", seed=2)
    other = random_block(tmp_path_factory.mktemp("other") / "d", target_layer_ids=(0, 9))
    common = ("--no-cache", "--max-context", "512", "--max-tree", "8")
    out = {
        "merged": Server(model, tmp_path_factory.mktemp("h1"), "--spec", "lookup,block", *common, env=env(block),
                         model="tiny"),
        "block": Server(model, tmp_path_factory.mktemp("h2"), "--spec", "block", *common, env=env(block), model="tiny"),
        "plain": Server(model, tmp_path_factory.mktemp("h3"), "--spec", "off", *common, env=env(block), model="tiny"),
        "other": Server(model, tmp_path_factory.mktemp("h4"), "--spec", "lookup,block", *common, env=env(other),
                        model="tiny"),
    }
    try:
        for s in out.values():
            s.wait_ready(120)
        yield out
    finally:
        for s in out.values():
            s.stop()


def answers(server: Server, **kw) -> list[str]:
    client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60)
    out = []
    for p in PROMPTS:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=24,
                                           **kw)
        out.append(r.choices[0].message.content)
    return out


def test_health_lists_the_drafters_after_the_selfcheck(servers):
    h = settled(servers["merged"])
    assert h["enabled"] and h["drafters"] == ["lookup", "block"] and h["selfcheck"]["ok"]
    assert settled(servers["block"])["drafters"] == ["block"]


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_speculative_servers_answer_what_the_plain_server_answers(servers, kw):
    for name in ("merged", "block"):
        settled(servers[name])
    want = answers(servers["plain"], **kw)
    assert answers(servers["merged"], **kw) == want
    assert answers(servers["block"], **kw) == want
    m = httpx.get(servers["merged"].url + "/metrics").text
    assert "tandem_spec_rounds_total" in m and "tandem_spec_drafted_total 0" not in m


def test_a_drafter_for_another_target_leaves_speculation_off_naming_it(servers):
    h = httpx.get(servers["other"].url + "/health").json()["speculation"]
    assert not h["enabled"] and "drafter 'block' cannot draft for target" in h["reason"] and "[9]" in h["reason"]
    assert json.dumps(answers(servers["other"], temperature=0)) == json.dumps(answers(servers["plain"], temperature=0))
