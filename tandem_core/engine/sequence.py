"""``SequenceEngine``: one sequence (batch 1) over a model's ``Runner``, written once for every family.

The engine owns the sequence; the runner only computes (``tandem_core.engine.runner``):

    kv.length / state    the committed tokens, and the live ``ModelState`` over the runner's buffers
                         (a ``restore`` or ``resume`` into it lands in those buffers and drops the
                         verified tree and the pending tokens: they described the state it replaced)
    the verified tree    the ``TreeStep`` of the last ``forward_tree``, until a commit, a discard, a
                         forward, a rollback or a state change uses it up
    pending tokens       what ``commit_tree`` appended since the last ``settle``: ``trim_pending`` and
                         ``rollback_to`` can take them back. For a runner with sections the engine keeps
                         the sections as they were at the settle (in buffers allocated with the engine,
                         counted in its memory parts) and each commit's record; taking back puts the sections
                         back and has the runner ``replay`` the records up to the new length. Without
                         sections a rollback only moves the length, to any earlier position.
    input checks         ids inside the vocabulary, the context's room, the tree's width and shape, a
                         commit path that runs root to leaf in the tree last verified
    chunking             ``forward`` runs ``spec.prefill_chunk`` rows a call; a one-row call (a decode
                         step, or a last chunk of one row) is the runner's ``decode``
    traces               ``trace_forward`` / ``trace_tree`` (the self-check's ``LayerTrace``), when the
                         runner honours ``capture`` (``spec.trace``)
    an MTP head          given at construction (``head=``, a ``DraftHead``): ``caps.mtp``, ``mtp_head()``
                         (``tandem_core.engine.base.MTPEngine``). Every forward chunk and every commit
                         hands the head the rows it reads of the tokens it appended (``DraftHead.append``:
                         that call's own rows; the head's layer is tapped for as long as the engine
                         lives), so the head's rows always hold the sequence; its sections and views
                         (``mtp.hidden``, ``mtp.K``, ...) are the live state's too: every cache tier saves
                         and restores them, and a rollback of pending tokens puts ``mtp.hidden`` back

Hot verbs: ``forward``, ``forward_tree``, ``forward_block``, ``commit_tree``, ``rollback_to``, ``picks``,
``hidden_post_norm``, ``hidden_at``, ``kv.length``, ``state``, ``reset``. Cold verbs: ``caps``,
``resume_at``, ``settle``, ``discard_pending``, ``trim_pending``, ``tap``, ``target_parts``, ``manifest``,
``memory_parts``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tandem_core.drafter import TargetParts
from tandem_core.engine.base import Capabilities, DraftHead, Manifest, MemoryPart, Trace, TreeOut
from tandem_core.engine.runner import Capture, Rows, Runner, Step, TreeStep
from tandem_core.ops import _tree
from tandem_core.state import ModelState, View

__all__ = ["ContextFull", "SequenceEngine"]


class ContextFull(ValueError):
    """A forward or a verify would hold more tokens than the engine's buffers (``caps.max_context``)."""


class _LiveState(ModelState):
    """The live state over a runner's buffers. A ``restore`` or ``resume`` calls ``on_change``: the engine
    forgets what described the state before (its verified tree and pending tokens)."""

    def __init__(self, sections: dict[str, torch.Tensor], views: dict[str, View],
                 on_change: Callable[[], None]) -> None:
        super().__init__(sections, views, 0)
        self._on_change = on_change

    def restore(self, snap: ModelState, length: int | None = None) -> None:
        super().restore(snap, length)
        self._on_change()

    def resume(self, n: int, sections: Mapping[str, torch.Tensor] | None = None) -> None:
        super().resume(n, sections)
        self._on_change()


class _KV:
    """``kv.length``: the tokens the sequence holds (the live state's length)."""

    __slots__ = ("_state",)

    def __init__(self, state: ModelState) -> None:
        self._state = state

    @property
    def length(self) -> int:
        return self._state.length

    def __repr__(self) -> str:
        return f"KV({self._state.length})"


@dataclass
class _Pending:
    """Tokens committed since the last settle: from ``start`` on; ``kept``, one runner record a commit
    (empty for a runner without sections)."""

    start: int
    kept: list[Any] = field(default_factory=list)
    head: list[torch.Tensor] = field(default_factory=list)   # the MTP head's read rows a commit (with a head)


class SequenceEngine:
    """One sequence over ``runner`` (which it owns); ``name`` names the engine in ``repr`` and errors."""

    def __init__(self, runner: Runner, *, name: str | None = None, head: DraftHead | None = None) -> None:
        spec = runner.spec
        if spec.max_context < 1 or spec.max_tree < 1 or spec.prefill_chunk < 1:
            raise ValueError(f"runner spec: max_context ({spec.max_context}), max_tree ({spec.max_tree}) and "
                             f"prefill_chunk ({spec.prefill_chunk}) must be positive")
        self.runner = runner
        self.name = name or type(runner).__name__
        sections, views = runner.buffers()
        self._runner_recurrent = bool(sections)
        if head is not None:
            sections, views = dict(sections), dict(views)
            own = {**head.sections(), **{k: View(t, axis) for k, (t, axis) in head.views().items()}}
            clash = sorted(set(own) & (set(sections) | set(views)))
            if clash:
                raise ValueError(f"{self.name}: the MTP head's state names {clash} are the runner's too")
            sections.update(head.sections())
            views.update({k: View(t, axis) for k, (t, axis) in head.views().items()})
        self._state = _LiveState(sections, views, self._forget)
        self.kv = _KV(self._state)
        self._recurrent = bool(sections)
        # the sections at the settle point, while tokens are pending
        self._keep: dict[str, torch.Tensor] = {k: torch.empty_like(t) for k, t in sections.items()}
        self._tree: TreeStep | None = None
        self._pending: _Pending | None = None
        self._hidden: list[torch.Tensor] = []
        self._hidden_cat: torch.Tensor | None = None
        self._taps: dict[int, list[torch.Tensor]] = {}
        self.caps = Capabilities(
            tree=True, resume=True, max_context=spec.max_context, max_tree=spec.max_tree,
            hidden_layers=spec.hidden_layers, device=spec.device, dtype=spec.dtype,
            workspace_bytes_per_token=spec.workspace_bytes_per_token, trace=spec.trace,
            prefill_chunk=spec.prefill_chunk, graph_widths=spec.graph_widths, hidden_size=spec.hidden_size,
            mtp=0 if head is None else int(head.layers), mtp_graphs=head is not None and bool(head.graphed))
        self._head = head
        self._tree_ids: torch.Tensor | None = None     # the verified tree's tokens (the head's, at its commit)
        if head is not None:
            self._check_head(head)
            if head.reads is not None:
                self.tap([head.reads])

    def _check_head(self, head: DraftHead) -> None:
        width = self.runner.spec.hidden_size if head.reads is None else None
        if width is not None and head.width != width:
            raise ValueError(f"{self.name}: the MTP head reads rows of {head.width} features, the target's "
                             f"hidden states have {width}")
        if head.reads is not None and head.reads not in self.caps.hidden_layers:
            raise ValueError(f"{self.name}: the MTP head reads layer {head.reads}, which cannot be tapped "
                             f"(caps.hidden_layers: {list(self.caps.hidden_layers)})")
        if head.max_context < self.caps.max_context:
            raise ValueError(f"{self.name}: the MTP head holds {head.max_context} positions, the engine "
                             f"{self.caps.max_context}")

    # -- hot verbs ------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor | Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` ([T] int64); fp32 logits ``[T, V]`` (``all_logits``) or ``[1, V]`` (the last).

        Runs ``caps.prefill_chunk`` rows at a time; one token is a decode step (the row a verify must
        equal). Settles the pending tokens and drops a verified tree first. The returned tensor is new."""
        return self._forward(tokens, all_logits, None)

    def forward_tree(self, tokens: torch.Tensor | Sequence[int],
                     parents: torch.Tensor | Sequence[int]) -> TreeOut:
        """Verify ``tokens`` ([N] int64) as a tree on top of the sequence (``parents[i] < i``, -1 for a child
        of the last committed token; node ``i`` at position ``kv.length + depth(i)``). Returns fp32
        ``logits [N, V]``: row ``i`` equals, bit for bit, the decode step's row after committing the
        path root..i. Nothing committed changes; the tree stays until the next ``forward_tree``,
        ``forward``, ``commit_tree``, ``rollback_to`` or ``discard_pending``. At most ``caps.max_tree``
        nodes."""
        return self._forward_tree(tokens, parents, None)

    def forward_block(self, tokens: torch.Tensor | Sequence[int]) -> TreeOut:
        """Verify a chain (node ``i``'s parent is ``i - 1``)."""
        n = int(torch.as_tensor(tokens).numel())
        return self._forward_tree(tokens, list(range(-1, n - 1)), None)

    @torch.inference_mode()
    def commit_tree(self, path: Sequence[int] | torch.Tensor) -> None:
        """Append the nodes of ``path`` (indices into the last verified tree, root to leaf: the first's
        parent is -1, each next one's parent is the one before) to the sequence: their view rows and the
        recurrent state after the last of them, as decode would leave them. The rest of the tree leaves
        no trace. The appended tokens are pending until ``settle``. An empty path commits nothing;
        either way the tree is used up."""
        tree = self._tree
        if tree is None:
            raise RuntimeError("commit_tree: no verified tree (forward_tree first; forward, discard_pending, "
                               "a commit, a rollback or a state restore drops it)")
        if tree.start != self.kv.length:
            raise RuntimeError(f"commit_tree: the tree was verified on {tree.start} tokens, the sequence now "
                               f"holds {self.kv.length}")
        idx = [int(i) for i in (path.tolist() if isinstance(path, torch.Tensor) else path)]
        for j, i in enumerate(idx):
            if not 0 <= i < tree.count:
                raise ValueError(f"commit_tree: path[{j}] = {i} is not a node of the verified tree "
                                 f"({tree.count} nodes)")
            want = -1 if j == 0 else idx[j - 1]
            if tree.parents[i] != want:
                raise ValueError(f"commit_tree: path[{j}] = node {i} has parent {tree.parents[i]}, not {want} "
                                 f"(a path runs root to leaf)")
        self._tree = None
        if not idx:
            return
        if self._pending is None:
            self._pending = _Pending(tree.start)
            if self._recurrent:
                self._keep_sections()
        kept = self.runner.commit(tree, idx)
        if self._runner_recurrent:
            self._pending.kept.append(kept)
        self._state.length = tree.start + len(idx)
        if self._head is not None and self._tree_ids is not None:
            at = torch.tensor(idx, dtype=torch.long)
            rows = self._head_rows().index_select(0, at.to(self._head_rows().device))
            self._pending.head.append(rows)
            self._head.append(self._tree_ids.index_select(0, at), rows, tree.start, decode_form=True)

    @torch.inference_mode()
    def rollback_to(self, n: int) -> None:
        """Forget every token past ``n``. With recurrent sections only pending tokens can be taken back
        (the sections come back from the settle point and the kept commits are replayed to ``n``); an
        earlier position needs a cache anchor (``state.resume``). Without sections any ``0 <= n``.
        Drops a verified tree."""
        length = self.kv.length
        if not 0 <= n <= length:
            raise ValueError(f"rollback_to({n}): the sequence holds {length} tokens")
        self._tree = None
        if n == length:
            return
        pend = self._pending
        if not self._recurrent:
            self._state.length = int(n)
            if pend is not None and n < pend.start:
                pend.start = int(n)
            return
        first = length if pend is None else pend.start
        if pend is None or n < first:
            raise ValueError(f"rollback_to({n}): only pending tokens can be taken back (positions {first}.."
                             f"{length}, committed since the last settle); an earlier position needs a cache "
                             f"anchor (state.resume)")
        for k, t in self._state.sections.items():
            t.copy_(self._keep[k])
        keep = n - pend.start
        if self._runner_recurrent:
            pend.kept = [self.runner.replay(pend.kept, keep)] if keep else []
        if self._head is not None:
            # the head's rows up to n - 2 were computed from the kept tokens; its section is the row at n - 1
            rows = torch.cat(pend.head)[:keep] if pend.head else None
            pend.head = [rows] if keep and rows is not None else []
            if keep and rows is not None:
                self._head.sections()["mtp.hidden"].copy_(rows[-1:])
        self._state.length = int(n)

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy picks ``[R, V] -> [R]``."""
        return logits.argmax(dim=-1)

    def hidden_post_norm(self) -> torch.Tensor:
        """The last forward's (or verified tree's) hidden states after the final norm, ``[T, H]`` (``[N, H]``
        by node after ``forward_tree``, kept through its commit); valid until the next forward."""
        if self._hidden_cat is None:
            if not self._hidden:
                raise RuntimeError("hidden_post_norm: no forward has run since the last reset")
            self._hidden_cat = self._hidden[0] if len(self._hidden) == 1 else torch.cat(self._hidden)
        return self._hidden_cat

    def hidden_at(self, layer: int) -> torch.Tensor:
        """The last forward's residual rows after ``layer`` (tapped with ``tap``), ``[T, H]``; by node after
        ``forward_tree``. Valid until the next forward."""
        rows = self._taps.get(layer)
        if rows is None:
            raise KeyError(f"hidden_at({layer}): layer {layer} is not tapped (tapped: {sorted(self._taps)})")
        if len(rows) > 1:
            rows[:] = [torch.cat(rows)]
        return rows[0]

    def mtp_head(self) -> DraftHead:
        """The MTP head given at construction (``caps.mtp``); refused, naming the engine, without one."""
        if self._head is None:
            raise RuntimeError(f"mtp_head: {self.name} was built without an MTP head (caps.mtp is 0)")
        return self._head

    def _head_rows(self) -> torch.Tensor:
        """The last call's rows the MTP head reads (``hidden_post_norm`` or its tapped layer's)."""
        assert self._head is not None
        return self.hidden_post_norm() if self._head.reads is None else self.hidden_at(self._head.reads)

    @property
    def state(self) -> ModelState:
        """The live state over the runner's buffers."""
        return self._state

    def reset(self) -> None:
        """Forget the sequence: length 0, sections zero, no tree, nothing pending."""
        self.runner.reset()
        if self._head is not None:
            for t in self._head.sections().values():
                t.zero_()
        self._state.length = 0
        self._hidden, self._hidden_cat = [], None
        self._taps = {k: [] for k in self._taps}
        self._forget()

    # -- cold verbs -----------------------------------------------------------------------------------
    def settle(self) -> None:
        """Make the pending tokens permanent (``trim_pending`` can no longer take them back)."""
        self._pending = None

    def discard_pending(self) -> None:
        """Drop the last verified tree (nothing committed changes)."""
        self._tree = None

    def trim_pending(self, n: int) -> None:
        """Take back the last ``n`` tokens committed since the last ``settle``."""
        count = 0 if self._pending is None else self.kv.length - self._pending.start
        if not 0 <= n <= count:
            raise ValueError(f"trim_pending({n}): {count} tokens are pending (committed since the last settle)")
        self.rollback_to(self.kv.length - n)

    def resume_at(self, n: int, sections: dict[str, torch.Tensor] | None = None) -> None:
        """Take the sequence back to ``n`` tokens whose view rows are already in the buffers (a common
        prefix), with the recurrent ``sections`` after exactly ``n`` tokens (an anchor's; without sections
        ``n`` must be the current length unless the runner has none). Drops the verified tree and the
        pending tokens (``state.resume``, which this is, raises naming a mismatch)."""
        self._state.resume(n, sections)

    def tap(self, layers: Sequence[int]) -> None:
        """Keep the residual rows after ``layers`` of every later forward (``hidden_at``); ``()`` stops.
        Refuses a layer outside ``caps.hidden_layers``, naming it."""
        want = tuple(sorted({int(i) for i in layers}))
        if self._head is not None and self._head.reads is not None:    # the head's layer stays tapped
            want = tuple(sorted({*want, int(self._head.reads)}))
        bad = [i for i in want if i not in self.caps.hidden_layers]
        if bad:
            raise ValueError(f"tap: layers {bad} cannot be tapped on {self.name} "
                             f"(caps.hidden_layers: {list(self.caps.hidden_layers)})")
        self.runner.tap(want)
        self._taps = {i: [] for i in want}

    def target_parts(self) -> TargetParts | None:
        """The runner's input embedding and output head, lent to a drafter (``TargetParts``), or None when the
        runner lends none (its optional ``parts()`` verb)."""
        parts = getattr(self.runner, "parts", None)
        return parts() if callable(parts) else None

    def manifest(self) -> Manifest:
        """The runner's manifest, with this file (it chunks the prefill) and the chunk among the settings."""
        m = self.runner.manifest()
        here = str(Path(inspect.getsourcefile(SequenceEngine) or __file__).resolve())
        return replace(m, files=tuple(sorted({*m.files, here})),
                       settings={**m.settings, "prefill_chunk": self.caps.prefill_chunk})

    def memory_parts(self) -> list[MemoryPart]:
        parts = self.runner.memory_parts()
        if self._head is not None:
            parts += self._head.memory_parts()
        if self._keep:
            parts.append(MemoryPart("pending.sections", sum(t.numel() * t.element_size()
                                                            for t in self._keep.values()), self.caps.device))
        return parts

    # -- diagnostics (tandem_core.spec.selfcheck.LayerTrace) -------------------------------------------
    def trace_forward(self, tokens: torch.Tensor | Sequence[int]) -> Trace:
        """``forward(tokens, all_logits=True)`` that also returns the hidden rows at every capture point
        (the sequence advances as by ``forward``)."""
        capture = self._capture("trace_forward")
        logits = self._forward(tokens, True, capture)
        return _trace(capture, logits)

    def trace_tree(self, tokens: torch.Tensor | Sequence[int],
                   parents: torch.Tensor | Sequence[int]) -> Trace:
        """``forward_tree`` that also returns the hidden rows at every capture point (the tree is left
        verified as by ``forward_tree``)."""
        capture = self._capture("trace_tree")
        out = self._forward_tree(tokens, parents, capture)
        return _trace(capture, out.logits)

    # -- the forms ------------------------------------------------------------------------------------
    def _capture(self, verb: str) -> Capture:
        if not self.caps.trace:
            raise RuntimeError(f"{verb}: {self.name} keeps no per-layer rows (caps.trace is off)")
        return []

    def _ids(self, tokens: torch.Tensor | Sequence[int], verb: str) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if ids.device.type != "cpu":
            ids = ids.cpu()
        if ids.numel() == 0:
            raise ValueError(f"{verb}: no tokens")
        lo, hi = (int(t) for t in torch.aminmax(ids))
        vocab = self.runner.spec.vocab_size
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{verb}: token id {lo if lo < 0 else hi} is outside the vocabulary (size {vocab})")
        return ids

    def _keep_sections(self) -> None:
        """Copy the sections at the settle point into the keep buffers."""
        for k, t in self._state.sections.items():
            self._keep[k].copy_(t)

    def _got(self, rows: Rows) -> None:
        """A call's rows: the hidden rows (and taps) the engine hands out until the next forward."""
        self._hidden.append(rows.hidden)
        for layer, t in rows.taps.items():
            self._taps.setdefault(layer, []).append(t)

    def _clear_rows(self) -> None:
        self._hidden, self._hidden_cat = [], None
        self._taps = {k: [] for k in self._taps}

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor | Sequence[int], all_logits: bool,
                 capture: Capture | None) -> torch.Tensor:
        ids = self._ids(tokens, "forward")
        T, n = int(ids.numel()), self.kv.length
        if n + T > self.caps.max_context:
            raise ContextFull(f"forward: {n} tokens held + {T} new exceed the engine's context of "
                              f"{self.caps.max_context}")
        self.settle()
        self._tree = None
        self._clear_rows()
        logits: list[torch.Tensor] = []
        chunk = self.caps.prefill_chunk
        for s in range(0, T, chunk):
            piece = ids[s:s + chunk]
            step = Step(self.kv.length, int(piece.numel()))
            if step.count == 1:
                rows = self.runner.decode(piece, step, capture=capture)
            else:
                want = "all" if all_logits else ("last" if s + chunk >= T else "none")
                rows = self.runner.prefill(piece, step, logits=want, capture=capture)
            self._state.length = step.end
            self._got(rows)
            if self._head is not None:
                head_rows = rows.hidden if self._head.reads is None else rows.taps[self._head.reads]
                self._head.append(piece, head_rows, step.start)       # ids on the host, rows on the device
            if rows.logits is not None and (all_logits or s + chunk >= T):
                logits.append(rows.logits if all_logits else rows.logits[-1:])
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    @torch.inference_mode()
    def _forward_tree(self, tokens: torch.Tensor | Sequence[int], parents: torch.Tensor | Sequence[int],
                      capture: Capture | None) -> TreeOut:
        ids = self._ids(tokens, "forward_tree")
        N = int(ids.numel())
        par = _tree.as_parents(parents)
        if len(par) != N:
            raise ValueError(f"forward_tree: {N} tokens but {len(par)} parents")
        if N > self.caps.max_tree:
            raise ValueError(f"forward_tree: {N} nodes exceed max_tree {self.caps.max_tree} (caps.max_tree)")
        depth = _tree.depths(par)
        n = self.kv.length
        if n + max(depth) + 1 > self.caps.max_context:
            raise ContextFull(f"forward_tree: {n} tokens held + a path of {max(depth) + 1} exceed the engine's "
                              f"context of {self.caps.max_context}")
        self._tree = None
        self._tree_ids = ids
        step = TreeStep(n, tuple(par), tuple(depth), tuple(_tree.preorder(par)))
        rows = self.runner.verify(ids, step, capture=capture)
        self._clear_rows()
        self._got(rows)
        self._tree = step
        assert rows.logits is not None
        return TreeOut(rows.logits)

    def _forget(self) -> None:
        self._tree = None
        self._pending = None

    def __repr__(self) -> str:
        c = self.caps
        return f"SequenceEngine({self.name}, {c.dtype}, {c.device}, {self.kv.length}/{c.max_context} tokens)"


def _trace(capture: Capture, logits: torch.Tensor) -> Trace:
    """Capture points (one entry a prefill chunk) as a ``Trace``: rows by point, chunks concatenated."""
    names: list[str] = []
    rows: dict[str, list[torch.Tensor]] = {}
    for name, t in capture:
        if name not in rows:
            names.append(name)
            rows[name] = []
        rows[name].append(t)
    return Trace(tuple(names), tuple(torch.cat(rows[n]) for n in names), logits)
