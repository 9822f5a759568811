"""The host wrapper on the CPU tile model: agreement with the oracle over edge
shapes, budget invariance, the #1784 bug caught by the bounds-checked model,
rejections before any launch, framework round trips."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

import mqa_bwd
from mqa_bwd.contract import OUTPUT_NAMES, SPEC_ARGS
from mqa_bwd import fixed_point, kernels, launch, layout, wrapper
from mqa_bwd.contract import Instruments
from mqa_bwd.model import ModelLauncher, TileBoundsError
from properties.case import INVALID_KINDS, SINKS, Case, expected, to_framework
from properties.checks import bitwise_difference
from properties.compare import compare, first_difference
from model_calls import call_model, slots_by_hand
from wide_grid import TileALaunch

ARGS = SPEC_ARGS
HEADS = (1, 2, 3, 5, 8, 13, 16, 17, 24, 31, 32, 33, 40, 48, 57, 63, 64, 65, 96, 127, 128)
SLOTS = (1, 31, 32, 33, 129)


def call(inputs, **kw):
    return mqa_bwd.mqa_latent_sparse_bwd(*[inputs[k] for k in ARGS], **kw)


def edge_cases():
    widths = ((16, 16), (32, 16), (64, 32), (48, 48))
    for n, (H, L) in enumerate(zip(HEADS, itertools.cycle(SLOTS))):
        d_k, d_v = widths[n % len(widths)]
        yield Case(
            B=1 + n % 2, S=2 + n % 3, S_kv=1 if n % 7 == 3 else 5 + n % 11, H=H, L=L, d_k=d_k, d_v=d_v,
            pattern=("random", "causal")[n % 2], invalid=INVALID_KINDS, hole_rate=0.25, duplicates=n % 3 == 0,
            empty_rows=n % 2, sink=SINKS[n % len(SINKS)], seed=1000 + n,
        )


@pytest.mark.parametrize("case", list(edge_cases()), ids=lambda c: f"H{c.H}-L{c.L}-Skv{c.S_kv}-{c.sink}")
def test_model_agrees_with_oracle(case):
    host = case.inputs()
    dq, dkv, dsink = call_model(to_framework(host))
    (dq64, dkv64, ds64), (dqb, dkvb, dsb) = expected(host)
    reports = [compare("dq", dq, dq64, dqb), compare("dkv", dkv, dkv64, dkvb), compare("d_attn_sink", dsink, ds64, dsb)]
    bad = [r.report() for r in reports if not r.ok]
    assert not bad, "\n".join(bad) + f"\nREPRO: {case.to_json()}"
    assert not torch.isnan(dq).any() and not torch.isnan(dkv).any() and not torch.isnan(dsink).any()


@pytest.mark.parametrize("block_h", [16, 32])
def test_both_group_widths_agree_with_oracle(block_h):
    case = Case(B=2, S=3, S_kv=9, H=40, L=33, d_k=32, d_v=16, invalid=INVALID_KINDS, hole_rate=0.2, sink="random", seed=7)
    host = case.inputs()
    got = call(to_framework(host), backend="model", block_h=block_h)
    (e64, eb) = expected(host)
    for name, g, w, b in zip(("dq", "dkv", "d_attn_sink"), got, e64, eb):
        r = compare(name, g, w, b)
        assert r.ok, r.report()


def test_scratch_budget_changes_no_bit():
    case = Case(B=2, S=7, S_kv=6, H=20, L=40, d_k=32, d_v=16, duplicates=True, invalid=("minus_one",), hole_rate=0.1, seed=3)
    inputs = to_framework(case.inputs())
    # From the least budget the call accepts up: the fixed design chunks nothing.
    least = wrapper.scratch_bytes(2, 7, 6, 20, 40, 32, 16)
    results = [call_model(inputs, budget) for budget in (least, least + 1, 2 * least, 3 * least, 1000 * least, None)]
    for i, name in enumerate(("dq", "dkv", "d_attn_sink")):
        diff = first_difference(name, [r[i] for r in results])
        assert diff is None, diff


@pytest.mark.parametrize("step", [1, 100])
def test_index_layout_in_bounded_steps_changes_no_bit(monkeypatch, step):
    # The slot layout scans the indices a bounded number of slots at a time;
    # the step must not show in any output.
    case = Case(B=2, S=7, S_kv=9, H=20, L=40, invalid=INVALID_KINDS, hole_rate=0.2, empty_rows=1, seed=12)
    inputs = to_framework(case.inputs())
    whole = call_model(inputs)
    monkeypatch.setattr(wrapper, "INDEX_STEP", step)
    stepped = call_model(inputs)
    for name, a, b in zip(("dq", "dkv", "d_attn_sink"), whole, stepped):
        assert bitwise_difference(name, b, a) is None


def test_a_rows_sort_takes_the_fewest_keys_a_thread_that_hold_it():
    # sorted_slots is built for 2, 4 and 8 keys a thread (256 threads): a row of Lp slots takes
    # the smallest build that holds Lp, fleet's 640 the 4-key one, dsv32's 2048 the 8-key one.
    capacity = {items: kernels.config.SORT_THREADS * items for items in kernels.SORT_ITEM_COUNTS}
    for padded in (1, 64, 512, 513, 640, 1024, 1025, 2047, 2048):
        items = kernels.sort_items(padded)
        assert capacity[items] >= padded, (padded, items)
        assert all(capacity[fewer] < padded for fewer in kernels.SORT_ITEM_COUNTS if fewer < items), (padded, items)
    assert kernels.sort_items(kernels.SORT_CAPACITY) == max(kernels.SORT_ITEM_COUNTS)
    for padded in (0, kernels.SORT_CAPACITY + 1):
        with pytest.raises(ValueError, match="^padded_slots: "):
            kernels.sort_items(padded)
    with pytest.raises(ValueError, match="^items: 3"):
        kernels.sorted_slots_program("int32", 3)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
@pytest.mark.parametrize("step_rows", [None, 3])
def test_the_one_step_slot_layout_is_the_three_steps(dtype, step_rows, monkeypatch):
    # Rows that fit one CTA of the fused kernel take one launch a step (sorted_slots) and keep
    # no sort keys; the result is slot_keys, the canonical sort and place_slots' (the path a
    # caller's order, or a longer row, takes). Every invalid kind, duplicates, B > 1, indices
    # the kernels read and one they do not (int16, converted a step at a time).
    case = Case(B=2, S=7, S_kv=40, H=16, L=37, invalid=INVALID_KINDS, hole_rate=0.3, duplicates=True, seed=5)
    info = torch.iinfo(dtype)
    idx = torch.from_numpy(case.indices()).to(torch.int64).clamp(info.min, info.max).to(dtype)
    if step_rows:
        monkeypatch.setattr(wrapper, "INDEX_STEP", step_rows * 37)
    p = wrapper.Problem(B=2, S=7, S_kv=40, H=16, L=37, d_k=64, d_v=32, block_h=16, dkv_buf_bytes=None)
    assert p.sorts_in_one_step and "slot sort keys" not in p.scratch()
    fused_counts, steps_counts = Instruments(), Instruments()
    fused = wrapper.global_slots(idx, p, ModelLauncher(instruments=fused_counts))
    three = wrapper.global_slots(idx, p, ModelLauncher(instruments=steps_counts),  # the same order, not the
                                 order=lambda keys: wrapper.canonical_order(keys))  # function: three steps
    assert bitwise_difference("slots", fused, three) is None
    launches = -(-p.rows // (step_rows or p.rows))
    assert fused_counts.counts["launch:sorted_slots"] == launches and "launch:slot_keys" not in fused_counts.counts
    # The fused kernel writes the rows' block counts whether or not the caller asked for them
    # (beside the slots, in one allocation); the three steps keep their sort keys.
    assert fused_counts.counts["allocations"] == 1 and steps_counts.counts["allocations"] == 2
    assert steps_counts.counts["launch:slot_keys"] == launches
    assert "launch:row_blocks" not in fused_counts.counts and "launch:row_blocks" not in steps_counts.counts
    # Asked for, the block counts come with the fused launches, else from a row_blocks launch
    # after the three steps: the reference's counts either way (a row of no valid slot, 0).
    empty_row = idx.clone()
    empty_row[1, 2] = -1
    fused_blocks, three_blocks = (torch.full((p.rows,), -7, dtype=torch.int32) for _ in range(2))
    fused_counts, steps_counts = Instruments(), Instruments()
    laid = wrapper.global_slots(empty_row, p, ModelLauncher(instruments=fused_counts), row_blocks=fused_blocks)
    wrapper.global_slots(empty_row, p, ModelLauncher(instruments=steps_counts),
                         order=lambda keys: wrapper.canonical_order(keys), row_blocks=three_blocks)
    want = layout.row_blocks(laid, p.B * p.S_kv, kernels.WIDE_SLOTS)
    assert torch.equal(fused_blocks, want) and torch.equal(three_blocks, want)
    assert want.tolist() == [1] * 9 + [0] + [1] * 4
    assert "launch:row_blocks" not in fused_counts.counts and fused_counts.counts["allocations"] == 1
    assert steps_counts.counts["launch:row_blocks"] == 1
    # The deterministic design's layout also fills the plan's slot marks: in the same launches
    # where rows fit a CTA (sorted_marks), else with a mark_slots launch after the three steps;
    # the same marks either way, and mark_slots' own.
    q = torch.randn((p.rows, 3, p.d_k), generator=torch.Generator().manual_seed(1)).bfloat16()

    def marks():
        return torch.zeros(p.B * p.S_kv, dtype=torch.int32), torch.zeros(p.rows, dtype=torch.int32), q, torch.full(
            (p.rows, 3), -7, dtype=torch.int32)

    fused_marks, three_marks, alone = marks(), marks(), marks()
    fused_counts, steps_counts = Instruments(), Instruments()
    wrapper.global_slots(idx, p, ModelLauncher(instruments=fused_counts), marks=fused_marks)
    wrapper.global_slots(idx, p, ModelLauncher(instruments=steps_counts), order=lambda keys: wrapper.canonical_order(keys),
                         marks=three_marks)
    ModelLauncher().mark_slots(fused, *alone)
    assert "launch:mark_slots" not in fused_counts.counts and fused_counts.counts["launch:sorted_slots"] == launches
    assert steps_counts.counts["launch:mark_slots"] == 1
    for name, got, other, want in zip(("referenced", "live_row", "q", "peak_q"), fused_marks, three_marks, alone):
        assert torch.equal(got, want) and torch.equal(other, want), name
    assert 0 < int(alone[0].sum()) < p.B * p.S_kv and int(alone[1].sum()) > 0 and bool((alone[3] > 0).all())
    # A Referenced shorter than the kv rows would be overrun by the kernel's marks: refused.
    short = (torch.zeros(p.B * p.S_kv - 1, dtype=torch.int32),) + marks()[1:]
    flat, slots = idx.reshape(p.rows, p.L).to(torch.int64), torch.empty((p.rows, p.padded_slots), dtype=torch.int32)
    counts = torch.empty((p.rows,), dtype=torch.int32)
    rows = (flat, slots, counts, 0, p.S, p.S_kv, p.B * p.S_kv, short)
    with pytest.raises(TileBoundsError, match="^sorted_slots: Referenced"):
        ModelLauncher().sorted_slots(*rows)
    with pytest.raises(ValueError, match=r"^referenced: shape \(79,\)"):
        launch.TileLangLauncher().sorted_slots(*rows)
    # A CTA a row writes the row's block count: fewer counts than rows would be overrun.
    few = (flat, slots, counts[:-1], 0, p.S, p.S_kv, p.B * p.S_kv)
    with pytest.raises(TileBoundsError, match=r"^sorted_slots: RowBlocks \(shape \(13,\)"):
        ModelLauncher().sorted_slots(*few)
    with pytest.raises(ValueError, match=r"^row_blocks: shape \(13,\), sorted_slots writes \(14,\)"):
        launch.TileLangLauncher().sorted_slots(*few)
    # The model holds the kernel to its tile: a row longer than one CTA sorts is refused.
    long_row = torch.zeros((2, kernels.SORT_CAPACITY + 64), dtype=torch.int32)
    two = torch.empty((2,), dtype=torch.int32)
    with pytest.raises(TileBoundsError, match="^sorted_slots: Slots"):
        ModelLauncher().sorted_slots(long_row[:, :40], long_row, two, 0, 7, 40, 80)
    # And the TileLang launcher, before it looks for the kernel.
    with pytest.raises(ValueError, match=rf"^slots: rows of {kernels.SORT_CAPACITY + 64} slots for 40 indices"):
        launch.TileLangLauncher().sorted_slots(long_row[:, :40], long_row, two, 0, 7, 40, 80)


def test_the_slot_layout_is_one_order_for_every_order_of_a_rows_slots():
    # Ascending global kv rows, invalid slots (every kind, now -1) last, then each row's walk
    # rotated by its position: a permutation of a row's indices, duplicates and invalid ones
    # included, gives the same layout.
    case = Case(B=2, S=5, S_kv=40, H=16, L=70, invalid=INVALID_KINDS, hole_rate=0.3, duplicates=True, seed=3)
    idx = torch.from_numpy(case.indices())
    p = wrapper.Problem(B=2, S=5, S_kv=40, H=16, L=70, d_k=64, d_v=32, block_h=16, dkv_buf_bytes=None)
    slots = wrapper.global_slots(idx, p, ModelLauncher())
    g = torch.Generator().manual_seed(0)
    shuffled = torch.gather(idx, -1, torch.argsort(torch.rand(idx.shape, generator=g), dim=-1))
    assert torch.equal(wrapper.global_slots(shuffled, p, ModelLauncher()), slots)
    # Undo each row's rotation: the sorted layout.
    block = kernels.WALK_BLOCK
    blocks = -(-(slots >= 0).sum(dim=1) // block)
    starts = torch.arange(p.rows) % p.S % blocks.clamp(min=1)
    assert bool((starts > 0).any()), "no row's walk is rotated: the case does not test it"
    ordered = slots.clone()
    for r in range(p.rows):
        span = int(blocks[r]) * block
        ordered[r, :span] = torch.roll(slots[r, :span], int(starts[r]) * block)
    valid = ordered >= 0
    assert bool((valid[:, 1:] <= valid[:, :-1]).all()), "an invalid slot before a valid one"
    keys = torch.where(valid, ordered, torch.iinfo(torch.int32).max)
    assert bool((keys[:, 1:] >= keys[:, :-1]).all())
    assert bool((slots[:, p.L :] == -1).all())
    # The caller's order stays available as the identity (the mutant that keeps it).
    kept = wrapper.global_slots(shuffled, p, ModelLauncher(), order=wrapper.caller_order)
    assert not torch.equal(kept, slots)


def test_neighbouring_rows_with_the_same_slots_walk_them_from_different_blocks():
    # Rows that name the same kv rows (an indexer's picks, sorted alike) would add into the same
    # lines block by block if walked in plain ascending order; rotated by their positions, rows
    # s and s + 1 take different blocks first, each row keeps its slots, and a row's position in
    # its sequence, not in the batch, sets its start (batch invariance).
    S, L, block = 6, 4 * kernels.WALK_BLOCK + 5, kernels.WALK_BLOCK  # 5 blocks, the last partial
    idx = torch.arange(L).repeat(2, S, 1)
    p = wrapper.Problem(B=2, S=S, S_kv=L, H=16, L=L, d_k=64, d_v=32, block_h=16, dkv_buf_bytes=None)
    slots = wrapper.global_slots(idx, p, ModelLauncher())
    first = slots[:, 0].tolist()
    assert first[:S] == [(s % 5) * block for s in range(S)]
    assert first[S:] == [L + (s % 5) * block for s in range(S)]  # batch element 1: its kv rows, the same starts
    for r in range(2 * S):
        assert sorted(slots[r][slots[r] >= 0].tolist()) == list(range((r // S) * L, (r // S + 1) * L))
    assert bool((slots[:, 5 * block :] == -1).all())


@pytest.mark.parametrize("B,S,L,dtype,step_rows", [
    (1, 6, 64, torch.int32, None),   # one step, no padding: the layout is the sort's own tensor
    (1, 6, 64, torch.int64, None),
    (3, 4, 37, torch.int32, None),   # batch offsets, padding
    (2, 5, 64, torch.int16, 2),      # several steps
    (2, 3, 33, torch.uint8, None),
])
def test_the_slot_layout_matches_one_written_by_hand(monkeypatch, B, S, L, dtype, step_rows):
    # Indices at both ends of the dtype, 2**40 for int64: invalid; int32 works in int32.
    S_kv = 40
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(B * 100 + L)
    idx = torch.randint(-3, S_kv + 3, (B, S, L), generator=g).clamp(info.min, info.max).to(dtype)
    idx.view(-1)[::7] = info.max
    idx.view(-1)[::11] = info.min
    if dtype == torch.int64:
        idx.view(-1)[::13] = 2**40
    if step_rows:
        monkeypatch.setattr(wrapper, "INDEX_STEP", step_rows * L)
    p = wrapper.Problem(B=B, S=S, S_kv=S_kv, H=16, L=L, d_k=64, d_v=32, block_h=16, dkv_buf_bytes=None)
    slots = wrapper.global_slots(idx, p, ModelLauncher())
    assert slots.dtype == torch.int32 and slots.shape == (B * S, p.padded_slots)
    assert np.array_equal(slots.numpy(), slots_by_hand(idx.numpy(), S_kv, p.padded_slots))


@pytest.mark.parametrize("S", [1, 4096, 1 << 20])
def test_fixed_point_scratch_is_independent_of_s_and_l(S):
    p = wrapper.Problem(B=1, S=S, S_kv=8192, H=128, L=2048, d_k=576, d_v=512, block_h=32, dkv_buf_bytes=None)
    assert p.fixed_bytes == 8192 * 576 * 8


class _LaunchLog(ModelLauncher):
    """Records what every main_bwd launch was handed."""

    def __init__(self, deterministic=True):
        super().__init__(deterministic)
        self.launches = []

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, **kw):
        self.launches.append({"q": q, "dO": grad_out, "dQ": dq, **kw})
        super().main_bwd(q, kv, grad_out, indices, lse2, delta, dq, dkv, **kw)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("H,block_h,expected", [
    (96, 32, [(32, 0, 64), (32, 64, 32)]),  # groups 0 and 1 as one wide tile, group 2 alone
    (48, 16, [(16, 0, 16), (16, 32, 16)]),  # fixed: a cluster of two 16-head groups, then one
])
def test_head_groups_are_read_in_place_not_copied(deterministic, H, block_h, expected):
    # Per-group copies of q, dO and dq would make scratch grow with S * H * Dk:
    # every group's launch gets the caller's q and grad_out storage, one dq,
    # and its own head offset. Pairs of groups run as one launch where a
    # kernel for the pair exists (kernels.main_launches).
    inputs = to_framework(Case(B=2, S=5, S_kv=9, H=H, L=33, d_k=32, d_v=16, seed=4).inputs())
    launcher = _LaunchLog(deterministic)
    wrapper.backward_with(launcher, *[inputs[k] for k in ARGS], block_h=block_h)
    launches = [(x["heads"], x["head_base"], x["config"].heads) for x in launcher.launches]
    if block_h == 16 and not deterministic:  # the control pairs no 16-head groups
        expected = [(16, 0, 16), (16, 16, 16), (16, 32, 16)]
    wide = deterministic and block_h == 32
    if wide:  # the wide tile adds in lanes; its corrections and its int64 redo (gated) launch after the others
        expected = expected + [expected[0], expected[0]]
        assert [(x["config"].accumulate, x["config"].corrections) for x in launcher.launches] == [
            ("lanes", False), ("fixed", False), ("lanes", True), ("fixed", False)]
        assert launcher.launches[-1]["gate"] is launcher.lanes_redone
    assert launches == expected
    pairs = len(expected) == 2 or wide  # every launch but the lone group's runs a pair of groups
    assert [x["config"].groups for x in launcher.launches] == ([2, 1, 2, 2] if wide else [2, 1] if pairs else [1, 1, 1])
    for x in launcher.launches:
        assert x["q"].data_ptr() == inputs["query"].data_ptr()
        assert x["dO"].data_ptr() == inputs["grad_out"].data_ptr()
        assert x["dQ"].data_ptr() == launcher.launches[0]["dQ"].data_ptr() and x["dQ"].shape[1] == H


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_wide_tiles_of_a_call_run_in_one_grid(deterministic):
    # H=160 in 32-head groups: groups 0-3 as one wide grid of two 64-head tiles from head 0,
    # group 4 alone; the deterministic call's corrections and gated int64 redo launch the same grid.
    inputs = to_framework(Case(B=2, S=5, S_kv=9, H=160, L=33, d_k=32, d_v=16, seed=4).inputs())
    launcher = _LaunchLog(deterministic)
    wrapper.backward_with(launcher, *[inputs[k] for k in ARGS], block_h=32)
    launches = [(x["head_base"], x["config"].heads, x["config"].tiles, x["config"].accumulate, x["config"].corrections)
                for x in launcher.launches]
    if deterministic:
        assert launches == [(0, 64, 2, "lanes", False), (128, 32, 1, "fixed", False), (0, 64, 2, "lanes", True),
                            (0, 64, 2, "fixed", False)]
    else:
        assert launches == [(0, 64, 2, "atomic", False), (128, 32, 1, "atomic", False)]


class _ModelTileALaunch(TileALaunch, ModelLauncher):
    """The wide tile's 64-head tiles as a launch each, on the CPU model."""


@pytest.mark.parametrize("seed", range(6))
def test_the_models_wide_grid_adds_what_a_launch_a_tile_adds(seed):
    # Each tile of a grid sums its own 64 heads' contributions (two 32-head groups) before its
    # integer adds, as a launch of that tile alone does: the same dkv bits. Summed over other
    # head splits, the rounded contributions differ in their last bits for some seeds.
    inputs = to_framework(Case(B=2, S=5, S_kv=40, H=128, L=33, d_k=32, d_v=16, seed=seed).inputs())
    args = [inputs[k] for k in ARGS]
    want = wrapper.backward_with(_ModelTileALaunch(), *args)
    got = wrapper.backward_with(ModelLauncher(), *args)
    for name, x, y in zip(("dq", "dkv", "d_attn_sink"), got, want):
        assert bitwise_difference(name, x, y) is None, bitwise_difference(name, x, y)


def test_model_slot_marks():
    # mark_slots: kv rows some valid slot names; query rows with a valid slot.
    # Slots past either end (12 and 13 with 12 kv rows, -3) mark nothing.
    # The same launch gives the plan max |q| of each (row, head) as bf16 bits.
    slots = torch.tensor([[0, 5, -1, 9], [-1, -1, -1, -1], [12, 13, 12, -3]], dtype=torch.int32)
    referenced, live_row = torch.zeros(12, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    q = torch.tensor([[[1.0, -3.0], [0.5, 0.25]], [[-2.0, float("nan")], [0.0, -0.0]], [[float("-inf"), 1.0], [7.0, -8.0]]],
                     dtype=torch.bfloat16)
    peak_q = torch.full((3, 2), -7, dtype=torch.int32)
    ModelLauncher().mark_slots(slots, referenced, live_row, q, peak_q)
    assert torch.nonzero(referenced).reshape(-1).tolist() == [0, 5, 9]
    assert live_row.tolist() == [1, 0, 0]
    got = fixed_point.bits_to_bf16(peak_q)
    assert got[0].tolist() == [3.0, 0.5] and torch.isnan(got[1, 0]) and got[1, 1] == 0.0
    assert got[2, 0] == float("inf") and got[2, 1] == 8.0


@pytest.mark.parametrize("mode", ["fixed", "atomic"])
def test_every_mode_needs_a_slot_block(mode):
    # The kernel gathers the first block before its loop and adds the last
    # block after it, from the state the loop leaves.
    R, HQ, Dk, Dv, NKV = 2, 16, 32, 16, 4
    t = (torch.zeros((R, HQ, Dk), dtype=torch.bfloat16), torch.zeros((NKV, Dk), dtype=torch.bfloat16),
         torch.zeros((R, HQ, Dv), dtype=torch.bfloat16), torch.zeros((R, 0), dtype=torch.int32),
         torch.zeros((R, HQ)), torch.zeros((R, HQ)), torch.zeros((R, HQ, Dk), dtype=torch.bfloat16))
    dkv = torch.zeros((NKV, Dk), dtype=torch.int64 if mode == "fixed" else torch.float32)
    config = kernels.MainConfig(16, Dk, Dv, mode)
    with pytest.raises(RuntimeError, match="at least one slot block"):
        ModelLauncher().main_bwd(*t, dkv, config=config, sm_scale=1.0, heads=16)


def test_a_tile_wider_than_its_group_is_caught_inside_a_wider_tensor():
    # #1784 in place: a group of 8 heads at head_base 8 of a 32-head tensor. The
    # 16-row tile would read and write heads 16-23 (the next group's), still
    # inside the tensor, where no guard band can see it.
    R, HQ, Dk, Dv, NKV = 2, 32, 32, 16, 4
    t = {
        "q": torch.zeros((R, HQ, Dk), dtype=torch.bfloat16), "kv": torch.zeros((NKV, Dk), dtype=torch.bfloat16),
        "grad_out": torch.zeros((R, HQ, Dv), dtype=torch.bfloat16), "indices": torch.zeros((R, 32), dtype=torch.int32),
        "lse2": torch.zeros((R, HQ)), "delta": torch.zeros((R, HQ)), "dq": torch.zeros((R, HQ, Dk), dtype=torch.bfloat16),
        "dkv": torch.zeros((NKV, Dk)),
    }
    with pytest.raises(TileBoundsError, match=r"main_bwd: Q head row 16 is outside \[8, 16\)"):
        ModelLauncher(deterministic=False).main_bwd(*t.values(), config=kernels.main_config(8, Dk, Dv, False),
                                                    sm_scale=1.0, heads=8, head_base=8)
    # The same group in 16-head steps is legal.
    ModelLauncher(deterministic=False).main_bwd(*t.values(), config=kernels.main_config(16, Dk, Dv, False),
                                                sm_scale=1.0, heads=16, head_base=16)


def _unpadded_call(inputs, H):
    """The #1784 wrapper: a head count below block_h goes to the kernel unpadded."""
    t = {k: v for k, v in inputs.items()}
    launcher = ModelLauncher()
    p = wrapper.validate(*[t[k] for k in ARGS], 16, None, launcher, design=launcher.deterministic)
    p = dataclasses.replace(p, pad_heads=False)
    assert p.group_width == H
    return wrapper.run(p, *[t[k] for k in ARGS[:-1]], t["sm_scale"], launcher)


def test_without_head_padding_an_8_head_call_touches_rows_past_the_tile():
    inputs = to_framework(Case(H=8, S=2, S_kv=5, L=4, d_k=32, d_v=16, seed=2).inputs())
    with pytest.raises(TileBoundsError) as err:
        _unpadded_call(inputs, 8)
    assert (err.value.kernel, err.value.tensor, err.value.row) == ("main_bwd", "Q", 8)
    assert "main_bwd: Q head row 8 is outside [0, 8)" in str(err.value)
    # ...and the padded wrapper (what ships) serves the same call.
    dq, dkv, dsink = call(inputs, backend="model")
    assert dq.shape == (1, 2, 8, 32)


def test_pad_heads_are_inert_and_sliced():
    case = Case(B=1, S=3, S_kv=7, H=5, L=9, d_k=32, d_v=16, sink="random", seed=11)
    host = case.inputs()
    dq, dkv, dsink = call(to_framework(host), backend="model")
    assert dq.shape == (1, 3, 5, 32) and dsink.shape == (5,)
    # Appending zero heads by hand (q = dO = out = 0, lse = 0, sink = -1e30) changes nothing real.
    padded = dict(host)
    extra = 11
    for name in ("query", "out", "grad_out"):
        a = host[name]
        padded[name] = np.concatenate([a, np.zeros(a.shape[:2] + (extra,) + a.shape[3:], a.dtype)], axis=2)
    padded["lse"] = np.concatenate([host["lse"], np.zeros(host["lse"].shape[:2] + (extra,), np.float32)], axis=2)
    padded["attn_sink"] = np.concatenate([host["attn_sink"], np.full(extra, -1e30, np.float32)])
    dq2, dkv2, dsink2 = call(to_framework(padded), backend="model")
    for name, got, want in (("dq", dq2[:, :, :5], dq), ("dkv", dkv2, dkv), ("d_attn_sink", dsink2[:5], dsink)):
        assert bitwise_difference(name, got, want) is None
    assert torch.count_nonzero(dsink2[5:]) == 0 and torch.count_nonzero(dq2[:, :, 5:].float()) == 0


class _RecordingAtomicModel(ModelLauncher):
    """The atomic control, keeping the dKV accumulator it casts at the end
    (fp32, or int64 fixed point when made deterministic)."""

    def __init__(self):
        super().__init__(deterministic=False)
        self.accumulators = []

    def cast_bf16(self, src, dst):
        self.accumulators.append(src.clone())
        super().cast_bf16(src, dst)

    def fixed_to_bf16(self, acc, row_scale, poisoned, dst):
        self.accumulators.append(acc.clone())
        super().fixed_to_bf16(acc, row_scale, poisoned, dst)


def test_atomic_model_is_not_bitwise_reproducible():
    # The final bf16 cast hides most fp32 order effects on small cases (as on a
    # GPU), so compare the fp32 accumulator the atomics produce.
    inputs = to_framework(Case(B=1, S=48, S_kv=2, H=16, L=8, d_k=32, d_v=16, seed=5).inputs())
    launcher = _RecordingAtomicModel()
    dqs = [wrapper.backward_with(launcher, *[inputs[k] for k in ARGS])[0] for _ in range(4)]
    assert first_difference("dkv fp32 accumulator", launcher.accumulators) is not None
    assert first_difference("dq", dqs) is None  # dq has one writer per row


def test_deterministic_model_accumulator_is_bitwise_stable():
    inputs = to_framework(Case(B=1, S=48, S_kv=2, H=16, L=8, d_k=32, d_v=16, seed=5).inputs())
    launcher = _RecordingAtomicModel()
    launcher.deterministic = True
    for _ in range(4):
        wrapper.backward_with(launcher, *[inputs[k] for k in ARGS])
    assert len(launcher.accumulators) == 4
    assert first_difference("dkv accumulator", launcher.accumulators) is None


def test_paddle_in_paddle_out():
    paddle = pytest.importorskip("paddle")
    case = Case(H=3, S=2, S_kv=4, L=5, d_k=32, d_v=16, seed=4)
    host = case.inputs()
    got = call(to_framework(host, "paddle"), backend="model")
    ref = call(to_framework(host, "torch"), backend="model")
    for name, g, r, dtype in zip(OUTPUT_NAMES, got, ref, (paddle.bfloat16, paddle.bfloat16, paddle.float32)):
        assert isinstance(g, paddle.Tensor) and g.dtype == dtype
        assert bitwise_difference(name, g, r) is None


def test_tensors_of_another_framework_than_querys_are_rejected_naming_them():
    pytest.importorskip("paddle")
    host = Case(H=3, S=2, S_kv=4, L=5, d_k=32, d_v=16, seed=4).inputs()
    for caller, other in (("torch", "paddle"), ("paddle", "torch")):
        for name in ("kv", "token_indices"):
            tensors = to_framework(host, caller)
            tensors[name] = to_framework(host, other)[name]
            instruments = Instruments()
            with pytest.raises(ValueError, match=rf"^{name}: a {other} tensor, but query is a {caller} tensor"):
                call(tensors, backend="model", instruments=instruments)
            assert not instruments.counts


# -- rejection ---------------------------------------------------------------


def _good():
    return to_framework(Case(B=1, S=2, S_kv=4, H=3, L=5, d_k=32, d_v=16, seed=9).inputs())


def _mutations():
    bf = torch.bfloat16
    yield "query", lambda a: a.update(query=a["query"].float())
    yield "kv", lambda a: a.update(kv=a["kv"].half())
    yield "out", lambda a: a.update(out=a["out"].float())
    yield "grad_out", lambda a: a.update(grad_out=a["grad_out"].float())
    yield "query", lambda a: a.update(query=a["query"][0])
    yield "kv", lambda a: a.update(kv=a["kv"][:, :, :16])
    yield "kv", lambda a: a.update(kv=torch.cat([a["kv"], a["kv"]], 0))
    yield "out", lambda a: a.update(out=a["out"][:, :1])
    yield "grad_out", lambda a: a.update(grad_out=a["grad_out"][..., :8])
    yield "out", lambda a: a.update(out=torch.zeros(1, 2, 3, 48, dtype=bf), grad_out=torch.zeros(1, 2, 3, 48, dtype=bf))
    yield "lse", lambda a: a.update(lse=a["lse"].double())
    yield "lse", lambda a: a.update(lse=a["lse"][..., :2])
    yield "attn_sink", lambda a: a.update(attn_sink=torch.zeros(4))
    yield "attn_sink", lambda a: a.update(attn_sink=torch.zeros(1, 3))
    yield "attn_sink", lambda a: a.update(attn_sink=torch.zeros(3, dtype=bf))
    yield "token_indices", lambda a: a.update(token_indices=a["token_indices"].float())
    yield "token_indices", lambda a: a.update(token_indices=a["token_indices"][0])
    yield "token_indices", lambda a: a.update(token_indices=a["token_indices"][:, :1])
    yield "sm_scale", lambda a: a.update(sm_scale=float("nan"))
    yield "sm_scale", lambda a: a.update(sm_scale=-1.0)
    yield "query", lambda a: a.update(query=np.zeros((1, 2, 3, 32)))
    yield "query", lambda a: a.update(query=torch.zeros(1, 2, 3, 24, dtype=bf), kv=torch.zeros(1, 4, 24, dtype=bf))


@pytest.mark.parametrize("argument,mutate", list(_mutations()))
def test_bad_argument_is_rejected_before_any_launch(argument, mutate):
    a = _good()
    mutate(a)
    instruments = Instruments()
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        call(a, backend="model", instruments=instruments)
    assert not instruments.counts


def test_top_k_past_the_kernels_slot_limit_is_rejected_before_any_launch():
    # mark_slots runs a row's slots as grid-y chunks, which CUDA caps.
    a = _good()
    a.update(token_indices=torch.zeros(1, 2, kernels.MAX_SLOTS_PER_ROW + 1, dtype=torch.int32))
    instruments = Instruments()
    with pytest.raises(ValueError, match=rf"^token_indices: top-k L = {kernels.MAX_SLOTS_PER_ROW + 1} pads to"):
        call(a, backend="model", instruments=instruments)
    assert not instruments.counts


@pytest.mark.parametrize("dims", [dict(S_kv=kernels.LANES_ADDRESSABLE // 576 + 1), dict(B=2, S_kv=kernels.LANES_ADDRESSABLE // 1152 + 1)])
def test_kv_past_the_lanes_row_offsets_is_rejected_where_the_lanes_run(dims):
    # The deterministic wide tile addresses a kv row by an unsigned 32-bit offset in 16-byte units
    # (d_k / 4 a row). Checked from the shapes alone: no tensor of that size is built.
    shape = dict(B=1, S=1, S_kv=1, H=64, L=1, d_k=576, d_v=512, block_h=None, dkv_buf_bytes=None) | dims
    big = wrapper.problem_of(**shape)
    with pytest.raises(ValueError, match=rf"^kv: B\*S_kv\*d_k = \d+ exceeds {kernels.LANES_ADDRESSABLE}\b"):
        wrapper.require_lanes_addressing(big, True)
    wrapper.require_lanes_addressing(big, False)  # the atomic control adds fp32 by row index
    wrapper.require_lanes_addressing(wrapper.problem_of(**(shape | dict(H=32))), True)  # no wide launch
    largest = shape | dict(S_kv=kernels.LANES_ADDRESSABLE // (576 * shape["B"]))
    wrapper.require_lanes_addressing(wrapper.problem_of(**largest), True)


def test_kv_rows_past_int32_are_rejected_from_the_shapes_alone():
    with pytest.raises(ValueError, match=r"^kv: B\*S_kv = \d+ rows exceed int32 addressing"):
        wrapper.problem_of(B=1, S=1, S_kv=2**31, H=64, L=1, d_k=576, d_v=512, block_h=None, dkv_buf_bytes=None)


@pytest.mark.parametrize("block_h", [0, 8, 48, 64, -16, 16.0, True, "16"])
def test_illegal_block_h_is_rejected(block_h):
    instruments = Instruments()
    with pytest.raises(ValueError, match=r"^block_h\b"):
        call(_good(), backend="model", block_h=block_h, instruments=instruments)
    assert not instruments.counts


@pytest.mark.parametrize("kw,argument", [
    (dict(dkv_buf_bytes=0), "dkv_buf_bytes"),
    (dict(dkv_buf_bytes=-8), "dkv_buf_bytes"),
    (dict(backend="cuda-magic"), "backend"),
])
def test_bad_configuration_is_rejected(kw, argument):
    instruments = Instruments()
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        call(_good(), **{"backend": "model", **kw}, instruments=instruments)
    assert not instruments.counts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_backend_refused_without_a_gpu():
    with pytest.raises(ValueError, match=r"^backend\b"):
        call(_good(), backend="tilelang")


def _fixed_launch_inputs(seed=0, R=3, HQ=32, Dk=32, Dv=16, NKV=8, Lp=32):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s: (torch.randn(*s, generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    indices = torch.randint(-1, NKV, (R, Lp), generator=g, dtype=torch.int32)
    return {
        "q": bf(R, HQ, Dk), "kv": bf(NKV, Dk), "grad_out": bf(R, HQ, Dv), "indices": indices,
        "lse2": torch.full((R, HQ), 6.0), "delta": torch.randn(R, HQ, generator=g) * 0.1,
        "dq": torch.zeros((R, HQ, Dk), dtype=torch.bfloat16), "dkv": torch.zeros((NKV, Dk), dtype=torch.int64),
    }


def _fixed(t, **kw):
    NKV, R, HQ = t["kv"].shape[0], t["q"].shape[0], t["q"].shape[1]
    cluster = kw.pop("cluster", 1)
    config = kernels.MainConfig(16, t["q"].shape[2], t["grad_out"].shape[2], "fixed", cluster)
    ModelLauncher().main_bwd(*t.values(), config=config, sm_scale=0.125, heads=16,
                             row_scale=torch.full((NKV,), 2.0**20), allowance=torch.full((R, HQ), float("inf")),
                             flag=torch.zeros(R, dtype=torch.int32), **kw)
    return t


def test_a_cluster_adds_its_groups_partials_once():
    # A cluster of two head groups adds rint((p0 + p1) * scale) per slot, two
    # launches rint(p0 * scale) + rint(p1 * scale): the same dq bits, dKV
    # within one rounding unit (plus the fp32 sum's rounding) per contribution.
    pair = _fixed(_fixed_launch_inputs(), cluster=2)
    apart = _fixed_launch_inputs()
    _fixed(apart, head_base=0)
    _fixed(apart, head_base=16)
    assert bitwise_difference("dq", pair["dq"], apart["dq"]) is None
    valid = pair["indices"][(pair["indices"] >= 0)].long()
    contributions = torch.bincount(valid, minlength=pair["kv"].shape[0]).view(-1, 1)
    diff = (pair["dkv"] - apart["dkv"]).abs()
    assert bool((diff <= 2 * contributions).all()), f"max diff {int(diff.max())}"
    assert bool((diff > 0).any())  # the rounding point did move: the test sees the cluster path


def test_a_cluster_with_zero_heads_adds_the_bits_of_the_other_group_alone():
    # Padding heads (q = dO = 0) stay inert in a cluster: their partial is an
    # exact zero, so the cluster's sum is the first group's partial.
    pair = _fixed_launch_inputs()
    pair["q"][:, 16:] = 0
    pair["grad_out"][:, 16:] = 0
    _fixed(pair, cluster=2)
    alone = _fixed(_fixed_launch_inputs(), head_base=0)
    assert bitwise_difference("dkv", pair["dkv"], alone["dkv"]) is None
    assert bitwise_difference("dq", pair["dq"][:, :16], alone["dq"][:, :16]) is None


@pytest.mark.parametrize("field,kw", [
    ("cluster", dict(heads=16, accumulate="atomic", cluster=2)),  # the control pairs only as a wide tile
    ("cluster", dict(heads=32, accumulate="fixed", cluster=2)),  # two 32-head groups run as the wide tile
    ("cluster", dict(heads=16, accumulate="fixed", cluster=4)),
    ("heads", dict(heads=8)),
    ("accumulate", dict(heads=16, accumulate="shard")),
    ("d_v", dict(heads=16, d_v=48)),
    ("wg0_chunks", dict(heads=16, wg0_chunks=2)),  # a field of the wide tile only
    ("wg0_chunks", dict(heads=64, accumulate="lanes", wg0_chunks=0)),
    ("dq_split", dict(heads=32, dq_split=256)),  # a field of the wide tile only
    ("dq_split", dict(heads=64, accumulate="lanes", dq_split=100)),
])
def test_main_configurations_are_validated_naming_the_field(field, kw):
    kw = {"d_k": 32, "d_v": 16, **kw}
    with pytest.raises(ValueError, match=rf"^{field}: "):
        kernels.MainConfig(**kw)


def test_the_launcher_overrides_only_the_wide_tiles_own_fields():
    # An A/B passes configurations: the wide tile's own fields, never the shape or the accumulation.
    with pytest.raises(ValueError, match=r"^wide_tile: \['accumulate'\]"):
        launch.TileLangLauncher(wide_tile={"accumulate": "atomic"})
    # How many tiles a launch covers is the launch policy's: overridden, it would leave heads
    # out or reach past the last one.
    with pytest.raises(ValueError, match=r"^wide_tile: \['tiles'\]"):
        launch.TileLangLauncher(wide_tile={"tiles": 1})
    # A value no wide launch could build is refused when the launcher is made, not at its first launch.
    with pytest.raises(ValueError, match=r"^wide_tile: wg0_chunks: 0 "):
        launch.TileLangLauncher(wide_tile={"wg0_chunks": 0})
    with pytest.raises(ValueError, match=r"^wide_tile: wg0_chunks=8 leaves warpgroup 1 none of the 8 dKV chunks at d_k=512"):
        launch.TileLangLauncher(wide_tile={"wg0_chunks": 8})
    assert launch.TileLangLauncher(wide_tile={"wg0_chunks": 3}).wide_tile == {"wg0_chunks": 3}
    # Warpgroup 1's dQ columns must fill two GEMMs at every width: at d_k = 512, 384 at most.
    with pytest.raises(ValueError, match=r"^wide_tile: dq_split=448 at d_k=512, d_v=512: from 64 to 384"):
        launch.TileLangLauncher(wide_tile={"dq_split": 448})
    assert launch.TileLangLauncher(wide_tile={"dq_split": 320}).wide_tile == {"dq_split": 320}


def test_the_launch_policy_pairs_groups_where_a_pair_kernel_exists():
    # Both accumulations pair 32-head groups into one 64-head launch; the fixed one pairs 16-head
    # groups as a cluster; a group without a partner, and the control's 16-head groups, keep
    # their own kernels.
    def shape(launches):
        return [(g, c.heads, c.cluster) for g, c in launches]

    assert shape(kernels.main_launches(3, 16, 576, 512, True)) == [(0, 16, 2), (2, 16, 1)]
    assert shape(kernels.main_launches(3, 32, 576, 512, True)) == [(0, 64, 1), (2, 32, 1)]
    assert shape(kernels.main_launches(3, 32, 576, 512, False)) == [(0, 64, 1), (2, 32, 1)]
    assert shape(kernels.main_launches(3, 16, 576, 512, False)) == [(0, 16, 1), (1, 16, 1), (2, 16, 1)]
    assert shape(kernels.main_launches(2, 16, 576, 512, False)) == [(0, 16, 1), (1, 16, 1)]
    assert kernels.main_config(8, 576, 512).heads == 16  # the tile the kernel derives from H


@pytest.mark.parametrize("deterministic", [True, False])
def test_every_pair_of_32_head_groups_runs_in_one_wide_grid(deterministic):
    # The wide tile's 64-head tiles of a call go in one launch (one persistent grid over the
    # (row, tile) items), where a launch a tile would end on a partial wave each. The tile count is
    # a launch argument: every count of two or more runs one kernel.
    def shape(launches):
        return [(g, c.heads, c.tiles, c.groups) for g, c in launches]

    assert shape(kernels.main_launches(4, 32, 576, 512, deterministic)) == [(0, 64, 2, 4)]
    assert shape(kernels.main_launches(5, 32, 576, 512, deterministic)) == [(0, 64, 2, 4), (4, 32, 1, 1)]
    assert shape(kernels.main_launches(6, 32, 512, 512, deterministic)) == [(0, 64, 3, 6)]
    (_, three), = kernels.main_launches(6, 32, 512, 512, deterministic)
    two = three.kernel
    assert two == dataclasses.replace(three, tiles=kernels.MULTI_TILE) and two.kernel is two
    assert {config for config in kernels.gpu_configs() if isinstance(config, kernels.MainConfig) and config.tiles > 1} >= {two}
    if deterministic:
        assert kernels.lanes_redo(three).tiles == 3
    for tiles in (0, 2.0):
        with pytest.raises(ValueError, match="^tiles"):
            kernels.MainConfig(64, 576, 512, "lanes", tiles=tiles)
    with pytest.raises(ValueError, match="^tiles"):
        kernels.MainConfig(32, 576, 512, "fixed", tiles=2)  # a narrow tile is one group a launch


def test_head_tile_rule():
    # SPEC: padded_H = max(next_power_of_2(H), 16), block_H = min(64, padded_H).
    assert [kernels.main_tile_heads(h) for h in (1, 8, 15, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 16, 16, 32, 32, 64, 64, 64, 64]


def test_instruments_must_be_instruments():
    with pytest.raises(ValueError, match=r"^instruments\b"):
        call(_good(), backend="model", instruments=object())


def test_instruments_count_every_launch_and_allocation():
    instruments = Instruments()
    call(_good(), backend="model", instruments=instruments)
    assert instruments.counts["launches"] == sum(v for k, v in instruments.counts.items() if k.startswith("launch:"))
    assert instruments.counts["launch:main_bwd"] == 1 and instruments.counts["allocations"] > 0
    seen = []

    def allocate(shape, dtype, device):
        seen.append(tuple(shape))
        return torch.empty(shape, dtype=dtype, device=device)

    call(_good(), backend="model", instruments=Instruments(allocate=allocate))
    assert len(seen) == instruments.counts["allocations"]


def test_buffers_zeroed_together_are_each_an_allocation_of_their_own():
    # The fixed design zeroes its marks, row flags, words and bounds with one fill (Launcher.
    # zeros_together, through float32 views; 2-byte elements through float16, others by themselves);
    # each stays an allocation of its own, inside its own guard bands, zeroed to its last byte and
    # no further, in its own dtype.
    from properties.guards import GuardBands

    bands = GuardBands()
    launcher = ModelLauncher(instruments=bands.instruments())
    specs = [((7,), torch.int32), ((3, 5), torch.int64), ((2,), torch.float32), ((9,), torch.int64), ((5,), torch.uint8),
             ((), torch.int64), ((4,), torch.bfloat16)]
    tensors = launcher.zeros_together(*specs)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == specs
    assert not any(bool(t.any()) for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(specs)
    assert bands.violations() == [] and launcher.instruments.counts["allocations"] == len(specs)


#: Operations that launch nothing on a GPU: allocation and views.
_NO_LAUNCH = {"empty", "empty_strided", "view", "_unsafe_view", "reshape", "slice", "split", "select", "alias", "as_strided",
              "detach", "t", "transpose", "unsqueeze", "squeeze", "expand"}
_KERNELS = ("delta", "sorted_slots", "slot_keys", "place_slots", "row_blocks", "mark_slots", "plan", "main_bwd",
            "dsink_reduce", "lanes_failed", "zero_gated", "poisoned_batches", "cast_bf16", "fixed_to_bf16", "lanes_to_bf16")


class _HostOpsLauncher(ModelLauncher):
    """The model, noting the operations the wrapper itself issues before the first main launch (a
    torch dispatch mode around the call; ops inside the launcher's kernels are the kernels'). No
    poison: the TileLang launcher, whose host path this stands for, fills nothing it allocates."""

    poison = None

    def __init__(self, deterministic):
        super().__init__(deterministic)
        self.inside, self.main_started, self.accumulations = 0, False, []


def _counted(name):
    def method(self, *args, **kw):
        if name == "main_bwd":
            self.main_started = True
            self.accumulations.append(kw["config"].accumulate)
        self.inside += 1
        try:
            return getattr(ModelLauncher, name)(self, *args, **kw)
        finally:
            self.inside -= 1
    return method


for _name in _KERNELS:
    setattr(_HostOpsLauncher, _name, _counted(_name))


@pytest.mark.parametrize("deterministic,H,accumulations,fills", [
    (True, 64, ["lanes", "lanes", "fixed"], ["_foreach_zero_"]),  # the wide tile, its corrections, its gated redo
    (True, 48, ["fixed", "fixed"], ["_foreach_zero_"]),  # 16-head groups: a cluster and one alone
    (False, 64, ["atomic"], ["_foreach_zero_"]),  # the accumulator and the wide launch's claim counter
])
def test_before_its_main_launch_the_wrapper_launches_only_its_fills(deterministic, H, accumulations, fills):
    # The host sets the pace before the main launch (docs/performance-log.md): beyond the
    # kernels, the wrapper's own device work there is its fills: one for all the zeroed buffers
    # (Launcher.zeros_together: the fixed design's marks and row flags, the lanes' words and bounds,
    # or the int64 accumulator; the control's accumulator; both designs' claim counters of the wide
    # launches). A torch op added to that path shows here.
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostOps(TorchDispatchMode):
        def __init__(self, launcher):
            super().__init__()
            self.launcher, self.ops = launcher, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not self.launcher.inside and not self.launcher.main_started and name not in _NO_LAUNCH:
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    inputs = to_framework(Case(B=1, S=3, S_kv=40, H=H, L=70, d_k=576, d_v=512, sink="random", seed=4).inputs())
    launcher = _HostOpsLauncher(deterministic)
    with HostOps(launcher) as mode:
        call_model(inputs, launcher=launcher)
    assert launcher.accumulations == accumulations
    assert mode.ops == fills


@pytest.mark.parametrize("deterministic,H,wide_launches", [(True, 64, 3), (True, 128, 3), (False, 64, 1), (True, 48, 0)])
@pytest.mark.parametrize("L", [70, 2100], ids=["fused", "three_steps"])
def test_the_wide_launches_share_one_count_of_the_rows_blocks(deterministic, H, wide_launches, L):
    # The slot layout counts a call's rows once for all its wide launches (the lanes launch, its
    # corrections and its redo): the fused layout kernel where a row fits its CTA, else a
    # row_blocks launch after the three steps; a wide launch given none counts them again (a
    # launch more).
    class Shared(ModelLauncher):
        def main_bwd(self, *args, config, row_blocks=None, **kw):
            if config.wide:
                given.append(None if row_blocks is None else row_blocks.data_ptr())
            return super().main_bwd(*args, config=config, row_blocks=row_blocks, **kw)

        def row_blocks(self, *args):
            counted.append(("row_blocks", args[2].data_ptr()))
            return super().row_blocks(*args)

        def sorted_slots(self, indices, slots, row_blocks, *args):
            counted.append(("sorted_slots", row_blocks.data_ptr()))
            return super().sorted_slots(indices, slots, row_blocks, *args)

    given, counted = [], []
    inputs = to_framework(Case(B=1, S=3, S_kv=2200, H=H, L=L, d_k=576, d_v=512, sink="random", seed=4).inputs())
    call_model(inputs, launcher=Shared(deterministic))
    assert len(given) == wide_launches and None not in given and len(set(given)) <= 1, given
    fused = L <= kernels.SORT_CAPACITY
    kinds = [kind for kind, _ in counted]
    assert kinds == (["sorted_slots"] if fused else ["row_blocks"] if wide_launches else []), counted
    assert not wide_launches or [ptr for _, ptr in counted] == given[:1], (counted, given)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("shift", [-1, 1])
def test_a_wide_launch_whose_row_counts_differ_from_its_slots_is_refused(deterministic, shift):
    # The wide tile's warpgroup 0 walks RowBlocks[r] blocks of row r, warpgroup 1 the blocks it
    # counts in the row's slots: on the GPU a count one block short or long leaves their handoffs
    # unmatched, a hang. The model refuses such a launch, naming the row.
    class OffByOne(ModelLauncher):
        def sorted_slots(self, indices, slots, row_blocks, *args):
            super().sorted_slots(indices, slots, row_blocks, *args)
            row_blocks[1] += shift

    inputs = to_framework(Case(B=1, S=3, S_kv=40, H=64, L=70, d_k=576, d_v=512, sink="random", seed=4).inputs())
    call_model(inputs, launcher=ModelLauncher(deterministic))  # the true counts pass
    with pytest.raises(RuntimeError, match=r"^main_bwd: RowBlocks\[1\] = \d+ where the row's slots give \d+ blocks"):
        call_model(inputs, launcher=OffByOne(deterministic))


@pytest.mark.parametrize("deterministic,H,launches", [(True, 64, 3), (True, 128, 3), (True, 48, 2), (False, 64, 1)])
def test_each_main_launch_gets_a_claim_counter_of_its_own_zeroed(deterministic, H, launches):
    # A wide launch's CTAs claim items from its counter (kernels/wide.py, ws_claim_item): a launch
    # that found a counter another launch had counted up would skip that many items.
    class Counters(ModelLauncher):
        def main_bwd(self, *args, claims=None, **kw):
            seen.append((claims.data_ptr(), tuple(claims.shape), claims.dtype, int(claims.sum())))
            return super().main_bwd(*args, claims=claims, **kw)

    seen = []
    inputs = to_framework(Case(B=1, S=3, S_kv=40, H=H, L=70, d_k=576, d_v=512, sink="random", seed=4).inputs())
    call_model(inputs, launcher=Counters(deterministic))
    assert len(seen) == launches and len({ptr for ptr, *_ in seen}) == launches, seen
    assert all(tuple(rest) == ((1,), torch.int32, 0) for _, *rest in seen), seen


def test_steps_are_the_seam_a_test_replaces():
    import dataclasses

    replaced = []

    def require_dtype(name, t, dtype, framework):
        replaced.append(name)
        wrapper.require_dtype(name, t, dtype, framework)

    steps = dataclasses.replace(wrapper.STEPS, require_dtype=require_dtype)
    a = _good()
    ours = wrapper.backward(*[a[k] for k in ARGS], backend="model", steps=steps)
    assert {"query", "kv", "out", "grad_out", "lse"} <= set(replaced)
    for name, x, y in zip(OUTPUT_NAMES, ours, call(a, backend="model")):
        assert bitwise_difference(name, x, y) is None



# -- bad input: every class a defined answer ------------------------------------


def _valid_slots(host):
    """[B, S, L] bool: the slots that name a kv row."""
    idx = host["token_indices"]
    return (idx >= 0) & (idx < host["kv"].shape[1])


def _nan(x):
    return torch.isnan(x.float())


def _poisoned_masks(host, deterministic, rows_heads):
    """The NaN outputs SPEC's rule gives when Lse2 is NaN at ``rows_heads`` ([B, S, H] bool):
    dq of each such (b, s, h) whose row has a valid slot, d_attn_sink of its head, and dkv:
    every row of its batch element (fixed design) or the kv rows its valid slots name (atomic)."""
    valid = _valid_slots(host)
    live = valid.any(axis=2)  # [B, S]
    hit = rows_heads & live[:, :, None]
    B, S_kv, d_k = host["kv"].shape
    dq = np.repeat(hit[..., None], host["query"].shape[3], axis=3)
    dsink = rows_heads.any(axis=(0, 1))
    dkv = np.zeros((B, S_kv), bool)
    for b, s in zip(*np.nonzero(hit.any(axis=2))):
        if deterministic:
            dkv[b] = True
        else:
            dkv[b, host["token_indices"][b, s][valid[b, s]]] = True
    return dq, np.repeat(dkv[..., None], d_k, axis=2), dsink


def _poison_case():
    # Row (0, 2) of batch element 0 has no valid slot; H = 5 pads to 16 heads.
    return Case(B=2, S=3, S_kv=9, H=5, L=5, d_k=32, d_v=16, sink="random", seed=5, empty_rows=1)


@pytest.mark.parametrize("backend", ["model", "model-atomic"])
@pytest.mark.parametrize("argument,value", [("lse", np.nan), ("lse", np.inf), ("attn_sink", np.nan), ("attn_sink", np.inf)])
def test_non_finite_lse_or_sink_poisons_exactly_what_the_rule_says(backend, argument, value):
    host = _poison_case().inputs()
    rows_heads = np.zeros(host["lse"].shape, bool)
    bad = dict(host)
    if argument == "lse":
        live = np.argwhere(_valid_slots(host).any(axis=2))
        dead = np.argwhere(~_valid_slots(host).any(axis=2))
        assert len(live) >= 2 and len(dead) >= 1
        lse = host["lse"].copy()
        for (b, s), h in ((live[0], 1), (live[-1], 3), (dead[0], 4)):  # a dead row's d_sink is poisoned too
            lse[b, s, h] = value
            rows_heads[b, s, h] = True
        bad["lse"] = lse
    else:
        sink = host["attn_sink"].copy()
        sink[2] = value
        rows_heads[:, :, 2] = True  # every row of the head, -inf lse included
        bad["attn_sink"] = sink
    clean = call(to_framework(host), backend=backend)
    got = call(to_framework(bad), backend=backend)
    want = _poisoned_masks(host, backend == "model", rows_heads)
    for name, g, c, mask in zip(("dq", "dkv", "d_attn_sink"), got, clean, want):
        mask = torch.from_numpy(np.ascontiguousarray(mask))
        assert torch.equal(_nan(g), mask), f"{name}: NaN at {torch.nonzero(_nan(g) != mask)[:5].tolist()} against the rule"
        if name != "dkv" or backend == "model":  # the atomic control's dkv bits follow the add order
            assert bitwise_difference(name, g[~mask], c[~mask]) is None, f"{name}: a value outside the rule's NaN changed"


def test_minus_inf_lse_keeps_its_meaning_no_valid_slot_zero_gradients():
    # -inf lse says "no valid slot": the (row, head) contributes nothing, not NaN,
    # also where the row does have valid slots (an lse that does not match them).
    host = _poison_case().inputs()
    live = np.argwhere(_valid_slots(host).any(axis=2))
    lse = host["lse"].copy()
    (b, s), h = live[0], 1
    lse[b, s, h] = -np.inf
    dq, dkv, dsink = call(to_framework({**host, "lse": lse}), backend="model")
    assert not any(torch.isnan(x.float()).any() for x in (dq, dkv, dsink))
    assert torch.count_nonzero(dq[b, s, h].float()) == 0


def test_the_poisoning_is_computed_on_the_device_in_the_delta_launch():
    # No host check: Lse2 itself carries the NaN, so the same rule holds on every
    # launcher (the GPU's kernels take the same Lse2). Both +inf and NaN, lse and sink.
    def lse2_of(lse, sink):
        o = torch.ones(lse.shape + (8,), dtype=torch.bfloat16)
        return wrapper.row_terms(o, o, lse, sink, ModelLauncher()).lse2

    lse = torch.tensor([[0.5, math.nan, math.inf, -math.inf], [1.0, 2.0, -math.inf, -math.inf]])
    lse2 = lse2_of(lse, torch.tensor([0.0, -math.inf, -1e30, math.nan]))
    assert torch.isnan(lse2).tolist() == [[False, True, True, True], [False, False, False, True]]
    assert lse2[1, 2].item() == math.inf  # -inf lse, finite sink: no valid slot
    lse2 = lse2_of(lse[:, :3].contiguous(), torch.tensor([0.0, math.inf, 1.0]))
    assert torch.isnan(lse2[:, 1]).all() and not torch.isnan(lse2[0, 0])


def _requires_grad(t):
    for name in ("query", "kv", "out", "grad_out", "lse", "attn_sink"):
        t[name].requires_grad_(True)
    return t


def test_tensors_that_require_grad_are_accepted_and_change_no_bit():
    host = Case(B=2, S=3, S_kv=9, H=5, L=5, d_k=32, d_v=16, sink="random", seed=5).inputs()
    plain = call(to_framework(host), backend="model")
    tracked = _requires_grad(to_framework(host))
    with torch.enable_grad():
        got = call(tracked, backend="model")
    for name, g, p in zip(OUTPUT_NAMES, got, plain):
        assert bitwise_difference(name, g, p) is None
        assert not g.requires_grad and g.grad_fn is None, f"{name}: the backward was recorded by autograd"


def test_paddle_tensors_that_require_grad_are_accepted():
    paddle = pytest.importorskip("paddle")
    host = Case(B=1, S=2, S_kv=4, H=3, L=5, d_k=32, d_v=16, seed=4).inputs()
    plain = call(to_framework(host, "paddle"), backend="model")
    tracked = to_framework(host, "paddle")
    for name in ("query", "kv", "out", "grad_out", "lse", "attn_sink"):
        tracked[name].stop_gradient = False
    got = call(tracked, backend="model")
    for name, g, p in zip(OUTPUT_NAMES, got, plain):
        assert isinstance(g, paddle.Tensor) and g.stop_gradient
        assert bitwise_difference(name, g, p) is None


class _KeptBuffers(ModelLauncher):
    """Keeps every buffer a call makes: those allocated through instruments=, and
    those torch ops make that reach a launch (the slot layout, Lse2, the plan's outputs)."""

    def __init__(self, deterministic):
        super().__init__(deterministic, instruments=Instruments(allocate=self._allocated))
        self.buffers = []

    def _allocated(self, shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        self.buffers.append(t)
        return t

    def main_bwd(self, q, kv, grad_out, indices, lse2, delta, dq, dkv, **kw):
        self.buffers += [indices, lse2]
        super().main_bwd(q, kv, grad_out, indices, lse2, delta, dq, dkv, **kw)

    def plan(self, *args, **kw):
        row_scale, allowance = super().plan(*args, **kw)
        self.buffers += [row_scale, allowance]
        return row_scale, allowance

    def bytes_kept(self, outputs, inputs) -> int:
        """Bytes of the distinct buffers kept, other than the outputs' and the inputs' memory."""
        seen = {t.untyped_storage().data_ptr() for t in (*outputs, *inputs)}
        total = 0
        for t in self.buffers:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("H,block_h", [(16, None), (5, None), (40, 16), (64, 32)])
def test_scratch_bytes_is_what_a_call_keeps_that_grows_with_s(deterministic, H, block_h):
    # Buffers that do not grow with S (the dKV accumulator, per-kv-row and per-head
    # vectors) are the same bytes at S and 2S; what grows is linear in S. So the
    # bytes kept at 2S less those at S are the scratch of S query rows.
    def kept(S):
        case = Case(B=2, S=S, S_kv=9, H=H, L=40, d_k=32, d_v=16, sink="random", seed=8)
        inputs = to_framework(case.inputs())
        launcher = _KeptBuffers(deterministic)
        outputs = wrapper.backward_with(launcher, *[inputs[k] for k in ARGS], block_h=block_h)
        return launcher.bytes_kept(outputs, [inputs[k] for k in ARGS[:-1] if inputs[k] is not None])

    backend = "model" if deterministic else "model-atomic"
    least = {S: mqa_bwd.scratch_bytes(2, S, 9, H, 40, 32, 16, block_h=block_h, backend=backend) for S in (3, 6, 12)}
    assert kept(6) - kept(3) == least[3] and kept(12) - kept(6) == least[6] == 2 * least[3]
    assert least[3] == sum(wrapper.Problem(2, 3, 9, H, 40, 32, 16, block_h or (32 if H % 32 == 0 else 16), None)
                           .scratch(deterministic).values())


@pytest.mark.parametrize("backend", ["model", "model-atomic"])
def test_a_budget_below_the_scratch_a_call_needs_is_refused_stating_it(backend):
    a = _good()  # B=1 S=2 S_kv=4 H=3 L=5 Dk=32 Dv=16
    least = mqa_bwd.scratch_bytes(1, 2, 4, 3, 5, 32, 16, backend=backend)
    instruments = Instruments()
    with pytest.raises(ValueError, match=rf"^dkv_buf_bytes: {least - 1} is below the {least} bytes of scratch"):
        call(a, backend=backend, dkv_buf_bytes=least - 1, instruments=instruments)
    assert not instruments.counts
    with pytest.raises(ValueError, match=rf"^dkv_buf_bytes: 1 is below .* pass at least {least}\b"):
        call(a, backend=backend, dkv_buf_bytes=1)
    for name, x, y in zip(OUTPUT_NAMES, call(a, backend=backend, dkv_buf_bytes=least), call(a, backend=backend)):
        assert bitwise_difference(name, x, y) is None


def test_validate_holds_the_budget_to_the_design_it_is_given():
    # backward_with passes its launcher's design; a peer that borrows validate (design=None,
    # mqa_bwd.cudnn) keeps scratch of its own. The launcher here is the fixed design's, so
    # the atomic control's least passing shows that validate does not ask the launcher.
    args = [_good()[k] for k in ARGS]
    launcher = ModelLauncher(deterministic=True)
    for design, backend in ((True, "model"), (False, "model-atomic")):
        least = mqa_bwd.scratch_bytes(1, 2, 4, 3, 5, 32, 16, backend=backend)
        with pytest.raises(ValueError, match=rf"^dkv_buf_bytes: {least - 1} is below the {least} bytes of scratch"):
            wrapper.validate(*args, None, least - 1, launcher, design=design)
        assert wrapper.validate(*args, None, least, launcher, design=design).dkv_buf_bytes == least
    assert mqa_bwd.scratch_bytes(1, 2, 4, 3, 5, 32, 16, backend="model-atomic") < mqa_bwd.scratch_bytes(
        1, 2, 4, 3, 5, 32, 16, backend="model")
    assert wrapper.validate(*args, None, 1, launcher, design=None).dkv_buf_bytes == 1


def test_the_scratch_of_the_fixed_design_at_the_production_shape():
    # dsv32 H=64: the slots (4096 x 2048 int32; a row of 2048 slots is sorted in one CTA, so no
    # sort keys are kept); Lse2, Delta, the d_sink rows, two peaks and the allowance per (row,
    # head); the row marks, flags and (the wide tile's) block counts per row.
    R, H, Lp = 4096, 64, 2048
    slots = R * Lp * 4
    assert mqa_bwd.scratch_bytes(1, R, 8192, H, 2048, 576, 512) == slots + R * H * 4 * 6 + R * 4 * 3
    # H = 8 pads to 16 heads: copies of q, out and grad_out, and of lse, the
    # allowance and dq over 16 heads (the allowance also over the real 8). No wide launch reads
    # the block counts, but the one-step slot layout writes them.
    Hp = 16
    assert mqa_bwd.scratch_bytes(1, R, 8192, 8, 2048, 576, 512) == (
        slots + R * Hp * 4 * 7 + R * 8 * 4 + R * 4 * 3 + R * Hp * (576 * 2 + 512 * 2 * 2 + 576 * 2))
    # The atomic control keeps no peaks, allowance, marks or flags; its wide tile the block counts.
    assert mqa_bwd.scratch_bytes(1, R, 8192, H, 2048, 576, 512, backend="tilelang-atomic") == (
        slots + R * H * 4 * 3 + R * 4)
    # Rows longer than a CTA sorts keep one INDEX_STEP of sort keys (4096 rows of 4096 slots),
    # which stop growing with S past one step.
    long_row = 4096
    assert kernels.SORT_CAPACITY < long_row
    for rows in (R, 4 * R):
        assert mqa_bwd.scratch_bytes(1, rows, 8192, H, long_row, 576, 512, backend="tilelang-atomic") == (
            rows * long_row * 4 + R * long_row * 4 + rows * H * 4 * 3 + rows * 4)


@pytest.mark.parametrize("kw,argument", [
    (dict(B=0), "B"), (dict(S=1.5), "S"), (dict(L=True), "L"), (dict(block_h=8), "block_h"), (dict(backend="x"), "backend"),
])
def test_scratch_bytes_checks_its_arguments(kw, argument):
    args = {"B": 1, "S": 2, "S_kv": 4, "H": 3, "L": 5, "d_k": 32, "d_v": 16, **kw}
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        mqa_bwd.scratch_bytes(**args)


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a.update(kv=torch.cat([a["kv"], a["kv"][:, :, :16]], 2)), "kv: dimension 2 (Dk) is 48, query's Dk is 32"),
    (lambda a: a.update(kv=torch.cat([a["kv"], a["kv"]], 0)), "kv: dimension 0 (B) is 2, query's B is 1"),
    (lambda a: a.update(out=a["out"][:, :, :1]), "out: dimension 2 (H) is 1, query's H is 3"),
    (lambda a: a.update(grad_out=a["grad_out"][:, :1]), "grad_out: dimension 1 (S) is 1, query's S is 2"),
    (lambda a: a.update(grad_out=a["grad_out"][..., :8]), "grad_out: dimension 3 (Dv) is 8, out's Dv is 16"),
    (lambda a: a.update(lse=a["lse"][..., :2]), "lse: dimension 2 (H) is 2, query's H is 3"),
    (lambda a: a.update(attn_sink=torch.zeros(4)), "attn_sink: dimension 0 (H) is 4, query's H is 3"),
    (lambda a: a.update(token_indices=a["token_indices"][:, :1]), "token_indices: dimension 1 (S) is 1, query's S is 2"),
    (lambda a: a.update(token_indices=a["token_indices"][:, :, :0]), "token_indices: dimension 2 (L) is 0; every dimension must be >= 1"),
    (lambda a: a.update(kv=a["kv"][:, :0]), "kv: dimension 1 (S_kv) is 0; every dimension must be >= 1"),
    (lambda a: a.update(out=torch.zeros(1, 2, 3, 48, dtype=torch.bfloat16), grad_out=torch.zeros(1, 2, 3, 48, dtype=torch.bfloat16)),
     "out: dimension 3 (Dv) is 48, more than query's Dk 32"),
    (lambda a: a.update(query=torch.zeros(1, 2, 3, 24, dtype=torch.bfloat16), kv=torch.zeros(1, 4, 24, dtype=torch.bfloat16)),
     "query: dimension 3 (Dk) is 24, not a multiple of 16"),
    (lambda a: a.update(query=a["query"][0]), "query: expected rank 4 [B,S,H,Dk], got rank 3"),
])
def test_shape_messages_name_the_dimension_that_is_wrong(mutate, message):
    a = _good()
    mutate(a)
    with pytest.raises(ValueError) as err:
        call(a, backend="model")
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
@pytest.mark.parametrize("argument,dtype,want,got", [
    ("query", np.float32, "bfloat16", "float32"),
    ("lse", np.float64, "float32", "float64"),
    ("token_indices", np.float32, None, "float32"),
])
def test_dtype_messages_speak_the_callers_framework(framework, argument, dtype, want, got):
    if framework == "paddle":
        pytest.importorskip("paddle")
    host = Case(B=1, S=2, S_kv=4, H=3, L=5, d_k=32, d_v=16, seed=9).inputs()
    host[argument] = host[argument].astype(np.float32).astype(dtype)
    with pytest.raises(ValueError) as err:
        call(to_framework(host, framework), backend="model")
    message = str(err.value)
    expected = (f"{argument}: expected dtype {framework}.{want}, got {framework}.{got}" if want
                else f"{argument}: expected an integer dtype, got {framework}.{got}")
    assert message == expected
    other = {"torch": "paddle", "paddle": "torch"}[framework]
    assert other not in message


def test_dtype_names_are_paddles_own():
    paddle = pytest.importorskip("paddle")
    from mqa_bwd import edge

    for name in ("bfloat16", "float16", "float32", "float64", "int32", "int64", "uint8", "bool", "complex64"):
        assert edge.dtype_name(getattr(torch, name), "paddle") == str(getattr(paddle, name))
        assert edge.dtype_name(getattr(torch, name), "torch") == str(getattr(torch, name))
    assert edge.device_name(torch.device("cpu"), "paddle") == str(paddle.CPUPlace())
    assert edge.device_name(torch.device("cuda:1"), "paddle") == "Place(gpu:1)"


def test_mismatched_devices_are_named_in_the_callers_framework():
    a = _good()
    a["kv"] = a["kv"].to("meta")
    with pytest.raises(ValueError, match=r"^kv: on meta, but query is on cpu$"):
        call(a, backend="model")
