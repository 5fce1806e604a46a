"""Admission through a real server: API key, 429 with Retry-After, the SSE wait comment, disconnects, --parallel."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from replay_server import Server, write_model  # noqa: E402

pytestmark = pytest.mark.server  # starts processes

KEY = "sekrit"
SCRIPTS = [{"when": "[[slow]]", "random": True, "endless": True, "delay_s": 0.05}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    srv = Server(write_model(root / "model", SCRIPTS), root / "home", "--queue", "1", "--api-key", KEY,
                 env={"TANDEM_WAIT_COMMENT_S": "0.5"})
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def body(text: str, **kw) -> dict:
    return {"model": "replay-test", "messages": [{"role": "user", "content": text}], **kw}


class Streamer(threading.Thread):
    """Reads one streamed request's SSE lines until told to stop (then closes the connection)."""

    def __init__(self, url: str, payload: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, payload
        self.lines: list[str] = []
        self.status: int | None = None
        self.stop_flag = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=30) as c, c.stream("POST", self.url + "/v1/chat/completions",
                                                         json=self.payload, headers=AUTH) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                    if self.stop_flag.is_set():
                        break
        finally:
            self.done.set()

    def data(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith("data: {")]

    def comments(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith(":")]


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def test_api_key_is_required_on_v1_but_not_health(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=10)
    assert good.chat.completions.create(**body("hi")).choices[0].message.content == "Hello there!"


def test_full_queue_429_wait_comments_and_disconnects_free_the_engine(server):
    a = Streamer(server.url, body("[[slow]]", stream=True, max_tokens=2000, seed=1))
    a.start()
    assert wait_until(lambda: len(a.data()) >= 2), "the first request never started"
    b = Streamer(server.url, body("[[slow]]", stream=True, max_tokens=2000, seed=2))
    b.start()
    assert wait_until(lambda: health(server)["engine"]["waiting"] == 1)
    # the queue (1) is full: a third request is refused with Retry-After
    r = httpx.post(server.url + "/v1/chat/completions", json=body("hi"), headers=AUTH, timeout=10)
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    # the waiting stream is opened and told why it waits, every 0.5 s here
    assert wait_until(lambda: len(b.comments()) >= 3, 5), b.lines
    assert b.status == 200 and b.comments()[0].startswith(": waiting for the engine: 1 in line")
    assert not b.data()
    # the first client goes away: its generation stops and the waiting one runs
    a.stop_flag.set()
    assert a.done.wait(10)
    assert wait_until(lambda: len(b.data()) >= 2, 10), "the engine was not freed by the disconnect"
    first = json.loads(b.data()[0][len("data: "):])
    assert first["choices"][0]["delta"]["role"] == "assistant"
    b.stop_flag.set()
    assert b.done.wait(10)
    assert wait_until(lambda: health(server)["engine"]["busy"] == 0, 10)
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", json=body("hi"), headers=AUTH, timeout=10)
    assert r.status_code == 200 and time.monotonic() - t0 < 5
    metrics = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert 'tandem_requests_total{endpoint="chat",finish_reason="cancelled"} 2' in metrics
    assert 'tandem_rejected_total{reason="queue_full"} 1' in metrics


def test_a_whole_request_whose_client_leaves_is_cancelled(server):
    before = server.log_text().count("finish=cancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body("[[slow]] again", max_tokens=2000), headers=AUTH,
                   timeout=httpx.Timeout(10, read=1.0))
    assert wait_until(lambda: health(server)["engine"]["busy"] == 0, 10)
    r = httpx.post(server.url + "/v1/chat/completions", json=body("hi"), headers=AUTH, timeout=10)
    assert r.json()["choices"][0]["message"]["content"] == "Hello there!"
    assert wait_until(lambda: server.log_text().count("finish=cancelled") == before + 1, 5)


@pytest.fixture(scope="module")
def parallel_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    srv = Server(write_model(root / "model", SCRIPTS), root / "home", "--parallel", "2")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_parallel_engines_serve_two_at_once(parallel_server):
    srv = parallel_server
    assert health(srv)["engine"]["engines"] == 2
    a = Streamer(srv.url, body("[[slow]]", stream=True, max_tokens=2000, seed=1))
    b = Streamer(srv.url, body("[[slow]]", stream=True, max_tokens=2000, seed=1))
    a.start()
    assert wait_until(lambda: len(a.data()) >= 2)
    b.start()
    assert wait_until(lambda: len(b.data()) >= 2, 5), "the second request waited for the first"
    assert health(srv)["engine"]["busy"] == 2 and not b.comments()
    for s in (a, b):
        s.stop_flag.set()
        assert s.done.wait(10)
    assert wait_until(lambda: health(srv)["engine"]["busy"] == 0, 10)


def test_parallel_without_spawn_is_refused_naming_the_model(tmp_path):
    srv = Server(write_model(tmp_path / "model", SCRIPTS, no_spawn=True), tmp_path / "home", "--parallel", "3")
    try:
        assert srv.proc.wait(60) == 2
    finally:
        srv.stop()
    time.sleep(0.1)
    err = srv.log_text()
    assert "--parallel 3" in err and "replay-test" in err and "spawn" in err
