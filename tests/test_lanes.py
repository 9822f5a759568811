"""The wide tile's lanes design (fixed_point, "The lanes") on the CPU: its arithmetic, its
bound, and the call-level rule that a call is the lanes' sums or the int64 design's, bit for bit."""

import numpy as np
import pytest
import torch

from mqa_bwd import bench, fixed_point, kernels, wrapper
from mqa_bwd.contract import SPEC_ARGS, Instruments
from mqa_bwd.model import (BOUND_CAP, ModelLauncher, beyond_magic, contribution_bounds, float_to_int32_rn, lane_words,
                           magic_words)
from properties.case import ALL_INVALID_KINDS, Case, to_framework

from lanes_redo import ForcedRedo


def _cancelling_terms(seed, n=5, columns=32, terms=64):
    """Lane integers whose partial sums leave 32 bits while each column's final sum fits."""
    g = np.random.default_rng(seed)
    x = g.integers(-2**30, 2**30, (terms, n, columns))
    goal = g.integers(-2**31 + 1, 2**31 - 1, (n, columns))
    rest = goal - x.sum(axis=0)
    parts = [x]
    while (np.abs(rest) >= 2**31).any():
        part = np.clip(rest, -2**30, 2**30)
        parts.append(part[None])
        rest = rest - part
    parts.append(rest[None])
    return np.concatenate(parts), goal


@pytest.mark.parametrize("seed", range(4))
def test_words_decode_exactly_whatever_the_order_even_when_partial_sums_wrap(seed):
    terms, goal = _cancelling_terms(seed)
    assert (np.abs(np.cumsum(terms, axis=0)) >= 2**31).any(), "the case must wrap"
    words = np.zeros((terms.shape[1], terms.shape[2] // 2), dtype=np.uint64)
    for i in np.random.default_rng(seed).permutation(len(terms)):
        words += lane_words(terms[i])
    got = fixed_point.decode_lane_words(torch.from_numpy(words.view(np.int64)))
    assert torch.equal(got, torch.from_numpy(goal))


def test_the_conversion_is_the_kernels_and_a_nan_fails_the_bound():
    x = np.array([[0.5, 1.5, -2.5, 3e9, -3e9, np.nan, 7.49, -7.5]], dtype=np.float32)
    assert float_to_int32_rn(x).tolist() == [[0, 2, -2, 2**31 - 1, -2**31, 0, 7, -8]]
    assert contribution_bounds(x).tolist() == [BOUND_CAP]
    assert contribution_bounds(np.array([[1.2, -3.5]], dtype=np.float32)).tolist() == [4]
    # The kernel keeps a peak as its upper 16 bits (two a register) and bounds it by the next bf16
    # up: 256.5 -> 258, not 257, and an exact bf16 gets its step too (1.0 -> 2, 2**39 -> 2**39 +
    # 2**32). An inf, or a finite peak whose next bf16 is inf, fails like a NaN. Zero adds
    # nothing, and neither does a peak below 2**-133 (upper bits 0: it rounds to 0); one at or above does.
    assert contribution_bounds(np.array([[256.5, -1.0], [0.0, 0.0], [1.0, 0.5]], dtype=np.float32)).tolist() == [258, 0, 2]
    assert contribution_bounds(np.array([[np.inf], [3.4e38], [2.0**39]], dtype=np.float32)).tolist() == [BOUND_CAP, BOUND_CAP, 2**39 + 2**32]
    assert contribution_bounds(np.array([[2.0**-134], [2.0**-133]], dtype=np.float32)).tolist() == [0, 1]


def test_a_bound_from_the_unscaled_peak_is_the_scaled_values_bound():
    # The kernel keeps a slot's peak of |x| and scales its upper 16 bits once a block, in the
    # bounds: with a power-of-two scale that is the bound of the scaled values' peak wherever x s
    # stays a normal float. An inf or NaN at a scale of 0 (an invalid slot's) still fails.
    g = np.random.default_rng(5)
    values = (g.normal(0, 10, (2000, 16)) * 2.0 ** g.integers(-60, 60, (2000, 1))).astype(np.float32)
    values[g.random(values.shape) < 0.01] = np.nan
    scales = (2.0 ** g.integers(-100, 100, 2000)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = values * scales[:, None]
        peak = np.abs(scaled).max(axis=1)
    normal = ~(peak < 2.0**-126)  # NaN and inf peaks included
    assert 1000 < normal.sum() < 2000 and np.isnan(peak).any() and np.isinf(peak).any()
    assert (contribution_bounds(values, scales) == contribution_bounds(scaled))[normal].all()
    bad = np.array([[np.inf, 1.0], [np.nan, 1.0]], dtype=np.float32)
    assert contribution_bounds(bad, np.zeros(2, dtype=np.float32)).tolist() == [BOUND_CAP, BOUND_CAP]


def test_the_ffma_rounding_is_the_conversion_up_to_its_range_and_flags_past_it():
    # fma(x, s, 1.5 * 2**23) rounds x s once, half to even, in a binade whose step is 1: the
    # conversion's integer wherever |x s| <= 2**22, ties and both signs included. Past it (or for a
    # NaN, or an invalid slot's -0.0 scale times an inf) the word differs and the row is flagged.
    g = np.random.default_rng(3)
    ties = np.arange(-20, 20) + 0.5
    edges = [2.0**22, -(2.0**22), 2.0**22 - 0.5, -(2.0**22) + 0.5, 0.0, -0.0, 2.0**-140, -(2.0**-126)]
    inside = np.concatenate([ties, edges, g.uniform(-(2.0**22), 2.0**22, 4000), g.normal(0, 1000, 4000)])
    inside = inside[: len(inside) // 16 * 16].astype(np.float32).reshape(-1, 16)
    assert (magic_words(inside) == lane_words(float_to_int32_rn(inside))).all()
    assert not beyond_magic(inside[np.abs(inside).max(1) < 2.0**22]).any()
    past = np.zeros((5, 16), dtype=np.float32)
    past[:, 3] = [2.0**22 + 1, -(2.0**22) - 1.5, 3e9, np.nan, 2.0**23 + 1]
    assert beyond_magic(past).all()
    assert (magic_words(past) != lane_words(float_to_int32_rn(past))).any(axis=1).all()


def test_a_word_holds_columns_q_and_q_plus_8_of_each_16():
    # The wide tile's thread holds columns c and c + 8 of a slot, so that is a word's pair
    # (config.LANE_GROUP); the cast kernel and the decode must agree with the kernel on it. A row
    # of 32 columns has no whole 128-column block: every group keeps its 8 words in place (the
    # layout of d_k's tail past its last whole block; the blocks' own: the next test).
    ints = np.arange(32).reshape(1, 32) - 16
    words = lane_words(ints)
    group, half = kernels.LANE_GROUP, kernels.LANE_GROUP // 2
    want = [int(np.int64(ints[0, group * (w // half) + w % half]).astype(np.uint64))
            + (int(np.int64(ints[0, group * (w // half) + half + w % half]).astype(np.uint64)) << 32) for w in range(16)]
    assert [int(w) for w in words[0]] == [w % 2**64 for w in want]
    assert fixed_point.decode_lane_words(torch.from_numpy(words.view(np.int64))).tolist() == ints.tolist()


@pytest.mark.parametrize("d_k", [576, 512, 64])
def test_a_warps_words_of_a_chunk_pair_fill_one_line(d_k):
    # The wide tile's warp w holds columns 16 w + q and 16 w + 8 + q (0 <= q < 8) of each 64-column
    # chunk for its slots: a chunk's 8 words of them start at lane_chunk_words; within a whole
    # 128-column block the two chunks' 16 words are one 128-byte line (ws_add_pair_lanes), past it
    # each 16-column group keeps its 8 words. The decode, the cast kernel's inverse and the
    # model's encoding follow the same map.
    columns = kernels.lane_word_columns(d_k)
    assert sorted(c for pair in columns for c in pair) == list(range(d_k))
    whole_chunks = d_k // kernels.LANE_BLOCK * 2
    for chunk in range(d_k // kernels.WIDE_CHUNK):
        word0, warp_words = kernels.lane_chunk_words(chunk, d_k)
        for warp in range(4):
            first = 64 * chunk + 16 * warp
            assert [columns[word0 + warp_words * warp + q] for q in range(8)] == [(first + q, first + 8 + q) for q in range(8)]
            if chunk < whole_chunks:
                line = word0 - 8 * (chunk % 2) + 16 * warp
                assert line % 16 == 0 and word0 + warp_words * warp == line + 8 * (chunk % 2)
    for word, (lo, hi) in enumerate(columns):
        assert kernels.config.lane_word_of_column(lo, d_k) == word == kernels.config.lane_word_of_column(hi, d_k)
    ints = np.random.default_rng(d_k).integers(-2**31, 2**31, (3, d_k))
    words = lane_words(ints)
    assert [[int(w) for w in row] for row in words] == [
        [(int(row[lo]) + (int(row[hi]) << 32)) % 2**64 for lo, hi in columns] for row in ints]  # lo sign-extended
    assert fixed_point.decode_lane_words(torch.from_numpy(words.view(np.int64))).tolist() == ints.tolist()


def test_joined_lanes_are_the_decoded_sums_unless_the_call_failed():
    values = np.array([3, -5, -2**31, 2**31 - 1] * 4).reshape(1, 16)
    words = torch.from_numpy(lane_words(values).view(np.int64))
    for failed, want in ((0, values[0].tolist()), (1, [0] * 16)):
        acc = torch.full((1, 16), 7, dtype=torch.int64)
        fixed_point.join_lanes(acc, words, torch.tensor([failed], dtype=torch.int32))
        assert acc.tolist() == [[7 + v for v in want]]
    many_values = np.arange(-24, 24).reshape(3, 16) * 2**26
    many = torch.from_numpy(lane_words(many_values).view(np.int64))
    acc = torch.zeros((3, 16), dtype=torch.int64)
    fixed_point.join_lanes(acc, many, torch.tensor([0], dtype=torch.int32), step_words=8)  # a row at a time
    assert acc.tolist() == many_values.tolist()
    assert fixed_point.lanes_failed(torch.tensor([0, kernels.LANE_LIMIT - 1])).tolist() == [0]
    assert fixed_point.lanes_failed(torch.tensor([0, kernels.LANE_LIMIT])).tolist() == [1]


class _ForcedRedo(ForcedRedo, ModelLauncher):
    """The int64 design on the wide tile, on the CPU model."""


class _RecordingBound(ModelLauncher):
    """Keeps the last lanes launch's per-row bounds (``bound``)."""

    def main_bwd(self, *args, config, bound=None, **kw):
        super().main_bwd(*args, config=config, bound=bound, **kw)
        if config.accumulate == "lanes":
            self.bound = bound.clone()


def _wide_case():
    return bench.production_inputs(1, 64, 128, 64, 64, device="cpu")  # H = 64: one wide launch


@pytest.mark.parametrize("gain", [12, 19])
def test_a_call_has_the_int64_redos_bits_whether_its_lanes_fit_or_not(gain):
    # At gain 12 every bound of this case holds, at 19 some do and some fail: either way the
    # call must be the forced int64 redo's, bit for bit (one scale, the same integers).
    args = _wide_case()
    forced = _ForcedRedo(lanes_gain=gain)
    int64 = wrapper.backward_with(forced, *args)
    assert int(forced.lanes_redone) == 1
    launcher = _RecordingBound(lanes_gain=gain)
    first = wrapper.backward_with(launcher, *args)
    failed = launcher.bound >= kernels.LANE_LIMIT
    if gain == 12:
        assert int(launcher.lanes_redone) == 0 and not failed.any(), "the lanes were used"
    else:
        assert 0 < int(failed.sum()) < int((launcher.bound > 0).sum()), "rows that fit and rows that fail"
        assert int(launcher.lanes_redone) == 1
    assert bench.same_bits(first, int64)
    assert bench.same_bits(first, wrapper.backward_with(launcher, *args))


def test_the_scales_gain_is_a_resolution_the_error_shows():
    # A coarser quantum must show in dkv's error against float64 (so every launch rounds at the
    # gain's scale: the lanes give the same integers, test above), and the default gain's must be
    # issue 30's admissible: at most 1.1x the error of the int64 sums at the plan's own scale.
    args = _wide_case()
    outputs = {g: wrapper.backward_with(_ForcedRedo(lanes_gain=g), *args) for g in (30, kernels.LANES_GAIN, 0)}
    dkv_error = {g: errors["dkv"] for g, errors in bench.oracle_errors(args, outputs).items()}
    assert dkv_error[0] > 1.1 * dkv_error[30]
    assert dkv_error[kernels.LANES_GAIN] <= 1.1 * dkv_error[30]


def test_the_instruments_see_whether_a_call_redid_its_lanes():
    # What the bench's "redo" column reads: one flag a deterministic call with a wide launch.
    args = _wide_case()
    for gain, redone in ((12, False), (19, True)):
        instruments = Instruments()
        wrapper.backward_with(ModelLauncher(lanes_gain=gain, instruments=instruments), *args)
        assert len(instruments.redone) == 1 and bench.lanes_redone(instruments) is redone, gain
    control = Instruments()
    wrapper.backward_with(ModelLauncher(deterministic=False, instruments=control), *args)
    assert control.redone == [] and bench.lanes_redone(control) is None and bench.lanes_redone(None) is None


@pytest.mark.parametrize("gain", [-1, 31, 2.0, True])
def test_a_gain_outside_the_lanes_resolution_is_refused(gain):
    with pytest.raises(ValueError, match="lanes_gain"):
        ModelLauncher(lanes_gain=gain)


@pytest.mark.parametrize("H,L,sink,seed", [(64, 33, "random", 1), (40, 129, "large", 2), (96, 64, "none", 3),
                                           (128, 65, "neg_inf", 4), (64, 1, "neg_1e30", 5)])
def test_lanes_give_the_redos_bits_across_the_case_space(H, L, sink, seed):
    # Invalid slots of every kind, duplicates, an empty row, every sink, a lone 32-head group beside a
    # wide pair (H = 96), two wide tiles into one set of words (H = 128), padded heads (H = 40).
    case = Case(B=2, S=3, S_kv=70, H=H, L=L, d_k=64, d_v=32, invalid=ALL_INVALID_KINDS, duplicates=True,
                empty_rows=1, sink=sink, seed=seed)
    inputs = to_framework(case.inputs(), "torch", "cpu")
    args = [inputs[k] for k in SPEC_ARGS]
    lanes, forced = ModelLauncher(lanes_gain=8), _ForcedRedo(lanes_gain=8)
    got = wrapper.backward_with(lanes, *args, block_h=32)
    want = wrapper.backward_with(forced, *args, block_h=32)
    assert int(lanes.lanes_redone) == 0 and int(forced.lanes_redone) == 1
    assert bench.same_bits(got, want)
