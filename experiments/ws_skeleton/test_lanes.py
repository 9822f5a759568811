"""The lanes design's arithmetic on the CPU (not in the default run):

    python -m pytest -m experiments experiments/ws_skeleton/test_lanes.py
"""

import numpy as np
import pytest
import torch

from mqa_bwd import bench, wrapper
from mqa_bwd.model import ModelLauncher

from .launcher import LANE_LIMIT, decode_words, lanes_scale
from .model import (BOUND_CAP, LanesModelLauncher, RecordingLanesLauncher, contribution_bounds, float_to_int32_rn,
                    lane_words)

pytestmark = pytest.mark.experiments


def _cancelling_terms(seed, n=5, columns=8, terms=64):
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
        words += lane_words(terms[i]).view(np.uint64)
    got = decode_words(torch.from_numpy(words.view(np.int64)))
    assert torch.equal(got, torch.from_numpy(goal))


def test_the_conversion_is_the_kernels_and_a_nan_fails_the_bound():
    x = np.array([[0.5, 1.5, -2.5, 3e9, -3e9, np.nan, 7.49, -7.5]], dtype=np.float32)
    assert float_to_int32_rn(x).tolist() == [[0, 2, -2, 2**31 - 1, -2**31, 0, 7, -8]]
    assert contribution_bounds(x).tolist() == [int(BOUND_CAP)]
    assert contribution_bounds(np.array([[1.2, -3.5]], dtype=np.float32)).tolist() == [4]


@pytest.fixture(scope="module")
def small_case():
    args = bench.production_inputs(1, 64, 128, 16, 64, device="cpu")
    return args, wrapper.backward_with(ModelLauncher(True), *args)


def test_lanes_that_fit_are_decoded_and_rerun_bitwise(small_case):
    args, int64 = small_case
    launcher = LanesModelLauncher(gain=12)
    first, again = wrapper.backward_with(launcher, *args), wrapper.backward_with(launcher, *args)
    assert launcher.redos == 0 and bench.same_bits(first, again)
    assert torch.equal(first[0], int64[0]) and torch.equal(first[2], int64[2])  # only dkv is summed otherwise
    assert not torch.equal(first[1], int64[1]), "another rounding: the lanes were used"
    assert bench.rel_l2(first[1], int64[1]) < 1e-4


def test_where_any_bound_fails_the_call_is_the_int64_design_bit_for_bit(small_case):
    args, int64 = small_case
    launcher = RecordingLanesLauncher(gain=16)
    out = wrapper.backward_with(launcher, *args)
    failed = launcher.bound >= LANE_LIMIT
    assert 0 < int(failed.sum()) < failed.numel(), "the case must have rows that fit and rows that fail"
    assert launcher.redos == 1 and bench.same_bits(out, int64)


def test_a_gain_beyond_the_lanes_resolution_is_refused():
    with pytest.raises(ValueError, match="gain"):
        lanes_scale(torch.ones(3), 31)


@pytest.mark.parametrize("stages", [0, 1, 2])
def test_the_row_exchange_puts_every_word_at_its_own_address_in_whole_runs(stages):
    # kernel.skel_add_chunk_lanes_rows step by step for one warp, a word named by (row, word): after
    # the exchange each add must carry the word its address names, every word exactly once, and
    # one instruction must cover 2^stages x 32 contiguous bytes of each row it touches.
    low = (1 << stages) - 1
    for half in (0, 1):
        w = [[(8 * half + (lane >> 2), 4 * n + (lane & 3)) for n in range(8)] for lane in range(32)]
        for s in range(stages):
            sent = [w[lane][n] if (lane >> (2 + s)) & 1 else w[lane][n | 1 << s] for lane in range(32)
                    for n in range(8) if not (n >> s) & 1]
            sent = [sent[lane * 4:(lane + 1) * 4] for lane in range(32)]
            for lane in range(32):
                upper = (lane >> (2 + s)) & 1
                got = sent[lane ^ (1 << (2 + s))]
                for i, n in enumerate(n for n in range(8) if not (n >> s) & 1):
                    if upper:
                        w[lane][n] = got[i]
                    else:
                        w[lane][n | 1 << s] = got[i]
        seen = set()
        for rows in range(low + 1):
            for n in range(8):
                if (n & low) != rows:
                    continue
                instruction = {}
                for lane in range(32):
                    q, k = lane >> 2, lane & 3
                    address = (8 * half + (rows | (q & ~low)), k + 4 * (q & low) + 4 * (n & ~low))
                    assert w[lane][n] == address
                    seen.add(address)
                    instruction.setdefault(address[0], []).append(address[1])
                for words in instruction.values():  # 8-byte words: runs of 4 << stages
                    words.sort()
                    assert len(words) == 4 << stages and words == list(range(words[0], words[0] + len(words)))
                    assert words[0] % len(words) == 0
        assert seen == {(8 * half + r, c) for r in range(8) for c in range(32)}
