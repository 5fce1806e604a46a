"""The sampler: greedy argmax, or a draw whose noise is keyed by (seed, absolute position) only.

Sampled decoding is a Gumbel-max draw: ``argmax(logits / T + g)`` over the
tokens that survive top-k / top-p / min-p, where ``g`` is Gumbel noise from a
generator seeded by a hash of ``(seed, position)``. That is an exact draw from
the filtered softmax, and a position always draws the same token from the same
logits, whether it is decoded alone, verified in a speculative block, or
replayed: seeded speculative output equals its plain twin.

Order of operations on one row of logits (``[V]``, float32):
    logit_bias, presence/frequency penalties  (what the request asks of the model)
    grammar mask                              (constrained decoding: -inf outside)
    temperature, top_k, top_p, min_p          (the distribution drawn from)
    Gumbel-max draw, or argmax when greedy
Logprobs are reported from the model's own distribution (``log_softmax`` of the
raw logits), like OpenAI's.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import torch

__all__ = ["SamplingParams", "Pick", "Sampler", "position_noise", "random_seed"]


def random_seed() -> int:
    """A fresh seed for a request that gave none (63 bits, so it fits a signed int64)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler.

    temperature 0 (or top_k 1) is greedy. ``seed`` keys the noise; ``top_logprobs``
    is how many alternatives to report per token (``None``: no logprobs at all).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0: off
    min_p: float = 0.0          # 0: off
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class Pick(NamedTuple):
    """One sampled token, with its logprob and the top alternatives when asked."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


def position_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel noise ``[vocab]`` (float32) that depends on ``(seed, position)`` and nothing else.

    Drawn on the CPU from a generator seeded by a hash of the key, then moved, so
    every device and every batching of the decode sees the same numbers.
    """
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(key, "little") & ((1 << 63) - 1))
    u = torch.rand(vocab, generator=gen, dtype=torch.float64)
    u = u.clamp_(min=1e-300, max=1.0 - 1e-16)
    return (-torch.log(-torch.log(u))).to(device=device, dtype=torch.float32)


class Sampler:
    """Draws tokens for one request. Holds the generated tokens' counts for the penalties.

    ``pick(logits, position, mask)``: logits ``[V]`` (any float dtype, any device) are the
    model's next-token distribution for absolute ``position`` (the index the picked
    token will have in the sequence); ``mask`` ``[V]`` bool, True where a token is
    allowed (constrained decoding), or None. ``accept(token)`` records a committed
    token for the penalties; the caller calls it once per token it keeps.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.counts: Counter[int] = Counter()

    def accept(self, token: int) -> None:
        self.counts[token] += 1

    def pick(self, logits: torch.Tensor, position: int, mask: torch.Tensor | None = None) -> Pick:
        raw = logits.reshape(-1).float()  # [V]
        x = self.adjust(raw)
        if mask is not None:
            x = x.masked_fill(~mask.to(x.device), float("-inf"))
        token = self.draw(x, position)
        return self.report(raw, token)

    def pick_rows(self, logits: torch.Tensor, positions: Sequence[int],
                  masks: Sequence[torch.Tensor | None] | None = None) -> list[Pick]:
        """Row ``r`` of ``logits`` ``[R, V]`` is drawn for ``positions[r]``, exactly as ``pick`` would.

        The penalties see the counts as they are now (the caller accepts tokens after).
        """
        out = []
        for r, pos in enumerate(positions):
            out.append(self.pick(logits[r], pos, None if masks is None else masks[r]))
        return out

    # -- the steps, in order ------------------------------------------------------------------------

    def adjust(self, raw: torch.Tensor) -> torch.Tensor:
        """Logit bias and presence/frequency penalties (OpenAI's definitions). raw: [V] float32."""
        p = self.params
        x = raw
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=raw.device)
            vals = torch.tensor(list(p.logit_bias.values()), dtype=raw.dtype, device=raw.device)
            x = x.clone()
            x.index_add_(0, ids, vals)
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self.counts.keys()), dtype=torch.long, device=raw.device)
            cnt = torch.tensor(list(self.counts.values()), dtype=raw.dtype, device=raw.device)
            x = x.clone() if x is raw else x
            x.index_add_(0, ids, -(cnt * p.frequency_penalty + p.presence_penalty))
        return x

    def filtered(self, x: torch.Tensor) -> torch.Tensor:
        """``x / T`` with every token outside top-k, top-p and min-p set to -inf. x: [V] float32."""
        p = self.params
        x = x / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_p < 1.0:
            probs = torch.softmax(x, dim=-1)
            sp, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sp, dim=-1) - sp  # mass strictly above each token
            drop_sorted = before >= p.top_p
            drop_sorted[0] = False  # the most likely token always stays
            drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        return x

    def draw(self, x: torch.Tensor, position: int) -> int:
        if self.params.greedy:
            return int(torch.argmax(x))
        y = self.filtered(x)
        g = position_noise(self.params.seed, position, y.numel(), y.device)
        return int(torch.argmax(y + g))

    def report(self, raw: torch.Tensor, token: int) -> Pick:
        n = self.params.top_logprobs
        if n is None:
            return Pick(token, None, ())
        lp = torch.log_softmax(raw, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if n > 0:
            vals, ids = torch.topk(lp, min(n, lp.numel()))
            top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()))
        return Pick(token, float(lp[token]), top)
