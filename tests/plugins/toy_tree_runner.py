"""A toy ``Runner`` for testing the speculative loop without a real model, run by the core's ``SequenceEngine``.

The model: a decaying running sum ``s_t = 0.5 s_{t-1} + E[tok_t]`` (a recurrent section ``s``; the tokens
as a view ``tok``), logits ``W s_t`` plus a strong bias towards ``succ(tok_t)``, so greedy text falls into
cycles the lookup drafter learns. Every row is computed on its own from its parent's state with the same
ops, so verified rows equal decode rows bit for bit. It is registered by no plugin file of the core: a
test builds it, which is what a third-party family does (``docs/adding-a-model.md``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tandem_core.engine import Manifest, MemoryPart, Rows, RunnerSpec, SequenceEngine, Step, TreeStep
from tandem_core.state import View


class ToyTreeRunner:
    def __init__(self, vocab: int = 48, hidden: int = 16, max_context: int = 4096, seed: int = 0,
                 bias: float = 3.0, max_tree: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.E = torch.randn(vocab, hidden, generator=g)
        self.W = torch.randn(vocab, hidden, generator=g) * 0.5
        self.succ = torch.randperm(vocab, generator=g)
        self.bias = bias
        self.vocab = vocab
        self.spec = RunnerSpec(vocab_size=vocab, hidden_size=hidden, max_context=max_context, max_tree=max_tree,
                               prefill_chunk=4096)
        self._s = torch.zeros(hidden)
        self._toks = torch.zeros(max_context, dtype=torch.long)
        self._tree: tuple[list[int], list[torch.Tensor]] | None = None   # the verified nodes' tokens and states
        self.forward_calls = 0

    # the one per-row computation, shared by decode, verify and replay
    def _row(self, s: torch.Tensor, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
        s2 = 0.5 * s + self.E[tok]
        logits = self.W @ s2
        logits = logits.clone()
        logits[self.succ[tok]] += self.bias
        return s2, logits

    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
        return {"s": self._s}, {"tok": View(self._toks, 0)}

    def _append(self, ids: torch.Tensor, start: int) -> Rows:
        self.forward_calls += 1
        states, rows = [], []
        for j, tok in enumerate(ids.tolist()):
            s2, lg = self._row(self._s, tok)
            self._s.copy_(s2)
            self._toks[start + j] = tok
            states.append(s2)
            rows.append(lg)
        return Rows(torch.stack(states), torch.stack(rows), {})

    def prefill(self, ids: torch.Tensor, step: Step, *, logits, capture=None) -> Rows:
        rows = self._append(ids, step.start)
        out = {"all": rows.logits, "last": rows.logits[-1:], "none": None}[logits]
        return Rows(rows.hidden, out, {})

    def decode(self, ids: torch.Tensor, step: Step, *, capture=None) -> Rows:
        return self._append(ids, step.start)

    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture=None) -> Rows:
        self.forward_calls += 1
        toks = ids.tolist()
        states, rows = [], []
        for tok, par in zip(toks, tree.parents):
            s2, lg = self._row(self._s if par < 0 else states[par], tok)
            states.append(s2)
            rows.append(lg)
        self._tree = (toks, states)
        return Rows(torch.stack(states), torch.stack(rows), {})

    def commit(self, tree: TreeStep, path: Sequence[int]) -> torch.Tensor:
        assert self._tree is not None, "commit without a verified tree"
        toks, states = self._tree
        for j, i in enumerate(path):
            self._toks[tree.start + j] = toks[i]
        self._s.copy_(states[path[-1]])
        self._tree = None
        return torch.tensor([toks[i] for i in path])

    def replay(self, kept: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        toks = torch.cat(list(kept))[:n]
        for tok in toks.tolist():
            self._s.copy_(self._row(self._s, tok)[0])
        return toks

    def tap(self, layers: tuple[int, ...]) -> None:
        assert not layers

    def reset(self) -> None:
        self._s.zero_()
        self._tree = None

    def manifest(self) -> Manifest:
        return Manifest(files=(__file__,))

    def memory_parts(self) -> list[MemoryPart]:
        return [MemoryPart("weights", (self.E.numel() + self.W.numel()) * 4, "cpu")]


def toy_tree_engine(**kw) -> SequenceEngine:
    """The core's sequence engine over a ``ToyTreeRunner(**kw)``."""
    return SequenceEngine(ToyTreeRunner(**kw), name="toytree")
