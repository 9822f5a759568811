"""The TileLang kernels on a Hopper GPU: agreement, memory safety, determinism.

Skipped with a reason on machines without a Hopper GPU and tilelang (CI).
Run on the H200 with: ``pytest -m gpu tests/test_gpu_kernels.py``.
"""

import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mqa_bwd.contract import OUTPUT_NAMES, SPEC_ARGS  # noqa: E402
from mqa_bwd.kernels import LOG2E  # noqa: E402
from mqa_bwd import fixed_point, launch, layout, mqa_latent_sparse_bwd, wrapper  # noqa: E402
from mqa_bwd.bench import RACECHECK_HAZARDS, SANITIZER_ERRORS, compute_sanitizer, production_inputs  # noqa: E402
from mqa_bwd.model import ModelLauncher, lane_words  # noqa: E402
from mqa_bwd.repro import RerunTracker  # noqa: E402
from properties.case import INVALID_KINDS, Case, expected, to_framework  # noqa: E402
from properties.checks import bitwise_difference  # noqa: E402
from properties.compare import compare, first_difference  # noqa: E402
from properties.guards import GuardBands  # noqa: E402

from hopper import ON_HOPPER  # noqa: E402
from lanes_redo import ForcedRedo  # noqa: E402
from wide_grid import TileALaunch  # noqa: E402

pytestmark = ON_HOPPER

HEADS = (1, 2, 3, 5, 8, 13, 16, 17, 24, 31, 32, 33, 40, 48, 57, 63, 64, 65, 96, 127, 128)
SLOTS = (1, 31, 32, 33, 129, 2048)
SINKS = ("none", "random", "neg_inf", "neg_1e30", "large")


def _grid_cases():
    for n, (H, L) in enumerate(itertools.product(HEADS, SLOTS)):
        yield Case(
            B=2 if n % 3 == 0 else 1, S=3, S_kv=max(64, L + 7), H=H, L=L, d_k=576, d_v=512,
            pattern="causal" if n % 2 else "random", invalid=INVALID_KINDS, hole_rate=0.2,
            duplicates=n % 4 == 1, empty_rows=1, sink=SINKS[n % len(SINKS)], seed=n,
        )


ARGS = SPEC_ARGS


def call_gpu(args, dkv_buf_bytes=None, launcher=None, instruments=None):
    """The TileLang path (deterministic unless ``launcher`` says otherwise)."""
    launcher = launcher or launch.TileLangLauncher(instruments=instruments)
    return wrapper.backward_with(launcher, *args, dkv_buf_bytes=dkv_buf_bytes)


def _run(host: dict, guards=None, deterministic=True):
    inputs = to_framework(host, "torch", "cuda")
    instruments = None
    if guards is not None:
        inputs = {k: (guards.place(v, k) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        instruments = guards.instruments()
    launcher = launch.TileLangLauncher(deterministic=deterministic, instruments=instruments)
    return inputs, call_gpu([inputs[k] for k in ARGS], launcher=launcher)


@pytest.mark.parametrize("case", list(_grid_cases()), ids=lambda x: f"H{x.H}-L{x.L}-{x.sink}")
def test_agrees_with_oracle_inside_guard_bands(case):
    _check_against_oracle(case)


def _check_against_oracle(case, deterministic=True):
    """One call inside guard bands: no band damaged, exact output shapes, agreement with the oracle."""
    host = case.inputs()
    guards = GuardBands()
    inputs, (dq, dkv, dsink) = _run(host, guards=guards, deterministic=deterministic)
    torch.cuda.synchronize()
    damaged = guards.violations()
    assert not damaged, f"guard bands damaged: {damaged}\nREPRO: {case.to_json()}"
    assert dq.shape == (case.B, case.S, case.H, 576) and dq.dtype == torch.bfloat16
    assert dkv.shape == (case.B, case.S_kv, 576) and dkv.dtype == torch.bfloat16
    assert dsink.shape == (case.H,) and dsink.dtype == torch.float32
    (dq64, dkv64, ds64), (dqb, dkvb, dsb) = expected(host)
    reports = [compare("dq", dq, dq64, dqb), compare("dkv", dkv, dkv64, dkvb)]
    if case.sink != "none":
        reports.append(compare("d_attn_sink", dsink, ds64, dsb))
    bad = [r.report() for r in reports if not r.ok]
    assert not bad, "\n".join(bad) + f"\nREPRO: {case.to_json()}"


@pytest.mark.parametrize("H,L", [(16, 1), (57, 33), (64, 129), (96, 65), (128, 2048)])
def test_atomic_control_agrees_with_oracle_inside_guard_bands(H, L):
    # The control's adds are deferred like the fixed design's: a block dropped
    # or added twice would show here, not only in the benchmark's rel L2. H = 96
    # runs the wide tile and a 32-head group into one accumulator (its line order).
    case = Case(B=2, S=3, S_kv=max(64, L + 7), H=H, L=L, d_k=576, d_v=512, invalid=INVALID_KINDS, hole_rate=0.2,
                duplicates=True, empty_rows=1, sink="random", seed=40 + H)
    _check_against_oracle(case, deterministic=False)


@pytest.mark.determinism
@pytest.mark.slow
@pytest.mark.parametrize("H", [64, 128])
def test_bitwise_identical_over_100_reruns_and_atomic_control_differs(H):
    args = production_inputs(B=1, S=4096, S_kv=8192, H=H, L=2048)
    for tracker in _reruns(args, "tilelang", 100):
        assert tracker.stats.report() is None, tracker.stats.report()
    dkv = _reruns(args, "tilelang-atomic", 10)[OUTPUT_NAMES.index("dkv")]
    assert not dkv.stats.bitwise, "the atomic control was bitwise stable"


def _reruns(args, backend, runs):
    """Each output's RerunTracker over ``runs`` calls. Runs are compared with run 0 on the device
    and dropped: a hundred dsv32 H=128 results (0.6 GB of dq each) do not fit in an H100."""
    trackers = [RerunTracker(name) for name in OUTPUT_NAMES]
    for _ in range(runs):
        for tracker, t in zip(trackers, mqa_latent_sparse_bwd(*args, backend=backend)):
            tracker.add(t)
    return trackers


def _slots_permuted(idx, seed=1):
    """Each row's slots in a random order (the same set), as an atomic top-k selector returns them."""
    g = torch.Generator(device=idx.device).manual_seed(seed)
    order = torch.argsort(torch.rand(idx.shape, device=idx.device, generator=g), dim=-1)
    return torch.gather(idx, -1, order)


@pytest.mark.determinism
@pytest.mark.parametrize("S,S_kv,H,L", [(512, 1024, 64, 256), (4096, 8192, 64, 2048)], ids=["S512-H64", "dsv32-H64"])
def test_any_slot_order_gives_the_same_bits(S, S_kv, H, L):
    # Before the canonical slot order, 3,544 (S=512) and 169,433 (dsv32 H=64)
    # elements of dq followed the slot order; dkv and d_attn_sink did not.
    args = production_inputs(B=1, S=S, S_kv=S_kv, H=H, L=L)
    base = mqa_latent_sparse_bwd(*args, backend="tilelang")
    for seed in (1, 2):
        reordered = args[:6] + (_slots_permuted(args[6], seed),) + args[7:]
        other = mqa_latent_sparse_bwd(*reordered, backend="tilelang")
        for name, a, b in zip(("dq", "dkv", "d_attn_sink"), base, other):
            diff = first_difference(name, [a, b], labels=("the selector's order", f"permutation {seed}"))
            assert diff is None, diff


@pytest.mark.determinism
@pytest.mark.parametrize("H,block_h", [(96, 32), (48, 16)])
def test_paired_and_lone_groups_bitwise_over_reruns(H, block_h):
    # H=96: a wide tile of two 32-head groups and a lone group; H=48 in
    # 16-head groups: a cluster of two and a lone group.
    args = production_inputs(B=1, S=1024, S_kv=8192, H=H, L=2048)
    runs = [wrapper.backward_with(launch.TileLangLauncher(), *args, block_h=block_h) for _ in range(10)]
    for i, name in enumerate(("dq", "dkv", "d_attn_sink")):
        diff = first_difference(name, [r[i] for r in runs])
        assert diff is None, diff


class _ForcedRedo(ForcedRedo, launch.TileLangLauncher):
    """The int64 kernel on the wide tile, on the GPU."""


@pytest.mark.parametrize("shape,gain,redone", [
    (dict(B=1, S=4096, S_kv=8192, H=64, L=2048), None, 0),  # dsv32 at the default gain: no bound fails there
    (dict(B=2, S=64, S_kv=256, H=128, L=200), 10, 0),      # two wide tiles into one set of words, a padded block
    (dict(B=2, S=64, S_kv=256, H=128, L=200), 30, 1),      # the plan's own scale: the device bounds must fail
    # Small S: at the default gain single values pass 2^22, where the lanes' rounding by FFMA is
    # not exact, so their rows are flagged and the corrections launch runs them
    # (benchmarks/magic_range.py finds all sampled rows there at S <= 256 with sharp attention).
    (dict(B=1, S=64, S_kv=128, H=64, L=64), None, 0),
    (dict(B=2, S=64, S_kv=256, H=128, L=200), None, 0),
])
def test_lanes_kernel_gives_the_int64_kernels_bits(shape, gain, redone):
    # Every deterministic launch rounds at one scale, so the lanes kernel's words, decoded, must
    # equal the int64 kernel's sums exactly: any fault in how a word is packed, exchanged or
    # addressed shows here as different dkv bits (the CPU model shares none of the CUDA). At
    # gain 30 the sums cannot fit 32 bits: a Bound that does not grow would keep the lanes.
    args = production_inputs(**shape)
    lanes = launch.TileLangLauncher(lanes_gain=gain)
    got = wrapper.backward_with(lanes, *args)
    assert int(lanes.lanes_redone) == redone, "the case must take the lanes" if not redone else "a bound must fail"
    forced = _ForcedRedo(lanes_gain=gain)
    want = wrapper.backward_with(forced, *args)
    assert int(forced.lanes_redone) == 1
    for name, x, y in zip(("dq", "dkv", "d_attn_sink"), got, want):
        assert bitwise_difference(name, x, y) is None, bitwise_difference(name, x, y)


@pytest.mark.parametrize("d_k", [576, 512])
@pytest.mark.parametrize("wg0_chunks", [None, 1, 2, 4])
def test_every_split_of_the_lanes_adds_the_int64_kernels_sums(d_k, wg0_chunks):
    # The split (MainConfig.wg0_chunks) decides which chunks go as a pair, whose words partner
    # lanes swap and add as one line (wide.lane_pairs, wg0_pairs): at 576 the default pairs all of
    # warpgroup 1's and warpgroup 0's first two, 1 and 4 leave warpgroup 0 no pair, 2 leaves
    # warpgroup 1 a chunk of its own; at 512 the default pairs warpgroup 0's too. The int64 redo
    # adds each column in place, pairing nothing: at each width and split, the same bits.
    args = production_inputs(B=2, S=64, S_kv=256, H=128, L=200, d_k=d_k)
    tile = {} if wg0_chunks is None else {"wg0_chunks": wg0_chunks}
    lanes, forced = launch.TileLangLauncher(lanes_gain=10, wide_tile=tile), _ForcedRedo(lanes_gain=10, wide_tile=tile)
    got, want = wrapper.backward_with(lanes, *args), wrapper.backward_with(forced, *args)
    assert int(lanes.lanes_redone) == 0 and int(forced.lanes_redone) == 1
    for name, x, y in zip(("dq", "dkv", "d_attn_sink"), got, want):
        assert bitwise_difference(name, x, y) is None, bitwise_difference(name, x, y)


class _TileALaunch(TileALaunch, launch.TileLangLauncher):
    """The wide tile's 64-head tiles as a launch each, on the GPU."""


@pytest.mark.parametrize("H", [128, 160, 192])
@pytest.mark.parametrize("gain,redone", [(None, 0), (30, 1)])
def test_one_wide_grid_gives_the_bits_of_a_launch_a_tile(H, gain, redone):
    # One persistent grid over the (row, tile) items must add what the same tiles add
    # launched apart: the head offset of each tile, in the lanes and in their int64 redo. H=160
    # puts a lone 32-head group after the grid's two tiles; H=192 launches the kernel built for
    # two tiles with three.
    args = production_inputs(B=2, S=64, S_kv=256, H=H, L=200)
    grid, apart = launch.TileLangLauncher(lanes_gain=gain), _TileALaunch(lanes_gain=gain)
    want, got = wrapper.backward_with(apart, *args), wrapper.backward_with(grid, *args)
    assert int(grid.lanes_redone) == int(apart.lanes_redone) == redone
    for name, x, y in zip(("dq", "dkv", "d_attn_sink"), got, want):
        assert bitwise_difference(name, x, y) is None, bitwise_difference(name, x, y)


@pytest.mark.parametrize("wg0_chunks", [1, 2, 4])
@pytest.mark.parametrize("gain,redone", [(None, 0), (30, 1)])
def test_wide_tile_split_of_dkv_chunks_leaves_the_bits(wg0_chunks, gain, redone):
    # Which warpgroup adds a dKV chunk is a configuration (MainConfig.wg0_chunks): integer adds
    # commute, so every split must give the default's bits (3 at d_k = 576: warpgroup 1's six
    # chunks in pairs, warpgroup 0's first two a pair), in the lanes and in their int64 redo:
    # 1 and 4 leave warpgroup 0 no pair, 2 leaves warpgroup 1 a chunk of its own.
    args = production_inputs(B=2, S=128, S_kv=512, H=128, L=320)
    default = launch.TileLangLauncher(lanes_gain=gain)
    split = launch.TileLangLauncher(lanes_gain=gain, wide_tile={"wg0_chunks": wg0_chunks})
    want, got = wrapper.backward_with(default, *args), wrapper.backward_with(split, *args)
    assert int(default.lanes_redone) == int(split.lanes_redone) == redone
    for name, x, y in zip(("dq", "dkv", "d_attn_sink"), got, want):
        assert bitwise_difference(name, x, y) is None, bitwise_difference(name, x, y)


@pytest.mark.determinism
@pytest.mark.parametrize("extra", [0, 1, 1 << 30])
def test_budget_invariance_on_gpu(extra):
    # The fixed design chunks nothing by the budget: from the least it accepts up, no bit moves.
    args = production_inputs(B=1, S=512, S_kv=1024, H=64, L=2048)
    budget = wrapper.scratch_bytes(1, 512, 1024, 64, 2048, 576, 512) + extra
    whole = call_gpu(args)
    chunked = call_gpu(args, dkv_buf_bytes=budget)
    for name, a, b in zip(("dq", "dkv", "d_attn_sink"), whole, chunked):
        assert bitwise_difference(name, b, a) is None, f"{name} changed with the scratch budget"


@pytest.mark.parametrize("Lp,NKV,HQ,Dk", [(160, 1 << 17, 21, 576), (2112, 1 << 22, 64, 512)])
def test_slot_marks_match_the_model_inside_guard_bands(Lp, NKV, HQ, Dk):
    # The fixed-point plan's marks: which kv rows some valid slot names, which
    # query rows have one (a CTA takes 1024 slots of a row: 160 are one partial
    # chunk, 2112 two whole and a partial one). NKV far above the slot count leaves
    # most rows unmarked; slots past either end mark nothing and write nothing.
    # The same launch reduces max |q| per (row, head) for the plan, as bf16 bit
    # patterns: the model's bits exactly, NaN and inf included, every head of HQ
    # (21: a warp's last batch of head rows is partial; 576 columns: a lane's last
    # load is past the row for most lanes).
    g = torch.Generator().manual_seed(3)
    R = 300
    slots = torch.randint(-3, NKV + 3, (R, Lp), generator=g, dtype=torch.int32)
    slots[7] = -1
    slots[8] = NKV + torch.arange(Lp, dtype=torch.int32) % 3  # only past the end
    slots[9] = -3
    q = torch.randn((R, HQ, Dk), generator=g).bfloat16()
    q[3, 4, 100], q[5, HQ - 1, Dk - 1], q[9, 3, 0], q[7, 0, 7] = float("nan"), float("-inf"), -1e30, float("nan")
    marks = {}
    for name, launcher, device in (("model", ModelLauncher(), "cpu"), ("tilelang", launch.TileLangLauncher(), "cuda")):
        guards = GuardBands()
        referenced = guards.allocate((NKV,), torch.int32, device, "Referenced").zero_()
        live_row = guards.allocate((R,), torch.int32, device, "LiveRow").zero_()
        peak_q = guards.allocate((R, HQ), torch.int32, device, "PeakQ").fill_(-7)
        launcher.mark_slots(slots.to(device), referenced, live_row, q.to(device), peak_q)
        assert not guards.violations(), f"{name}: {guards.violations()}"
        marks[name] = (referenced.cpu(), live_row.cpu(), peak_q.cpu())
    assert torch.equal(marks["model"][0], marks["tilelang"][0])
    assert torch.equal(marks["model"][1], marks["tilelang"][1])
    assert torch.equal(marks["model"][2], marks["tilelang"][2]), "max |q| bits differ from the model"
    peak_q = fixed_point.bits_to_bf16(marks["tilelang"][2])
    assert torch.isnan(peak_q[3, 4]) and torch.isnan(peak_q[7, 0]) and peak_q[5, HQ - 1] == float("inf")
    assert peak_q[9, 3] == torch.tensor(1e30).bfloat16()
    assert 0 < int(marks["tilelang"][0].sum()) < NKV // 2
    assert marks["tilelang"][1][7:10].tolist() == [0, 0, 0] and int(marks["tilelang"][1].sum()) == R - 3


@pytest.mark.parametrize("B,S,S_kv,L,dtype", [(1, 64, 128, 64, torch.int32), (3, 5, 70, 37, torch.int64),
                                              (2, 7, 40, 129, torch.int32), (2, 4, 33, 8, torch.int16),
                                              (2, 5, 1500, 700, torch.int32), (2, 3, 3000, 2048, torch.int64),
                                              (1, 3, 5000, 2100, torch.int32)])
@pytest.mark.parametrize("step_rows", [None, 3])
@pytest.mark.parametrize("marked", [False, True], ids=["layout", "with_marks"])
def test_slot_layout_kernels_give_the_models_slots_inside_guard_bands(B, S, S_kv, L, dtype, step_rows, marked,
                                                                      monkeypatch):
    # The slot layout (wrapper.global_slots) against the reference steps (layout.py, the
    # model's): sorted_slots for rows of up to SORT_CAPACITY slots (its builds of 2, 4 and 8 keys
    # a thread: up to 512, 1024 and 2048 slots, 2048 full), slot_keys and place_slots around
    # torch's sort for longer ones (2100); every invalid kind, duplicates,
    # padding, B > 1, indices of each dtype the kernels read and one they do not (int16,
    # converted first), one step and several (a step's row0 sets its batch offsets).
    # with_marks: the deterministic design's layout, which also fills the plan's slot marks and
    # max |q| bits (sorted_marks a step where rows fit a CTA, else mark_slots after the layout),
    # the model's exactly; 21 heads leave a warp's last batch of head rows partial, NaN and inf
    # included. Either way the rows' block counts (the fused kernels', else row_blocks'): a row
    # with no valid slot (0 blocks), and where L allows one whose valid slots fill whole blocks
    # (a count rounded up where it should not be shows there).
    case = Case(B=B, S=S, S_kv=S_kv, H=16, L=L, invalid=INVALID_KINDS, hole_rate=0.3, duplicates=True, seed=L)
    info = torch.iinfo(dtype)
    idx = torch.from_numpy(case.indices()).to(torch.int64).clamp(info.min, info.max).to(dtype)
    rows = idx.view(B * S, L)
    rows[0] = -1
    whole = 64 * (L // 64) if L < 128 else 128
    if whole:
        rows[-1] = -1
        rows[-1, :whole] = (torch.arange(whole) % S_kv).to(dtype)
    if step_rows:
        monkeypatch.setattr(wrapper, "INDEX_STEP", step_rows * L)
    p = wrapper.Problem(B=B, S=S, S_kv=S_kv, H=16, L=L, d_k=64, d_v=32, block_h=16, dkv_buf_bytes=None)
    R, NKV, HQ = B * S, B * S_kv, 21
    q = torch.randn((R, HQ, p.d_k), generator=torch.Generator().manual_seed(L)).bfloat16()
    q[0, 3, 17], q[R - 1, HQ - 1, p.d_k - 1] = float("nan"), float("-inf")
    got = {}
    for name, device in (("model", "cpu"), ("tilelang", "cuda")):
        guards = GuardBands()
        launcher = ModelLauncher(instruments=guards.instruments()) if name == "model" else launch.TileLangLauncher(
            instruments=guards.instruments())
        marks = None
        if marked:
            marks = (guards.allocate((NKV,), torch.int32, device, "Referenced").zero_(),
                     guards.allocate((R,), torch.int32, device, "LiveRow").zero_(), q.to(device),
                     guards.allocate((R, HQ), torch.int32, device, "PeakQ").fill_(-7))
        row_blocks = guards.allocate((R,), torch.int32, device, "RowBlocks").fill_(-7)
        slots = wrapper.global_slots(idx.to(device), p, launcher, marks=marks, row_blocks=row_blocks)
        assert not guards.violations(), f"{name}: {guards.violations()}"
        got[name] = (slots.cpu(), row_blocks.cpu()) + (
            () if marks is None else (marks[0].cpu(), marks[1].cpu(), marks[3].cpu()))
    assert bitwise_difference("slots", got["tilelang"][0], got["model"][0]) is None
    slots = got["model"][0]
    assert 0 < int((slots >= 0).sum()) < slots.numel() and bool((slots[:, L:] == -1).all())
    assert torch.equal(got["tilelang"][1], got["model"][1]), (got["tilelang"][1] != got["model"][1]).nonzero()[:8]
    assert int(got["model"][1][0]) == 0 and (not whole or int(got["model"][1][-1]) == whole // 64)
    if marked:
        for what, want, have in zip(("referenced", "live_row", "peak_q"), got["model"][2:], got["tilelang"][2:]):
            assert torch.equal(want, have), f"{what} differs from the model"
        assert torch.equal(got["model"][2], (torch.zeros(NKV, dtype=torch.int32).index_fill_(0, slots[slots >= 0].long(), 1)))
        assert torch.isnan(fixed_point.bits_to_bf16(got["tilelang"][4])[0, 3])


@pytest.mark.parametrize("R,Lp,order", [(1, 64, "prefix"), (300, 640, "prefix"), (300, 640, "interleaved"),
                                         (97, 2048, "interleaved"), (5, 4096, "prefix")])
def test_row_blocks_kernel_counts_as_the_reference(R, Lp, order):
    # The wide tile's warpgroup 0 walks RowBlocks[r] blocks of a row and warpgroup 1 the blocks it
    # counts in the row's slots: a count that differs from the reference hangs the launch. Each
    # row's slots end at a random extent, valid up to it (a prefix, as the canonical order lays
    # them out) or with invalid ones among them (a caller's order); then rows with no valid slot,
    # a valid one only in the last slot, every slot valid, and slots past the kv rows.
    g = torch.Generator().manual_seed(R + Lp)
    NKV = 1000
    slots = torch.randint(0, NKV, (R, Lp), generator=g, dtype=torch.int32)
    if order == "interleaved":
        slots[torch.rand((R, Lp), generator=g) < 0.5] = -1
    extent = torch.randint(0, Lp + 1, (R, 1), generator=g)
    slots[torch.arange(Lp).view(1, Lp) >= extent] = -1
    slots[0] = -1
    if R > 3:
        slots[1] = -1
        slots[1, Lp - 1] = NKV - 1
        slots[2] = torch.arange(Lp, dtype=torch.int32) % NKV
        slots[3] = NKV
    have = torch.full((R,), -7, dtype=torch.int32, device="cuda")
    launch.TileLangLauncher().row_blocks(slots.cuda(), NKV, have)
    want = layout.row_blocks(slots, NKV, 64)
    assert int(want[0]) == 0
    if R > 3:
        assert want[1:4].tolist() == [Lp // 64, Lp // 64, 0]
    if R > 64:
        assert len(set(want.tolist())) > Lp // 256, "the rows' extents should give many counts"
    assert torch.equal(have.cpu(), want), (have.cpu() != want).nonzero()[:8]


def test_the_delta_launch_keeps_the_lse2_poisoning_rule_and_values():
    # Lse2 from the Delta launch against the reference (layout.lse_base2, the model's): the same
    # NaN and inf positions (the bad-input rule), finite values within a few fp32 ulps of torch's
    # logaddexp (the kernel's exp and log1p are not torch's); and the sink rows formed from the
    # launch's own Lse2 (layout.sink_rows).
    g = torch.Generator().manual_seed(0)
    R, H, Dv = 300, 40, 512
    lse = torch.randn((R, H), generator=g) * 5
    sink = torch.randn((H,), generator=g)
    lse[0, :4] = torch.tensor([-math.inf, math.inf, math.nan, 0.0])
    sink[5], sink[6], sink[7] = math.nan, math.inf, -math.inf
    o, do = (torch.randn((R, H, Dv), generator=g).bfloat16() for _ in range(2))
    got = {}
    for name, launcher, device in (("model", ModelLauncher(), "cpu"), ("tilelang", launch.TileLangLauncher(), "cuda")):
        terms = wrapper.row_terms(*(t.to(device) for t in (o, do, lse, sink)), launcher)
        got[name] = [t.cpu() for t in terms[:3]]
    (have, delta, dsink_rows), (want, _, _) = got["tilelang"], got["model"]
    assert bool(torch.isnan(want[:, 5:7]).all()) and float(want[0, 0]) == math.inf  # the rule, in the reference
    nan_at = (torch.isnan(have) != torch.isnan(want)).nonzero().tolist()
    assert not nan_at, f"NaN in one of the two at (row, head) {nan_at[:8]}"
    inf_at = (torch.isinf(have) != torch.isinf(want)).nonzero().tolist()
    assert not inf_at, f"inf in one of the two at (row, head) {inf_at[:8]}"
    finite = torch.isfinite(want)
    error = float((have - want)[finite].abs().max())
    assert error <= 4e-6 * float(want[finite].abs().max()), f"largest difference {error}"
    from_own = layout.sink_rows(have, sink * LOG2E, delta)
    torch.testing.assert_close(dsink_rows, from_own, rtol=2e-6, atol=0.0, equal_nan=True, msg="DSinkRows")


@pytest.mark.parametrize("R,H", [(1, 16), (31, 40), (4099, 64), (8192, 128)])
def test_dsink_reduction_gives_the_models_bits(R, H):
    # The kernel sums in the order the model writes down (reductions.dsink_reduce_program):
    # the bits must agree, fewer rows than groups included; the row order must show in the
    # bits, or the test could not tell the kernel's order from another.
    rows = torch.randn((R, H), generator=torch.Generator().manual_seed(R), dtype=torch.float32) * 1e3
    sums = {}
    for name, launcher, device in (("model", ModelLauncher(), "cpu"), ("tilelang", launch.TileLangLauncher(), "cuda")):
        guards = GuardBands()
        dsink = guards.allocate((H,), torch.float32, device, "DSink")
        launcher.dsink_reduce(rows.to(device), dsink)
        assert not guards.violations(), f"{name}: {guards.violations()}"
        sums[name] = dsink.cpu()
    assert bitwise_difference("d_attn_sink", sums["tilelang"], sums["model"]) is None
    if R > 1000:  # one row at a time, in increasing order, gives other bits here
        in_row_order = np.add.accumulate(rows.numpy(), axis=0, dtype=np.float32)[-1]
        assert not np.array_equal(sums["model"].numpy(), in_row_order), "the order does not show in these bits"


@pytest.mark.parametrize("acc_summed", [True, False])
@pytest.mark.parametrize("failed", [0, 1])
def test_lanes_cast_gives_the_reference_joins_bits(failed, acc_summed):
    # The fused join and cast (lanes_to_bf16) against the reference: join_lanes, then
    # fixed_to_bf16 (the model's). Lanes at both ends of 32 bits, negative sums, a NaN scale, a
    # poisoned batch element (the second of four: its rows NaN whatever their scale). Without
    # acc_summed acc is read only where the redo ran: here acc holds sums where failed, and
    # garbage that neither may read where not.
    g = torch.Generator().manual_seed(11 + failed)
    N, C = 1000, 576
    acc = torch.randint(-2**40, 2**40, (N, C), generator=g, dtype=torch.int64)
    lanes = torch.randint(-2**31, 2**31, (N, C), generator=g, dtype=torch.int64)
    lanes[0, :4] = torch.tensor([-2**31, 2**31 - 1, -1, 0])
    words = torch.from_numpy(lane_words(lanes.numpy()).view(np.int64))
    scale = torch.ldexp(torch.ones(N), torch.randint(-30, 10, (N,), generator=g))
    scale[3] = float("nan")
    gate = torch.tensor([failed], dtype=torch.int32)
    poisoned = torch.tensor([0, 1, 0, 0], dtype=torch.int32)
    got = {}
    for name, launcher, device in (("model", ModelLauncher(), "cpu"), ("tilelang", launch.TileLangLauncher(), "cuda")):
        guards = GuardBands()
        dst = guards.allocate((N, C), torch.bfloat16, device, "Dst")
        launcher.lanes_to_bf16(acc.clone().to(device), words.to(device), gate.to(device), scale.to(device),
                               poisoned.to(device), dst, acc_summed=acc_summed)
        assert not guards.violations(), f"{name}: {guards.violations()}"
        got[name] = dst.cpu()
    # A NaN row is NaN on both (its payload is the device's fp64 division's, not the host's).
    nan = torch.isnan(got["model"].float())
    nan_rows = torch.zeros(N, dtype=torch.bool)
    nan_rows[3], nan_rows[N // 4: N // 2] = True, True
    assert torch.equal(torch.isnan(got["tilelang"].float()), nan) and torch.equal(nan.all(dim=1), nan_rows)
    assert int(nan.sum()) == C * int(nan_rows.sum())
    assert bitwise_difference("dkv", got["tilelang"][~nan], got["model"][~nan]) is None
    kept = ~nan_rows & (torch.arange(N) >= 4)
    without_lanes = (acc.double() / scale.double().view(-1, 1)).float().bfloat16()
    assert torch.equal(got["model"][kept].float(), without_lanes[kept].float()) == bool(failed)
    if not (acc_summed or failed):  # the lanes alone: acc's sums would have shown
        joined_with_acc = ((lanes + acc).double() / scale.double().view(-1, 1)).float().bfloat16()
        assert not torch.equal(got["tilelang"][kept].float(), joined_with_acc[kept].float())


def test_fixed_cast_poisons_exactly_the_flagged_batch_elements():
    # fixed_to_bf16 against the model's: three batch elements of 300 kv rows, the last poisoned,
    # a NaN scale in the first; the middle one's rows keep their values.
    g = torch.Generator().manual_seed(5)
    N, C = 900, 576
    acc = torch.randint(-2**40, 2**40, (N, C), generator=g, dtype=torch.int64)
    scale = torch.ldexp(torch.ones(N), torch.randint(-30, 10, (N,), generator=g))
    scale[7] = float("nan")
    poisoned = torch.tensor([0, 0, 1], dtype=torch.int32)
    got = {}
    for name, launcher, device in (("model", ModelLauncher(), "cpu"), ("tilelang", launch.TileLangLauncher(), "cuda")):
        guards = GuardBands()
        dst = guards.allocate((N, C), torch.bfloat16, device, "Dst")
        launcher.fixed_to_bf16(acc.to(device), scale.to(device), poisoned.to(device), dst)
        assert not guards.violations(), f"{name}: {guards.violations()}"
        got[name] = dst.cpu()
    nan = torch.isnan(got["model"].float())
    assert torch.equal(torch.isnan(got["tilelang"].float()), nan)
    assert nan[7].all() and nan[600:].all() and int(nan.sum()) == C * 301
    assert bitwise_difference("dkv", got["tilelang"][~nan], got["model"][~nan]) is None


@pytest.mark.parametrize("B,S,NKV", [(1, 4096, 8192), (3, 333, 1000), (5, 1, 7)])
def test_call_flags_give_the_references(B, S, NKV):
    # lanes_failed and poisoned_batches against the torch references (Launcher's): no flag, a mass
    # flag at either end of the rows, the lanes' rounding flag alone (not a fault), a bound at
    # LANE_LIMIT at either end of the kv rows and every other one below it.
    R = B * S
    for flagged_rows, bound_rows in (([], []), ([R - 1], [NKV - 1]), ([0, R // 2], [0]), ([], [NKV // 3])):
        row_flags = torch.zeros(R, dtype=torch.int32)
        row_flags[R // 3] = fixed_point.FLAG_MAGIC
        row_flags[flagged_rows] = fixed_point.FLAG_MASS | fixed_point.FLAG_MAGIC
        bound = torch.full((NKV,), fixed_point.LANE_LIMIT - 1, dtype=torch.int64)
        bound[bound_rows] = fixed_point.LANE_LIMIT
        got = {}
        for name, launcher, device in (("reference", launch.Launcher(), "cpu"), ("tilelang", launch.TileLangLauncher(), "cuda")):
            poisoned, failed = torch.zeros(B, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
            launcher.lanes_failed(bound.to(device), failed)
            launcher.poisoned_batches(row_flags.to(device), poisoned)
            got[name] = (poisoned.cpu().tolist(), failed.cpu().tolist())
        assert got["tilelang"] == got["reference"]
        assert got["tilelang"] == ([int(b in {r // S for r in flagged_rows}) for b in range(B)], [int(bool(bound_rows))])


@pytest.mark.parametrize("gate", [0, 1])
def test_zero_gated_zeroes_only_where_the_gate_is_set(gate):
    N, C = 1001, 576
    acc = torch.randint(-2**62, 2**62, (N, C), dtype=torch.int64, generator=torch.Generator().manual_seed(gate))
    guards = GuardBands()
    given = guards.allocate((N, C), torch.int64, "cuda", "Acc")
    given.copy_(acc)
    launch.TileLangLauncher().zero_gated(given, torch.tensor([gate], dtype=torch.int32, device="cuda"))
    assert not guards.violations(), guards.violations()
    assert torch.equal(given.cpu(), torch.zeros_like(acc) if gate else acc)


def test_delta_maxima_match_the_model():
    # The fixed-point design's delta launch also reduces max |dO| per (row,
    # head) for the plan, as bf16 bit patterns: the model's bits exactly (NaN
    # and inf included), heads past H untouched (H = 21 masks most of the
    # second tile), Lse2 that of the plain delta kernel bit for bit, and Delta /
    # DSinkRows up to fp32 summation order.
    g = torch.Generator().manual_seed(5)
    R, H, Dv = 70, 21, 512
    do = torch.randn((R, H, Dv), generator=g).bfloat16()
    o = torch.randn((R, H, Dv), generator=g).bfloat16()
    lse, sink = torch.randn((R, H), generator=g), torch.randn((H,), generator=g)
    do[6, 0, 7], do[7, 1, 511], o[8, 2, 9] = float("nan"), float("inf"), float("nan")
    shapes = {"Lse2": (R, H), "Delta": (R, H), "DSinkRows": (R, H)}
    results = {}
    for name, launcher, device in (("model", ModelLauncher(), "cpu"), ("tilelang", launch.TileLangLauncher(), "cuda")):
        args = [t.to(device) for t in (o, do, lse, sink)]
        guards = GuardBands()
        outs = [guards.allocate(shape, torch.float32, device, n).fill_(-7.0) for n, shape in shapes.items()]
        peaks = [guards.allocate((R, H), torch.int32, device, "PeakDO").fill_(-7)]
        launcher.delta(*args, *outs, *peaks)
        plain = [guards.allocate(shape, torch.float32, device, n).fill_(-7.0) for n, shape in shapes.items()]
        launcher.delta(*args, *plain)
        assert not guards.violations(), f"{name}: {guards.violations()}"
        results[name] = [t.cpu() for t in outs + peaks + plain]
    model, gpu = results["model"], results["tilelang"]
    assert torch.equal(gpu[3], model[3]), "max |dO| bits differ from the model"
    peak_do = fixed_point.bits_to_bf16(gpu[3])
    assert torch.isnan(peak_do[6, 0]) and peak_do[7, 1] == float("inf") and not torch.isnan(peak_do[8, 2])
    assert bitwise_difference("Lse2", gpu[0], gpu[4]) is None
    for i, what in ((1, "Delta"), (2, "DSinkRows")):
        torch.testing.assert_close(gpu[i], gpu[4 + i], rtol=1e-5, atol=1e-5, equal_nan=True, msg=what)


# The main kernel alone on the given slots, once per kept configuration: the
# atomic control's 32-head group and its pair as one 64-head CTA (the wide
# tile: the control's kernel at H = 64 and 128), one fixed-point group, the
# wide tile in lanes and its int64 redo (warp-specialised: its warpgroups hand
# P, dS and KV over on mbarriers), and the cluster of two 16-head groups that
# swap P and dS tiles (bulk copies, mbarriers), and the lanes' corrections launch on every other
# row (flagged as a lanes launch flags them). ``launch``: the launch module
# of the package under test. Shared by the sanitizer scripts.
MAIN_KERNEL_EACH_DESIGN = """
def main_kernel_each_design(idx, R, HQ, NKV, seed, launch=None):
    import torch
    if launch is None:
        from mqa_bwd import launch
    kernels = launch.K  # the configurations of the package under test (a mutant's are its own classes)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, HQ, 576, generator=g).bfloat16().cuda()
    kv = torch.randn(NKV, 576, generator=g).bfloat16().cuda()
    do = torch.randn(R, HQ, 512, generator=g).bfloat16().cuda()
    lse2, delta = torch.full((R, HQ), 30.0).cuda(), torch.randn(R, HQ, generator=g).cuda()
    configs = [kernels.main_config(heads, 576, 512, deterministic, cluster) for heads, deterministic, cluster in
               ((32, False, 1), (32, False, 2), (32, True, 1), (32, True, 2), (16, True, 2))]
    configs.insert(4, kernels.lanes_redo(configs[3]))
    configs.insert(4, kernels.lanes_corrections(configs[3]))
    for config in configs:
        deterministic = config.accumulate != "atomic"
        dq = torch.empty(R, HQ, 576, dtype=torch.bfloat16).cuda()
        width = 576 // 2 if config.accumulate == "lanes" else 576
        dkv = torch.zeros(NKV, width, dtype=torch.int64 if deterministic else torch.float32).cuda()
        flag = torch.zeros(R, dtype=torch.int32)
        if config.corrections:
            flag[1::2] = launch.fixed_point.FLAG_MAGIC  # the rows a lanes launch flagged
        extra = {} if not deterministic else dict(
            row_scale=torch.ones(NKV).cuda(), flag=flag.cuda(), allowance=torch.full((R, HQ), float("inf")).cuda())
        if config.wide:  # the lanes' bound; the redo runs (gate 1)
            extra.update(bound=torch.zeros(NKV, dtype=torch.int64).cuda(), gate=torch.ones(1, dtype=torch.int32).cuda())
        launch.TileLangLauncher(deterministic=deterministic).main_bwd(
            q, kv, do, idx.cuda(), lse2, delta, dq, dkv, config=config, sm_scale=0.04,
            heads=32 if config.wide else config.heads, **extra)
    torch.cuda.synchronize()
"""

SANITIZED_CALL = MAIN_KERNEL_EACH_DESIGN + """
import torch
from properties.case import ALL_INVALID_KINDS, Case, to_framework
from mqa_bwd import launch, wrapper
from mqa_bwd.contract import SPEC_ARGS as ARGS
# Whole calls: every invalid kind (the wrapper maps them to -1), duplicates, an empty row, both head tiles.
for H, L in ((5, 33), (40, 129)):
    case = Case(B=2, S=4, S_kv=200, H=H, L=L, d_k=576, d_v=512, invalid=ALL_INVALID_KINDS, duplicates=True,
                empty_rows=1, sink="random", seed=H)
    inputs = to_framework(case.inputs(), "torch", "cuda")
    for deterministic in (True, False):
        wrapper.backward_with(launch.TileLangLauncher(deterministic=deterministic), *[inputs[k] for k in ARGS])
# The main kernel alone, with slots outside [0, NKV) that the wrapper never hands it: its own bounds test.
R, HQ, NKV, Lp = 8, 128, 100, 64
idx = torch.randint(0, NKV, (R, Lp), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
odd = torch.tensor([-7, -1, NKV, NKV + 5, 2**31 - 1, -2**31], dtype=torch.int32)
idx[:, ::5] = odd[torch.arange(R * 13) % len(odd)].view(R, 13)
main_kernel_each_design(idx, R, HQ, NKV, seed=0)
print("sanitized calls done")
"""


SHARED_MEMORY_CALL = MAIN_KERNEL_EACH_DESIGN + """
import importlib, importlib.util, os, shutil, sys, tempfile
import torch
import mqa_bwd
# The main kernel alone, two slot blocks: each design's shared-memory protocol.
DROP = os.environ.get("DROP_BARRIER")  # a mutant: a copy of the package without the barrier of this comment
launch = None
if DROP:
    # The mutant is a whole package of its own (as benchmarks/package_ab.py loads
    # another revision): nothing in the package under test is patched.
    copy = os.path.join(tempfile.mkdtemp(prefix="mqa_mutant_"), "mqa_bwd")
    shutil.copytree(os.path.dirname(mqa_bwd.__file__), copy)
    module, statement = DROP.split("|")  # kernels/<module>.py and the statement to drop
    path = os.path.join(copy, "kernels", module + ".py")
    source = open(path).read()
    assert source.count(statement) == 1, DROP
    open(path, "w").write(source.replace(statement, "pass"))
    spec = importlib.util.spec_from_file_location("mqa_bwd_mutant", os.path.join(copy, "__init__.py"),
                                                  submodule_search_locations=[copy])
    sys.modules["mqa_bwd_mutant"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["mqa_bwd_mutant"])
    launch = importlib.import_module("mqa_bwd_mutant.launch")
R, HQ, NKV, Lp = 4, 128, 100, 64
idx = torch.randint(-1, NKV, (R, Lp), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
main_kernel_each_design(idx, R, HQ, NKV, seed=1, launch=launch)
print("sanitized calls done")
"""


#: A folder where every sanitizer run writes its whole report (scripts/gpu-run.sh sets it under
#: $OUT, so that the reports come back from the device): a failure's message shows only the tail.
SANITIZER_REPORTS = "MQA_SANITIZER_REPORTS"
SANITIZER_TIMEOUT_S = 900


def run_under_compute_sanitizer(tool_name: str, script: str, finish: bool = True, **env_extra) -> tuple:
    """(exit code, report) of ``script`` run by compute-sanitizer's ``tool_name`` (exit code 99:
    the tool found errors); fails if the script did not finish, unless ``finish`` is False (a
    mutant, which may fault once its race has been seen). Where $MQA_SANITIZER_REPORTS
    names a folder, the whole report goes to a file there, named after the test, and the
    report's last line names that file."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    tool = compute_sanitizer()
    if tool is None:
        pytest.skip("needs compute-sanitizer (CUDA toolkit)")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))))
    env.pop("DROP_BARRIER", None)  # a mutant only where a test asks for one
    env.update(env_extra)
    command = [tool, "--tool", tool_name, "--error-exitcode", "99", sys.executable, "-c", script]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SANITIZER_TIMEOUT_S, cwd=root, env=env)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as hung:  # a hung kernel (a mutant's barrier phases): keep what it printed
        code, stdout, stderr = None, *(as_text(x) + f"\ntimed out after {SANITIZER_TIMEOUT_S} s" for x in
                                       (hung.stdout, hung.stderr))
    # The tool's report is on stdout; stderr (compile logs) follows it.
    report = stdout + stderr
    folder = os.environ.get(SANITIZER_REPORTS)
    if folder:
        test = os.environ.get("PYTEST_CURRENT_TEST", tool_name).split("::")[-1]
        test = re.sub(r" \((setup|call|teardown)\)$", "", test)
        path = pathlib.Path(folder) / (re.sub(r"[^\w.-]+", "_", test)[:120] + ".log")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"exit code {code}\n{report}")
        report += f"\nwhole report: {path}\n"
    assert not finish or "sanitized calls done" in stdout, report[-4000:]
    return code, report


def as_text(output) -> str:
    """A subprocess's captured output as text (a timeout hands it over as bytes, or None)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def sanitizer_count(report: str, pattern: str) -> int:
    """The number that ``pattern`` (one group) captures in the report; fails if the summary is missing."""
    import re

    found = re.search(pattern, report)
    assert found, report[-4000:]
    return int(found.group(1))


@pytest.mark.slow
def test_no_invalid_memory_access_under_compute_sanitizer():
    # Guard bands see stray writes, not stray reads. memcheck sees both, with
    # the caching allocator off so that a read just past a buffer is past an
    # allocation. It does not see shared-memory races (the next test).
    code, report = run_under_compute_sanitizer("memcheck", SANITIZED_CALL)
    assert code == 0 and sanitizer_count(report, SANITIZER_ERRORS) == 0, report[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("tool_name,summary", [("racecheck", RACECHECK_HAZARDS), ("synccheck", SANITIZER_ERRORS)])
def test_no_shared_memory_hazard_under_compute_sanitizer(tool_name, summary):
    # racecheck: two threads of a CTA touching one shared-memory word without
    # a barrier between them; synccheck: barriers that not every thread
    # reaches. Neither sees the cluster's cross-CTA protocol (the peer's bulk
    # copy into the inbox): the GPU reruns and the model tests cover that.
    code, report = run_under_compute_sanitizer(tool_name, SHARED_MEMORY_CALL)
    assert code == 0 and sanitizer_count(report, summary) == 0, report[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("barrier", [
    "main_bwd|T.sync_threads()  # every warp is done with KV_s",
    'wide|T.call_extern("handle", "mqa_handoff_wait", bars.data, PDS_READY, p)',
])
def test_racecheck_sees_a_dropped_barrier(barrier):
    # The previous test can fail: without the barrier before the next block's
    # KV gather, cp.async overwrites KV_s while other warps still read it (and
    # the gather reads slot_next as it is stored; on the H200: 30 hazards);
    # without the wide tile's wait for PDS_READY, warpgroup 1 reads the block's
    # slots and scales before warpgroup 0 has stored them. (Without warpgroup 0's
    # wait for PDS_FREE instead, racecheck reported no hazard on the H200; what
    # that wait guards is read by wgmma, through the async proxy.) The mutant need not
    # finish: its warpgroup 1 may take a block's kv row offsets before they are stored, and
    # the lanes' adds trust those offsets (the slot layout makes every one valid), so a
    # later add may fault; the hazards racecheck printed before that are what counts.
    code, report = run_under_compute_sanitizer("racecheck", SHARED_MEMORY_CALL, finish=False, DROP_BARRIER=barrier)
    assert sanitizer_count(report, RACECHECK_HAZARDS) > 0, report[-4000:]


def plan_inputs(B, S, H, S_kv, seed, quirk=None, device="cuda"):
    """Inputs of a launcher's plan: q, grad_out [B, S, H, ...], Delta and the maxima as the
    delta launch leaves them ([R, H + 3]: three padding heads of garbage the plan must not
    read), kv's value part, the slot marks; ``quirk`` bends them toward an edge of the proof."""
    from mqa_bwd import fixed_point

    g = torch.Generator().manual_seed(seed)
    R, NKV, HQ = B * S, B * S_kv, H + 3
    q = torch.randn((B, S, H, 576), generator=g).bfloat16()
    do = torch.randn((B, S, H, 512), generator=g).bfloat16()
    delta = torch.randn((R, HQ), generator=g)
    kv_v = torch.randn((NKV, 512), generator=g).bfloat16()
    referenced = (torch.rand(NKV, generator=g) < 0.7).to(torch.int32)
    live_row = (torch.rand(R, generator=g) < 0.9).to(torch.int32)
    live_row[R - S] = referenced[NKV - S_kv] = 1
    if quirk == "nan_q":  # the last batch element's proof no longer holds: its scales are NaN
        q[-1, 0, 0, 5] = float("nan")
    elif quirk == "dead":  # batch element 1 has no live row, element 2 no referenced kv row
        live_row[S : 2 * S] = 0
        referenced[2 * S_kv :] = 0
    elif quirk == "inf_delta":  # b = inf on one live term: b_max / b is NaN there
        delta[R - S, 0] = float("inf")
    elif quirk == "huge":  # peaks past FP32_SAFE: the element is poisoned
        q[0, 1, 0, 3] = 1e30
    elif quirk == "nan_kv":  # a NaN in a referenced kv row's value part: max |kv| is NaN, element 0 poisoned
        kv_v[3, 100] = float("nan")
        referenced[3] = 1
    elif quirk == "zeros":  # a = 0 everywhere, b = max |dO| only; kv rows of zeros: bound_j = N_b b_max
        q.zero_()
        kv_v[: S_kv // 2] = 0
    peak_q = torch.randint(0, 1 << 15, (R, HQ), generator=g, dtype=torch.int32)
    peak_do = torch.randint(0, 1 << 15, (R, HQ), generator=g, dtype=torch.int32)
    peak_q[:, :H] = fixed_point.magnitude_bits(q.reshape(R, H, 576))
    peak_do[:, :H] = fixed_point.magnitude_bits(do.reshape(R, H, 512))
    return [t.to(device) for t in (q, do, delta, kv_v, referenced, live_row)], peak_q.to(device), peak_do.to(device)


@pytest.mark.parametrize("shape,quirk,sm_scale", [
    ((1, 64, 8, 256), None, 0.0417), ((2, 33, 3, 100), "nan_q", 0.0417), ((3, 17, 5, 50), "dead", 0.125),
    ((2, 40, 4, 64), "inf_delta", 0.0417), ((2, 40, 4, 64), "huge", 0.0417), ((1, 30, 2, 300), "zeros", -0.5),
    ((2, 40, 4, 64), "nan_kv", 0.0417),
    ((1, 4096, 64, 8192), None, 576**-0.5),
])
@pytest.mark.parametrize("gain", [30, fixed_point.LANES_GAIN, 0])
def test_plan_kernels_give_the_torch_plan_bits(shape, quirk, sm_scale, gain):
    # The TileLang launcher runs the fixed-point plan as three kernels, the last of which also
    # applies the lanes' gain; every output bit must be the torch reference's (on the same
    # device): maxima, counts, NaN and inf cases, poisoned and dead batch elements.
    (q, do, delta, kv_v, referenced, live_row), peak_q, peak_do = plan_inputs(*shape, seed=len(str(quirk)), quirk=quirk)
    args = (q, do, delta, kv_v, referenced, live_row, sm_scale, peak_q, peak_do)
    want = launch.Launcher.plan(launch.TileLangLauncher(lanes_gain=gain), *args)
    got = launch.TileLangLauncher(lanes_gain=gain).plan(*args)
    for name, x, y in zip(("row_scale", "allowance"), want, got):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        same = torch.isnan(x).eq(torch.isnan(y)) & (x.nan_to_num(-1.0) == y.nan_to_num(-1.0))
        assert bool(same.all()), f"{name}: {int((~same).sum())} of {x.numel()} differ, first at {torch.nonzero(~same)[0].tolist()}"
    # The quirks that break a proof poison exactly their batch element (every kv row a slot names).
    nan = torch.isnan(want[0]).view(shape[0], -1)
    poisoned = ((nan | (referenced == 0).view(shape[0], -1)).all(dim=1) & nan.any(dim=1)).tolist()
    broken = {"nan_q": shape[0] - 1, "inf_delta": shape[0] - 1, "huge": 0, "nan_kv": 0}.get(quirk)
    assert poisoned == [b == broken for b in range(shape[0])], poisoned


def test_fixed_point_flag_poisons_only_the_flagged_batch_element():
    case = Case(B=2, S=5, S_kv=300, H=33, L=129, d_k=576, d_v=512, sink="random", seed=7)
    host = case.inputs()
    _, (dq, dkv, dsink) = _run(host)
    assert torch.isfinite(dkv.float()).all()
    bad = dict(host, lse=host["lse"].copy())
    bad["lse"][1, 3, 32] -= 1.0  # H=33 runs in groups of 16: head 32 is the third group's (head_base 32)
    _, (dq2, dkv2, dsink2) = _run(bad)
    assert torch.isnan(dkv2[1].float()).all(), "the kernel did not flag a softmax mass above the allowance"
    assert bitwise_difference("dkv", dkv2[0], dkv[0]) is None, "a flag in batch element 1 changed batch element 0"
    assert torch.isfinite(dq2.float()).all() and torch.isfinite(dsink2).all()
    bad["lse"] = host["lse"].copy()
    bad["lse"][0, 1, 5] = float("nan")
    _, (_, dkv3, _) = _run(bad)
    assert torch.isnan(dkv3[0].float()).all(), "the kernel did not flag a NaN softmax mass"
    assert bitwise_difference("dkv", dkv3[1], dkv[1]) is None


def test_fixed_point_non_finite_kv_rows_poison_dkv_only_when_read():
    case = Case(B=1, S=5, S_kv=300, H=16, L=33, d_k=576, d_v=512, seed=8)
    host = case.inputs()
    used = sorted(set(host["token_indices"].reshape(-1).tolist()) & set(range(300)))
    spare = next(j for j in range(300) if j not in used)
    _, (dq, dkv, _) = _run(host)
    bad = dict(host, kv=host["kv"].copy())
    bad["kv"][0, spare, 3] = float("inf")  # nobody reads it: its dkv stays exactly 0 (SPEC)
    _, (dq2, dkv2, _) = _run(bad)
    assert torch.count_nonzero(dkv2[0, spare].float()) == 0
    assert bitwise_difference("dkv", dkv2, dkv) is None and bitwise_difference("dq", dq2, dq) is None
    bad["kv"][0, used[0], 3] = float("inf")
    _, (_, dkv3, _) = _run(bad)
    assert torch.isnan(dkv3[0, used[0]].float()).all()


def _poison(host, argument, value):
    """host with lse NaN/+inf at (a live row, head 1) of each batch element, or the sink at head H // 2."""
    bad = dict(host)
    if argument == "lse":
        lse = host["lse"].copy()
        idx = host["token_indices"]
        live = ((idx >= 0) & (idx < host["kv"].shape[1])).any(axis=2)
        for b in range(lse.shape[0]):
            lse[b, live[b].nonzero()[0][0], min(1, lse.shape[2] - 1)] = value
        bad["lse"] = lse
    else:
        sink = host["attn_sink"].copy()
        sink[len(sink) // 2] = value
        bad["attn_sink"] = sink
    return bad


@pytest.mark.parametrize("backend", ["tilelang", "tilelang-atomic"])
@pytest.mark.parametrize("H,block_h", [(5, None), (48, 16), (64, None), (128, None)])
@pytest.mark.parametrize("argument,value", [("lse", float("nan")), ("lse", float("inf")),
                                            ("attn_sink", float("nan")), ("attn_sink", float("inf"))])
def test_non_finite_lse_or_sink_poisons_as_on_the_model(backend, H, block_h, argument, value):
    # SPEC's "Bad input" rule on the kernels: NaN exactly where the CPU model has it
    # (tests/test_wrapper_model.py pins the model to the rule), the rest unchanged.
    host = Case(B=2, S=3, S_kv=64, H=H, L=33, d_k=576, d_v=512, sink="random", empty_rows=1, seed=H).inputs()
    bad = _poison(host, argument, value)

    def run(h, device, name):
        t = to_framework(h, "torch", device)
        return [x.cpu() for x in mqa_latent_sparse_bwd(*[t[k] for k in ARGS], backend=name, block_h=block_h)]

    gpu = run(bad, "cuda", backend)
    model = run(bad, "cpu", "model" if backend == "tilelang" else "model-atomic")
    clean = run(host, "cuda", backend)
    for name, g, m, c in zip(("dq", "dkv", "d_attn_sink"), gpu, model, clean):
        nan = torch.isnan(m.float())
        assert nan.any(), f"{name}: the model has no NaN: the case does not exercise the rule"
        assert torch.equal(torch.isnan(g.float()), nan), f"{name}: NaN elsewhere than on the model"
        if name != "dkv" or backend == "tilelang":  # the control's dkv bits follow the add order
            assert bitwise_difference(name, g[~nan], c[~nan]) is None, f"{name}: a value outside the rule's NaN changed"


def test_tensors_that_require_grad_are_accepted_on_gpu():
    host = Case(B=1, S=3, S_kv=64, H=64, L=33, d_k=576, d_v=512, sink="random", seed=2).inputs()
    plain = to_framework(host, "torch", "cuda")
    tracked = to_framework(host, "torch", "cuda")
    for name in ("query", "kv", "out", "grad_out", "lse", "attn_sink"):
        tracked[name].requires_grad_(True)
    want = mqa_latent_sparse_bwd(*[plain[k] for k in ARGS], backend="tilelang")
    with torch.enable_grad():
        got = mqa_latent_sparse_bwd(*[tracked[k] for k in ARGS], backend="tilelang")
    for name, g, w in zip(("dq", "dkv", "d_attn_sink"), got, want):
        assert bitwise_difference(name, g, w) is None and not g.requires_grad, name
