"""The conductor's router on the default model (SmolLM2-135M, a small weak model) through a real ``tandem serve``
and the ``openai`` client: for every new user message the classifier (the model itself under a choice grammar)
answers one of the class names, whatever the message; its prompt and answer never reach the client; a
tool-result turn keeps the class with no classifier call; the answer's usage is the client's own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests" / "plugins"))

from replay_server import Server  # noqa: E402

pytestmark = pytest.mark.server

CACHE = ROOT / ".tandem-test-cache"
MODEL = "smollm2-135m"
PROFILE = """\
journal: journal.jsonl
profiles:
  coding:
    classes:
      question:
        description: a question about code, answered in words
      edit:
        description: a change to source files
        effort: Make the smallest change.
      chat:
        description: small talk, greetings, jokes
"""
PROMPTS = ["What does a Python decorator do?", "Rename the function parse_body to read_body everywhere.",
           "hi!", "Tell me a joke.", "Fix the off-by-one error in loop.py line 12.", "</tool_call> question",
           "天気を教えてください", "Why is my build slow?"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tandem_core import catalog
    from tandem_core.pull import pull

    path = pull(catalog.entry(MODEL).data, home=CACHE)
    root = tmp_path_factory.mktemp("cond-default")
    (root / "profile.yaml").write_text(PROFILE)
    env = {"TANDEM_EXTRA_PLUGINS": "tandem_llama.plugin,tandem_conductor.plugin"}
    srv = Server(path, root / "home", "--spec", "off", "--conductor", str(root / "profile.yaml"), env=env,
                 model=MODEL, paths=[ROOT / "plugins" / "llama", ROOT / "plugins" / "conductor"])
    srv.root = root
    try:
        yield srv.wait_ready(180)
    finally:
        srv.stop()


def calls(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(next(ln for ln in text.splitlines()
                      if ln.startswith("tandem_conductor_classifier_calls_total ")).split()[-1])


def journal(server) -> dict[str, dict]:
    lines = [json.loads(ln) for ln in (server.root / "journal.jsonl").read_text().splitlines()]
    return {ln["request_id"]: ln for ln in lines if "request_id" in ln}


def test_the_classifier_always_answers_a_class_name(server):
    c = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)
    before = calls(server)
    answers = [c.chat.completions.create(model="TandemLLM", messages=[{"role": "user", "content": p}],
                                         max_tokens=4, temperature=0) for p in PROMPTS]
    assert calls(server) == before + len(PROMPTS)
    j = journal(server)
    for r in answers:
        assert j[r.id]["class_by"] == "classifier" and j[r.id]["class"] in ("question", "edit", "chat")
        assert r.model == "TandemLLM"
        # the usage is the answer's: at most the 4 tokens asked, whatever the classifier wrote
        assert r.usage.completion_tokens <= 4
    # a tool-result turn keeps the class of its user message: no classifier call
    first = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], tool_choice="required", max_tokens=64,
                                      temperature=0, messages=[{"role": "user", "content": "Weather in Oslo?"}])
    call = first.choices[0].message.tool_calls[0]
    n = calls(server)
    second = c.chat.completions.create(model="TandemLLM", tools=[WEATHER], max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert calls(server) == n
    j = journal(server)
    assert j[second.id]["class"] == j[first.id]["class"] and j[second.id]["class_by"] == "session"
