"""Streaming detokenisation: the pieces add up to ``decode(all_ids)`` exactly, partial characters
are held back, and the work per token stays bounded."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest

from tandem_core.server.detok import StreamDetokenizer
from tandem_core.tokenizer import HFTokenizer

from qwen35_tokenizer import qwen35_tokenizer


def _stream(tok, ids: Sequence[int], **kw) -> list[str]:
    d = StreamDetokenizer(tok, **kw)
    out = [d.push(i) for i in ids]
    out.append(d.flush())
    return out


@pytest.fixture(scope="module")
def qwen() -> HFTokenizer:
    return qwen35_tokenizer()


@pytest.fixture(scope="module")
def partial_ids(qwen: HFTokenizer) -> list[int]:
    """Qwen tokens that hold an incomplete UTF-8 sequence (they decode to U+FFFD alone)."""
    found = []
    for i in range(0, 248044, 7):
        if "\ufffd" in qwen.decode([i]):
            found.append(i)
    assert len(found) > 50
    return found


def test_random_ids_add_up_to_the_full_decode(qwen: HFTokenizer, partial_ids: list[int]) -> None:
    rng = random.Random(1)
    specials = list(range(248044, 248077))
    for trial in range(300):
        n = rng.randint(1, 40)
        ids = [rng.choice(partial_ids) if rng.random() < 0.4 else
               rng.choice(specials) if rng.random() < 0.1 else rng.randrange(248044) for _ in range(n)]
        for skip in (False, True):
            pieces = _stream(qwen, ids, skip_special_tokens=skip)
            assert "".join(pieces) == qwen.decode(ids, skip_special_tokens=skip), (trial, ids)


def test_split_characters_are_held_until_complete(qwen: HFTokenizer) -> None:
    text = "naïve 🤔 比较 ✓ 🎉 👨‍👩‍👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end"
    ids = qwen.encode(text)
    pieces = _stream(qwen, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 1  # some token completed nothing: a character was still partial
    # every piece ends on a whole character and starts where the last left off
    acc = ""
    for p in pieces:
        acc += p
        assert text.startswith(acc)


def test_byte_run_cut_by_the_end_flushes_as_the_full_decode(qwen: HFTokenizer) -> None:
    ids = qwen.encode("ok 🤔")
    cut = ids[:-1]  # the emoji's last bytes are missing
    assert qwen.decode(cut).endswith("\ufffd")
    d = StreamDetokenizer(qwen)
    streamed = "".join(d.push(i) for i in cut)
    assert "\ufffd" not in streamed
    assert streamed + d.flush() == qwen.decode(cut)
    assert d.flush() == ""
    assert d.ids == cut


def _metaspace_tokenizer() -> HFTokenizer:
    """A SentencePiece-style tokenizer (Metaspace ▁, byte fallback), whose per-token decode is not the
    suffix of the whole decode: a token's leading ▁ is dropped at the start of a decode."""
    from tokenizers import Tokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "▁Hello", "▁world", "▁the", "s", "ing", "▁é", "t", "▁x", "x", "!", ".", "▁.", "▁▁"]
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(pieces[:3])],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(pieces)}, "merges": []},
    }
    return HFTokenizer(Tokenizer.from_str(json.dumps(doc)), eos_tokens=["</s>"])


def test_metaspace_decoder_needs_the_window() -> None:
    tok = _metaspace_tokenizer()
    ids = [tok.token_to_id(t) for t in ("▁Hello", "▁world", "!", "▁the", "▁x", "s")]
    whole = tok.decode(ids)
    assert whole == "Hello world! the xs"
    assert "".join(tok.decode([i]) for i in ids) != whole  # naive per-token decode loses the spaces
    assert "".join(_stream(tok, ids)) == whole


def test_metaspace_random_ids_with_byte_fallback() -> None:
    """Byte runs that are whole characters, or a character cut short (then U+FFFD per byte), between
    ordinary tokens. (A run mixing whole characters with invalid bytes is not streamable exactly:
    ByteFallback then writes U+FFFD for every byte of the run, even the earlier valid ones.)"""
    tok = _metaspace_tokenizer()
    rng = random.Random(2)

    def run(text: str) -> list[int]:
        return [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode()]

    whole_runs = [run(t) for t in ("€", "ü", "日本", "🤔", "a€b")]
    cut_runs = [run("€")[:1], run("€")[:2], run("🤔")[:3]]
    ordinary = [i for i in range(3, tok.vocab_size) if not tok.id_to_token(i).startswith("<0x")]
    for trial in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            ids += rng.choice(whole_runs) if r < 0.2 else rng.choice(cut_runs) if r < 0.3 else []
            ids.append(rng.choice(ordinary))
        if rng.random() < 0.5:
            ids += rng.choice(cut_runs + whole_runs)  # end inside or right after a run
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids), (trial, ids)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1]) or "\ufffd" in tok.decode(ids)


class _Counting:
    """A tokenizer wrapper counting how many ids each decode reads."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner
        self.read = 0

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        self.read += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_bounded(qwen: HFTokenizer) -> None:
    text = ("The quick brown fox jumps over the lazy dog; 比较 ✓ 🤔. " * 60)
    ids = qwen.encode(text)
    counting = _Counting(qwen)
    d = StreamDetokenizer(counting)  # type: ignore[arg-type]
    out = "".join(d.push(i) for i in ids) + d.flush()
    assert out == text
    assert counting.read <= 8 * len(ids)  # O(window) per token, not O(n): n^2/2 would be ~len(ids) * 400
