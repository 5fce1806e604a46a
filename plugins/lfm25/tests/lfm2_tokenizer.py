"""A test tokenizer with LFM2's special tokens, built with the ``tokenizers`` library (no LFM2 tokenizer can be
downloaded here).

LFM2's tokenizer (LiquidAI's ``tokenizer.json``) is a byte-level BPE whose first ids are its special
tokens: 0 ``<|pad|>``, 1 ``<|startoftext|>``, 2 ``<|endoftext|>``, 3-5 the fill-in-the-middle
tokens, 6 ``<|im_start|>``, 7 ``<|im_end|>`` (the end of a turn, ``eos_token_id`` 7 in the configs),
8-9 ``<|tool_list_start|>``/``<|tool_list_end|>``, 10-11 ``<|tool_call_start|>``/``<|tool_call_end|>``,
12-13 ``<|tool_response_start|>``/``<|tool_response_end|>``. This one keeps those ids, then the 256
byte tokens (any text encodes), then a few merges up to ``vocab_size`` ids, so it fits the tiny
checkpoints' vocabulary.

``write_tokenizer(dir, vocab_size)`` writes ``tokenizer.json``, ``tokenizer_config.json`` (bos
``<|startoftext|>``, eos ``<|im_end|>``) and the plugin's chat template into a checkpoint directory.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

SPECIALS = [
    "<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>", "<|im_start|>",
    "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
    "<|tool_response_start|>", "<|tool_response_end|>",
]
# merges of frequent pairs (in byte-level symbols, where Ġ is a space), until the vocabulary is full
_MERGE_WORDS = ["Ġt", "Ġa", "he", "in", "re", "on", "Ġthe", "er", "Ġs", "at", "Ġw", "Ġo", "en", "Ġc", "it", "is",
                "an", "or", "es", "Ġb", "ed", "Ġf", "ing", "Ġp", "ou", "Ġin", "al", "ar", "Ġto", "Ġm", "Ġof", "ic",
                "Ġd", "Ġand", "le", "Ġh", "ion", "as", "om", "Ġth", "ent", "Ġl", "ro", "st", "ct", "Ġre", "()", "=\"",
                "\",", "_f"]


def _merges(alphabet: set[str]) -> list[tuple[str, str]]:
    """Pairs whose halves are already tokens, in order (each merged word becomes a token)."""
    known = set(alphabet)
    out = []
    for word in _MERGE_WORDS:
        for cut in range(len(word) - 1, 0, -1):
            a, b = word[:cut], word[cut:]
            if a in known and b in known:
                out.append((a, b))
                known.add(word)
                break
    return out


@functools.cache
def tokenizer_json(vocab_size: int = 320) -> str:
    """The ``tokenizer.json`` text of ``vocab_size`` ids (specials, bytes, merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = []
    for a, b in _merges(set(alphabet)):
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    if len(vocab) > vocab_size:
        raise ValueError(f"a byte-level vocabulary needs at least {len(SPECIALS) + 256} ids, not {vocab_size}")
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def write_tokenizer(directory: Path, vocab_size: int, chat_template: str | None = None) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` and (when given) ``chat_template.jinja`` in ``directory``."""
    (directory / "tokenizer.json").write_text(tokenizer_json(vocab_size))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    if chat_template is not None:
        (directory / "chat_template.jinja").write_text(chat_template)


def lfm2_tokenizer(vocab_size: int = 320):
    """The test tokenizer as a ``tandem_core.tokenizer.HFTokenizer`` (eos ``<|im_end|>``, bos ``<|startoftext|>``)."""
    from tokenizers import Tokenizer

    from tandem_core.tokenizer import HFTokenizer

    return HFTokenizer(Tokenizer.from_str(tokenizer_json(vocab_size)), eos_tokens=["<|im_end|>"],
                       bos_token="<|startoftext|>")
