"""Speculative decoding: the plain loop's step, made of propose, verify, walk, commit, emit.

``SpecDecode`` is ``Decode`` with one step replaced. The loop keeps one *pending* token:
the model's own pick of the last round, already committed to the answer (it is the
model's choice) but not yet in the engine. A round::

    tree  = propose()            drafters continue prompt + answer; StairCut cuts the merged tree
    out   = verify(tree)         one forward: the pending token as the root, the tree below it
    path  = walk(tree, out)      the model's own picks, keyed by (seed, position), along the tree
    commit(path)                 the engine keeps pending + accepted nodes; the answer gets them + one more
    emit()                       the text now safe to send

Every token the round yields is the model's own pick at its position, drawn exactly
as the plain loop would draw it, and every verified row equals the decode row bit for
bit (the engine's row invariance, checked at load by ``spec.selfcheck``): speculative
output equals plain output token for token, greedy and seeded sampling alike. A round
with nothing worth drafting is a plain decode step (``plain_round``: the engine's decode
forward, not a one-node verify). A request with a grammar constraint decodes plainly.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem_core.drafter import Drafter, ReadsHidden
from tandem_core.engine import TreeEngine
from tandem_core.spec.cut import StairCut
from tandem_core.spec.loop import Chunk, Decode
from tandem_core.spec.sampler import Pick
from tandem_core.spec.tree import TokenTree
from tandem_core.spec.walk import WalkResult, walk_lazy

__all__ = ["DrafterGate", "needed_tokens", "SpecDecode", "SpecStats", "Speculation"]


@dataclass
class SpecStats:
    """Counts for /metrics and the log line: rounds, drafted and accepted nodes, tokens yielded."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    verify_ms: float = 0.0
    paused: int = 0             # rounds a costly drafter sat out (its gate's pause), a drafter a round

    def add(self, other: SpecStats) -> None:
        self.paused += other.paused
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.tokens += other.tokens
        self.verify_ms += other.verify_ms

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class DrafterGate:
    """Whether a costly drafter (one with ``costly = True``: its proposal is a forward of its own, the block
    drafter's) proposes this round. One gate a drafter and engine (``Speculation.gates``): what a proposal costs
    and saves on this engine carries over from request to request. Two rules pause it, each for ``2 ** level``
    rounds of its own (the level grows with each pause, up to ``max_level``), after which it is asked again:

    - misses (per request: ``new_request`` resets it): its verified nodes all missed in ``patience`` verifies in
      a row (rounds where the cut kept none of its nodes do not count); one accepted node resets this rule;
    - cost: the time its proposals save is below the time they cost, both averaged over the rounds it was asked
      (``alpha_gain``, ``alpha_cost``: the newest round's weight), decided from the ``warm``-th round on and
      then every round it is asked. A round saves ``gain`` ms: the accepted tokens that needed its nodes (the
      path from the first accepted node no other drafter proposed) times a decode step's price; it costs the
      proposal's own wall time. A drafter that hits now and then but not enough to pay for its forward (the
      block drafter on chat) is paused by this rule, which the misses rule never does; one round that saves
      much more than it costs (the text turned to what it drafts well) lifts the average past the cost again.
      A new request caps a pause left by an earlier one at ``2 ** request_level`` rounds.

    Skipping never changes what is emitted, only what is drafted."""

    patience: int = 8
    max_level: int = 6
    warm: int = 3
    alpha_gain: float = 0.25
    alpha_cost: float = 0.5
    request_level: int = 2
    misses: int = 0
    level: int = 0
    skip: int = 0               # rounds left of the misses rule's pause
    cost_skip: int = 0          # rounds left of the cost rule's pause
    skipped: int = 0            # rounds sat out, every request
    cost_ms: float = 0.0        # average wall ms of one proposal
    gain_ms: float = 0.0        # average ms a round's proposal saved
    valued: int = 0             # rounds valued (the cost rule decides from the ``warm``-th)
    cost_level: int = 0
    cost_pauses: int = 0

    def ask(self) -> bool:
        if self.skip > 0 or self.cost_skip > 0:
            self.skip = max(0, self.skip - 1)
            self.cost_skip = max(0, self.cost_skip - 1)
            self.skipped += 1
            return False
        return True

    def new_request(self) -> None:
        """A new request on the engine: the misses rule starts over; the cost rule keeps what it learnt."""
        self.misses = self.level = self.skip = 0
        self.cost_skip = min(self.cost_skip, 2 ** self.request_level)

    def observe(self, accepted: bool) -> None:
        if accepted:
            self.misses = self.level = 0
            return
        self.misses += 1
        if self.misses >= self.patience:
            self.skip = 2 ** self.level
            self.level = min(self.level + 1, self.max_level)
            self.misses = self.patience - 1      # after the pause one more miss pauses it again, longer

    def paid(self, ms: float) -> None:
        """One proposal took ``ms`` of wall time."""
        self.cost_ms = ms if self.valued == 0 else (1 - self.alpha_cost) * self.cost_ms + self.alpha_cost * ms

    def value(self, gain_ms: float) -> None:
        """The round's proposal saved ``gain_ms`` (0 when the cut kept none of its nodes). Call after ``paid``."""
        a = self.alpha_gain
        self.gain_ms = gain_ms if self.valued == 0 else (1 - a) * self.gain_ms + a * gain_ms
        self.valued += 1
        if self.valued < self.warm:
            return
        if self.gain_ms < self.cost_ms:
            self.cost_skip = 2 ** self.cost_level
            self.cost_level = min(self.cost_level + 1, self.max_level)
            self.cost_pauses += 1
        else:
            self.cost_level = 0


def needed_tokens(tree: TokenTree, path_nodes: Sequence[int], name: str, proposers: Sequence[str]) -> int:
    """How many of the accepted path's tokens needed drafter ``name``'s nodes: the path from its first node that
    none of the round's other ``proposers`` proposed (0 when the others proposed the whole path)."""
    others = set(proposers) - {name}
    for j, k in enumerate(path_nodes):
        srcs = tree.sources[k]
        if name in srcs and not others.intersection(srcs):
            return len(path_nodes) - j
    return 0


@dataclass
class Speculation:
    """One engine's speculation: its drafters (they keep this engine's session history), its cut
    (prices and calibration learnt on this engine)."""

    drafters: Sequence[Drafter]
    cut: StairCut
    max_tree: int
    totals: SpecStats = field(default_factory=SpecStats)
    gates: dict[str, DrafterGate] = field(default_factory=dict)   # the costly drafters' gates on this engine


class SpecDecode(Decode):
    """``Decode`` with speculation. ``engine`` must be a ``TreeEngine`` (``caps.tree``)."""

    def __init__(self, engine: Any, request: Any, detok: Any, *, speculation: Speculation, **kw: Any) -> None:
        super().__init__(engine, request, detok, **kw)
        self.spec = speculation
        self.stats = SpecStats()
        self.tree_engine: TreeEngine = engine
        self._begun = False
        self._indexing: threading.Thread | None = None
        self._proposed: list[str] = []     # the drafters that proposed this round (their gates hear the outcome)
        self._asked: list[str] = []        # the costly drafters asked this round (their gates price the round)
        self._gates = speculation.gates    # the costly drafters' gates: this engine's, each told of the new request
        for gate in self._gates.values():
            gate.new_request()
        # drafters that read the target's hidden rows: the engine taps their layers, and every forward of the
        # sequence hands them its rows (the prefill's, each decode step's, each verify's accepted path)
        self._readers = [d for d in speculation.drafters if isinstance(d, ReadsHidden)]
        self._tapped: tuple[int, ...] = tuple(sorted({i for d in self._readers for i in d.requires().hidden_layers}))
        if self._tapped:
            engine.tap(self._tapped)
            self.start = self._reading_start(self.start)

    def run(self) -> Iterator[Chunk]:
        """The plain loop's ``run``, with the drafters indexing the prompt while the prefill runs (on the GPU a
        128K-token prompt takes the lookup drafter ~0.65 s of CPU to index, which otherwise lands between the
        first and the second token); the first round waits for it."""
        if self.spec.drafters and self.constraint is None:
            self._indexing = threading.Thread(target=self._begin, name="tandem-draft-index", daemon=True)
            self._indexing.start()
        try:
            yield from super().run()
        finally:
            if self._indexing is not None:
                self._indexing.join()        # the drafters are never touched by two requests at once

    def step(self) -> Chunk:
        if self.constraint is not None or len(self.pending) != 1:
            return super().step()          # the first token (from the prefill's logits), a grammar, or injected text
        if not self._begun:
            if self._indexing is not None:
                self._indexing.join()
            if not self._begun:
                self._begin()
        tree = self.propose()              # drafters' proposals, merged and cut
        if len(tree) == 0:
            return self.plain_round()      # nothing worth verifying: a decode step
        out = self.verify(tree)            # [1 + N, V]: after pending, after each node
        result = self.walk(tree, out)      # the model's own picks along the tree
        self.commit_round(tree, result, out)
        return self.emit()

    # -- the round's parts ----------------------------------------------------------------------------

    def _begin(self) -> None:
        for d in self.spec.drafters:
            d.begin(list(self.req.prompt))
        self._begun = True

    def _reading_start(self, start: Any) -> Any:
        """The prefill (``start``), handing the drafters the rows of every chunk it forwards (read before the
        ``between`` safe point, where the side lane may run forwards of its own)."""

        def reading(engine: Any, prompt: Sequence[int], **kw: Any) -> torch.Tensor:
            between = kw.get("between")
            if between is not None:
                def grab_then_between() -> None:
                    self._hand_rows(list(prompt))
                    between()
                kw["between"] = grab_then_between
            logits = start(engine, prompt, **kw)
            self._hand_rows(list(prompt))
            return logits

        return reading

    def _hand_rows(self, sequence: Sequence[int], index: torch.Tensor | None = None, first: int = 0) -> None:
        """The last forward's tapped rows to the drafters: the forward's rows ending at ``kv.length`` (or, after a
        verify, the rows ``index`` of its nodes, at positions from ``first``: pending and the accepted path)."""
        eng: Any = self.engine             # a tapping engine (SequenceEngine's hidden_at)
        rows = {i: eng.hidden_at(i) for i in self._tapped}
        if index is not None:
            rows = {i: r.index_select(0, index.to(r.device)) for i, r in rows.items()}
        else:
            first = self.engine.kv.length - int(next(iter(rows.values())).shape[0])
        n = int(next(iter(rows.values())).shape[0])
        tokens = list(sequence[first:first + n])
        if first < 0 or len(tokens) != n:
            return                          # rows that are not this sequence's (nothing was forwarded)
        for d in self._readers:
            d.hidden(first, tokens, rows)

    def _context(self) -> list[int]:
        return [*self.req.prompt, *self.generated]

    def propose(self) -> TokenTree:
        context = self._context()
        room = self.req.max_tokens - len(self.generated)  # drafted tokens past max_tokens are never kept
        budget = min(self.spec.max_tree, max(room, 0))
        if budget <= 0 or not self.spec.drafters:
            return TokenTree.empty()
        proposals = []
        self._proposed = []
        self._asked = []                   # the costly drafters asked this round (each paid for its proposal)
        for d in self.spec.drafters:
            costly = getattr(d, "costly", False)
            if costly and not self._gates.setdefault(d.name, DrafterGate()).ask():
                self.stats.paused += 1
            else:
                t0 = time.perf_counter()
                p = d.propose(context, budget)
                if costly:
                    self._gates[d.name].paid((time.perf_counter() - t0) * 1e3)
                    self._asked.append(d.name)
                if len(p):
                    proposals.append(p)
                    self._proposed.append(d.name)
        tree = TokenTree.merge(proposals)
        if len(tree) == 0:
            return tree
        return self.spec.cut.cut_round(tree, len(context), budget).tree

    def plain_round(self) -> Chunk:
        """A round with nothing to verify: the plain loop's step (the pending token forwarded as a decode
        step, whose row is the verify's row 0 bit for bit), timed as a one-row verify for the cut's prices,
        and told to the drafters like any round."""
        (pending,) = self.pending
        t0 = time.perf_counter()
        logits = self.forward()            # [1, V]: the engine now holds the pending token
        ms = (time.perf_counter() - t0) * 1e3
        if self._tapped:
            self._hand_rows(self._context())
        self.spec.cut.observe(1, len(self.req.prompt) + len(self.generated) - 1, ms)
        self.stats.verify_ms += ms
        before = len(self.generated)
        self.commit(self.sample(logits))
        for d in self.spec.drafters:
            d.accepted([pending])
        for name in self._asked:             # a costly drafter asked this round: its proposal saved nothing
            self._gates[name].value(0.0)
        self._asked = []
        self._proposed = []                  # nothing verified: no drafter was tried (the cut's exploration retries)
        self.stats.rounds += 1
        self.stats.tokens += len(self.generated) - before
        return self.emit()

    def verify(self, tree: TokenTree) -> torch.Tensor:
        (pending,) = self.pending
        tokens = torch.tensor([pending, *tree.tokens], dtype=torch.long)          # [1 + N]
        parents = torch.tensor([-1, *(p + 1 for p in tree.parents)], dtype=torch.long)
        t0 = time.perf_counter()
        logits = self.tree_engine.forward_tree(tokens, parents).logits             # [1 + N, V]
        ms = (time.perf_counter() - t0) * 1e3
        self.spec.cut.observe(len(tokens), len(self.req.prompt) + len(self.generated) - 1, ms)
        self.stats.verify_ms += ms
        return logits

    def walk(self, tree: TokenTree, logits: torch.Tensor) -> WalkResult:
        first = len(self.req.prompt) + len(self.generated)   # the position drawn after the pending token
        depth = tree.depth
        saved = Counter(self.sampler.counts)                 # penalties see the tokens the walk accepts
        picks: dict[int, Pick] = {}

        def pick(k: int) -> int:
            if k >= 0:
                self.sampler.accept(tree.tokens[k])
            row, pos = (0, first) if k < 0 else (k + 1, first + depth[k])
            picks[k] = self.sampler.pick(logits[row], pos)
            return picks[k].token

        try:
            result = walk_lazy(tree, pick)
        finally:
            self.sampler.counts = saved
        self._round_picks = [picks[-1], *(picks[k] for k in result.path_nodes)]
        return result

    def commit_round(self, tree: TokenTree, result: WalkResult, logits: torch.Tensor) -> None:
        (pending,) = self.pending
        path = [tree.tokens[k] for k in result.path_nodes]
        start, sequence = self.tree_engine.kv.length, [*self._context(), *path]
        self.tree_engine.commit_tree([0, *(k + 1 for k in result.path_nodes)])  # engine: + pending + path
        before = len(self.generated)
        self.commit(self._round_picks)      # the answer: + path + bonus, or fewer at a stop or max_tokens
        kept = len(self.generated) - before
        # like the plain loop, the engine holds every kept token but the last: pending + path[:kept - 1]
        held = 1 + min(len(path), kept - 1)
        if held < 1 + len(path):
            self.tree_engine.trim_pending(1 + len(path) - held)
        self.tree_engine.settle()
        if self._tapped:                    # the verify's rows of what the engine kept: pending + the path
            rows = torch.tensor([0, *(k + 1 for k in result.path_nodes)][:held], dtype=torch.long)
            self._hand_rows(sequence, rows, start)
        self.pending = self.pending[-1:] if self.finish is None else []
        self.forwarded([pending, *path][:held])
        for d in self.spec.drafters:
            d.accepted([pending, *path])
        self.spec.cut.observe_walk(tree, result.path_nodes)
        hit = {src for k in result.path_nodes for src in tree.sources[k]}
        tried = {src for srcs in tree.sources for src in srcs}
        for name in self._proposed:          # a drafter whose verified nodes all missed; one the cut left out is not tried
            if name in tried and name in self._gates:
                self._gates[name].observe(name in hit)
        if self._asked:                      # what each costly drafter's proposal saved: its tokens at a step's price
            step_ms = float(self.spec.cut.curve(start, 1)[0])
            for name in self._asked:
                self._gates[name].value(needed_tokens(tree, result.path_nodes, name, self._proposed) * step_ms)
        self._asked = []
        self._proposed = []
        self.stats.rounds += 1
        self.stats.drafted += len(tree)
        self.stats.accepted += len(path)
        self.stats.tokens += kept

    def forwarded(self, tokens: Sequence[int]) -> None:
        """The engine now also holds ``tokens`` (a cache tier follows the sequence through this)."""
        hook = self.on_forwarded
        if hook is not None and tokens:
            hook(list(tokens))

    def finish_stats(self) -> SpecStats:
        self.spec.totals.add(self.stats)
        return self.stats
