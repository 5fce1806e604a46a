"""The token tree one verify forward checks: drafted tokens, their parents, probabilities and sources.

Node ``i`` holds ``tokens[i]``; its parent is ``parents[i]`` (``-1``: a child of
the last committed token, the root). Parents come first (``parents[i] < i``),
so any prefix of the nodes that is closed under ancestors is itself a tree,
and a chain is the tree ``parents == (-1, 0, 1, ...)``.

``probs[i]`` is the drafters' probability of ``tokens[i]`` given the path to
its parent (the largest over the drafters that proposed it); ``path_probs[i]``
multiplies them from the root, an estimate of the chance node ``i`` is on the
accepted path. ``sources[i]`` names every drafter that proposed the node and
``source_probs[i]`` each one's own conditional probability (calibration is per
source).

``merge(proposals)`` makes one tree of several drafters' proposals: two nodes
with the same parent and the same token are one node (the max probability is
kept and every source remembered), so shared prefixes are verified once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np
import torch

from tandem_core.drafter import Proposal

__all__ = ["TokenTree"]


@dataclass(frozen=True)
class TokenTree:
    """An immutable token tree. Build with ``merge`` / ``from_proposal`` / ``chain``; ``N = len(tree)``."""

    tokens: tuple[int, ...]                       # [N]
    parents: tuple[int, ...]                      # [N], parents[i] < i, -1 for the root's children
    probs: tuple[float, ...]                      # [N] conditional probability (max over sources)
    sources: tuple[tuple[str, ...], ...]          # [N] the drafters that proposed node i
    source_probs: tuple[tuple[float, ...], ...]   # [N] each source's own conditional probability

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.parents) == len(self.probs) == len(self.sources) == len(self.source_probs) == n):
            raise ValueError("token tree: tokens, parents, probs, sources and source_probs differ in length")
        if n and (min(self.parents) < -1 or any(map(int.__ge__, self.parents, range(n)))):
            i = next(i for i, par in enumerate(self.parents) if not -1 <= par < i)
            raise ValueError(f"token tree: node {i} has parent {self.parents[i]} (need -1 <= parent < {i})")

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def empty(cls) -> "TokenTree":
        return cls((), (), (), (), ())

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: Sequence[float] | None = None,
              source: str = "chain") -> "TokenTree":
        probs = [1.0] * len(tokens) if probs is None else probs
        return cls.from_proposal(Proposal.chain(tokens, probs, source))

    @classmethod
    def from_proposal(cls, proposal: Proposal) -> "TokenTree":
        return cls.merge([proposal])

    @classmethod
    def merge(cls, proposals: Iterable[Proposal]) -> "TokenTree":
        """One tree of every proposal; a node with the same parent and token as an earlier one joins it."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        sources: list[list[str]] = []
        sprobs: list[list[float]] = []
        index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
        for prop in proposals:
            local: list[int] = []  # proposal node -> merged node
            for tok, par, p in zip(prop.tokens, prop.parents, prop.probs):
                mpar = -1 if par < 0 else local[par]
                key = (mpar, tok)
                j = index.get(key)
                if j is None:
                    j = len(tokens)
                    index[key] = j
                    tokens.append(tok)
                    parents.append(mpar)
                    probs.append(p)
                    sources.append([prop.source])
                    sprobs.append([p])
                else:
                    probs[j] = max(probs[j], p)
                    if prop.source in sources[j]:
                        k = sources[j].index(prop.source)
                        sprobs[j][k] = max(sprobs[j][k], p)
                    else:
                        sources[j].append(prop.source)
                        sprobs[j].append(p)
                local.append(j)
        return cls(tuple(tokens), tuple(parents), tuple(probs), tuple(map(tuple, sources)),
                   tuple(map(tuple, sprobs)))

    # -- shape ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """[N] nodes on the path from the root to ``i``, ``i`` included (the root's children: 1)."""
        d: list[int] = []
        for par in self.parents:
            d.append(1 if par < 0 else d[par] + 1)
        return tuple(d)

    @cached_property
    def path_probs(self) -> tuple[float, ...]:
        """[N] the product of ``probs`` from the root to ``i``."""
        out: list[float] = []
        for par, p in zip(self.parents, self.probs):
            out.append(p if par < 0 else out[par] * p)
        return tuple(out)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """[N + 1] children of each node; the last entry (index -1) lists the root's children."""
        ch: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, par in enumerate(self.parents):
            ch[par].append(i)
        return tuple(map(tuple, ch))

    @property
    def is_chain(self) -> bool:
        return all(par == i - 1 for i, par in enumerate(self.parents))

    def path_to(self, i: int) -> tuple[int, ...]:
        """The nodes from the root to ``i``, ``i`` last."""
        out: list[int] = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return tuple(reversed(out))

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Every root-to-leaf path (node indices), one a leaf, in leaf order."""
        kids = self.children
        return tuple(self.path_to(i) for i in range(len(self)) if not kids[i])

    # -- for the verify forward ----------------------------------------------------------------------

    def tokens_tensor(self) -> torch.Tensor:
        """[N] int64."""
        return torch.tensor(self.tokens, dtype=torch.long)

    def parents_tensor(self) -> torch.Tensor:
        """[N] int64, -1 for the root's children."""
        return torch.tensor(self.parents, dtype=torch.long)

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: ``mask[i, j]`` iff ``j`` is ``i`` or an ancestor of ``i`` (who node ``i`` attends to
        among the tree's nodes; every node also attends to the whole committed sequence)."""
        n = len(self)
        m = np.zeros((n, n), dtype=bool)
        for i, par in enumerate(self.parents):
            if par >= 0:
                m[i, :i] = m[par, :i]
            m[i, i] = True
        return torch.from_numpy(m)

    # -- cutting --------------------------------------------------------------------------------------

    def subtree(self, keep: Iterable[int]) -> "TokenTree":
        """The nodes ``keep`` (closed under ancestors), reindexed in their original order, parents preserved.

        Node ``j`` of the result is ``sorted(keep)[j]`` of this tree. Fails naming a node whose parent
        is not kept.
        """
        kept = sorted(set(keep))
        new = {old: j for j, old in enumerate(kept)}
        parents: list[int] = []
        for old in kept:
            if not 0 <= old < len(self):
                raise IndexError(f"subtree: node {old} is not in a tree of {len(self)} nodes")
            par = self.parents[old]
            if par >= 0 and par not in new:
                raise ValueError(f"subtree: node {old} is kept but its parent {par} is not")
            parents.append(-1 if par < 0 else new[par])
        return TokenTree(tuple(self.tokens[i] for i in kept), tuple(parents),
                         tuple(self.probs[i] for i in kept), tuple(self.sources[i] for i in kept),
                         tuple(self.source_probs[i] for i in kept))
