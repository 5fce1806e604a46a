"""The token-prefix hash chain: which stored sequence does a prompt share the most with.

``h_0`` is a constant; ``h_k = H(h_{k-1} || tokens[(k-1)B : kB])`` over blocks of ``B``
tokens. A stored sequence of ``L`` tokens is filed under ``h_0 .. h_{L//B}``; a prompt's
own chain, walked from its deepest block down, meets the stored sequences that share
the most whole blocks with it first. The exact common prefix (and the position a tier
can resume at, at or before it) is then measured on the tokens themselves, so a hash
collision can never return a wrong prefix.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator

import numpy as np

from tandem_core.cache.base import common_prefix

__all__ = ["PrefixIndex", "sequence_key"]

_SEED = hashlib.blake2b(b"tandem-prefix-chain-v1", digest_size=16).digest()


def _chain(tokens: np.ndarray, blocks: int, block: int) -> list[bytes]:
    out = [_SEED]
    h = _SEED
    for k in range(blocks):
        h = hashlib.blake2b(h + tokens[k * block:(k + 1) * block].astype("<i8").tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def sequence_key(tokens: np.ndarray) -> str:
    """A name for the whole sequence (hex): equal token sequences get equal keys."""
    return hashlib.blake2b(tokens.astype("<i8").tobytes(), digest_size=16).hexdigest()


class PrefixIndex:
    """Stored token sequences by key, searchable by longest shared prefix.

    Not thread-safe on its own: the tier that owns it holds its lock around every call.
    """

    def __init__(self, block: int = 256) -> None:
        if block < 1:
            raise ValueError(f"prefix index block must be >= 1, not {block}")
        self.block = block
        self._at: dict[bytes, set[str]] = {}
        self._tokens: dict[str, np.ndarray] = {}
        self._chains: dict[str, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, key: object) -> bool:
        return key in self._tokens

    def keys(self) -> Iterator[str]:
        return iter(list(self._tokens))

    def tokens(self, key: str) -> np.ndarray:
        return self._tokens[key]

    def add(self, key: str, tokens: np.ndarray) -> None:
        if key in self._tokens:
            self.remove(key)
        chain = _chain(tokens, len(tokens) // self.block, self.block)
        for h in chain:
            self._at.setdefault(h, set()).add(key)
        self._tokens[key] = tokens
        self._chains[key] = chain

    def remove(self, key: str) -> None:
        if key not in self._tokens:
            return
        for h in self._chains.pop(key):
            keys = self._at.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._at[h]
        del self._tokens[key]

    def search(self, tokens: np.ndarray, limit: int,
               usable: Callable[[str, int], int]) -> tuple[str, int, int] | None:
        """The stored sequence that gives the furthest start for ``tokens[:limit]``.

        ``usable(key, common)`` says where that entry can resume given ``common`` shared
        tokens (0: nowhere). Returns ``(key, start, common)`` or None.
        """
        limit = max(0, min(limit, len(tokens)))
        head = tokens[:limit]
        depth = limit // self.block
        chain = _chain(head, depth, self.block)
        best: tuple[str, int, int] | None = None
        seen: set[str] = set()
        for k in range(depth, -1, -1):
            # entries first met at depth k share fewer than (k+1)*B tokens: none can beat ``best``
            if best is not None and best[1] >= (k + 1) * self.block:
                break
            keys = self._at.get(chain[k])
            if not keys:
                continue
            for key in sorted(keys - seen):
                seen.add(key)
                common = common_prefix(self._tokens[key], head)
                start = usable(key, common)
                if start > 0 and (best is None or start > best[1]):
                    best = (key, start, common)
        return best
