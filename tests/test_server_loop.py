"""The plain decode loop, stop strings, the chat template, grammars and admission, without a server."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from replay_server import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

from tandem_core.engine import Capabilities  # noqa: E402
from tandem_core.server.admission import Admission, QueueFull  # noqa: E402
from tandem_core.server.detok import StreamDetokenizer  # noqa: E402
from tandem_core.server.grammar import Grammars  # noqa: E402
from tandem_core.server.template import TemplateError, render_chat  # noqa: E402
from tandem_core.serving import Served  # noqa: E402
from tandem_core.spec.loop import Decode, DecodeRequest, StopStrings  # noqa: E402
from tandem_core.spec.sampler import SamplingParams  # noqa: E402
from tandem_core.tokenizer import HFTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return HFTokenizer(build_tokenizer(), eos_tokens=["<|im_end|>"])


class _KV:
    length = 0


class ScriptEngine:
    """Peaks on ``script[k]`` for the k-th generated token (then on ``end``); counts forwarded tokens."""

    def __init__(self, script: list[int], end: int, vocab: int, random_logits: bool = False) -> None:
        self.script, self.end, self.vocab, self.random = script, end, vocab, random_logits
        self.caps = Capabilities(max_context=4096)
        self.kv = _KV()
        self.prompt_len = 0
        self.forwarded: list[int] = []
        self.resets = 0

    def reset(self) -> None:
        self.kv.length = 0
        self.resets += 1

    def forward(self, tokens, *, all_logits=False):
        ids = torch.as_tensor(tokens).reshape(-1).tolist()
        if self.kv.length == 0:
            self.prompt_len = len(ids)
        else:
            self.forwarded += ids
        self.kv.length += len(ids)
        k = self.kv.length - self.prompt_len
        if self.random:
            return torch.randn(1, self.vocab, generator=torch.Generator().manual_seed(self.kv.length))
        row = torch.zeros(1, self.vocab)
        row[0, self.script[k] if k < len(self.script) else self.end] = 10.0
        return row


def decode(tok, text, *, max_tokens=100, stops=(), cancel=None, constraint=None, random_logits=False):
    end = tok.eos_token_ids[0]
    eng = ScriptEngine(tok.encode(text), end, tok.vocab_size, random_logits)
    req = DecodeRequest([1, 2, 3], max_tokens, SamplingParams(temperature=0.0), frozenset([end]), tuple(stops))
    dec = Decode(eng, req, StreamDetokenizer(tok), constraint=constraint, cancel=cancel)
    chunks = list(dec.run())
    return "".join(c.text for c in chunks), chunks, dec, eng


def test_greedy_decode_replays_and_stops_on_the_end_token(tok):
    text = "Hello there! The weather in Paris is sunny."
    out, chunks, dec, eng = decode(tok, text)
    assert out == text
    assert chunks[-1].finish == "stop"
    assert dec.completion_tokens == len(tok.encode(text)) + 1  # the end token counts
    assert eng.forwarded == tok.encode(text)  # every kept token forwarded once; the end token never
    assert eng.resets == 1


def test_max_tokens_ends_with_length(tok):
    out, chunks, dec, _ = decode(tok, "Hello there! The weather in Paris is sunny.", max_tokens=3)
    assert chunks[-1].finish == "length" and dec.completion_tokens == 3
    assert out == tok.decode(tok.encode("Hello there! The weather in Paris is sunny.")[:3])


@pytest.mark.parametrize("stop", ["Paris", "in Paris", "y.", "!", "e w"])
def test_stop_string_never_leaves_even_split_across_tokens(tok, stop):
    text = "Hello there! The weather in Paris is sunny."
    out, chunks, _, _ = decode(tok, text, stops=[stop, "never-there"])
    assert out == text[:text.index(stop)]
    assert chunks[-1].finish == "stop"
    assert all(stop not in c.text for c in chunks)


def test_stop_strings_at_every_split_point():
    text = "abc STOP def"
    for cut in range(len(text) + 1):
        s = StopStrings(["STOP", "xyz"])
        a, hit_a = s.feed(text[:cut])
        b, hit_b = s.feed(text[cut:]) if not hit_a else ("", True)
        assert a + b == "abc " and (hit_a or hit_b)
    s = StopStrings(["STOP"])
    assert s.feed("abc ST") == ("abc ", False)
    assert s.feed("ill") == ("STill", False)
    assert s.feed("S") == ("", False) and s.flush() == "S"


def test_cancel_stops_at_the_next_step(tok):
    cancel = threading.Event()
    end = tok.eos_token_ids[0]
    eng = ScriptEngine(tok.encode("Hello there! " * 20), end, tok.vocab_size)
    req = DecodeRequest([1], 1000, SamplingParams(temperature=0.0), frozenset([end]))
    dec = Decode(eng, req, StreamDetokenizer(tok), cancel=cancel)
    it = dec.run()
    for _ in range(3):
        next(it)
    cancel.set()
    rest = list(it)
    assert [c.finish for c in rest] == ["cancelled"] and dec.completion_tokens == 3


def test_json_grammar_makes_random_logits_valid_json(tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    g = Grammars(tok, tok.eos_token_ids)
    out, chunks, _, _ = decode(tok, "", max_tokens=200, constraint=g.constraint(g.json_grammar(schema)),
                               random_logits=True)
    assert chunks[-1].finish == "stop"
    jsonschema.validate(json.loads(out), schema)


@pytest.mark.parametrize("fmt,text", [
    ("hermes_json", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'),
    ("qwen_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
])
@pytest.mark.parametrize("think", ["none", "maybe"])
def test_tool_grammar_takes_the_format_and_refuses_other_text(tok, fmt, text, think):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    g = Grammars(tok, tok.eos_token_ids)
    c = g.constraint(g.tool_grammar(tools, fmt, think, parallel=False))
    if think == "maybe":
        text = "<think>\nI think so.\n</think>\n\n" + text
    ids = tok.encode(text)
    assert not c.allowed(tok.vocab_size)[tok.encode("Hello")[0]]  # plain text is refused
    for i in ids:
        assert c.allowed(tok.vocab_size)[i]
        c.advance(i)
    assert c.done()


def test_thinking_stays_free_before_the_constrained_part(tok):
    g = Grammars(tok, tok.eos_token_ids)
    c = g.constraint(g.json_grammar(None, think="open"))
    for i in tok.encode('Hello there! def add(x, y):</think>\n{"a": 1}'):
        assert c.allowed(tok.vocab_size)[i]
        c.advance(i)
    assert c.done()


def served(tok, template=CHAT_TEMPLATE) -> Served:
    return Served("m", None, tok, template)  # type: ignore[arg-type]


def test_template_renders_tools_thinking_and_tool_call_arguments(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo"}}]
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = render_chat(served(tok), msgs, tools=tools, template_kwargs={"enable_thinking": False})
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n")
    assert '"description": "Météo"' in text  # tojson keeps non-ASCII
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # arguments text parsed
    assert "<|im_start|>user\nWeather?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(served(tok), msgs[1:2]).endswith("<|im_start|>assistant\n")


def test_template_sandbox_raise_exception_and_strftime(tok):
    t = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}{{ strftime_now('%Y') }}"
    assert render_chat(served(tok, t), [{"role": "user", "content": "a"}]).isdigit()
    with pytest.raises(TemplateError, match="one message only"):
        render_chat(served(tok, t), [{"role": "user", "content": "a"}] * 2)
    with pytest.raises(TemplateError):  # the sandbox refuses reaching into Python internals
        render_chat(served(tok, "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"),
                    [{"role": "user", "content": "a"}])
    with pytest.raises(TemplateError):  # immutable: no mutation of the messages
        render_chat(served(tok, "{{ messages.append(1) }}"), [{"role": "user", "content": "a"}])


def test_admission_hands_engines_in_order_and_refuses_a_full_queue():
    async def main():
        adm = Admission(["e0"], queue=2)  # type: ignore[list-item]
        a = adm.enter()
        b, c = adm.enter(), adm.enter()
        assert a.slot.done() and not b.slot.done() and adm.position(c) == 2
        with pytest.raises(QueueFull) as err:
            adm.enter()
        assert err.value.retry_after == 10  # no request served yet: the default
        adm.served(3.0)
        adm.leave(b)  # b's client went away
        assert adm.position(c) == 1
        adm.release(a.slot.result())
        assert c.slot.done() and c.slot.result().engine == "e0"
        assert adm.estimate(2) == pytest.approx(6.0)
        adm.leave(c)  # a slot never used comes back
        assert adm.busy == 0

    asyncio.run(main())


def test_ledger_rows_and_the_ledger_command(tmp_path, capsys):
    import argparse

    from tandem_core.cli.ledger_cmd import run_ledger
    from tandem_core.cli.main import CliError
    from tandem_core.server.ledger import Ledger, UsageRow

    with pytest.raises(CliError, match="no ledger"):
        run_ledger(argparse.Namespace(ledger=str(tmp_path / "none.sqlite"), last=5, json=False))
    led = Ledger(tmp_path / "l.sqlite")
    for i in range(3):
        led.write(UsageRow(1.7e9 + i, f"req-{i}", "m", "chat", 10 + i, 5, "stop", 0.1, 20.0, 0.0, 1.0, 5,
                           32000 if i == 2 else None, i % 2 == 0))
    rows = led.last(2)
    assert [r.request_id for r in rows] == ["req-1", "req-2"] and rows[1].stream is True
    assert rows[1].capped_from == 32000 and rows[0].ttft_s == pytest.approx(0.1)
    led.close()
    run_ledger(argparse.Namespace(ledger=str(tmp_path / "l.sqlite"), last=2, json=True))
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["request_id"] for r in out] == ["req-1", "req-2"]
    run_ledger(argparse.Namespace(ledger=str(tmp_path / "l.sqlite"), last=5, json=False))
    table = capsys.readouterr().out
    assert "req-0" in table and "capped to 5" in table
