"""The tables every CUDA graph runner builds a round from (host-side, plain Python; no torch): the verify widths
it captures, a tree's depths and paths, the cache slots a node reads and the conv inputs before it. Every
plugin's graph runner builds its rounds from these (and re-exports them under the same names)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem_core.engine.runner import widths_up_to

__all__ = ["GATE_ONE", "WIDTHS", "conv_windows", "runner_widths", "slots_of", "tree_tables"]

WIDTHS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
GATE_ONE = 100.0   # sigmoid(100) = 1 / (1 + 3.7e-44) rounds to 1.0 in fp32: the kernel's gate is the identity


def runner_widths(max_tree: int) -> tuple[int, ...]:
    """``WIDTHS`` up to the first that holds ``max_tree`` (at most 128, the row-invariant matmul's rows)."""
    if not 1 <= max_tree <= WIDTHS[-1]:
        raise ValueError(f"max_tree must be in 1..{WIDTHS[-1]}, got {max_tree}")
    return widths_up_to(WIDTHS, max_tree)


def tree_tables(parents: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """``(depth, anc)`` of a tree (``parents[i] < i``, -1: a root): ``anc[i]`` is node i's path, root first,
    ``i`` itself last (``anc[i][d]``: its ancestor at depth d)."""
    depth: list[int] = []
    anc: list[list[int]] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"verify: node {i}'s parent {p} is not an earlier node or -1")
        depth.append(0 if p < 0 else depth[p] + 1)
        anc.append([i] if p < 0 else [*anc[p], i])
    return depth, anc


def slots_of(L: int, anc: Sequence[int]) -> list[int]:
    """The cache slots a node with path ``anc`` (root first, itself last) reads on top of ``L`` committed
    tokens, in position order: ``0 .. L-1``, then ``L + anc[d]`` for every depth (decode: ``0 .. L``)."""
    return [*range(L), *(L + a for a in anc)]


def conv_windows(anc: Sequence[Sequence[int]], k1: int) -> list[list[int]]:
    """Each node's ``k1`` conv inputs before its own, oldest first: ``c < k1`` is column ``c`` of the committed
    tail, ``k1 + j`` node ``j``'s input (its ancestors on its path)."""
    out = []
    for a in anc:
        full = [*range(k1), *(k1 + j for j in a[:-1])]
        out.append(full[len(full) - k1:])
    return out
