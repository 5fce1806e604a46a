"""Token-tree structure shared by the tree ops: depths, a depth-first order, and ancestors.

``parents: [N]`` int: ``parents[i] < i`` is node ``i``'s parent, ``-1`` for a node
whose parent is the last committed token (a tree may have several such roots).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["as_parents", "depths", "preorder", "ancestors"]


def as_parents(parents: torch.Tensor | Sequence[int]) -> list[int]:
    """``parents`` as a list of ints, checked: every ``parents[i]`` in ``[-1, i)``."""
    out = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
    for i, p in enumerate(out):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a node's parent must be an earlier node or -1")
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """``depth[i]``: 0 for a root, ``depth[parent] + 1`` otherwise."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def preorder(parents: Sequence[int]) -> list[int]:
    """The nodes in depth-first preorder (children in index order). When node ``i`` is visited, the last
    node visited at each depth ``d < depth(i)`` is ``i``'s ancestor at depth ``d``."""
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else children[p]).append(i)
    order: list[int] = []
    stack = list(reversed(roots))
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children[i]))
    return order


def ancestors(parents: Sequence[int], i: int, limit: int) -> list[int]:
    """Up to ``limit`` ancestors of node ``i``, nearest first (parent, grandparent, ...)."""
    out: list[int] = []
    p = parents[i]
    while p >= 0 and len(out) < limit:
        out.append(p)
        p = parents[p]
    return out
