"""The conductor on a real model (the tiny Qwen3.8 hybrid, caches on) through ``tandem serve`` and the ``openai``
client, against a cold server (no conductor, no caches) given the same prompts:

- the replayed note keeps the prefix cache hitting: turn n+1's prefill starts at the end anchor of turn n (the
  log line and ``/metrics``), and every answer equals the cold server's with the same note written in;
- an opencode-shaped title request during a long generation is recognised by its shape, capped at 64 tokens,
  served through the side lane with no note, and the long answer equals the cold server's.
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from conftest_qwen38 import PLUGIN_SRC, qwen38_ckpts  # noqa: F401  (fixture)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests" / "plugins"))

from replay_server import Server  # noqa: E402

pytestmark = pytest.mark.server  # starts processes

# a template whose rendering of an answer is the answer's own tokens (the session's prompts extend each other)
TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
            "{%- endif %}")
NOTE = "\n\n<tandem_note>\nw5 w6 w7\n- w8 w9\n</tandem_note>"      # what the profile's class writes
PROFILE = """\
default_profile: coding
journal: journal.jsonl
clients:
  - name: opencode
    user_agent: "^opencode/"
    profile: coding
profiles:
  coding:
    classifier: none
    classes:
      build:
        effort: w5 w6 w7
        rules: [w8 w9]
    side_requests:
      - name: title
        roles: [system, user, user]
        tools: false
        stream: true
        system_contains: title
        max_tokens: 64
"""
OPENCODE = {"User-Agent": "opencode/0.15.0 ai-sdk/provider-utils/3.0.9 runtime/bun/1.3.0"}
LONG = 800


@pytest.fixture(scope="module")
def model(qwen38_ckpts, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("cond-model") / "tiny"
    shutil.copytree(qwen38_ckpts.text.path, d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


def start(model_dir: Path, home: Path, *args: str) -> Server:
    env = {"TANDEM_EXTRA_PLUGINS": "tandem_qwen38.plugin,tandem_conductor.plugin"}
    return Server(model_dir, home, "--spec", "off", "--max-context", "1024", *args, env=env, model="tiny",
                  paths=[PLUGIN_SRC, ROOT / "plugins" / "conductor"])


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("cond")
    (root / "profile.yaml").write_text(PROFILE)
    conducted = start(model, root / "home", "--conductor", str(root / "profile.yaml"))
    cold = start(model, root / "cold", "--no-cache")
    conducted.root = root
    try:
        conducted.wait_ready(120)
        cold.wait_ready(120)
        yield conducted, cold
    finally:
        conducted.stop()
        cold.stop()


def banned(model_dir: Path) -> dict[str, int]:
    """logit_bias banning every special token and [UNK]: the answer is words, max_tokens long."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "[UNK]"]
    return {str(tok.token_to_id(n)): -100 for n in names if tok.token_to_id(n) is not None}


def clients(conducted: Server, cold: Server, **headers: str) -> tuple[OpenAI, OpenAI]:
    return (OpenAI(base_url=conducted.url + "/v1", api_key="x", timeout=120, max_retries=0, default_headers=headers),
            OpenAI(base_url=cold.url + "/v1", api_key="x", timeout=120, max_retries=0))


def prefill(server: Server, rid: str) -> tuple[str, int, int]:
    line = next(ln for ln in server.log_text().splitlines() if f"req={rid} " in ln)
    m = re.search(r"prefill=(\w+):(\d+)/(\d+)", line)
    assert m, line
    return m.group(1), int(m.group(2)), int(m.group(3))


def test_the_replayed_note_keeps_the_prefix_hitting(servers, model):
    conducted, cold = servers
    c, k = clients(conducted, cold)
    bias = banned(model)
    kw = dict(max_tokens=6, temperature=0, logit_bias=bias)
    first = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4"}]
    r1 = c.chat.completions.create(model="TandemLLM", messages=first, **kw)
    c1 = r1.choices[0].message.content
    assert r1.choices[0].finish_reason == "length" and len(c1.split()) == 6
    # the cold server, with the note written in where the conductor put it: the same prompt, the same answer
    k1 = k.chat.completions.create(model="tiny", messages=[first[0], {"role": "user", "content": "w3 w4" + NOTE}],
                                   **kw)
    assert (k1.usage.prompt_tokens, k1.choices[0].message.content) == (r1.usage.prompt_tokens, c1)
    second = [*first, {"role": "assistant", "content": c1}, {"role": "user", "content": "w10 w11"}]
    r2 = c.chat.completions.create(model="TandemLLM", messages=second, **kw)
    tier, start_at, total = prefill(conducted, r2.id)
    # the end anchor: turn 1's prompt and every answer token the engine holds (the last one it never forwarded)
    assert (tier, start_at) == ("resident", r1.usage.prompt_tokens + 6 - 1), (tier, start_at, total)
    assert total == r2.usage.prompt_tokens
    k2 = k.chat.completions.create(model="tiny", messages=[
        first[0], {"role": "user", "content": "w3 w4" + NOTE}, second[2],
        {"role": "user", "content": "w10 w11" + NOTE}], **kw)
    assert (k2.usage.prompt_tokens, k2.choices[0].message.content) == (r2.usage.prompt_tokens,
                                                                       r2.choices[0].message.content)
    assert prefill(cold, k2.id)[1] == 0
    reused = next(ln for ln in httpx.get(conducted.url + "/metrics").text.splitlines()
                  if ln.startswith('tandem_prefill_tokens_total{part="reused"}'))
    assert float(reused.split()[-1]) >= start_at           # the metrics count the reused prefix too


class Long(threading.Thread):
    def __init__(self, c: OpenAI, bias: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.c, self.bias = c, bias
        self.text = ""
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in self.c.chat.completions.create(
                    model="TandemLLM", messages=[{"role": "user", "content": "w20 w21 w22"}], max_tokens=LONG,
                    temperature=0, logit_bias=self.bias, stream=True):
                for ch in chunk.choices:
                    self.text += ch.delta.content or ""
                    if self.text:
                        self.started.set()
        except BaseException as exc:  # the test reads it
            self.error = exc
            self.started.set()


def title_request(c: OpenAI, model_name: str, max_tokens: int = 32000) -> tuple[str, str, int, int]:
    text, rid, usage = "", "", None
    for chunk in c.chat.completions.create(
            model=model_name, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
                      {"role": "user", "content": "Generate a title for this conversation:"},
                      {"role": "user", "content": "w30 w31 w32"}]):
        rid = chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert usage is not None
    return text, rid, usage.prompt_tokens, usage.completion_tokens


def side_total(server: Server) -> float:
    for ln in httpx.get(server.url + "/metrics").text.splitlines():
        if ln.startswith("tandem_side_lane_total "):
            return float(ln.split()[-1])
    raise AssertionError("no tandem_side_lane_total")


def test_an_opencode_title_request_takes_the_side_lane(servers, model):
    conducted, cold = servers
    c, k = clients(conducted, cold, **OPENCODE)
    bias = banned(model)
    before = side_total(conducted)
    long = Long(c, bias)
    long.start()
    assert long.started.wait(60) and long.error is None
    t0 = time.monotonic()
    text, rid, prompt_tokens, completion = title_request(c, "TandemLLM")
    took = time.monotonic() - t0
    long.join(120)
    assert long.error is None and not long.is_alive()
    line = next(ln for ln in conducted.log_text().splitlines() if f"req={rid} " in ln)
    assert " lane=side" in line, line
    assert side_total(conducted) == before + 1
    assert completion <= 64 and "max_tokens=32000" not in line
    # no note, no classifier: the prompt is the client's own (the cold server's count); the journal says "title"
    _, _, cold_prompt, _ = title_request(k, "tiny", 64)
    assert prompt_tokens == cold_prompt
    journal = (conducted.root / "journal.jsonl").read_text()
    assert '"side":"title"' in journal
    # the long generation's answer is its uninterrupted answer
    ref = k.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w20 w21 w22" + NOTE}],
                                    max_tokens=LONG, temperature=0, logit_bias=bias)
    assert long.text == ref.choices[0].message.content
    assert took < 60
