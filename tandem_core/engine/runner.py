"""The runner contract: a model's arithmetic over one sequence's buffers, and nothing else.

The core's ``SequenceEngine`` (``tandem_core.engine.sequence``) owns the sequence: its length,
the verified tree, the tokens pending since the last settle, input checks, prefill chunking,
traces. A model plugin supplies a ``Runner``: prefill rows, decode a token, verify a tree,
commit a path into the state, redo kept commits, and say what computed its rows. A family may
ship several runners (a plain-torch reference that runs anywhere, a CUDA graph runner), chosen at
load by the device; the engine never asks which one it holds.

Who owns what:

- The runner allocates its buffers once (``buffers()``: the recurrent ``sections`` and the
  token-axis ``views``) and reads and writes them in place; the engine's live ``ModelState`` wraps
  exactly these tensors, so a cache restore lands where the runner (and any graph it captured)
  reads them. The engine keeps ``length``; a runner is told where each call starts (``Step.start``,
  ``TreeStep.start``) and keeps no length of its own that could disagree.
- ``Rows.logits`` is a new fp32 tensor (the caller owns it); ``Rows.hidden`` and ``Rows.taps`` may
  be views of the runner's own buffers, valid until its next call.
- Row invariance: ``decode`` and ``verify`` compute every row with the same ops in the same
  order, so a verified node's row equals, bit for bit, the row ``decode`` computes at that
  position after the path root..node is committed. ``prefill`` is batched and need not be.

The engine calls, for a sequence of ``n`` committed tokens:

    prefill(ids, Step(n, T), logits=..., capture=...)   T >= 2 tokens appended (one chunk)
    decode(ids, Step(n, 1), capture=...)                one token appended
    verify(ids, TreeStep(n, ...), capture=...)          nothing appended; the runner keeps what
                                                         commit needs until its next call
    commit(tree, path)                                  the path's nodes appended at tree.start
    replay(kept, m)                                     sections (put back by the engine to the
                                                         settle point) advanced along m kept tokens
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Iterator, Literal, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from tandem_core.engine.base import Manifest, MemoryPart
from tandem_core.state import View

__all__ = ["Step", "TreeStep", "Rows", "RunnerSpec", "Runner", "Capture", "LogitRows", "widths_up_to"]

Capture = list[tuple[str, torch.Tensor]]
"""(point name, hidden rows ``[T, H]``) in forward order, appended after every layer's mixer and
feed-forward and after the final norm (``"layer 3 attention mixer"``, ``"layer 3 mlp"``, ``"final
norm"``): the self-check names the layer and row where a verify differs from decode by them. A
prefill split in chunks appends one entry a point per chunk."""

LogitRows = Literal["all", "last", "none"]


@dataclass(frozen=True)
class Step:
    """Rows appended by one ``prefill`` or ``decode`` call: positions ``start .. start + count - 1``."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[count]`` int64 positions."""
        return torch.arange(self.start, self.end, device=device)


@dataclass(frozen=True)
class TreeStep:
    """A tree verified on top of ``start`` committed tokens: node ``i``'s parent is ``parents[i] < i``
    (-1: a child of the last committed token), it sits at position ``start + depth[i]``; ``order`` is
    the depth-first preorder (children in index order: when node ``i`` is visited, the last node
    visited at each shallower depth is its ancestor there)."""

    start: int
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    order: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.parents)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[count]`` int64 positions."""
        return torch.tensor(self.depth, dtype=torch.long, device=device) + self.start


class Rows(NamedTuple):
    """What one call computed.

    hidden  ``[T, H]`` the rows after the final norm (by node for a verify)
    logits  fp32 ``[T, V]`` (``"all"``; every ``decode`` and ``verify``), ``[1, V]`` (``"last"``), or
            None (``"none"``)
    taps    layer -> ``[T, H]``: the residual stream after that layer, for the layers the engine asked
            to tap (``Runner.tap``); empty when none were asked
    """

    hidden: torch.Tensor
    logits: torch.Tensor | None
    taps: dict[int, torch.Tensor]


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner is, for the engine's checks and ``Capabilities``.

    vocab_size     ids in ``[0, vocab_size)`` are accepted
    max_context    the most tokens the buffers hold
    max_tree       the widest tree one ``verify`` takes
    prefill_chunk  rows a ``prefill`` call takes at most; a prefill split at its multiples (counted
                   from the forward's first token) gives the same bits
    device, dtype  where and in what the rows are computed (``"cuda"``, ``"bf16"``)
    trace          ``capture`` is honoured (the self-check's per-layer rows)
    hidden_layers  layers ``tap`` may name (a drafter reads their rows)
    workspace_bytes_per_token  prefill scratch per row (the memory gate's estimate); 0: generic
    graph_widths   the verify widths captured as CUDA graphs (``()``: the runner runs eagerly)
    """

    vocab_size: int
    hidden_size: int
    max_context: int
    max_tree: int
    prefill_chunk: int
    device: str = "cpu"
    dtype: str = "fp32"
    trace: bool = False
    hidden_layers: tuple[int, ...] = ()
    workspace_bytes_per_token: int = 0
    graph_widths: tuple[int, ...] = ()


@runtime_checkable
class Runner(Protocol):
    """A model's arithmetic for one sequence (batch 1). See the module docstring for ownership."""

    spec: RunnerSpec

    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
        """The live state's tensors, allocated once: ``sections`` (recurrent state after the last
        committed token, copied whole) and ``views`` (token-axis buffers, ``[0, length)`` the sequence).
        Called once, by the engine; the same tensors every time."""
        ...

    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        """Append ``ids`` (``[T]`` int64 on the CPU, ``T == step.count >= 2``) at ``step.start``: write
        the views' rows, advance the sections. Batched arithmetic. ``logits="last"``: the last row's,
        computed as ``decode`` computes a row's."""
        ...

    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        """Append one token (``ids: [1]``) at ``step.start``: the row-invariant form ``verify`` equals."""
        ...

    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        """Verify ``ids`` (``[N]``, ``N == tree.count <= spec.max_tree``) as ``tree`` on top of
        ``tree.start`` committed tokens. Nothing committed changes (view rows past ``tree.start`` may be
        used as scratch). Each node is computed from its parent's recurrent state and over its own
        ancestors; row ``i`` equals the decode row after committing path root..i, bit for bit. Keeps
        what ``commit`` needs until the runner's next call."""
        ...

    def commit(self, tree: TreeStep, path: Sequence[int]) -> Any:
        """Append the nodes ``path`` (root to leaf, non-empty, checked by the engine) of the tree last
        verified to the state at ``tree.start``: their view rows, and the sections as decode would leave
        them after those tokens, bit for bit. Returns a record from which ``replay`` can redo it (None
        for a runner without sections)."""
        ...

    def replay(self, kept: Sequence[Any], n: int) -> Any:
        """The engine has put the sections back to what they were before the first of ``kept`` (the
        records of consecutive commits); advance them along the first ``n >= 1`` tokens of those
        records, bit for bit as the commits did. Returns the record of those ``n`` tokens."""
        ...

    def tap(self, layers: tuple[int, ...]) -> None:
        """From now on return the residual rows after ``layers`` (a subset of ``spec.hidden_layers``) in
        ``Rows.taps``; ``()`` stops."""
        ...

    def reset(self) -> None:
        """Zero the sections (the engine sets the length to 0)."""
        ...

    # optional: ``parts() -> tandem_core.drafter.TargetParts``, the input embedding and output head lent to a
    # drafter that reads them (the engine's ``target_parts``); a runner without it lends none

    def manifest(self) -> Manifest:
        """What computes the rows: source files, the settings that change arithmetic, a weights identity."""
        ...

    def memory_parts(self) -> list[MemoryPart]:
        """Every buffer and weight the runner holds, by part and device."""
        ...


def widths_up_to(widths: Sequence[int], max_tree: int) -> tuple[int, ...]:
    """The verify widths a graph runner captures for trees of up to ``max_tree`` nodes: ``widths`` (ascending)
    up to the first that holds ``max_tree`` (all of them when none does)."""
    out = []
    for w in widths:
        out.append(int(w))
        if w >= max_tree:
            break
    return tuple(out)


@contextlib.contextmanager
def graph_capture(graph: Any, stream: Any, **kw: Any) -> Iterator[None]:
    """``torch.cuda.graph(graph, stream=stream, **kw)`` with Python's garbage collector collected first and held
    off until the capture ends. A collection during a capture can free an earlier engine's ``CUDAGraph`` (or
    anything holding device memory), and its ``cudaGraphExecDestroy`` on the capturing thread invalidates the
    capture ("operation not permitted when stream is capturing"): every graph runner captures through this."""
    import torch

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, stream=stream, **kw):
            yield
    finally:
        if was:
            gc.enable()
