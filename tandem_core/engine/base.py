"""The engine contract: the hot verbs the decode loop calls and the cold verbs the server and caches call.

An engine holds one sequence (batch 1): its tokens' KV rows and recurrent state
live in buffers the engine owns. What an engine can do beyond the base verbs is
said by its ``caps`` (a frozen ``Capabilities`` record), never by probing it.

Protocols here are split by capability:

- ``Engine``: every engine. ``forward`` appends tokens to the sequence and
  returns their logits; ``state`` is the live ``ModelState``; ``reset`` empties.
- ``TreeEngine`` (``caps.tree``): speculation verbs. ``forward_tree`` verifies a
  token tree on top of the sequence without committing; ``commit_tree(path)``
  keeps one root-to-leaf path; ``rollback_to(n)`` forgets tokens past ``n``.
- ``ResumableEngine`` (``caps.resume``): ``resume_at(n, sections)`` for the caches.
- ``MTPEngine`` (``caps.mtp``): a tree engine whose checkpoint ships a multi-token-prediction head.
  ``mtp_head()`` is the head (a ``DraftHead``: the family's arithmetic over its own KV rows). The engine
  keeps the head's rows true for the sequence itself: every forward and commit hands the head the rows it
  reads of the appended tokens (``DraftHead.append``, from that call's own rows: never another target
  pass), and the head's rows are sections and views of the engine's state (``DraftHead.sections`` /
  ``views``), so every cache tier saves and restores them with the target's. The shared MTP drafter
  (``tandem_drafters.mtp``) only launches drafts (``DraftHead.launch``).

``supports_tree(engine)``, ``supports_resume(engine)`` and ``supports_mtp(engine)`` read the flags and
narrow the type (``TypeIs``), so a caller needs neither ``hasattr`` nor a ``# type: ignore``. Every
engine built on the core's ``SequenceEngine`` (``tandem_core.engine.sequence``) offers the first two;
it offers the third when it was given a head.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

from typing_extensions import TypeIs

import torch

from tandem_core.state import ModelState

__all__ = [
    "Capabilities", "MemoryPart", "Manifest", "Engine", "TreeEngine", "ResumableEngine", "KVInfo",
    "TreeOut", "Trace", "restore_state", "supports_tree", "supports_resume", "source_files", "op_paths",
    "tensor_bytes", "DraftHead", "HeadRows", "MTPEngine", "supports_mtp", "head_append", "head_launch",
]


@dataclass(frozen=True)
class Capabilities:
    """What an engine offers beyond the base verbs. Read it; never ``hasattr`` an engine."""

    tree: bool = False          # forward_tree / forward_block / commit_tree / rollback_to
    resume: bool = False        # resume_at (the caches' verb)
    max_context: int = 0        # the most tokens its buffers hold
    max_tree: int = 0           # the widest tree forward_tree verifies in one call
    hidden_layers: tuple[int, ...] = ()  # layers whose hidden states a drafter may read
    device: str = "cpu"
    dtype: str = "fp32"
    workspace_bytes_per_token: int = 0  # prefill scratch per row it runs (for the memory gate); 0: generic
    trace: bool = False         # trace_forward / trace_tree: per-layer rows (spec.selfcheck.LayerTrace)
    prefill_chunk: int = 0      # rows a long forward runs at a time, counted from the call's first token;
                                # forwards split at multiples of it give the same bits (0: not said)
    graph_widths: tuple[int, ...] = ()  # verify widths captured as CUDA graphs (decode is width 1); (): eager
    hidden_size: int = 0        # the width of the hidden rows (a drafter's taps); 0: not said
    mtp: int = 0                # decoder layers of the MTP head ``mtp_head()`` offers (0: no head)
    mtp_graphs: bool = False    # the head's draft steps run as CUDA graphs (``DraftHead.graphed``)


def source_files(*things: Any) -> set[str]:
    """The resolved source file of each module, class or function (for a ``Manifest``'s files)."""
    import inspect

    return {str(Path(inspect.getsourcefile(t) or "").resolve()) for t in things}


def op_paths(ops: Any) -> dict[str, str]:
    """``{op name: "module:qualname"}`` of a runner's resolved ops (for a ``Manifest``'s extra)."""
    return {n: f"{fn.__module__}:{fn.__qualname__}" for n, fn in sorted(ops.items())}


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


class MemoryPart(NamedTuple):
    """One part of an engine's memory: ``name``, bytes, and where it lives."""

    name: str
    nbytes: int
    device: str


@dataclass(frozen=True)
class Manifest:
    """What computed an engine's rows: the files, the settings that change arithmetic, and anything else.

    ``fingerprint()`` hashes the files' bytes, the settings and the extras; a cache
    row written under one fingerprint is never read under another.
    """

    files: tuple[str, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in sorted(self.files):
            p = Path(f)
            h.update(p.name.encode())
            h.update(p.read_bytes())
        h.update(json.dumps(self.settings, sort_keys=True, default=str).encode())
        h.update(json.dumps(self.extra, sort_keys=True, default=str).encode())
        return h.hexdigest()


class KVInfo(Protocol):
    @property
    def length(self) -> int:
        """Tokens the sequence holds (committed)."""
        ...


@runtime_checkable
class Engine(Protocol):
    """The base verbs every engine has."""

    caps: Capabilities
    kv: KVInfo

    def forward(self, tokens: torch.Tensor | Sequence[int], *, all_logits: bool = False) -> torch.Tensor:
        """Append ``tokens`` ([T] int64) to the sequence; return logits ``[T, V]`` (all) or ``[1, V]`` (last).

        Long inputs run in prefill chunks; the result equals one full forward.
        The returned tensor is new (the caller owns it).
        """
        ...

    def picks(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's own greedy picks: ``argmax`` over the last axis, ``[R, V] -> [R]``."""
        ...

    def hidden_post_norm(self) -> torch.Tensor:
        """The last forward's hidden states after the final norm, ``[T, H]`` (valid until the next forward)."""
        ...

    @property
    def state(self) -> ModelState:
        """The live state over the engine's own buffers (restore into it lands in place)."""
        ...

    def reset(self) -> None:
        """Forget the sequence: length 0, recurrent state zero."""
        ...

    def manifest(self) -> Manifest:
        ...

    def memory_parts(self) -> list[MemoryPart]:
        ...


class Trace(NamedTuple):
    """Hidden rows at an engine's capture points, in forward order (``"layer 3 mlp"``, ...): what the
    self-check's ``LayerTrace`` verbs return to name the layer of a difference."""

    points: tuple[str, ...]
    rows: tuple[torch.Tensor, ...]    # rows[j]: [T, H] at points[j]
    logits: torch.Tensor              # [T, V]


class TreeOut(NamedTuple):
    """A verified tree: ``logits[i]`` is the model's next-token distribution after node ``i``
    (on the path root..i). The tensor is new; the caller owns it."""

    logits: torch.Tensor  # [N, V]


@runtime_checkable
class TreeEngine(Engine, Protocol):
    """Speculation verbs (``caps.tree``). Row invariance: ``logits[i]`` of a verified node equals, bit for
    bit, the row plain decode computes at that position after committing the same path.

    Lifecycle of a round: ``forward_tree`` (pending tree, nothing committed) -> ``commit_tree(path)``
    (the path's rows and recurrent state become the sequence's next tokens; the rest of the tree is
    dropped) -> tokens may still be taken back with ``trim_pending`` until ``settle()``.
    """

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor) -> TreeOut:
        """Verify ``tokens`` ([N] int64) as a tree on top of the sequence. ``parents[i] < i`` is the
        parent's index, ``-1`` for a child of the last committed token. Node ``i`` sits at position
        ``kv.length + depth(i)``. Leaves the committed sequence unchanged; a later ``forward_tree`` or
        ``discard_pending`` drops this tree. Refuses more than ``caps.max_tree`` nodes."""
        ...

    def forward_block(self, tokens: torch.Tensor) -> TreeOut:
        """Verify a chain (node ``i``'s parent is ``i - 1``): ``forward_tree`` with those parents."""
        ...

    def commit_tree(self, path: Sequence[int]) -> None:
        """Append the nodes of ``path`` (indices into the last verified tree, root to leaf: the first's
        parent is -1, each next one's parent is the one before) to the sequence: their KV rows and the
        recurrent state after the last of them. A rejected branch leaves no trace."""
        ...

    def rollback_to(self, n: int) -> None:
        """Forget every token past ``n``. An engine with recurrent state can go back only within the
        pending tokens (those committed since the last ``settle``); earlier positions need a cache
        anchor (``state.resume``). Raises ``ValueError`` naming the limit otherwise."""
        ...

    def discard_pending(self) -> None:
        """Drop the last verified tree (nothing committed changes)."""
        ...

    def trim_pending(self, n: int) -> None:
        """Take back the last ``n`` tokens committed since the last ``settle`` (a stop string inside the
        accepted tokens, say)."""
        ...

    def settle(self) -> None:
        """Make the pending tokens permanent and free what was kept to take them back."""
        ...


@runtime_checkable
class ResumableEngine(Engine, Protocol):
    """Cache verbs (``caps.resume``)."""

    def resume_at(self, n: int, sections: dict[str, torch.Tensor] | None = None) -> None:
        """Take the sequence back to ``n`` tokens whose views are already in the buffers (a common
        prefix), with the recurrent ``sections`` after exactly ``n`` tokens (an anchor's)."""
        ...


class HeadRows(NamedTuple):
    """What one ``DraftHead.run`` computed for rows ``start .. start + T - 1``."""

    carry: torch.Tensor           # [T, D] what the next depth reads in place of the target's rows
    logits: torch.Tensor | None   # fp32 [T, V] the guess at the token two past each row's (None: not asked)


@runtime_checkable
class DraftHead(Protocol):
    """A checkpoint's multi-token-prediction head: the family's arithmetic, over its own KV rows.

    Row ``i`` reads ``(x_{i+1}, h_i)``: the token after position ``i`` and the target's row at ``i``
    (``reads``: None for the hidden state after the final norm, ``Rows.hidden``; a layer index for that
    layer's tapped rows, ``Rows.taps``); its logits are the head's guess at ``x_{i+2}``. A deeper draft
    step feeds a row's ``carry`` and its guessed token back at ``i + 1``.

    Its state, for a sequence of ``n`` tokens: its KV rows ``0 .. n - 2`` (``views``: tensor and token
    axis, ``max_context`` positions; row ``n - 1`` waits for ``x_n``) and the target's row at ``n - 1``
    (``sections``: ``mtp.hidden [1, D]``, what row ``n - 1`` will read). The engine keeps both true
    (``append`` after every forward and commit) and makes them part of its ``ModelState``, so a restore
    from any cache tier brings them back with the target's rows. ``launch`` drafts from that state; the
    rows it writes past ``n - 1`` are scratch (the next ``append`` rewrites them).
    """

    layers: int                 # decoder layers; draft depth k runs layer k % layers
    reads: int | None           # None: the target's hidden after the final norm; else the tapped layer
    width: int                  # D, the features of a row it reads
    max_context: int
    graphed: bool               # launch (and a short append) replays CUDA graphs (``caps.mtp_graphs``)

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int, *, layer: int = 0,
            logits: bool = True) -> HeadRows:
        """``tokens [T]`` (each row's next token) and ``hidden [T, D]`` at positions ``start ..``; ``logits``
        False: the rows only (a capture that only fills the head's KV rows skips the output head). The
        reference form; writes the head's KV rows there."""
        ...

    def append(self, tokens: torch.Tensor, rows: torch.Tensor, start: int, *, decode_form: bool = False) -> None:
        """The sequence appended ``tokens [T]`` at positions ``start ..`` whose target rows are ``rows [T, D]``:
        the head's rows ``start - 1 .. start + T - 2`` (the first reads ``mtp.hidden``; none when ``start``
        is 0), then ``mtp.hidden`` <- ``rows[-1]``. ``decode_form``: each row as a one-row step would compute
        it (a commit's rows then equal plain decoding's bit for bit, as the self-check compares them)."""
        ...

    def launch(self, token: int, position: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``depth`` chained draft steps for a sequence of ``position + 1`` tokens whose pending token is
        ``token``: depth 0 is row ``position`` (``token`` and ``mtp.hidden``), depth ``k`` reads depth
        ``k - 1``'s top token and carry at ``position + k``. Returns the top two tokens ``[depth, 2]`` int64
        and their probabilities ``[depth, 2]`` fp32 on the head's device, launched, not waited for (valid
        until the next launch)."""
        ...

    def sections(self) -> dict[str, torch.Tensor]:
        """The head's sections: ``mtp.hidden [1, D]``, the target's row at the sequence's last position."""
        ...

    def views(self) -> dict[str, tuple[torch.Tensor, int]]:
        """The head's own rows: name -> (tensor, token axis)."""
        ...

    def memory_parts(self) -> list[MemoryPart]:
        ...


def head_append(head: DraftHead, tokens: torch.Tensor, rows: torch.Tensor, start: int, chunk: int = 512,
                decode_form: bool = False) -> None:
    """``DraftHead.append`` over the head's reference ``run`` (``chunk`` rows a call, one with ``decode_form``;
    ``logits`` off)."""
    hidden = head.sections()["mtp.hidden"]
    T = int(tokens.numel())
    if T == 0:
        return
    rows = rows.to(hidden.dtype)
    if start > 0:
        at, src = start - 1, torch.cat([hidden, rows[:-1]])                 # row start-1 reads the section
        ids = tokens
    else:
        at, src, ids = 0, rows[:-1], tokens[1:]
    step = 1 if decode_form else chunk
    for s in range(0, int(ids.numel()), step):
        head.run(ids[s:s + step], src[s:s + step], at + s, logits=False)
    hidden.copy_(rows[-1:])


def head_launch(head: DraftHead, token: int, position: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``DraftHead.launch`` over the head's reference ``run``: one call a depth, the top two by softmax."""
    hidden = head.sections()["mtp.hidden"]
    tok = torch.tensor([int(token)], dtype=torch.long, device=hidden.device)
    carry = hidden
    tokens, probs = [], []
    for k in range(depth):
        out = head.run(tok, carry, position + k, layer=k % max(1, int(head.layers)))
        assert out.logits is not None
        top = torch.softmax(out.logits[-1].float(), dim=-1).topk(2)
        tokens.append(top.indices)
        probs.append(top.values)
        tok, carry = top.indices[:1], out.carry[-1:]
    return torch.stack(tokens), torch.stack(probs)


@runtime_checkable
class MTPEngine(TreeEngine, Protocol):
    """A tree engine with an MTP head (``caps.mtp``), whose rows it keeps true for its sequence."""

    def mtp_head(self) -> DraftHead:
        """The head (one per engine: its rows follow this engine's sequence)."""
        ...


def supports_mtp(engine: Engine) -> TypeIs[MTPEngine]:
    """Whether ``engine`` offers an MTP head (``caps.mtp``) with the tree verbs a drafter's proposals need."""
    return engine.caps.tree and engine.caps.mtp > 0


def supports_tree(engine: Engine) -> TypeIs[TreeEngine]:
    """Whether ``engine`` has the speculation verbs (``caps.tree``)."""
    return engine.caps.tree


def supports_resume(engine: Engine) -> TypeIs[ResumableEngine]:
    """Whether ``engine`` has the cache verb ``resume_at`` (``caps.resume``)."""
    return engine.caps.resume


def restore_state(engine: Engine, snap: ModelState, length: int | None = None) -> None:
    """Copy ``snap`` into ``engine``'s own buffers (``state.restore``; ``length``: the sequence's length
    afterwards when the rows past ``snap.length`` still hold it) and tell an engine that resumes
    (``caps.resume``) that its sequence is that long again, which drops any verified tree or pending tokens."""
    if length is None:
        engine.state.restore(snap)
    else:
        engine.state.restore(snap, length)
    if supports_resume(engine):
        engine.resume_at(engine.state.length)
