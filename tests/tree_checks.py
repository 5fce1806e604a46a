"""Helpers shared by the engines' tree-verify tests (tests/test_qwen38_tree.py, tests/test_llama_tree.py)."""

from __future__ import annotations

import torch

from tandem_core.state import ModelState

__all__ = ["Recorded", "path_to", "walk", "carries"]


class Recorded:
    """A prompt's state, then a greedy decode: rows[j] after feeding tokens[j], states[j] after it."""

    def __init__(self, engine, ids, n):
        engine.reset()
        logits = engine.forward(ids)
        self.start = engine.state.clone()
        self.tokens, rows, self.states, self.hidden = [], [], [], []
        tok = int(engine.picks(logits)[-1])
        for _ in range(n):
            self.tokens.append(tok)
            row = engine.forward([tok])
            rows.append(row[0])
            self.hidden.append(engine.hidden_post_norm()[0].clone())
            self.states.append(engine.state.clone())
            tok = int(engine.picks(row)[-1])
        self.rows = torch.stack(rows)

    def state_at(self, j: int) -> ModelState:
        """After the first ``j`` generated tokens."""
        return self.start if j == 0 else self.states[j - 1]


def path_to(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def walk(tokens: list[int], parents: list[int], picks: list[int]) -> tuple[list[int], int]:
    """The longest path whose every next token is the model's pick; returns (node path, the next pick)."""
    node = parents.index(-1)
    path = [node]
    while True:
        nxt = [j for j in range(len(tokens)) if parents[j] == node and tokens[j] == picks[node]]
        if not nxt:
            return path, picks[node]
        node = nxt[0]
        path.append(node)


def carries(tokens, parents, i, rest):
    """Node ``i`` heads a chain of descendants carrying ``rest``."""
    if tokens[i] != rest[0]:
        return False
    if len(rest) == 1:
        return True
    return any(parents[j] == i and carries(tokens, parents, j, rest[1:]) for j in range(len(tokens)))
