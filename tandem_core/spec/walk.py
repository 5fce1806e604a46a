"""The walk: follow a verified token tree with the model's own picks, keep the longest agreeing path.

After one verify forward the model has a pick at every node: ``picks[k]`` is
its own next token after node ``k``, ``picks_root`` its next token after the
last committed token. From the root, the walk moves to the child whose token
is the model's pick, as long as there is one; the nodes it passes are
accepted, and the model's pick after the last of them is one more token of
its own (the bonus). So every round yields ``len(path) + 1`` tokens, each of
which the model itself chose: the output equals plain decoding token for token.

Greedy and seeded sampling walk identically, because the caller supplies the
picks. Greedy: ``picks = argmax(logits)``. Sampled: the pick after node ``k``
is ``Sampler.pick`` on that node's logits for absolute position
``pick_positions(tree, first)[k]`` — the sampler's noise is keyed by
``(seed, absolute position)`` only, so a position draws the same token whether
it is decoded alone or verified in a tree, and seeded speculative output
equals its plain twin. A picker whose draw depends on the tokens before it
(presence/frequency penalties, a grammar) cannot precompute every node's pick:
``walk_lazy(tree, pick)`` asks ``pick(k)`` only for the nodes the walk
reaches, in path order, so the caller can advance its state as it goes.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from tandem_core.spec.tree import TokenTree

__all__ = ["WalkResult", "walk", "walk_lazy", "pick_positions"]


class WalkResult(NamedTuple):
    """The round's outcome.

    path_nodes  accepted node indices into the verified tree, root to leaf (``commit_tree(path_nodes)``)
    tokens      every token the round yields, in order: the accepted nodes' tokens, then ``bonus``
    bonus       the model's own pick after the last accepted node (after the root when none is)
    """

    path_nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    bonus: int

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted this round (``len(tokens) - 1``)."""
        return len(self.path_nodes)


def walk_lazy(tree: TokenTree, pick: Callable[[int], int]) -> WalkResult:
    """The walk with picks computed on demand: ``pick(-1)`` after the root, ``pick(k)`` after node ``k``.

    ``pick`` is called once for the root and once for each accepted node, in path order.
    """
    kids = tree.children
    toks = tree.tokens
    path: list[int] = []
    node = -1
    want = int(pick(-1))
    while True:
        nxt = -1
        for c in kids[node]:
            if toks[c] == want:
                nxt = c
                break
        if nxt < 0:
            break
        path.append(nxt)
        node = nxt
        want = int(pick(nxt))
    return WalkResult(tuple(path), tuple(toks[i] for i in path) + (want,), want)


def walk(tree: TokenTree, picks: Sequence[int] | torch.Tensor, picks_root: int) -> WalkResult:
    """The walk with every pick known: ``picks`` [N] (the model's token after node ``k``),
    ``picks_root`` (after the last committed token)."""
    if isinstance(picks, torch.Tensor):
        picks = picks.reshape(-1).tolist()
    if len(picks) != len(tree):
        raise ValueError(f"walk: {len(picks)} picks for a tree of {len(tree)} nodes")
    root = int(picks_root)
    return walk_lazy(tree, lambda k: root if k < 0 else int(picks[k]))


def pick_positions(tree: TokenTree, first: int) -> list[int]:
    """[N] the absolute position of the token drawn after each node.

    ``first`` is the absolute position of the root's children (the committed length
    when the tree hangs on the last committed token); ``picks_root`` is drawn for
    ``first`` and the pick after node ``k`` for ``first + depth[k]``.
    """
    return [first + d for d in tree.depth]
