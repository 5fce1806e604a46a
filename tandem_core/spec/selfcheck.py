"""The load-time self-check: every verified row equals the decode step's row, bit for bit.

Speculation is lossless only if a row a verify computes equals the row plain
decode computes at that position (row invariance). The self-check proves it on
the engine that serves, through the ``TreeEngine`` verbs only (no model code):

1. record: prefill a short prompt, then decode ``tokens`` tokens greedily one at a
   time, keeping every row's logits and the state after the last one;
2. chains: from the prompt's state, replay the recorded tokens as one chain of
   every width ``1 .. min(max_width, tokens)`` in turn (``forward_block``, commit,
   settle), each verified row against the recorded row (``torch.equal``); a
   replay that reaches the recorded end checks the state against the recorded
   state (sections whole, views up to length) and starts again;
3. trees: one tree of every width ``1 .. max_width``, each holding the recorded
   continuation (a path of 1 .. width nodes) and distractor branches: siblings of
   the path's root, branches off the path at every depth, branches off branches
   (shared prefixes), in a shuffled order (parents before children), so a node's
   neighbour in index order is rarely its parent. The path's rows are checked and
   the path committed; the replay runs on from there, and whenever it reaches the
   recorded end the state is checked and the replay starts again.

On the first difference it stops and, when the engine offers the ``LayerTrace``
diagnostics (``caps.trace``), re-runs that row both ways (a decode step, and the same verify from
the decode's state) with per-layer capture and names the first layer whose
hidden row differs. ``SelfCheck.first_mismatch`` is one line naming the verify's
form and width, the row, and the layer. The engine is left reset.

Work: ``tokens`` decode steps, then a chain verify of every width up to
``min(max_width, tokens)`` and a tree verify of every width up to ``max_width``
(plus a few chains closing each replay): about ``tokens + 2 * max_width`` forwards
of ``max_width * (max_width + 1)`` nodes in all, bounded whatever the model.

    run_selfcheck(engine, prompt=None, *, tokens=24, max_width=None, seed=0) -> SelfCheck
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Protocol, Sequence, cast, runtime_checkable

import torch

from tandem_core.engine import Trace, TreeEngine, restore_state
from tandem_core.state import ModelState

__all__ = ["SelfCheck", "Mismatch", "Trace", "LayerTrace", "run_selfcheck", "PROMPT_TOKENS"]

PROMPT_TOKENS = 16   # the default prompt: this many ids drawn from the seed


@runtime_checkable
class LayerTrace(Protocol):
    """Diagnostics an engine may offer (``caps.trace``): ``forward``/``forward_tree`` with per-layer capture.

    Each has exactly its verb's arithmetic and effect on the sequence (``trace_forward`` appends the
    tokens, ``trace_tree`` leaves the tree verified) and also returns the hidden rows at every capture
    point. Used only to name the layer of a difference."""

    def trace_forward(self, tokens: torch.Tensor | Sequence[int]) -> Trace: ...

    def trace_tree(self, tokens: torch.Tensor | Sequence[int],
                   parents: torch.Tensor | Sequence[int]) -> Trace: ...


@dataclass(frozen=True)
class Mismatch:
    """The first difference: a verified row (``form`` chain or tree) or the state after a replay."""

    form: str              # "chain", "tree" or "state"
    width: int             # nodes in the verify (the replay's width for "state")
    node: int              # the node's index in the verify (-1 for "state")
    row: int               # the recorded decode row it should equal (0 = after the first generated token)
    position: int          # that row's token position in the sequence
    layer: str | None      # the first capture point whose row differs, or the state tensor; None: unknown
    detail: str = ""

    def describe(self) -> str:
        if self.form == "state":
            return (f"state after replaying {self.row + 1} decode steps as verifies of width {self.width} "
                    f"differs from plain decode's: {self.layer}")
        where = f"first differing layer: {self.layer}" if self.layer else "layer unknown"
        text = (f"{self.form} verify of width {self.width}: node {self.node} (decode row {self.row}, "
                f"position {self.position}) differs from the decode step's row; {where}")
        return f"{text} ({self.detail})" if self.detail else text


@dataclass(frozen=True)
class SelfCheck:
    """The self-check's result. ``first_mismatch``: one line naming the form, width, row and layer."""

    ok: bool
    rows_checked: int
    widths: tuple[int, ...]
    first_mismatch: str | None
    mismatch: Mismatch | None = None
    seconds: float = 0.0


class _Found(Exception):
    def __init__(self, mismatch: Mismatch, tokens: list[int], parents: list[int], offset: int) -> None:
        super().__init__(mismatch.describe())
        self.mismatch, self.tokens, self.parents, self.offset = mismatch, tokens, parents, offset


@dataclass
class _Record:
    start: ModelState           # after the prompt
    tokens: list[int]           # the greedy continuation: tokens[j] is fed at position start.length + j
    rows: torch.Tensor          # [K, V]: rows[j] = logits after feeding tokens[j]
    final: ModelState           # after feeding every token

    @property
    def base(self) -> int:
        return self.start.length


def run_selfcheck(engine: TreeEngine, prompt: Sequence[int] | None = None, *, tokens: int = 24,
                  max_width: int | None = None, seed: int = 0) -> SelfCheck:
    """Replay a recorded greedy decode of ``tokens`` tokens as chains and trees of every verify width up to
    ``max_width`` (default and limit: ``caps.max_tree``) and compare every verified row and the state
    after the commits with plain decode's, bit for bit. ``prompt``: token ids (default: ``PROMPT_TOKENS``
    ids drawn from ``seed``). Never raises for what it finds: an engine error is a failed check."""
    t0 = time.perf_counter()
    caps = engine.caps
    if not caps.tree or caps.max_tree < 1:
        return SelfCheck(False, 0, (), "the engine verifies no trees (caps.tree is off)", None, 0.0)
    width = caps.max_tree if max_width is None else max(1, min(int(max_width), caps.max_tree))
    widths = tuple(range(1, width + 1))
    check = _Checker(engine, random.Random(seed))
    try:
        with torch.no_grad():
            rec = _record(engine, prompt, max(1, int(tokens)), seed)
            check.rec = rec
            check.chains(range(1, min(width, len(rec.tokens)) + 1))
            check.trees(widths)
    except _Found as found:
        mismatch = found.mismatch
        if mismatch.form != "state":
            mismatch = _diagnose(engine, check.rec, found)
        engine.reset()
        return SelfCheck(False, check.rows, widths, mismatch.describe(), mismatch, time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001  (the check's verdict: the engine cannot verify)
        engine.reset()
        return SelfCheck(False, check.rows, widths, f"the self-check stopped: {type(exc).__name__}: {exc}",
                         None, time.perf_counter() - t0)
    engine.reset()
    return SelfCheck(True, check.rows, widths, None, None, time.perf_counter() - t0)


# -- recording ------------------------------------------------------------------------------------------
def _record(engine: TreeEngine, prompt: Sequence[int] | None, K: int, seed: int) -> _Record:
    engine.reset()
    if prompt is None:
        vocab = int(engine.forward([0]).shape[-1])
        engine.reset()
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
    logits = engine.forward(torch.as_tensor(list(prompt), dtype=torch.long))
    start = engine.state.clone()
    toks, rows = [], []
    tok = int(engine.picks(logits)[-1])
    for _ in range(K):
        toks.append(tok)
        row = engine.forward(torch.tensor([tok]))                 # [1, V]: the decode step's row
        rows.append(row[-1])
        tok = int(engine.picks(row)[-1])
    return _Record(start, toks, torch.stack(rows), engine.state.clone())


# -- replays --------------------------------------------------------------------------------------------
class _Checker:
    def __init__(self, engine: TreeEngine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.rows = 0
        self.rec: _Record

    def chains(self, widths: range) -> None:
        """One chain of every width, each from where the last one's commit left the replay."""
        rec, K = self.rec, len(self.rec.tokens)
        restore_state(self.engine, rec.start)
        c = 0
        for w in widths:
            if c + w > K:                                  # finish this replay, check its state, start again
                c = self._finish(c, w)
            c = self._chain(c, w)
            if c == K:
                self._state(w)
                restore_state(self.engine, rec.start)
                c = 0
        if c:
            self._finish(c, widths[-1])

    def _finish(self, c: int, width: int) -> int:
        """Verify the rest of the recorded tokens as chains of up to ``width``, check the state, restart."""
        K = len(self.rec.tokens)
        while c < K:
            c = self._chain(c, min(width, K - c))
        self._state(width)
        restore_state(self.engine, self.rec.start)
        return 0

    def _chain(self, c: int, n: int) -> int:
        toks = self.rec.tokens[c:c + n]
        out = self.engine.forward_block(torch.tensor(toks))
        for j in range(n):
            self._row(out.logits[j], "chain", n, j, c + j, toks, list(range(-1, n - 1)), c)
        self.engine.commit_tree(list(range(n)))
        self.engine.settle()
        return c + n

    def trees(self, widths: tuple[int, ...]) -> None:
        """One tree of every width, each from where the last one's commit left the replay."""
        rec, K = self.rec, len(self.rec.tokens)
        vocab = int(rec.rows.shape[-1])
        restore_state(self.engine, rec.start)
        c = 0
        for n in widths:
            p = self.rng.randint(1, min(n, K - c))
            toks, parents, path = self._tree(c, p, n, vocab)
            out = self.engine.forward_tree(torch.tensor(toks), torch.tensor(parents))
            for d, node in enumerate(path):
                self._row(out.logits[node], "tree", n, node, c + d, toks, parents, c)
            self.engine.commit_tree(path)
            self.engine.settle()
            c += p
            if c == K:
                self._state(n)
                restore_state(self.engine, rec.start)
                c = 0
        if c:
            self._finish(c, widths[-1])

    def _tree(self, c: int, p: int, n: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
        """``n`` nodes: the recorded tokens ``c .. c+p-1`` as a path, the rest distractors, shuffled
        (parents first). Returns tokens, parents and the path's node indices."""
        truth = self.rec.tokens
        rng = self.rng
        tok = [truth[c + d] for d in range(p)]
        par = list(range(-1, p - 1))
        depth = list(range(p))
        on_path = [True] * p
        while len(tok) < n:
            parent = rng.choice([-1, *range(len(tok))])
            d = 0 if parent < 0 else depth[parent] + 1
            t = rng.randrange(vocab)
            want = truth[c + d] if (parent < 0 or on_path[parent]) and c + d < len(truth) else None
            if t == want:
                t = (t + 1) % vocab                        # a distractor: another token than the path's
            tok.append(t)
            par.append(parent)
            depth.append(d)
            on_path.append(False)
        order: list[int] = []                                          # a random topological order
        placed: set[int] = set()
        ready = [i for i in range(n) if par[i] < 0]
        while ready:
            i = ready.pop(rng.randrange(len(ready)))
            order.append(i)
            placed.add(i)
            ready.extend(j for j in range(n) if par[j] == i)
        new = {old: k for k, old in enumerate(order)}
        tokens = [tok[i] for i in order]
        parents = [-1 if par[i] < 0 else new[par[i]] for i in order]
        return tokens, parents, [new[i] for i in range(p)]

    def _row(self, got: torch.Tensor, form: str, width: int, node: int, row: int, toks: list[int],
             parents: list[int], offset: int) -> None:
        self.rows += 1
        if not torch.equal(got, self.rec.rows[row]):
            pos = self.rec.base + row
            raise _Found(Mismatch(form, width, node, row, pos, None), toks, parents, offset)

    def _state(self, width: int) -> None:
        got, want = self.engine.state, self.rec.final
        K = len(self.rec.tokens)
        if got.length != want.length:
            raise _Found(Mismatch("state", width, -1, K - 1, want.length, f"length {got.length}, "
                                  f"not {want.length}"), [], [], 0)
        for name, t in want.sections.items():
            if not torch.equal(got.sections[name], t):
                raise _Found(Mismatch("state", width, -1, K - 1, want.length,
                                      _first_diff(f"section {name}", got.sections[name], t)), [], [], 0)
        for name, v in want.views.items():
            mine = got.views[name].head(want.length)
            if not torch.equal(mine, v.head(want.length)):
                raise _Found(Mismatch("state", width, -1, K - 1, want.length,
                                      _first_diff(f"view {name}", mine, v.head(want.length))), [], [], 0)


def _first_diff(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    ne = (got != want).nonzero()
    return f"{name} at index {tuple(int(i) for i in ne[0])}" if len(ne) else name


# -- naming the layer ---------------------------------------------------------------------------------
def _diagnose(engine: TreeEngine, rec: _Record, found: _Found) -> Mismatch:
    """Re-run the mismatched row as a decode step and as the same verify from the decode's state, with
    per-layer capture; name the first capture point whose row differs."""
    m = found.mismatch
    if not engine.caps.trace:
        return Mismatch(m.form, m.width, m.node, m.row, m.position, None,
                        "the engine offers no layer trace (caps.trace is off)")
    tracer = cast(LayerTrace, engine)
    try:
        restore_state(engine, rec.start)
        for t in rec.tokens[:m.row]:
            engine.forward(torch.tensor([t]))
        dec = tracer.trace_forward(torch.tensor([rec.tokens[m.row]]))
        restore_state(engine, rec.start)
        for t in rec.tokens[:found.offset]:
            engine.forward(torch.tensor([t]))
        ver = tracer.trace_tree(torch.tensor(found.tokens), torch.tensor(found.parents))
        engine.discard_pending()
    except Exception as exc:  # noqa: BLE001  (diagnostics only)
        return Mismatch(m.form, m.width, m.node, m.row, m.position, None,
                        f"the layer trace stopped: {type(exc).__name__}: {exc}")
    for name, a, b in zip(dec.points, dec.rows, ver.rows):
        if not torch.equal(a[-1], b[m.node]):
            return Mismatch(m.form, m.width, m.node, m.row, m.position, name)
    if not torch.equal(dec.logits[-1], ver.logits[m.node]):
        return Mismatch(m.form, m.width, m.node, m.row, m.position, "the output head")
    return Mismatch(m.form, m.width, m.node, m.row, m.position, None,
                    "verified from the plain decode's state the row agrees: "
                    "the state earlier commits left differs")
