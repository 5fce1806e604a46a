"""A toy ``TreeEngine`` for testing the speculative loop without a real model.

The model: a decaying running sum ``s_t = 0.5 s_{t-1} + E[tok_t]`` (a recurrent section),
logits ``W s_t`` plus a strong bias towards ``succ(tok_t)``, so greedy text falls into
cycles the lookup drafter learns. Every row is computed on its own from its parent's
state with the same ops, so verified rows equal decode rows bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tandem_core.engine import Capabilities, Manifest, MemoryPart, TreeOut
from tandem_core.state import ModelState, View


class _KV:
    def __init__(self, state: ModelState) -> None:
        self._state = state

    @property
    def length(self) -> int:
        return self._state.length


class ToyTreeEngine:
    def __init__(self, vocab: int = 48, hidden: int = 16, max_context: int = 4096, seed: int = 0,
                 bias: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.E = torch.randn(vocab, hidden, generator=g)
        self.W = torch.randn(vocab, hidden, generator=g) * 0.5
        self.succ = torch.randperm(vocab, generator=g)
        self.bias = bias
        self.vocab = vocab
        self.caps = Capabilities(tree=True, resume=True, recurrent=True, max_context=max_context, max_tree=64)
        self._s = torch.zeros(hidden)
        self._toks = torch.zeros(max_context, dtype=torch.long)
        self._live = ModelState({"s": self._s}, {"tok": View(self._toks, 0)}, 0)
        self.kv = _KV(self._live)
        self._tree: tuple[list[int], list[int], list[torch.Tensor]] | None = None
        self._undo: list[tuple[int, torch.Tensor]] = []   # pending: (length before, state before)
        self.forward_calls = 0

    # the one per-row computation, shared by decode and verify
    def _row(self, s: torch.Tensor, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
        s2 = 0.5 * s + self.E[tok]
        logits = self.W @ s2
        logits = logits.clone()
        logits[self.succ[tok]] += self.bias
        return s2, logits

    def forward(self, tokens, *, all_logits: bool = False) -> torch.Tensor:
        self.forward_calls += 1
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).tolist()
        rows = []
        for tok in t:
            s2, lg = self._row(self._s, tok)
            self._s.copy_(s2)
            self._toks[self._live.length] = tok
            self._live.length += 1
            rows.append(lg)
        out = torch.stack(rows)
        self._undo.clear()
        return out if all_logits else out[-1:]

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor) -> TreeOut:
        self.forward_calls += 1
        toks, pars = tokens.tolist(), parents.tolist()
        if len(toks) > self.caps.max_tree + 1:
            raise ValueError(f"tree of {len(toks)} nodes exceeds max_tree {self.caps.max_tree}")
        states, rows = [], []
        for tok, par in zip(toks, pars):
            base = self._s if par < 0 else states[par]
            s2, lg = self._row(base, tok)
            states.append(s2)
            rows.append(lg)
        self._tree = (toks, pars, states)
        return TreeOut(torch.stack(rows))

    def forward_block(self, tokens: torch.Tensor) -> TreeOut:
        n = len(tokens)
        return self.forward_tree(tokens, torch.arange(-1, n - 1))

    def commit_tree(self, path: Sequence[int]) -> None:
        assert self._tree is not None, "commit_tree without a verified tree"
        toks, pars, states = self._tree
        prev = -1
        for i in path:
            if pars[i] != prev:
                raise ValueError(f"path node {i} is not a child of {prev}")
            self._undo.append((self._live.length, self._s.clone()))
            self._toks[self._live.length] = toks[i]
            self._live.length += 1
            self._s.copy_(states[i])
            prev = i
        self._tree = None

    def trim_pending(self, n: int) -> None:
        if n > len(self._undo):
            raise ValueError(f"cannot trim {n} tokens: {len(self._undo)} pending")
        for _ in range(n):
            length, s = self._undo.pop()
            self._live.length = length
            self._s.copy_(s)

    def rollback_to(self, n: int) -> None:
        self.trim_pending(self._live.length - n)

    def discard_pending(self) -> None:
        self._tree = None

    def settle(self) -> None:
        self._undo.clear()

    def resume_at(self, n: int, sections=None) -> None:
        self._undo.clear()

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def hidden_post_norm(self) -> torch.Tensor:
        return self._s[None]

    @property
    def state(self) -> ModelState:
        return self._live

    def reset(self) -> None:
        self._s.zero_()
        self._live.length = 0
        self._undo.clear()
        self._tree = None

    def cache_state(self) -> ModelState:
        return self._live

    def manifest(self) -> Manifest:
        return Manifest(files=(__file__,))

    def memory_parts(self) -> list[MemoryPart]:
        return [MemoryPart("weights", (self.E.numel() + self.W.numel()) * 4, "cpu")]
