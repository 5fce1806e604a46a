"""The side lane through a real server (the tiny Qwen3.8 hybrid, speculation and caches on), with the official
``openai`` client: while a long generation streams, short requests (<= 64 output tokens, thinking off) are
answered at once, whole and streamed, chat and completions; a request that is not short waits its turn. Every
answer equals the one the same request gets from an idle server, and the long generation's text equals its
uninterrupted text (its state came back byte for byte)."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from conftest_qwen38 import qwen38_ckpts  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"
sys.path.insert(0, str(PLUGINS))
from replay_server import Server  # noqa: E402

pytestmark = pytest.mark.server  # starts processes

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
NO_END = {"0": -100, "2": -100}     # <|endoftext|>, <|im_end|>: the long answer runs to max_tokens
LONG = 700


def start(path, home, **env):
    env = {"TANDEM_EXTRA_PLUGINS": "tandem_qwen38.plugin,tandem_drafters.plugin",
           "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT), str(ROOT / "plugins" / "qwen38_27b"),
                                          str(ROOT / "plugins" / "drafters")]), **env}
    srv = Server(path, home, "--spec", "lookup", "--max-tree", "8", "--max-context", "1024", env=env)
    srv.wait_ready(120)
    deadline = time.monotonic() + 120
    while httpx.get(srv.url + "/health").json()["speculation"]["reason"] == "self-check running":
        assert time.monotonic() < deadline, "the self-check did not finish"
        time.sleep(0.2)
    return srv


@pytest.fixture(scope="module")
def server(qwen38_ckpts, tmp_path_factory):  # noqa: F811
    srv = start(qwen38_ckpts.text.path, tmp_path_factory.mktemp("side"))
    try:
        yield srv
    finally:
        srv.stop()


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 37 + 11 * i) % 300}" for i in range(n))


class Long(threading.Thread):
    """The long generation, streamed; ``started`` once its first token arrived, ``ended_at`` when it ended."""

    def __init__(self, client: OpenAI) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.text = ""
        self.started = threading.Event()
        self.ended_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model="replay-test", messages=[{"role": "user", "content": words(1, 30)}], max_tokens=LONG,
                temperature=0, logit_bias=NO_END, stream=True, extra_body=NO_THINK)
            for ev in stream:
                if ev.choices and ev.choices[0].delta.content:
                    self.text += ev.choices[0].delta.content
                    self.started.set()
        except BaseException as exc:  # the test reads it
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


def shorts(client: OpenAI) -> list[str]:
    """Three short requests: chat whole, chat streamed, completions; their texts."""
    a = client.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": words(2, 40)}],
                                       max_tokens=16, temperature=0, extra_body=NO_THINK)
    parts = client.chat.completions.create(model="replay-test",
                                           messages=[{"role": "user", "content": words(3, 12)}],
                                           max_tokens=64, temperature=0, stream=True, extra_body=NO_THINK)
    b = "".join(ev.choices[0].delta.content or "" for ev in parts if ev.choices)
    c = client.completions.create(model="replay-test", prompt=words(4, 20), max_tokens=10, temperature=0)
    return [a.choices[0].message.content or "", b, c.choices[0].text]


def not_short(client: OpenAI) -> str:
    r = client.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": words(5, 10)}],
                                       max_tokens=65, temperature=0, extra_body=NO_THINK)
    return r.choices[0].message.content or ""


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_short_requests_are_served_inside_a_running_generation(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=300)
    before = metric(server.url, "tandem_side_lane_total")
    long = Long(client)
    long.start()
    assert long.started.wait(120) and long.error is None, long.error
    t0 = time.monotonic()
    got = shorts(client)
    t_shorts = time.monotonic()
    waited: dict[str, object] = {}
    slow = threading.Thread(target=lambda: waited.update(text=not_short(client), at=time.monotonic()), daemon=True)
    slow.start()
    long.join(300)
    slow.join(300)
    assert long.error is None and long.ended_at is not None, long.error
    # the short ones were answered while the long one ran; the one asking for 65 tokens waited for it
    assert t_shorts < long.ended_at, (t_shorts - t0, long.ended_at - t0)
    assert waited["at"] > long.ended_at
    assert metric(server.url, "tandem_side_lane_total") == before + 3
    lines = [ln for ln in server.log_text().splitlines() if " lane=side" in ln]
    assert len(lines) == 3 and all("finish=" in ln for ln in lines), lines

    # the same requests on the idle server: the same answers; the long one's text is its uninterrupted text
    assert shorts(client) == got
    assert not_short(client) == waited["text"]
    alone = Long(client)
    alone.run()
    assert alone.error is None and alone.text == long.text and len(long.text.split()) >= LONG // 2
    assert metric(server.url, "tandem_side_lane_total") == before + 3   # an idle engine serves them plainly


def test_health_counts_the_side_lane(server):
    eng = httpx.get(server.url + "/health").json()["engine"]
    assert eng["side_lane"]["waiting"] == 0 and eng["side_lane"]["served"] >= 0


def test_with_the_side_lane_off_a_short_request_queues(qwen38_ckpts, tmp_path):  # noqa: F811
    srv = start(qwen38_ckpts.text.path, tmp_path, TANDEM_SIDE_LANE="0")
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=300)
        long = Long(client)
        long.start()
        assert long.started.wait(120) and long.error is None, long.error
        r = client.completions.create(model="replay-test", prompt=words(4, 20), max_tokens=10, temperature=0)
        done_at = time.monotonic()
        long.join(300)
        assert r.choices[0].text and long.ended_at is not None and done_at > long.ended_at
        assert metric(srv.url, "tandem_side_lane_total") == 0 and " lane=side" not in srv.log_text()
    finally:
        srv.stop()
