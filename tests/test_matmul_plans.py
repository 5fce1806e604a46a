"""The CUDA kernels' host-side choices: which layout and split a weight shape gets, how attention cuts the context."""

from __future__ import annotations

from tandem_core.ops import triton_matmul as tm


def test_the_heuristic_plan_is_the_wide_swapped_layout():
    p = tm.plan_for(34816, 5120)
    assert (p.layout, p.BN, p.BK, p.stages) == ("wy", 64, 128, 3)


def test_k_is_split_while_the_column_tiles_leave_multiprocessors_idle():
    assert tm.plan_for(5120, 6144).split == 2              # 80 tiles; a third cut would leave 12 steps a part
    assert tm.plan_for(5120, 17408).split == 4             # 80 tiles, then 160, then 320 >= 2 per multiprocessor
    assert tm.plan_for(34816, 5120).split == 1             # 544 tiles
    assert tm.plan_for(64, 256).split == 1                 # K too short to cut (fewer than 16 steps a part)


def test_a_tuned_plan_wins_over_the_heuristic():
    plan = tm.MatmulPlan(128, 128, 1, 4, 3, "xw")
    tm.set_plan(1234, 5120, plan)
    try:
        assert tm.plan_for(1234, 5120) is plan
    finally:
        tm._PLANS.pop((1234, 5120))


def test_the_attention_scratch_holds_every_split_of_the_context_and_refuses_a_ragged_split():
    import pytest
    import torch

    from tandem_core.ops import triton_attention as ta

    sc = ta.AttnScratch(4, 6, 32, 1000, torch.device("cpu"), split=128)
    assert (sc.split, sc.splits) == (128, 8) and sc.acc.shape == (8, 24, 32)
    assert ta.AttnScratch(1, 6, 32, 1000, torch.device("cpu")).split == ta.SPLIT
    with pytest.raises(ValueError, match="split 100"):
        ta.AttnScratch(4, 6, 32, 1000, torch.device("cpu"), split=100)
