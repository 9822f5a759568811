"""memory_safety's guard bands see reads and zero-valued adds, for any implementation.

The float inputs sit inside NaN read bands: an implementation that reads kv
row -1 or row S_kv turns its outputs NaN, and the property names the buffer
and the side. Every allocation made through the seam sits inside denormal
canaries: an fp32 add of 0.0 at index -1 (which flushes a denormal, as a GPU
atomic add does) is caught, although it leaves every value the same. Each
check has a deliberately bad implementation here that it must catch; ours
must pass. On a CPU a stray access needs storage around the buffer to land
in, which the bands provide: the bad implementations use the buffer's
storage past its ends, as a kernel's pointer arithmetic would.
"""

import struct

import pytest
import torch

from mqa_bwd import edge
from mqa_bwd.wrapper import mqa_latent_sparse_bwd
from properties import checks, guards
from properties.case import Case
from properties.target import Target

from hopper import ON_HOPPER

BACKENDS = ["model", pytest.param("tilelang", marks=ON_HOPPER)]


def _case(backend: str, **fields) -> Case:
    widths = dict(d_k=576, d_v=512) if backend == "tilelang" else dict(d_k=32, d_v=16)
    return Case(**{**dict(B=1, S=3, S_kv=9, H=16, L=8, seed=11, sink="random"), **widths, **fields})


def _target(function, name: str, backend: str) -> Target:
    return Target(function, f"{__name__}:{name}", backend, "cuda" if backend == "tilelang" else "cpu")


# ---------------------------------------------------------------------------
# Deliberately bad implementations
# ---------------------------------------------------------------------------


def _rows_around(t: torch.Tensor, row: int):
    """[rows + 2, row] view of ``t``'s storage from one row before it to one row past it
    (None where the storage does not reach that far: a plain allocation)."""
    start = t.storage_offset() - row
    end = t.storage_offset() + t.numel() + row
    if start < 0 or end * t.element_size() > t.untyped_storage().nbytes():
        return None
    return t.as_strided((t.numel() // row + 2, row), (row, 1), start)


def _reads_kv_at(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, bad_index, **kwargs):
    """Ours, plus: a slot holding ``bad_index`` gathers kv row ``b * S_kv + bad_index`` unmasked and
    weighs it by 0 (so a finite row changes nothing; a NaN one poisons dq)."""
    dq, dkv, dsink = mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs)
    kv_t, idx = edge.to_torch(kv, "kv"), edge.to_torch(token_indices, "token_indices").long()
    B, S_kv, d_k = kv_t.shape
    around = _rows_around(kv_t, d_k)
    if around is None:
        return dq, dkv, dsink
    picked = idx == (S_kv if bad_index == "S_kv" else bad_index)
    rows = (torch.arange(B, device=idx.device).view(B, 1, 1) * S_kv + idx + 1)[picked]  # +1: around[0] is row -1
    dq_t = edge.to_torch(dq, "dq").clone()
    contribution = torch.zeros(dq_t.shape[:2] + (d_k,), dtype=torch.float32, device=dq_t.device)
    contribution[picked.any(dim=2)] = 0.0 * around[rows].float().sum(dim=0, keepdim=True)
    dq_t = (dq_t.float() + contribution[:, :, None, :]).to(torch.bfloat16)
    return edge.from_torch(dq_t, edge.framework_of(dq)), dkv, dsink


def reads_kv_row_minus_one(*args, **kwargs):
    return _reads_kv_at(*args, bad_index=-1, **kwargs)


def reads_kv_row_s_kv(*args, **kwargs):
    return _reads_kv_at(*args, bad_index="S_kv", **kwargs)


def fp32_add_flushing_denormals(x: torch.Tensor, y: float) -> torch.Tensor:
    """x + y with the semantics of a GPU fp32 atomic add (red.add.f32): subnormal inputs and
    results flushed to zero. (torch on a CPU keeps denormals; this is the flush made explicit.)"""
    tiny = torch.finfo(torch.float32).tiny
    x = torch.where(x.abs() < tiny, torch.zeros_like(x), x)
    r = x + y
    return torch.where(r.abs() < tiny, torch.zeros_like(r), r)


def adds_zero_before_its_accumulator(*args, instruments=None, **kwargs):
    """Ours, with dkv re-accumulated in fp32 in a buffer from the seam's allocator, and one stray
    fp32 add of 0.0 at that buffer's index -1."""
    dq, dkv, dsink = mqa_latent_sparse_bwd(*args, instruments=instruments, **kwargs)
    dkv_t = edge.to_torch(dkv, "dkv")
    allocate = instruments.allocate if instruments is not None and instruments.allocate is not None else None
    shape = tuple(dkv_t.shape)
    acc = allocate(shape, torch.float32, dkv_t.device) if allocate else torch.empty(shape, device=dkv_t.device)
    acc.zero_()
    acc += dkv_t.float()
    if acc.storage_offset() >= 1:
        stray = acc.as_strided((1,), (1,), acc.storage_offset() - 1)
        stray.copy_(fp32_add_flushing_denormals(stray, 0.0))
    return dq, edge.from_torch(acc.to(torch.bfloat16), edge.framework_of(dkv)), dsink


# ---------------------------------------------------------------------------
# The bands
# ---------------------------------------------------------------------------


def _fp32(word: int) -> torch.Tensor:
    return torch.tensor([struct.unpack("<f", word.to_bytes(4, "little"))[0]], dtype=torch.float32)


def test_a_zero_add_flushes_the_canary_and_leaves_the_byte_pattern_as_it_was():
    # Why the canary: the add the bad implementation makes is invisible to the 0xA5 write band.
    canary, byte_pattern = _fp32(guards.CANARY_WORD), _fp32(int.from_bytes(bytes([guards.WRITE_BYTE]) * 4, "little"))
    assert 0 < canary.abs().item() < torch.finfo(torch.float32).tiny  # a denormal
    assert fp32_add_flushing_denormals(canary, 0.0).view(torch.int32).item() == 0
    same = fp32_add_flushing_denormals(byte_pattern, 0.0)
    assert same.view(torch.int32).item() == byte_pattern.view(torch.int32).item()
    halves = guards.CANARY_PATTERN[:2], guards.CANARY_PATTERN[2:]
    for half in halves:  # each 16-bit half a bf16 denormal too
        value = torch.tensor(list(half), dtype=torch.uint8).view(torch.bfloat16).float().abs().item()
        assert 0 < value < torch.finfo(torch.bfloat16).tiny


def test_read_bands_hold_nan_and_a_write_to_one_is_found():
    bands = guards.GuardBands()
    kv = bands.place_input(torch.randn(1, 9, 32).bfloat16(), "kv")
    lse = bands.place_input(torch.randn(1, 3, 5), "lse")
    for t in (kv, lse):
        around = _rows_around(t.view(-1, t.shape[-1]), t.shape[-1])
        assert torch.isnan(around[0]).all() and torch.isnan(around[-1]).all()
        assert torch.isfinite(around[1:-1]).all()
    assert bands.violations() == []
    _rows_around(kv.view(-1, 32), 32)[-1, 3] = 1.0
    (v,) = bands.violations()
    assert (v.label, v.side, v.kind, v.first, v.count) == ("kv", "after", "read", 6, 2)


# ---------------------------------------------------------------------------
# The property catches them, and passes ours
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, kind, side", [
    ("reads_kv_row_minus_one", "minus_one", "before its first row (row -1)"),
    ("reads_kv_row_s_kv", "s_kv", "past its last row (row 9)"),
])
def test_a_read_outside_kv_is_reported_naming_kv_and_the_side(backend, name, kind, side):
    case = _case(backend, invalid=(kind,), hole_rate=0.3)
    verdict = checks.memory_safety(_target(globals()[name], name, backend), case)
    assert not verdict.ok, verdict.report
    assert verdict.findings["read bands"] is False and verdict.findings["guard bands"], verdict.report
    assert f"out-of-bounds read of kv, {side}" in verdict.report, verdict.report
    assert "out-of-bounds read of query" not in verdict.report  # only the buffer that was read
    ours = checks.memory_safety(Target.load(None, backend), case)
    assert ours.ok and ours.findings["read bands"], ours.report


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_add_at_index_minus_one_is_caught_by_the_denormal_canary(backend):
    case = _case(backend)
    verdict = checks.memory_safety(_target(adds_zero_before_its_accumulator, "adds_zero_before_its_accumulator",
                                           backend), case)
    assert not verdict.ok, verdict.report
    assert verdict.findings["denormal canary"] is False, verdict.report
    assert verdict.findings["guard bands"], verdict.report  # nothing but the flushed word changed
    assert "1 word(s) became +-0.0, the first at byte -4" in verdict.report, verdict.report


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fields", [
    dict(invalid=("minus_one", "s_kv", "near_above_s_kv", "near_negative"), hole_rate=0.3, B=2),
    dict(H=5, L=33, sink="none", empty_rows=1, invalid=("minus_one",), hole_rate=0.1),
    dict(H=40, S=4, block_h=16, duplicates=True, cancelling_rows=True),
])
def test_ours_is_safe_inside_read_bands_and_canaries(backend, fields):
    verdict = checks.memory_safety(Target.load(None, backend), _case(backend, **fields))
    assert verdict.ok, verdict.report
    assert verdict.findings["read bands"] and verdict.findings["denormal canary"] and verdict.findings["guard bands"]
    assert "inside NaN read bands" in verdict.report and "inside denormal canaries" in verdict.report


def test_an_implementation_without_the_seam_still_gets_read_bands():
    def no_seam(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs):
        return reads_kv_row_minus_one(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs)

    target = Target(no_seam, f"{__name__}:no_seam", "model", "cpu")
    assert not target.instrumented
    verdict = checks.memory_safety(target, _case("model", invalid=("minus_one",), hole_rate=0.3))
    assert not verdict.ok and "out-of-bounds read of kv, before its first row" in verdict.report, verdict.report
    assert "denormal canary" not in verdict.findings  # no allocations of its own to band


def test_outputs_nan_without_any_band_are_not_called_a_read():
    def nan_dq(*args, **kwargs):
        dq, dkv, dsink = mqa_latent_sparse_bwd(*args, **kwargs)
        return torch.full_like(dq, float("nan")), dkv, dsink

    verdict = checks.memory_safety(Target(nan_dq, f"{__name__}:nan_dq", "model", "cpu"), _case("model"))
    assert verdict.ok and verdict.findings["read bands"], verdict.report


def test_paddle_inputs_keep_their_bands():
    pytest.importorskip("paddle")
    verdict = checks.memory_safety(Target.load(None, "model"), _case("model", framework="paddle"))
    assert verdict.ok and verdict.findings["read bands"], verdict.report
