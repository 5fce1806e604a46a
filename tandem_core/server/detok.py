"""Streaming detokenisation: token ids in, newly completed text out.

Decoding one token at a time is wrong in two ways: a byte-level token may hold
part of a UTF-8 character (it decodes to U+FFFD until the rest arrives), and
some decoders change a token's text by what precedes it (a SentencePiece
``▁word`` loses its space at the start of a decode). ``StreamDetokenizer``
keeps a small window of ids instead: ``decode(window + new)`` minus
``decode(window)`` is the new text, and the window moves on only when that text
does not end in U+FFFD. Each ``push`` decodes the window and the ids since it
(O(window), not O(n)); the concatenated output equals
``tokenizer.decode(all_ids)``.

Exactness needs a decoder whose text before a complete character does not
depend on what follows it: byte-level BPE (GPT-2, Qwen, Llama 3) and
SentencePiece with byte fallback on valid UTF-8 are. One case is not streamable
by any detokeniser: ``ByteFallback`` writes U+FFFD for every byte of a run of
byte tokens that holds an invalid sequence anywhere, so a run that starts with
valid characters and later turns invalid decodes differently whole.
"""

from __future__ import annotations

from tandem_core.serving import Tokenizer

__all__ = ["StreamDetokenizer"]

_REPLACEMENT = "\ufffd"


class StreamDetokenizer:
    """Text for one generation, token by token.

    ``push(id)`` returns the text that id completes ("" while a character is
    still partial); ``flush()`` returns what was held back at the end (a partial
    character becomes U+FFFD, as the full decode writes it). Owns its id list;
    the tokenizer is only read.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids[_prefix:_read] were decoded as context, already emitted
        self._read = 0  # ids before this were emitted
        self._prefix_text = ""  # decode(ids[_prefix:_read])

    @property
    def ids(self) -> list[int]:
        """Every id pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Text completed by ``token_id`` (may be "")."""
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """What was held back (an incomplete character at the end decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        return self._advance(text)

    def _advance(self, text: str) -> str:
        """Emit ``text`` past the window's text; the ids just emitted become the next window."""
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        window = self._ids[self._prefix:self._read]
        self._prefix_text = self._tok.decode(window, skip_special_tokens=self._skip)
        return new
