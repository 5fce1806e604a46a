"""The sampler: greedy is argmax; a sampled draw depends on (seed, position, logits) only."""

from __future__ import annotations

import math

import pytest
import torch

from tandem_core.spec.sampler import Sampler, SamplingParams, position_noise, random_seed

V = 50


def logits(seed: int = 0, v: int = V) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_whatever_the_seed_and_position():
    x = logits()
    for seed in (0, 1, 99):
        for pos in (0, 5, 1000):
            assert Sampler(SamplingParams(temperature=0.0, seed=seed)).pick(x, pos).token == int(x.argmax())
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=3)).pick(x, 7).token == int(x.argmax())


def test_a_position_draws_the_same_token_however_the_decode_is_batched():
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    rows = torch.stack([logits(i) for i in range(8)])  # [R, V]
    positions = [40 + i for i in range(8)]
    alone = [Sampler(p).pick(rows[i], positions[i]).token for i in range(8)]
    batched = [q.token for q in Sampler(p).pick_rows(rows, positions)]
    reversed_batch = [q.token for q in Sampler(p).pick_rows(rows.flip(0), positions[::-1])][::-1]
    assert alone == batched == reversed_batch
    # another seed or another position changes the draw somewhere
    other_seed = [Sampler(SamplingParams(temperature=0.9, top_p=0.95, seed=4321)).pick(rows[i], positions[i]).token
                  for i in range(8)]
    shifted = [Sampler(p).pick(rows[i], positions[i] + 1).token for i in range(8)]
    assert other_seed != alone and shifted != alone


def test_noise_is_keyed_by_seed_and_position_only():
    a = position_noise(5, 17, 1000)
    assert torch.equal(a, position_noise(5, 17, 1000))
    assert not torch.equal(a, position_noise(5, 18, 1000))
    assert not torch.equal(a, position_noise(6, 17, 1000))
    assert a.dtype == torch.float32 and torch.isfinite(a).all()


def test_sampled_frequencies_follow_the_softmax():
    x = torch.tensor([2.0, 1.0, 0.0, -1.0])
    t = 0.8
    n = 4000
    counts = torch.zeros(4)
    s = Sampler(SamplingParams(temperature=t, seed=42))
    for pos in range(n):
        counts[s.pick(x, pos).token] += 1
    expect = torch.softmax(x / t, -1) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def allowed_set(params: SamplingParams, x: torch.Tensor) -> set[int]:
    y = Sampler(params).filtered(x)
    return set(torch.isfinite(y).nonzero().flatten().tolist())


def test_top_k_top_p_min_p_keep_the_right_tokens():
    x = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    assert allowed_set(SamplingParams(top_k=2), x) == {0, 1}
    assert allowed_set(SamplingParams(top_p=0.7), x) == {0, 1}      # 0.5 < 0.7 <= 0.75
    assert allowed_set(SamplingParams(top_p=0.75), x) == {0, 1}
    assert allowed_set(SamplingParams(top_p=0.76), x) == {0, 1, 2}
    assert allowed_set(SamplingParams(top_p=0.01), x) == {0}         # the top token always stays
    assert allowed_set(SamplingParams(min_p=0.3), x) == {0, 1, 2}   # >= 0.15
    assert allowed_set(SamplingParams(min_p=0.31), x) == {0, 1}
    # a draw never leaves the allowed set
    s = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=9))
    assert {s.pick(x, pos).token for pos in range(300)} <= {0, 1, 2}


def test_penalties_and_logit_bias_follow_openai():
    x = torch.zeros(6)
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={4: 3.0, 5: -100.0}))
    for t in (1, 1, 2):
        s.accept(t)
    adj = s.adjust(x)
    expect = torch.tensor([0.0, -(2 * 0.25 + 0.5), -(0.25 + 0.5), 0.0, 3.0, -100.0])
    assert torch.allclose(adj, expect)
    assert torch.equal(x, torch.zeros(6))  # the model's logits are not touched
    greedy = Sampler(SamplingParams(temperature=0, frequency_penalty=2.0))
    y = torch.tensor([1.0, 0.0])
    assert greedy.pick(y, 0).token == 0
    greedy.accept(0)
    assert greedy.pick(y, 1).token == 1  # 1 - 2 < 0


def test_mask_limits_the_draw():
    x = logits(3)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[4, 9]] = True
    for pos in range(50):
        assert Sampler(SamplingParams(temperature=1.0, seed=pos)).pick(x, pos, mask).token in (4, 9)
    assert Sampler(SamplingParams(temperature=0)).pick(x, 0, mask).token == (4 if x[4] > x[9] else 9)


def test_logprobs_come_from_the_model_distribution():
    x = logits(5)
    lp = torch.log_softmax(x, -1)
    pick = Sampler(SamplingParams(temperature=0.0, top_logprobs=3, presence_penalty=1.0)).pick(x, 0)
    assert pick.logprob == pytest.approx(float(lp[pick.token]))
    top_ids = torch.topk(lp, 3).indices.tolist()
    assert [i for i, _ in pick.top] == top_ids
    assert all(math.isclose(v, float(lp[i]), rel_tol=1e-6) for i, v in pick.top)
    assert Sampler(SamplingParams(temperature=0.0)).pick(x, 0).logprob is None


def test_random_seeds_differ():
    assert len({random_seed() for _ in range(20)}) == 20
