"""The lookup drafter: proposes continuations it has seen, as a tree with probabilities from counts.

Three places it looks, each an n-gram index (``tandem_drafters.ngram``):

- the sequence: the prompt and every committed token, indexed as they come;
- the session: earlier turns' tokens that the current prompt does not repeat
  (a rewritten tail, an earlier conversation), kept up to ``history_tokens``;
- the corpus store (optional, ``TANDEM_LOOKUP_CORPUS`` or ``corpus=``): text
  tokenised once with the target's tokenizer (``tandem corpus build``).

Each round it matches the context's last ``k`` tokens for ``k`` from long to
short (16, 12, 8, 6, 4, 3, 2, 1) and reads the tokens that followed up to
``occurrences`` earlier matches in each place. Every continuation counts with
weight ``k`` (a longer match is more telling) times its place's weight; the
continuations are merged into a trie, a node's probability given its parent is
``count(node) / (count(children of parent) + alpha)``, and the most probable
nodes (best-first on the path probability, at most ``max_nodes``) are the
proposal. A repetitive sequence therefore gets a long, confident chain; a
context seen with different continuations gets a branching tree. The corpus is
asked only when the session has not already given ``occurrences`` matches of
``corpus_skip_order`` tokens or more.

Cost: a dict lookup per order and a few list operations per continuation,
whatever the context's length (``tools/bench_lookup.py``: about 40 us a proposal
at a 32k-token context, about 110 us with a 2M-token corpus store, on a server CPU).

``requires()`` declares only the tokenizer fingerprint, and only when a corpus
store is open (without one the drafter reads nothing but the sequence's own ids
and suits any target).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tandem_core.drafter import Proposal, Requirements, TargetInfo
from tandem_core.settings import SETTINGS
from tandem_drafters.corpus import CorpusStore
from tandem_drafters.ngram import DEFAULT_ORDERS, SENTINEL, NgramIndex

__all__ = ["LookupConfig", "LookupDrafter"]

# A chain being emitted yields to a waiting node only once it falls below this share of that node's path
# probability: two chains of similar probability then take turns in runs instead of node by node (the
# proposal is the top nodes up to this tolerance; the cut re-ranks them on calibrated acceptance anyway).
_SLACK = 0.8


@dataclass(frozen=True)
class LookupConfig:
    """The lookup drafter's knobs (the defaults suit agent transcripts)."""

    orders: tuple[int, ...] = DEFAULT_ORDERS  # suffix lengths matched, longest first
    max_depth: int = 48                       # tokens read after one match
    occurrences: int = 8                      # matches read per place (sequence, session, corpus)
    alpha: float = 1.0                        # additive smoothing in count units (a k-token match counts k)
    min_prob: float = 1e-3                    # nodes below this path probability are not proposed
    history_tokens: int = 1 << 17             # session tokens kept (the oldest half goes when full)
    session_weight: float = 0.75              # weight of a session match against a sequence match
    corpus_weight: float = 0.5                # weight of a corpus match
    fold_after: int = 16                      # uncommitted context tokens indexed provisionally beyond this
    corpus_skip_order: int = 8                # the corpus is not asked when the session gave `occurrences`
                                              # matches at least this long


class LookupDrafter:
    """A ``tandem_core.drafter.Drafter`` over the sequence, the session and an optional corpus store."""

    name = "lookup"

    def __init__(self, target: TargetInfo | None = None, *, corpus: str | Path | None = None,
                 config: LookupConfig | None = None, verify_corpus: bool = True) -> None:
        self.config = config or LookupConfig()
        path = corpus if corpus is not None else _corpus_setting()
        self.corpus: CorpusStore | None = None
        if path:
            self.corpus = CorpusStore.open(Path(path).expanduser(), target.tokenizer if target else None,
                                           verify=verify_corpus)
        self._seq = NgramIndex(self.config.orders)
        self._hist = NgramIndex(self.config.orders)
        self._told = 0  # tokens of the sequence as told by begin + accepted (the index may hold more)

    def requires(self) -> Requirements:
        return Requirements(tokenizer=self.corpus.tokenizer_sha256 if self.corpus is not None else None)

    # -- the sequence -------------------------------------------------------------------------------

    def begin(self, prompt_ids: Sequence[int]) -> None:
        prompt = [int(t) for t in prompt_ids]
        cp = _common_prefix(self._seq.tokens, prompt)
        if cp < len(self._seq):
            self._remember(self._seq.tokens[cp:])
            self._seq.truncate(cp)
        self._seq.extend(prompt[cp:])
        self._told = len(prompt)

    def accepted(self, tokens: Sequence[int]) -> None:
        toks = [int(t) for t in tokens]
        n, told = len(self._seq), self._told
        if n > told:  # the index folded some context in already: keep what agrees
            have = self._seq.tokens[told:told + len(toks)]
            if toks[:len(have)] == have:
                self._seq.extend(toks[len(have):])
            else:
                self._seq.truncate(told)
                self._seq.extend(toks)
        else:
            self._seq.extend(toks)
        self._told = told + len(toks)

    def reset(self) -> None:
        self._seq.clear()
        self._hist.clear()
        self._told = 0

    def _remember(self, tokens: list[int]) -> None:
        """Keep tokens the sequence is dropping as session history (a separator after them)."""
        if len(tokens) < 2:
            return
        self._hist.extend([*tokens, SENTINEL])
        cap = self.config.history_tokens
        if len(self._hist) > cap:
            keep = self._hist.tokens[-(cap // 2):]
            self._hist.clear()
            self._hist.extend(keep)

    def _sync(self, context: Sequence[int]) -> None:
        """Make the index agree with ``context`` (cheaply: one token compared in the usual case)."""
        seq, L = self._seq, len(context)
        n = len(seq)
        if L >= n and (n == 0 or int(context[n - 1]) == seq.tokens[n - 1]):
            if L - n > self.config.fold_after:
                seq.extend(context[n:])
            return
        told = self._told
        if told <= L and (told == 0 or int(context[told - 1]) == seq.tokens[told - 1]):
            seq.truncate(told)
            if L - told > self.config.fold_after:
                seq.extend(context[told:])
            return
        self.begin(context)

    # -- proposing ----------------------------------------------------------------------------------

    def propose(self, context_ids: Sequence[int], max_nodes: int) -> Proposal:
        cfg = self.config
        if max_nodes <= 0 or len(context_ids) == 0:
            return Proposal.empty(self.name)
        self._sync(context_ids)
        n = len(self._seq)
        keys = self._seq.end_keys(context_ids[n:] if len(context_ids) > n else ())
        tail = context_ids[-self._seq.max_order:]
        if not isinstance(tail, list):
            tail = [int(t) for t in tail]
        depth = min(max_nodes, cfg.max_depth)
        conts: dict[tuple[int, ...], float] = {}
        places: list[tuple[Any, float]] = [(self._seq, 1.0)]
        if len(self._hist):
            places.append((self._hist, cfg.session_weight))
        if self.corpus is not None:
            places.append((self.corpus, cfg.corpus_weight))
        strong = 0  # matches of at least corpus_skip_order tokens found in the session so far
        for place, weight in places:
            if place is self.corpus and strong >= cfg.occurrences:
                break  # the session already knows this context well: the corpus would add little
            for e, k in place.occurrences(tail, keys, cfg.occurrences):
                c = place.continuation(e, depth)
                if c:
                    key = tuple(c)
                    conts[key] = conts.get(key, 0.0) + weight * k
                    strong += k >= cfg.corpus_skip_order
        if not conts:
            return Proposal.empty(self.name)
        return self._best_first(conts, max_nodes)

    def _best_first(self, conts: dict[tuple[int, ...], float], max_nodes: int) -> Proposal:
        """The trie of ``conts`` (continuation -> weight), read best-first on path probability.

        The trie is never built whole: a node is the group of continuations sharing its
        path. Where every continuation of a group agrees and none ends, the path is a
        fixed chain with one conditional probability (``W / (W + alpha)``), emitted in a
        tight loop while it beats the heap; the group splits by next token only where
        its continuations part or some end.
        """
        alpha, floor = self.config.alpha, self.config.min_prob
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        Group = list[tuple[tuple[int, ...], float]]
        # (-path, tie, token, p, parent, group, depth of token, group weight, shared end or -1)
        heap: list[tuple[float, int, int, float, int, Group, int, float, int]] = []
        tick = 0

        def expand(group: Group, depth: int, parent: int, path: float) -> None:
            nonlocal tick
            kids: dict[int, list[Any]] = {}
            total = alpha
            for cont, w in group:
                if depth < len(cont):
                    tok = cont[depth]
                    ent = kids.get(tok)
                    if ent is None:
                        kids[tok] = [w, [(cont, w)]]
                    else:
                        ent[0] += w
                        ent[1].append((cont, w))
                    total += w
            for tok, (w, sub) in kids.items():
                p = w / total
                if path * p >= floor:
                    tick += 1
                    heapq.heappush(heap, (-path * p, tick, tok, p, parent, sub, depth, w, -1))

        expand(list(conts.items()), 0, -1, 1.0)
        while heap and len(tokens) < max_nodes:
            neg, _, tok, p, parent, group, depth, weight, end = heapq.heappop(heap)
            path = -neg
            i = len(tokens)
            tokens.append(tok)
            parents.append(parent)
            probs.append(p)
            d = depth + 1
            if end < 0:
                end = _shared_end(group, d)
            pc = weight / (weight + alpha)
            # the shared chain [d, end): emit the run whose path probability stays at or above both the
            # floor and (nearly, _SLACK) the best waiting node; path * pc^j falls geometrically, so
            # the run is counted at once
            top = -heap[0][0] if heap else 0.0
            bar = max(floor, top * _SLACK)
            room = min(end - d, max_nodes - len(tokens))
            run = room if path * pc ** room >= bar else _steps_above(path, pc, bar, room)
            if run:
                first = group[0][0]
                tokens.extend(first[d:d + run])
                parents.extend(range(i, i + run))
                probs.extend([pc] * run)
                i, path, d = len(tokens) - 1, path * pc ** run, d + run
            if len(tokens) >= max_nodes:
                break
            if d < end:  # the chain continues below the waiting node (or the floor)
                q = path * pc
                if q >= floor:
                    tick += 1
                    heapq.heappush(heap, (-q, tick, group[0][0][d], pc, i, group, d, weight, end))
            else:
                expand(group, d, i, path)
        return Proposal(tuple(tokens), tuple(parents), tuple(probs), self.name)


def _steps_above(path: float, pc: float, bar: float, room: int) -> int:
    """The most steps ``j <= room`` with ``path * pc ** j >= bar`` (``pc < 1``)."""
    if path * pc < bar:
        return 0
    j = min(room, int(math.log(bar / path) / math.log(pc)) if bar > 0 else room)
    while j > 0 and path * pc ** j < bar:
        j -= 1
    while j < room and path * pc ** (j + 1) >= bar:
        j += 1
    return j


def _shared_end(group: list[tuple[tuple[int, ...], float]], start: int) -> int:
    """The first index ``>= start`` where the group's continuations part or one of them ends."""
    m = min(len(c) for c, _ in group)
    if len(group) == 1 or m <= start:
        return max(m, start)
    first = group[0][0]
    rest = [c for c, _ in group[1:]]
    if all(c[start:m] == first[start:m] for c in rest):
        return m
    lo, hi = start, m  # [start, lo) agrees everywhere; [start, hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if all(c[start:mid] == first[start:mid] for c in rest):
            lo = mid
        else:
            hi = mid
    return lo


def _corpus_setting() -> str | None:
    """``TANDEM_LOOKUP_CORPUS`` (declared here too, so the drafter works without plugin discovery)."""
    from tandem_drafters.plugin import SETTINGS_DECLARED

    for s in SETTINGS_DECLARED:
        if s.name not in SETTINGS:
            SETTINGS.declare(s)
    return str(SETTINGS.get("LOOKUP_CORPUS")) or None


def _common_prefix(a: list[int], b: list[int]) -> int:
    m = min(len(a), len(b))
    if m == 0:
        return 0
    if a[:m] == b[:m]:
        return m
    diff = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64))
    return int(diff[0])
