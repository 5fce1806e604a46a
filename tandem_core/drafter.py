"""The drafter contract: what a drafter reads of the target, what it proposes, and the load-time check.

A drafter guesses the target's next tokens so that one verify forward can
accept several at once. It never decides anything: the target's own picks do
(``tandem_core.spec.walk``), so a wrong guess costs time, never correctness.

The life of a drafter, for one sequence::

    d = build_drafter("lookup", target)        # construct, then check_target(...) refuses a mismatch
    d.begin(prompt_ids)                         # the sequence is now exactly prompt_ids
    while generating:
        p = d.propose(context_ids, max_nodes)   # a chain or tree continuing context_ids[-1]
        ...verify, walk, commit...
        d.accepted(tokens)                      # these tokens were appended to the sequence
    d.reset()                                   # forget the sequence (and, for lookup, the session)

``context_ids`` is the sequence ``begin`` + every ``accepted`` so far, possibly
followed by tokens the loop holds but has not committed yet (the model's own
token from the last round, whose KV row the next verify computes). A drafter
may treat that tail as provisional.

Construction convention: a registered drafter (``tandem_drafters`` hook,
``register(name, "module:Class")``) is built as ``Class(target=TargetInfo, **options)``;
``build_drafter`` does that and then runs ``check_target``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Drafter",
    "DrafterMismatch",
    "Proposal",
    "ReadsHidden",
    "Requirements",
    "TargetInfo",
    "TargetParts",
    "build_drafter",
    "check_target",
]


class DrafterMismatch(ValueError):
    """A drafter needs something of the target that the target does not offer (the message names both)."""


@dataclass(frozen=True)
class Requirements:
    """What a drafter reads of the target.

    hidden_layers  layers whose hidden states it reads (indices into the target's layers)
    embedding      it reads the target's input embedding
    head           it reads the target's output head (lm_head)
    tokenizer      the sha256 fingerprint of the tokenizer its token ids mean, or None (any tokenizer)
    vocab_size     the vocabulary its own head or tables assume, or None (any)
    hidden_size    the width of the hidden rows it reads (and of the embedding and head), or None (any)
    mtp            it drives the target's own MTP head (``tandem_core.engine.base.MTPEngine``)
    """

    hidden_layers: tuple[int, ...] = ()
    embedding: bool = False
    head: bool = False
    tokenizer: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    mtp: bool = False


@dataclass(frozen=True)
class TargetParts:
    """The target's own input embedding and output head, lent read-only to a drafter (shared, never copied).

    embed   ``ids [T] int64 -> [T, H]`` rows of the input embedding, in ``dtype`` on ``device``
    head    ``h [T, H] -> [T, V]`` fp32 logits of the output head
    """

    embed: Callable[[Any], Any]
    head: Callable[[Any], Any]
    device: str = "cpu"
    dtype: Any = None


@dataclass(frozen=True)
class TargetInfo:
    """What a target offers a drafter. ``name`` is the model's id (messages, and where a drafter looks for the
    files shipped beside the model); ``parts`` the embedding and head themselves, when the engine lends them;
    ``mtp`` the decoder layers of its MTP head (0: none); ``engine`` the engine the drafter drafts for, when it
    is built for one (the MTP drafter drives that engine's own head)."""

    hidden_layers: tuple[int, ...] = ()
    embedding: bool = False
    head: bool = False
    tokenizer: str | None = None
    vocab_size: int = 0
    name: str = ""
    hidden_size: int = 0
    parts: TargetParts | None = field(default=None, compare=False, repr=False)
    mtp: int = 0
    engine: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, caps: Any, *, tokenizer: str | None, vocab_size: int, embedding: bool = True,
           head: bool = True, name: str = "", hidden_size: int = 0,
           parts: TargetParts | None = None, engine: Any = None) -> TargetInfo:
        """From an engine's ``Capabilities`` (its ``hidden_layers``, its MTP head) and the served tokenizer;
        ``engine``: the engine itself, for a drafter built for it."""
        return cls(tuple(caps.hidden_layers), embedding, head, tokenizer, int(vocab_size), name,
                   int(hidden_size), parts, int(caps.mtp), engine)

    @classmethod
    def of_engine(cls, engine: Any, *, tokenizer: str | None, vocab_size: int, name: str = "") -> TargetInfo:
        """From an engine: its taps and hidden size (``caps``) and the embedding and head it lends
        (``target_parts``; an engine that lends none offers neither)."""
        lend = getattr(engine, "target_parts", None)
        parts = lend() if callable(lend) else None
        return cls.of(engine.caps, tokenizer=tokenizer, vocab_size=vocab_size, embedding=parts is not None,
                      head=parts is not None, name=name, hidden_size=int(getattr(engine.caps, "hidden_size", 0)),
                      parts=parts, engine=engine)


@dataclass(frozen=True)
class Proposal:
    """A drafter's guess: a chain or a tree of tokens continuing the context's last token.

    tokens   [N] token ids
    parents  [N] parent node index, ``parents[i] < i``; -1: a child of the context's last token
    probs    [N] the drafter's probability of ``tokens[i]`` given the path to its parent
             (conditional, in [0, 1]; the tree multiplies them into path probabilities)
    source   the drafter's name (calibration keeps one curve a source)

    Nodes come parents first (a topological order). A chain has ``parents == (-1, 0, 1, ...)``.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or len(self.probs) != n:
            raise ValueError(f"proposal from {self.source!r}: tokens, parents and probs differ in length "
                             f"({n}, {len(self.parents)}, {len(self.probs)})")
        if n and (min(self.parents) < -1 or any(map(int.__ge__, self.parents, range(n)))):
            i = next(i for i, par in enumerate(self.parents) if not -1 <= par < i)
            raise ValueError(f"proposal from {self.source!r}: node {i} has parent {self.parents[i]} "
                             f"(need -1 <= parent < {i})")
        if n and not (min(self.probs) >= 0.0 and max(self.probs) <= 1.0) or any(map(math.isnan, self.probs)):
            i = next(i for i, p in enumerate(self.probs) if not 0.0 <= p <= 1.0)
            raise ValueError(f"proposal from {self.source!r}: node {i} has probability {self.probs[i]} "
                             "outside [0, 1]")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: Sequence[float], source: str) -> Proposal:
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)),
                   tuple(float(p) for p in probs), source)

    @classmethod
    def empty(cls, source: str) -> Proposal:
        return cls((), (), (), source)


@runtime_checkable
class Drafter(Protocol):
    """A drafter for one sequence at a time. See the module docstring for the call order.

    Calls come from the decode loop's thread only; a drafter needs no locks.
    ``propose`` must be fast (it runs every round, before the verify) and must
    not mutate what ``begin``/``accepted`` built beyond caching.
    """

    name: str

    def requires(self) -> Requirements:
        """What it reads of the target (checked at load by ``check_target``)."""
        ...

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new sequence starts: it is exactly ``prompt_ids``."""
        ...

    def propose(self, context_ids: Sequence[int], max_nodes: int) -> Proposal:
        """At most ``max_nodes`` nodes continuing ``context_ids[-1]`` (an empty proposal is fine)."""
        ...

    def accepted(self, tokens: Sequence[int]) -> None:
        """``tokens`` were appended to the sequence (the accepted path and the model's own token)."""
        ...

    def reset(self) -> None:
        """Forget everything learnt from sequences (not the construction options)."""
        ...


@runtime_checkable
class ReadsHidden(Protocol):
    """A drafter that reads the target's hidden rows (``Requirements.hidden_layers``). The loop taps those layers
    on the engine and hands every row the target computes for the sequence, inside the forwards it runs anyway
    (the prefill, each decode step, each verify's accepted path): no extra target pass."""

    def hidden(self, start: int, tokens: Sequence[int], rows: Mapping[int, Any]) -> None:
        """The target's residual rows after each required layer (``rows[layer]``: ``[T, H]``, valid only during
        the call) for ``tokens``, at positions ``start .. start + T - 1`` of the sequence (rows past ``start``
        that the drafter held before are superseded)."""
        ...


def check_target(drafter_name: str, requirements: Requirements, target: TargetInfo) -> None:
    """Refuse a drafter whose requirements the target does not meet; the message names every mismatch."""
    problems: list[str] = []
    missing = sorted(set(requirements.hidden_layers) - set(target.hidden_layers))
    if missing:
        offered = sorted(target.hidden_layers) or "none"
        problems.append(f"hidden layer(s) {missing} (the target offers {offered})")
    if requirements.embedding and not target.embedding:
        problems.append("the embedding (the target does not offer it)")
    if requirements.head and not target.head:
        problems.append("the head (the target does not offer it)")
    if requirements.tokenizer is not None and requirements.tokenizer != target.tokenizer:
        theirs = target.tokenizer or "unknown"
        problems.append(f"tokenizer sha256 {requirements.tokenizer} (the target's is {theirs})")
    if requirements.mtp and not target.mtp:
        problems.append("an MTP head (the target's checkpoint ships none, or its engine offers none: "
                        "caps.mtp is 0)")
    if requirements.vocab_size is not None and requirements.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {requirements.vocab_size} (the target's is {target.vocab_size})")
    if requirements.hidden_size is not None and requirements.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {requirements.hidden_size} (the target's is {target.hidden_size or 'unknown'})")
    if problems:
        who = f" {target.name!r}" if target.name else ""
        raise DrafterMismatch(f"drafter {drafter_name!r} cannot draft for target{who}: it needs "
                              + "; ".join(problems))


def build_drafter(name: str, target: TargetInfo, **options: Any) -> Drafter:
    """Build the drafter registered as ``name`` for ``target`` and check it (``DrafterMismatch`` if it
    does not fit)."""
    from tandem_core.plugins import import_string, registries

    known = registries().drafters
    if name not in known:
        raise KeyError(f"no drafter {name!r} registered; known: {', '.join(sorted(known)) or 'none'}")
    factory = import_string(known[name]) if isinstance(known[name], str) else known[name]
    drafter = factory(target=target, **options)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter {name!r} ({known[name]}) does not implement the Drafter protocol")
    check_target(name, drafter.requires(), target)
    return drafter

