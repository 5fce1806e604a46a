"""Made-up models for the cache tests (imported by tests/test_cache_*.py), and their own checks.

``TinyEngine`` is a tiny made-up hybrid that computes every position on its own, in
the same order whatever the chunking, so a prefill resumed from any cache tier can be
compared with a cold prefill BIT FOR BIT:

- a linear-RNN layer with a short convolution: sections ``rnn.h`` [D] and ``conv.tail`` [2, D];
- a toy attention over views: ``attn.K`` [C, D] (token axis 0, fp32) and ``attn.V``
  [2, C, D/2] (token axis 1, bf16);
- with ``odd=True``, stranger buffers: a view ``odd.codes`` [3, 2, C] (token axis 2, int8),
  a view ``odd.pos`` [C, 1] (float64) and a section ``odd.count`` (a 0-d int64).

The cache code never sees any of these names: it reads ``engine.state`` only.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem_core.engine import Capabilities, Manifest, MemoryPart
from tandem_core.state import ModelState, View

LAYOUTS = {
    "hybrid": dict(recurrent=True, attention=True),
    "attention-only": dict(recurrent=False, attention=True),
    "recurrent-only": dict(recurrent=True, attention=False),
    "odd-views": dict(recurrent=False, attention=True, odd=True),
}


class _KV:
    def __init__(self, state: ModelState) -> None:
        self._state = state

    @property
    def length(self) -> int:
        return self._state.length


class TinyEngine:
    def __init__(self, *, recurrent: bool = True, attention: bool = True, odd: bool = False, vocab: int = 40,
                 dim: int = 8, capacity: int = 1024, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * scale

        self.vocab, self.dim, self.capacity = vocab, dim, capacity
        self.embed = r(vocab, dim)
        self.A, self.B = r(dim, dim, scale=0.3), r(dim, dim, scale=0.5)
        self.Wq, self.Wk, self.Wv = r(dim, dim, scale=0.5), r(dim, dim, scale=0.5), r(dim, dim, scale=0.5)
        self.head = r(vocab, dim)
        sections: dict[str, torch.Tensor] = {}
        views: dict[str, View] = {}
        if recurrent:
            sections["rnn.h"] = torch.zeros(dim)
            sections["conv.tail"] = torch.zeros(2, dim)
        if attention:
            views["attn.K"] = View(torch.zeros(capacity, dim), 0)
            views["attn.V"] = View(torch.zeros(2, capacity, dim // 2, dtype=torch.bfloat16), 1)
        if odd:
            views["odd.codes"] = View(torch.zeros(3, 2, capacity, dtype=torch.int8), 2)
            views["odd.pos"] = View(torch.zeros(capacity, 1, dtype=torch.float64), 0)
            sections["odd.count"] = torch.zeros((), dtype=torch.int64)
        self._state = ModelState(sections, views, 0)
        self.kv = _KV(self._state)
        self.caps = Capabilities(resume=True, max_context=capacity)
        self._hist: list[dict[str, torch.Tensor] | None] = []   # sections after each position (rollback)
        self.resumed_at: list[int] = []

    # -- hot verbs ------------------------------------------------------------------------
    def forward(self, tokens, *, all_logits: bool = False) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).tolist()
        S, V = self._state.sections, self._state.views
        rows = []
        for tok in ids:
            p = self._state.length
            if p >= self.capacity:
                raise ValueError(f"TinyEngine: position {p} past capacity {self.capacity}")
            x = self.embed[tok]
            y = torch.zeros(self.dim)
            if "rnn.h" in S:
                tail = S["conv.tail"]
                c = x + 0.5 * tail[1] + 0.25 * tail[0]
                tail[0].copy_(tail[1])
                tail[1].copy_(x)
                h = torch.tanh(self.A @ S["rnn.h"] + self.B @ c)
                S["rnn.h"].copy_(h)
                y = y + h
            if "attn.K" in V:
                K, Vt = V["attn.K"].tensor, V["attn.V"].tensor
                K[p] = self.Wk @ x
                Vt[:, p] = (self.Wv @ x).view(2, self.dim // 2).to(torch.bfloat16)
                w = torch.softmax(K[:p + 1] @ (self.Wq @ x) / math.sqrt(self.dim), 0)        # w: [p+1]
                y = y + (w.view(1, -1, 1) * Vt[:, :p + 1].float()).sum(1).reshape(-1)      # [D]
            if "odd.codes" in V:
                codes, pos = V["odd.codes"].tensor, V["odd.pos"].tensor
                codes[:, :, p] = ((torch.arange(6).view(3, 2) * 5 + tok * 7 + p * 3) % 101 - 50).to(torch.int8)
                pos[p, 0] = p * 0.5 + tok
                S["odd.count"] += tok
                extra = codes[:, :, :p + 1].float().mean() + pos[:p + 1].mean().float() + S["odd.count"].float()
                y = y + 1e-3 * extra
            self._state.length = p + 1
            del self._hist[p:]
            self._hist.append({k: v.clone() for k, v in S.items()})
            rows.append(self.head @ y)
        logits = torch.stack(rows)                                                         # [T, V]
        return logits if all_logits else logits[-1:]

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    @property
    def state(self) -> ModelState:
        return self._state

    def reset(self) -> None:
        for t in self._state.sections.values():
            t.zero_()
        self._state.length = 0
        self._hist.clear()

    def rollback_to(self, n: int) -> None:
        """Forget tokens past ``n`` (the sections come back from this engine's own history)."""
        if n == 0:
            self.reset()
            return
        saved = self._hist[n - 1]
        if saved is None:
            raise ValueError(f"TinyEngine: no history at {n} (the state was restored from a cache since)")
        for k, v in saved.items():
            self._state.sections[k].copy_(v)
        self._state.length = n
        del self._hist[n:]

    # -- cold verbs -----------------------------------------------------------------------
    def resume_at(self, n: int) -> None:
        """The state was taken to ``n`` from outside: this engine's own history before it is unknown."""
        self.resumed_at.append(n)
        self._hist = [None] * n

    def settle(self) -> None:
        """Nothing is ever pending in this engine: every forwarded token is committed."""

    def discard_pending(self) -> None:
        """Nothing is ever pending in this engine."""

    def trim_pending(self, n: int) -> None:
        """Nothing is ever pending in this engine."""

    def manifest(self) -> Manifest:
        return Manifest(files=(__file__,), settings={"dim": self.dim})

    def memory_parts(self) -> list[MemoryPart]:
        return [MemoryPart("weights", sum(t.numel() * 4 for t in (self.embed, self.A, self.B, self.head)), "cpu")]


def state_tensors(state: ModelState) -> dict[str, torch.Tensor]:
    """Every tensor of the state's sequence (views cut to its length), detached copies."""
    return {k: v.clone() for k, v in state.tensors().items()}


def assert_same_state(a: ModelState, b: ModelState) -> None:
    assert a.length == b.length
    ta, tb = state_tensors(a), state_tensors(b)
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k], tb[k]), k


def cold(layout: dict, tokens) -> tuple[torch.Tensor, TinyEngine]:
    """A cold prefill of ``tokens`` in one forward: (last logits [1, V], the engine)."""
    eng = TinyEngine(**layout)
    return eng.forward(torch.as_tensor(list(tokens))), eng


def tokens(n: int, seed: int, vocab: int = 40) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# -- the toy's own properties (what makes the cache tests' bit-for-bit claims meaningful) --------

@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_toy_chunked_forward_equals_one_forward_bit_for_bit(layout):
    toks = tokens(90, seed=1)
    ref, ref_eng = cold(LAYOUTS[layout], toks)
    eng = TinyEngine(**LAYOUTS[layout])
    for a in range(0, 90, 17):
        out = eng.forward(torch.as_tensor(toks[a:a + 17]))
    assert torch.equal(out, ref)
    assert_same_state(eng.state, ref_eng.state)


def test_toy_rollback_equals_never_having_gone_further():
    toks = tokens(40, seed=2)
    ref, ref_eng = cold(LAYOUTS["hybrid"], toks[:30])
    eng = TinyEngine(**LAYOUTS["hybrid"])
    eng.forward(torch.as_tensor(toks))
    eng.rollback_to(30)
    assert_same_state(eng.state, ref_eng.state)
    assert torch.equal(eng.forward(torch.as_tensor(toks[30:31])), ref_eng.forward(torch.as_tensor(toks[30:31])))
