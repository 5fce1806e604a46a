"""``tandem serve`` on a CUDA device, end to end, with the official ``openai`` client (skipped without one).

Two real servers on tiny re-randomised checkpoints, started as a user starts them (``--device cuda``):

- the Qwen3.8 hybrid (the CUDA graph runner, bf16 by the device's default), two engines (``--parallel 2``),
  speculation with the lookup drafter through the CUDA verify, and the caches: ``/health`` and ``/metrics``
  show the device, memory by part and the captured graph widths, and the self-check passed on the device;
  chats whole and streamed; a forced tool call that parses; ``json_object``; a short request answered
  inside a long generation (the side lane) with the long text unchanged; a client that leaves is cancelled;
  a second turn of a session resumes from the resident prefix on the device;
- the Llama family (the default model's), from a tiny GGUF file, on the device in bf16 through its CUDA graph
  runner: it serves, and its self-check passes there (verified rows equal decode rows on the GPU).

On the CPU this file only checks that ``--device cuda`` is refused in one line before anything loads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest_qwen38 import qwen38_ckpts  # noqa: F401  (fixture)
from test_llama_tiny import _hf_model, bpe, write_gguf  # noqa: F401  (bpe: fixture)

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "plugins"
sys.path.insert(0, str(PLUGINS))
from replay_server import Server  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (tandem serve --device cuda)")
pytestmark = pytest.mark.server
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
NO_END = {"0": -100, "2": -100}
ENV = {"TANDEM_EXTRA_PLUGINS": "tandem_qwen38.plugin,tandem_drafters.plugin,tandem_llama.plugin",
       "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT), str(ROOT / "plugins" / "qwen38_27b"),
                                      str(ROOT / "plugins" / "drafters"), str(ROOT / "plugins" / "llama"),
                                      os.environ.get("PYTHONPATH", "")])}


def test_device_cuda_without_a_gpu_is_refused_in_one_line(tmp_path):
    if CUDA:
        pytest.skip("this machine has a CUDA device")
    r = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "run", "--device", "cuda", "--ids", "1,2"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "TANDEM_HOME": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--device 'cuda'" in lines[0] and "no CUDA device" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def _ready(srv: Server) -> Server:
    srv.wait_ready(300)
    deadline = time.monotonic() + 300
    while httpx.get(srv.url + "/health").json()["speculation"].get("reason") == "self-check running":
        assert time.monotonic() < deadline, "the self-check did not finish"
        time.sleep(0.2)
    return srv


@pytest.fixture(scope="module")
def qwen_gpu(qwen38_ckpts, tmp_path_factory):  # noqa: F811
    if not CUDA:
        pytest.skip("needs a CUDA device")
    srv = Server(qwen38_ckpts.text.path, tmp_path_factory.mktemp("gpu"), "--device", "cuda", "--parallel", "2",
                 "--spec", "lookup", "--max-tree", "16", "--max-context", "2048", env=ENV)
    try:
        yield _ready(srv)
    finally:
        srv.stop()
        keep_log(srv, "qwen")


def keep_log(srv: Server, name: str) -> None:
    """On the device machine (``$OUT`` set by the device tool) the server's log comes back with the results."""
    out = os.environ.get("OUT")
    if out:
        Path(out, f"server_gpu_{name}.log").write_text(srv.log_text()[-200000:])


def client(srv: Server):
    from openai import OpenAI

    return OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=300, max_retries=0)


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 37 + 11 * i) % 300}" for i in range(n))


@needs_cuda
def test_health_and_metrics_show_the_device_memory_and_graphs(qwen_gpu):
    h = httpx.get(qwen_gpu.url + "/health").json()
    eng = h["engine"]
    assert eng["device"].startswith("cuda") and eng["dtype"] == "bf16" and eng["engines"] == 2
    assert eng["graph_widths"] and eng["graph_widths"][0] == 1 and eng["graph_widths"][-1] == eng["max_tree"]
    parts = {m["name"]: m for m in h["memory"]}
    assert {"weights", "gdn.S", "kv", "cuda.workspace"} <= set(parts)
    assert all(parts[k]["device"].startswith("cuda") for k in ("weights", "kv"))
    spec = h["speculation"]
    assert spec["enabled"], spec                                 # the self-check passed on the device
    metrics = httpx.get(qwen_gpu.url + "/metrics").text
    assert re.search(r'^tandem_engine_info\{device="cuda:\d",dtype="bf16"', metrics, re.M)
    assert re.search(r'^tandem_engine_memory_bytes\{engine="1",part="kv",device="cuda:\d"\} \d+', metrics, re.M)
    assert re.search(r'^tandem_engine_graph_widths\{width="%d"\} 1' % eng["max_tree"], metrics, re.M)


@needs_cuda
def test_chats_on_the_device(qwen_gpu):
    c = client(qwen_gpu)
    whole = c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": words(1, 20)}],
                                      max_tokens=24, temperature=0, extra_body=NO_THINK)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    parts = c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": words(1, 20)}],
                                      max_tokens=24, temperature=0, stream=True, extra_body=NO_THINK,
                                      stream_options={"include_usage": True})
    text = "".join(ev.choices[0].delta.content or "" for ev in parts if ev.choices)
    assert text == whole.choices[0].message.content
    # the tiny checkpoint's word-level tokenizer has no decoder llguidance reads: a grammar is refused, 400
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="tokenizer"):
        c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": words(3, 10)}],
                                  response_format={"type": "json_object"}, max_tokens=64, extra_body=NO_THINK)


@needs_cuda
def test_a_session_turn_resumes_from_the_resident_prefix_on_the_device(qwen_gpu):
    """Turn 2 starts with turn 1's prompt (token ids, so the prefix is exact): it resumes from the resident prefix
    on the device (the anchor at turn 1's prompt end), on the engine that ran turn 1 (two engines serve)."""
    c = client(qwen_gpu)
    prompt = [(13 * i + 5) % 290 + 10 for i in range(300)]
    c.completions.create(model="replay-test", prompt=prompt, max_tokens=16, temperature=0)
    c.completions.create(model="replay-test", prompt=prompt + [(7 * i + 3) % 290 + 10 for i in range(40)],
                         max_tokens=8, temperature=0)
    time.sleep(0.5)
    lines = [ln for ln in qwen_gpu.log_text().splitlines() if " prompt=340 " in ln]
    assert lines and "prefill=resident:300/340" in lines[-1], lines


class Long(threading.Thread):
    def __init__(self, c, n: int = 600) -> None:
        super().__init__(daemon=True)
        self.c, self.n, self.text, self.started = c, n, "", threading.Event()

    def run(self) -> None:
        stream = self.c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": words(1, 30)}],
                                                max_tokens=self.n, temperature=0, logit_bias=NO_END, stream=True,
                                                extra_body=NO_THINK)
        for ev in stream:
            if ev.choices and ev.choices[0].delta.content:
                self.text += ev.choices[0].delta.content
                self.started.set()


@needs_cuda
def test_the_side_lane_and_parallel_engines_on_the_device(qwen_gpu):
    c = client(qwen_gpu)
    longs = [Long(c), Long(c)]                                # both engines busy
    for t in longs:
        t.start()
    assert all(t.started.wait(120) for t in longs)
    short = c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": words(4, 30)}],
                                      max_tokens=12, temperature=0, extra_body=NO_THINK)
    assert short.choices[0].message.content
    for t in longs:
        t.join(300)
    assert longs[0].text == longs[1].text and longs[0].text            # the same request on either engine
    alone = Long(c)
    alone.run()
    assert alone.text == longs[0].text                                  # the side lane left the long text alone
    assert any(" lane=side" in ln for ln in qwen_gpu.log_text().splitlines())


@needs_cuda
def test_a_client_that_leaves_is_cancelled_on_the_device(qwen_gpu):
    with httpx.stream("POST", qwen_gpu.url + "/v1/chat/completions", timeout=60, json={
            "model": "replay-test", "messages": [{"role": "user", "content": words(9, 20)}], "max_tokens": 1500,
            "stream": True, "logit_bias": NO_END, **NO_THINK}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    deadline = time.monotonic() + 30
    while not any("finish=cancelled" in ln for ln in qwen_gpu.log_text().splitlines()):
        assert time.monotonic() < deadline, "the left request was not cancelled"
        time.sleep(0.2)


@needs_cuda
def test_the_llama_family_serves_on_the_device_with_grammars_and_its_self_check(tmp_path, bpe):  # noqa: F811
    path = write_gguf(tmp_path / "tiny.gguf", _hf_model(False, seed=3, max_position_embeddings=2048), bpe, "Q8_0")
    srv = _ready(Server(path, tmp_path / "home", "--device", "cuda", "--spec", "lookup", "--max-tree", "8",
                        "--max-context", "2048", env={**ENV, "TANDEM_LLAMA_CUDA_RUNNER": "1"}))
    try:
        h = httpx.get(srv.url + "/health").json()
        assert h["engine"]["device"].startswith("cuda") and h["engine"]["dtype"] == "bf16"
        eng = h["engine"]                                # the CUDA graph runner (LlamaCudaRunner): widths 1..8
        assert eng["graph_widths"] and eng["graph_widths"][0] == 1 and eng["graph_widths"][-1] == eng["max_tree"]
        assert h["speculation"]["enabled"], h["speculation"]
        c = client(srv)
        got = c.completions.create(model="replay-test", prompt=[5, 17, 2, 99], max_tokens=12, temperature=0)
        assert got.usage.completion_tokens > 0
        tool = {"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
            "required": ["city", "days"], "additionalProperties": False}}}
        forced = c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": "weather?"}],
                                           tools=[tool], tool_choice="required", max_tokens=120, temperature=0)
        ch = forced.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        args = json.loads(ch.message.tool_calls[0].function.arguments)
        assert set(args) == {"city", "days"} and isinstance(args["days"], int)
        js = c.chat.completions.create(model="replay-test", messages=[{"role": "user", "content": "json please"}],
                                       response_format={"type": "json_object"}, max_tokens=64, temperature=0)
        json.loads(js.choices[0].message.content)
    finally:
        srv.stop()
        keep_log(srv, "llama")



@needs_cuda
def test_a_restart_restores_the_gpu_session_from_the_spill(qwen38_ckpts, tmp_path):  # noqa: F811
    """SIGTERM spills the engine's session (device tensors written to disk); a new server on the same cache
    directory restores it onto the device and the next turn resumes from it, not from cold."""
    home = tmp_path / "home"
    args = ("--device", "cuda", "--spec", "off", "--max-context", "2048", "--cache-dir", str(tmp_path / "cache"))
    prompt = [(11 * i + 3) % 290 + 10 for i in range(400)]
    first = _ready(Server(qwen38_ckpts.text.path, home, *args, env=ENV))
    try:
        client(first).completions.create(model="replay-test", prompt=prompt, max_tokens=8, temperature=0)
    finally:
        first.stop()
    assert "session spill: 1 sessions" in first.log_text(), first.log_text()[-2000:]
    again = _ready(Server(qwen38_ckpts.text.path, home, *args, env=ENV))
    try:
        assert "session spill: engine 0 resumes a session of" in again.log_text()
        client(again).completions.create(model="replay-test", prompt=prompt + [42] * 30, max_tokens=4,
                                         temperature=0)
        time.sleep(0.5)
        line = [ln for ln in again.log_text().splitlines() if " prompt=430 " in ln][-1]
        assert "prefill=resident:400/430" in line, line
    finally:
        again.stop()
        keep_log(again, "restart")
