"""The CUDA matmul plans are chosen on the host: which layout and split a weight shape gets for a row count."""

from __future__ import annotations

import pytest

from tandem_core.ops import triton_matmul as tm


@pytest.mark.parametrize("rows, layout", [(1, "wx"), (16, "wx"), (17, "xw"), (64, "xw"), (128, "xw")])
def test_the_layout_follows_the_widest_verify(rows, layout):
    assert tm.plan_for(34816, 5120, rows).layout == layout


def test_k_is_split_only_when_the_column_tiles_leave_multiprocessors_idle():
    assert tm.plan_for(5120, 17408, 1).split == 2          # 80 tiles of 64 columns
    assert tm.plan_for(5120, 17408, 64).split == 2         # 40 tiles of 128
    assert tm.plan_for(34816, 5120, 1).split == 1          # 544 tiles
    assert tm.plan_for(64, 256, 1).split == 1              # K too short to halve (fewer than 4 steps a part)


def test_a_tuned_plan_wins_over_the_heuristic_for_every_row_count():
    plan = tm.MatmulPlan(128, 128, 1, 4, 3, "xw")
    tm.set_plan(1234, 5120, plan)
    try:
        assert tm.plan_for(1234, 5120, 1) is plan and tm.plan_for(1234, 5120, 128) is plan
    finally:
        tm._PLANS.pop((1234, 5120))
