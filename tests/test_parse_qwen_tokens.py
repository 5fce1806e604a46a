"""The real Qwen3.5 tokenizer: the conversion agrees with the package's own encoder, and model
outputs streamed token by token through ``StreamDetokenizer`` into ``OutputParser`` give the same
events' result as the whole text parsed at once."""

from __future__ import annotations

import json
import random

import pytest

from tandem_core.server.detok import StreamDetokenizer
from tandem_core.server.parse import Collected, OutputParser, parse_complete
from tandem_core.tokenizer import HFTokenizer

from qwen35_tokenizer import converter, package_encoder, qwen35_tokenizer

TEXTS = [
    "Hello, world! It's a test; we'll see they've DON'T I'M.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\n",
    "    indented\n\tTabbed\t\tline\r\n\r\nwindows   spaces     end   ",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 zwj ❤️‍🔥",
    "café naïve e\u0301 Ångström ß ΣΊΣΥΦΟΣ привет مرحبا שלום हिन्दी",
    "numbers 1234567890 3.14159 1e-9 0x1F 1_000_000",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\n",
    "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n</function>\n</tool_call>"
    "<tool_response>\nok\n</tool_response><|endoftext|>",
    "<|vision_start|><|image_pad|><|vision_end|> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "   \n\n\n   \t  \u3000 \u00a0 trailing",
    "JSON {\"a\": [1, 2, {\"b\": null}], \"c\": \"\\u00e9\\n\"} and <xml attr='1'/>",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE x's it'LL",
]


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return qwen35_tokenizer()


@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_converted_tokenizer_matches_the_package_encoder(tok: HFTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == package_encoder().encode(text)
    assert tok.decode(ids) == package_encoder().decode(ids)


def test_converted_tokenizer_matches_on_decoded_random_tokens(tok: HFTokenizer) -> None:
    """Adversarial texts: the decode of random token runs (odd merges, partial characters)."""
    rng = random.Random(0)
    ref = package_encoder()
    for _ in range(400):
        text = tok.decode([rng.randrange(248044) for _ in range(rng.randint(1, 24))])
        assert tok.encode(text) == ref.encode(text), repr(text)


def test_special_tokens_sit_at_the_qwen35_ids(tok: HFTokenizer) -> None:
    want = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
            "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
            "</think>": 248069}
    assert {t: tok.token_to_id(t) for t in want} == want
    assert tok.vocab_size == 248077
    assert tok.eos_token_ids == (248046, 248044)
    # the chat format's text tags survive skip_special_tokens; control tokens do not
    ids = tok.encode("<|im_start|>a<think>b</think><tool_call>c</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think><tool_call>c</tool_call>"


def test_merges_follow_the_ranks() -> None:
    conv = converter()
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert conv.merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]
    alpha = conv.byte_alphabet()
    assert len(set(alpha)) == 256 and alpha[ord("A")] == "A" and alpha[ord(" ")] == "\u0120"


TOOLS = [
    {"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
        "replace_all": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "integer"}}}}},
]

OUTPUTS = [
    ("qwen_xml", True,
     "The test fails because `résumé` is compared as bytes 🤔.\n"
     "I should fix the comparison, then run tests.\n"
     "</think>\n\nI'll fix the comparison in `utils.py` — 日本語 too.\n\n"
     "<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/utils.py\n</parameter>\n"
     "<parameter=old_string>\n    if a.encode() < b.encode():\n        return '<lt>'\n</parameter>\n"
     "<parameter=new_string>\n    if a < b:  # 比较 ✓\n        return \"<lt>\"\n</parameter>\n"
     "<parameter=replace_all>\nfalse\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=bash>\n<parameter=command>\npytest -q tests/ 2>&1 | tail -5\n</parameter>\n"
     "<parameter=timeout>\n120\n</parameter>\n</function>\n</tool_call>"),
    ("qwen_xml", True,
     "Nothing to call here.\n</think>\n\nThe answer is **42** 🎉 — voilà: `x < y && y > z`."),
    ("hermes_json", True,
     "Run it.\n</think>\n\n<tool_call>\n"
     "{\"name\": \"bash\", \"arguments\": {\"command\": \"echo '😀 <ok>'\", "
     "\"timeout\": 5}}\n</tool_call>"),
]


@pytest.mark.parametrize("fmt,think,text", OUTPUTS, ids=["xml-edit-and-bash", "plain-answer", "hermes-bash"])
def test_token_by_token_stream_matches_the_whole_parse(tok: HFTokenizer, fmt: str, think: bool,
                                                       text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) > 20
    detok = StreamDetokenizer(tok)
    parser = OutputParser(fmt, think, think, TOOLS, id_prefix="q")
    events: list = []
    pieces: list[str] = []
    for i in ids:
        piece = detok.push(i)
        pieces.append(piece)
        events += parser.feed(piece)
    tail = detok.flush()
    pieces.append(tail)
    events += parser.feed(tail) + parser.finish()
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    streamed = Collected().add(events)
    whole = parse_complete(text, fmt, think, think, TOOLS, id_prefix="q")
    assert (streamed.content, streamed.reasoning, streamed.tool_calls) == tuple(whole)
    assert streamed.malformed == []
    if fmt == "qwen_xml" and whole.tool_calls:
        assert [json.loads(c.arguments) for c in whole.tool_calls] == [
            {"path": "src/utils.py", "old_string": "    if a.encode() < b.encode():\n        return '<lt>'",
             "new_string": "    if a < b:  # 比较 ✓\n        return \"<lt>\"", "replace_all": False},
            {"command": "pytest -q tests/ 2>&1 | tail -5", "timeout": 120},
        ]


def test_some_tokens_split_characters(tok: HFTokenizer) -> None:
    """The stream test above is meaningful: Qwen's byte-level tokens do split rare characters."""
    text = "🤔 比较 ✓ 🎉 😀"
    ids = tok.encode(text)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "expected a token holding part of a character"
