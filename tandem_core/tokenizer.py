"""A ``Tokenizer`` over a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

Model plugins that ship a ``tokenizer.json`` (or can build one, as the GGUF
reader does from its metadata) use this; a plugin with another tokenizer
implements the ``tandem_core.serving.Tokenizer`` protocol itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

__all__ = ["HFTokenizer", "load_chat_template"]


class HFTokenizer:
    def __init__(self, tokenizer: Any, *, eos_tokens: Sequence[str] = (), bos_token: str | None = None,
                 extra_eos_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok: _Tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        ids = [i for i in (tokenizer.token_to_id(t) for t in eos_tokens) if i is not None]
        self.eos_token_ids = tuple(dict.fromkeys([*ids, *extra_eos_ids]))
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token = bos_token
        self._fp: str | None = None
        self.special_ids = frozenset(
            tokenizer.token_to_id(t.content) for t in tokenizer.get_added_tokens_decoder().values() if t.special
        )

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> "HFTokenizer":
        from tokenizers import Tokenizer as _Tok

        return cls(_Tok.from_file(str(path)), **kw)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "HFTokenizer":
        """``tokenizer.json`` with the eos/bos tokens named by ``tokenizer_config.json`` and
        ``generation_config.json`` (eos ids) where present."""
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{d}: no tokenizer.json")
        cfg = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")
        eos = _token_str(cfg.get("eos_token"))
        bos = _token_str(cfg.get("bos_token"))
        extra = gen.get("eos_token_id", [])
        extra = [extra] if isinstance(extra, int) else list(extra or [])
        return cls.from_file(path, eos_tokens=[eos] if eos else [], bos_token=bos, extra_eos_ids=extra)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (constrained decoding builds llguidance's tokenizer from it)."""
        return self._tok.to_str()

    def fingerprint(self) -> str:
        if self._fp is None:
            canon = json.dumps(json.loads(self._tok.to_str()), sort_keys=True, separators=(",", ":"))
            self._fp = hashlib.sha256(canon.encode()).hexdigest()
        return self._fp


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def load_chat_template(directory: str | Path) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja``, or ``tokenizer_config.json``'s field."""
    d = Path(directory)
    j = d / "chat_template.jinja"
    if j.exists():
        return j.read_text()
    tmpl = _read_json(d / "tokenizer_config.json").get("chat_template")
    if isinstance(tmpl, list):  # named templates: take "default"
        tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
    return tmpl
