"""The persistent wide tile's handoff programs (tests/wide_handoffs.py) under random schedules, no
GPU and no compiler: every schedule finishes (no deadlock), every wait passes on its own phase,
and warpgroup 0 refills KV_s, Q_s and dO_s for a row only after warpgroup 1's last reads of the
row before. tests/test_kernels_compile.py checks that the generated CUDA runs these programs."""

import random

import pytest

from mqa_bwd.kernels.wide import KV_FREE, PDS_FREE, ROW_FREE, ROW_READY
from wide_handoffs import ProtocolError, random_rows, run


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "fixed or atomic"])
def test_the_persistent_handoffs_hold_under_random_schedules(lanes):
    rng = random.Random(1)
    for _ in range(3000):
        run(random_rows(rng), rng, lanes)


@pytest.mark.parametrize("kept,refilled", [((PDS_FREE,), "KV_s"), ((KV_FREE,), "Q_s")],
                         ids=["without KV_FREE", "without PDS_FREE"])
@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "fixed or atomic"])
def test_a_row_start_without_either_wait_is_caught(kept, refilled, lanes):
    # The model must be able to fail: with one of a row start's two waits dropped, some schedule
    # refills the buffer that wait guards while warpgroup 1 still reads it.
    rng = random.Random(2)
    with pytest.raises(ProtocolError, match=f"^{refilled} refilled"):
        for _ in range(3000):
            run(random_rows(rng), rng, lanes, row_start_waits=kept)


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "fixed or atomic"])
def test_a_claim_that_waits_only_for_the_item_before_is_caught(lanes):
    # The model must be able to fail: a claim that waits for warpgroup 1 to read the item before
    # (its word is free) rather than this one lets one side run two phases ahead of the other's
    # parity wait on a row handoff, which would alias.
    early = (("wait", ROW_FREE, "item before", "after an item"), ("arrive", ROW_READY, None, None))
    rng = random.Random(3)
    with pytest.raises(ProtocolError, match=f"passes a wait on phase .* of mbarrier ({ROW_READY}|{ROW_FREE}) "):
        for _ in range(3000):
            run(random_rows(rng), rng, lanes, claim=early)
