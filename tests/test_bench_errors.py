"""The bench's error column on the CPU: the float64 torch reference against the NumPy oracle, the
per-output errors and their ratio to the atomic control with the model backends, backend choice."""

import json
import math

import numpy as np
import pytest
import torch

import oracle
from mqa_bwd import bench
from mqa_bwd.contract import OUTPUT_NAMES, SPEC_ARGS
from mqa_bwd.edge import to_numpy
from properties.case import ALL_INVALID_KINDS, Case, to_framework

from hopper import NEEDS_HOPPER


def _torch_args(host: dict) -> tuple:
    tensors = to_framework(host, "torch", "cpu")
    return tuple(tensors[name] for name in SPEC_ARGS)


def _numpy_oracle(host: dict) -> tuple:
    return oracle.backward(*(host[name] for name in SPEC_ARGS), precision="float64")


def _worst_relative_gap(got, want) -> float:
    """max |got - want| / max(1, max |want|) over the three outputs."""
    gaps = []
    for g, w in zip(got, want):
        g, w = g.numpy(), np.asarray(w, dtype=np.float64)
        gaps.append(float(np.max(np.abs(g - w))) / max(1.0, float(np.max(np.abs(w)))))
    return max(gaps)


#: float64 against float64 in another summation order: differences at the last bits only.
REFERENCE_GAP = 1e-12


@pytest.mark.parametrize("sink", ["random", "none", "large"])
def test_the_float64_reference_matches_the_numpy_oracle(sink):
    case = Case(B=2, S=5, S_kv=40, H=3, L=17, d_k=64, d_v=32, invalid=ALL_INVALID_KINDS, hole_rate=0.3,
                duplicates=True, empty_rows=1, sink=sink, seed=7)
    host = case.inputs()
    want = _numpy_oracle(host)
    args = _torch_args(host)
    rows = bench.reference_rows_per_block(case.H, case.L, case.d_k)
    assert rows >= case.S  # the default budget takes these rows in one block; now two rows a block:
    budget = 2 * 8 * (3 * case.L * case.d_k + 6 * case.H * case.L + 4 * case.H * case.d_k)
    assert bench.reference_rows_per_block(case.H, case.L, case.d_k, budget) == 2
    for b in (bench.REFERENCE_BLOCK_BYTES, budget):
        got = bench.reference_float64(args, budget_bytes=b)
        assert all(x.dtype == torch.float64 for x in got)
        assert _worst_relative_gap(got, want) <= REFERENCE_GAP
    blocks = []
    dq_none, dkv, dsink = bench.reference_float64(args, lambda b, rows, dq: blocks.append((b, rows, dq)),
                                                  keep_dq=False, budget_bytes=budget)
    assert dq_none is None and len(blocks) == case.B * 3  # S=5 in blocks of 2, 2, 1
    assert torch.equal(torch.cat([dq for _, _, dq in blocks[:3]]), got[0][0])


def test_the_cross_check_sees_a_reference_that_is_wrong():
    # The same comparison, with the sink left out of the reference, or one invalid kind read as valid.
    case = Case(B=2, S=4, S_kv=24, H=2, L=9, d_k=64, d_v=32, invalid=("s_kv", "near_above_s_kv"), hole_rate=0.4,
                sink="random", seed=8)
    host = case.inputs()
    want = _numpy_oracle(host)
    args = list(_torch_args(host))
    no_sink = list(args)
    no_sink[5] = None
    assert _worst_relative_gap(bench.reference_float64(no_sink), want) > 1e3 * REFERENCE_GAP
    index = args[6].clone()
    index[index == case.S_kv] = case.S_kv - 1
    read_as_valid = args[:6] + [index, args[7]]
    assert _worst_relative_gap(bench.reference_float64(read_as_valid), want) > 1e3 * REFERENCE_GAP


def _model_shape_args():
    return bench.production_inputs(B=1, S=12, S_kv=48, H=4, L=16, d_k=64, d_v=32, seed=3, device="cpu")


def _rel_l2_64(got, want) -> float:
    got, want = np.asarray(got.double()), np.asarray(want, dtype=np.float64)
    denominator = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / denominator) if denominator else float(np.linalg.norm(got - want))


def _noisy(call, output: int, scale: float):
    """A deliberately worse backend: ``call``'s results with one output scaled by (1 + scale)."""
    def worse():
        result = list(call())
        result[output] = (result[output].double() * (1 + scale)).to(result[output].dtype)
        return tuple(result)
    return worse


def test_error_columns_with_the_model_backends():
    args = _model_shape_args()
    calls = {name: bench.backend_call(name, args) for name in ("model", "model-atomic")}
    calls["dkv 1% off"] = _noisy(calls["model"], 1, 1e-2)
    calls["all NaN dq"] = lambda: (torch.full_like(calls["model"]()[0], math.nan),) + tuple(calls["model"]()[1:])
    quality = bench.assess(args, calls, budget_bytes=1 << 16)  # a few blocks of rows
    # Each error is the relative L2 distance from the NumPy oracle's float64 backward.
    want = oracle.backward(*[to_numpy(x) if isinstance(x, torch.Tensor) else x for x in args], precision="float64")
    for name in ("model", "model-atomic", "dkv 1% off"):
        got = calls[name]()
        for i, output in enumerate(OUTPUT_NAMES):
            assert quality[name].error[output] == pytest.approx(_rel_l2_64(got[i], want[i]), rel=1e-6), (name, output)
    assert quality["model"].rel_l2_vs_first is None and quality["model-atomic"].rel_l2_vs_first < bench.AGREEMENT_RTOL
    assert quality["all NaN dq"].error["dq"] == math.inf and quality["all NaN dq"].rel_l2_vs_first == math.inf
    assert 1e-3 < quality["model"].error["dq"] < 1e-2  # bf16 outputs: an error of bf16's order, never 0

    rows = []
    for name in calls:
        row = bench.Row(1, 12, 48, 4, 16, 64, 32, name, 1.0, 1.0, 0.0, error=quality[name].error,
                        rel_l2_vs_first=quality[name].rel_l2_vs_first)
        rows.append(row)
    bench.with_error_ratios(rows)
    by_name = {r.backend: r for r in rows}
    control = quality["model-atomic"].error
    assert by_name["model-atomic"].error_over_atomic is None and bench.admissible(by_name["model-atomic"]) is None
    for output in OUTPUT_NAMES:
        assert by_name["model"].error_over_atomic[output] == quality["model"].error[output] / control[output]
    assert by_name["dkv 1% off"].error_over_atomic["dkv"] > 2 and not bench.admissible(by_name["dkv 1% off"])
    assert by_name["all NaN dq"].error_over_atomic["dq"] == math.inf and not bench.admissible(by_name["all NaN dq"])

    lines = bench.table(rows).splitlines()
    header = lines[0]
    for title in ("err dq", "err dkv", "err dsink", "err/atomic", "det/atomic", "det/cuDNN", "rel L2", "scratch GiB"):
        assert title in header
    assert "OVER" in lines[3] and "OVER" in lines[4] and "OVER" not in lines[2]
    assert f"{quality['model'].error['dkv']:.2e}" in lines[1]
    # The rows round-trip through --json / --from-json with their errors.
    data = json.loads(bench.to_json(rows))
    again = [bench.Row(**row) for row in data["rows"]]
    assert again[2].error_over_atomic == by_name["dkv 1% off"].error_over_atomic


def _visible(S, S_kv):
    return torch.arange(S) + (S_kv - S) + 1


@pytest.mark.parametrize("S, S_kv, L", [(40, 40, 16), (24, 64, 80), (1, 8, 3)])
@pytest.mark.parametrize("pattern", ["indexer", "distinct"])
def test_indexer_and_distinct_indices_name_visible_rows_each_once(S, S_kv, L, pattern):
    idx = bench.production_inputs(1, S, S_kv, 2, L, d_k=16, d_v=8, seed=5, device="cpu", indices=pattern)[6]
    assert idx.shape == (1, S, L) and idx.dtype == torch.int32
    for s, visible in enumerate(_visible(S, S_kv).tolist()):
        row = idx[0, s]
        valid = row[row >= 0]
        assert len(valid) == min(L, visible), f"row {s}: {len(valid)} valid slots, {min(L, visible)} visible"
        assert bool((row[len(valid):] == -1).all()), f"row {s}: -1 only after the valid slots"
        assert int(valid.max()) < visible and len(set(valid.tolist())) == len(valid), f"row {s}"


def test_uniform_indices_are_visible_rows_drawn_with_repeats():
    S, S_kv, L = 16, 20, 64
    idx = bench.draw_indices(2, S, S_kv, L, "uniform", torch.Generator().manual_seed(4))
    assert idx.shape == (2, S, L) and idx.dtype == torch.int32
    assert bool((idx >= 0).all()) and bool((idx < _visible(S, S_kv).view(1, S, 1)).all())
    assert len(set(idx[0, 0].tolist())) < L  # 64 draws over 5 visible rows
    with pytest.raises(ValueError, match="indices: 'zipf' is none of uniform, distinct, indexer"):
        bench.draw_indices(1, S, S_kv, L, "zipf", torch.Generator())


def test_indexer_rows_share_their_kv_rows_where_uniform_and_distinct_ones_do_not():
    S, S_kv, L = 64, 2048, 256
    uniform, distinct, indexer = (bench.draw_indices(1, S, S_kv, L, pattern, torch.Generator().manual_seed(0))
                                  for pattern in ("uniform", "distinct", "indexer"))
    # Uniform and distinct draws share about L / visible of their slots with the previous row
    # (1/8 here), and a uniform row names some kv rows twice where a distinct one never does.
    assert max(bench.index_overlap(uniform), bench.index_overlap(distinct)) < 0.2 < 0.5 < bench.index_overlap(indexer)
    assert min(len(set(row.tolist())) for row in uniform[0]) < L
    assert all(len(set(row.tolist())) == L for row in distinct[0])


def test_index_overlap_counts_the_previous_rows_kv_rows():
    rows = torch.tensor([[[0, 1, 2, 3], [3, 2, 9, -1], [9, 8, 7, 6]], [[5, 6, 7, 8], [5, 6, 7, 8], [-1, -1, -1, 0]]])
    # batch 0: row 1 shares 3 and 2 of its 3 valid slots, row 2 shares 9 of 4; batch 1: 4 of 4, 0 of 1.
    assert bench.index_overlap(rows) == pytest.approx((2 + 1 + 4 + 0) / (3 + 4 + 4 + 1))
    assert bench.index_overlap(rows[:, :1]) == 0.0


def test_the_forward_of_the_indexer_pattern_leaves_its_invalid_slots_out():
    args = bench.production_inputs(1, 6, 6, 2, 4, d_k=16, d_v=8, seed=1, device="cpu", indices="indexer")
    q, kv, out, lse, idx = args[0], args[1], args[2], args[4], args[6]
    assert int((idx[0, 0] < 0).sum()) == 3  # row 0 sees one kv row
    logits = (q[0, 0].float() @ kv[0, 0].float()) * args[7]  # [H]: its one valid slot
    torch.testing.assert_close(lse[0, 0], logits)
    with pytest.raises(ValueError, match="indices: 'zipf' is none of uniform, distinct, indexer"):
        bench.production_inputs(1, 6, 6, 2, 4, device="cpu", indices="zipf")


def test_a_temperature_scales_q_before_the_forward_and_leaves_the_rest():
    # q times T in bf16, then the forward on that q: the same kv, indices and grad_out, an lse
    # that is the scaled scores', and a softmax mass still at most 1.
    plain = bench.production_inputs(1, 6, 8, 2, 4, d_k=16, d_v=8, seed=2, device="cpu")
    hot = bench.production_inputs(1, 6, 8, 2, 4, d_k=16, d_v=8, seed=2, device="cpu", temperature=4.0)
    torch.testing.assert_close(hot[0], (plain[0].float() * 4).bfloat16(), rtol=0, atol=0)
    for i in (1, 3, 5, 6):
        torch.testing.assert_close(hot[i], plain[i], rtol=0, atol=0)
    again = bench._forward(hot[0], hot[1], hot[6], hot[5], hot[7], 8)
    torch.testing.assert_close(hot[2], again[0], rtol=0, atol=0)
    torch.testing.assert_close(hot[4], again[1], rtol=0, atol=0)
    assert not torch.equal(hot[4], plain[4])


def test_rows_of_two_index_patterns_are_compared_within_their_pattern():
    make = lambda backend, ms, indices: bench.Row(1, 64, 128, 16, 32, 576, 512, backend, ms, 1.0, 0.5,
                                                  indices=indices, index_overlap=0.5)
    rows = bench.with_ratios([make("tilelang", 6.0, "uniform"), make("tilelang-atomic", 4.0, "uniform"),
                              make("tilelang", 9.0, "indexer"), make("tilelang-atomic", 3.0, "indexer")])
    assert [r.det_over_atomic for r in rows] == [1.5, None, 3.0, None]
    assert "indexer 0.50" in bench.table(rows).splitlines()[3]


def test_error_ratio_edges():
    assert bench.error_ratio(2e-3, 1e-3) == 2.0
    assert bench.error_ratio(0.0, 0.0) == 1.0 and bench.error_ratio(1e-9, 0.0) == math.inf
    row = bench.Row(1, 1, 1, 1, 1, 64, 32, "tilelang", 1.0, 1.0, 0.0,
                    error_over_atomic={"dq": 1.1, "dkv": 0.9, "d_attn_sink": 1.0})
    assert bench.admissible(row)
    row.error_over_atomic["dkv"] = 1.1000001
    assert not bench.admissible(row)


def test_ratios_against_the_control_and_cudnn_go_to_our_deterministic_rows_only():
    make = lambda backend, ms: bench.Row(1, 64, 128, 16, 32, 576, 512, backend, ms, 1.0, 0.5)
    rows = bench.with_ratios([make("tilelang", 6.0), make("tilelang-atomic", 4.0), make("cudnn", 3.0)])
    assert [(r.det_over_atomic, r.det_over_cudnn) for r in rows] == [(1.5, 2.0), (None, None), (None, None)]
    # The queued ratio needs both rows' queued times (a run before the column had none).
    assert rows[0].queued_det_over_cudnn is None
    make = lambda backend, ms, queued: bench.Row(1, 64, 128, 16, 32, 576, 512, backend, ms, 1.0, 0.5, queued_ms=queued)
    rows = bench.with_ratios([make("tilelang", 6.0, 5.0), make("tilelang-atomic", 4.0, 3.0), make("cudnn", 3.0, 4.0)])
    assert [r.queued_det_over_cudnn for r in rows] == [1.25, None, None]
    shown = bench.table(rows).splitlines()[1]
    assert "5.000" in shown and "1.25" in shown


def test_a_new_column_is_one_entry():
    rows = [bench.Row(1, 64, 128, 16, 32, 576, 512, "tilelang", 6.0, 1.0, 0.5)]
    columns = bench.COLUMNS + [bench.Column("pred GiB", 8, lambda r: "0.07")]
    header, line = bench.table(rows, columns).splitlines()
    assert header.endswith("pred GiB") and line.endswith("0.07")


def test_backends_are_parsed_then_checked_here(monkeypatch):
    assert bench.parse_backends(None) == ["tilelang", "tilelang-atomic", "cudnn"]
    assert bench.parse_backends("cudnn, tilelang") == ["cudnn", "tilelang"]
    with pytest.raises(ValueError, match="--backends: 'model' is not a GPU backend"):
        bench.parse_backends("tilelang,model")
    reasons = {"cudnn": "cuDNN is not installed"}
    monkeypatch.setattr(bench, "backend_unavailable", lambda backend: reasons.get(backend))
    assert bench.runnable_backends(bench.parse_backends(None), asked=False) == (
        ["tilelang", "tilelang-atomic"], {"cudnn": "cuDNN is not installed"})
    with pytest.raises(ValueError, match="--backends: 'cudnn' cannot run here: cuDNN is not installed"):
        bench.runnable_backends(["tilelang", "cudnn"], asked=True)
    reasons["tilelang"] = "no CUDA device"
    with pytest.raises(ValueError, match="Hopper GPU.*no CUDA device"):
        bench.runnable_backends(["tilelang"], asked=False)


def test_cudnn_is_left_out_of_shapes_outside_its_domain():
    shape = dict(B=1, S=64, S_kv=128, H=1, L=32)
    assert "H=1" in bench.outside_domain("cudnn", shape, 576, 512)
    assert "widths" in bench.outside_domain("cudnn", dict(shape, H=8), 64, 32)
    assert bench.outside_domain("cudnn", dict(shape, H=8), 576, 512) is None
    assert bench.outside_domain("tilelang", shape, 64, 32) is None


def test_a_second_peer_is_served_by_what_its_function_declares(monkeypatch):
    # One entry in contract.PEERS and the attributes on its function: no branch in bench.
    import domain_fakes
    from mqa_bwd import contract

    monkeypatch.setitem(contract.PEERS, "second", "domain_fakes:second_peer")
    shape = dict(B=1, S=12, S_kv=48, H=4, L=16)
    assert bench.outside_domain("second", shape, 64, 32) is None
    assert "H=65" in bench.outside_domain("second", dict(shape, H=65), 64, 32)
    assert "topk_multiple=16" in bench.outside_domain("second", dict(shape, L=24), 64, 32)
    # Its device is the CPU, and bench times on a CUDA GPU: a reason, then its own reason.
    assert "runs on cpu" in bench.backend_unavailable("second")
    monkeypatch.setattr(domain_fakes.second_peer, "device", "cuda")
    assert bench.backend_unavailable("second") is None
    monkeypatch.setattr(domain_fakes.second_peer, "backend_unavailable", lambda backend: "its library is missing")
    assert bench.runnable_backends(["second"], asked=False) == ([], {"second": "its library is missing"})
    with pytest.raises(ValueError, match="--backends: 'second' cannot run here: its library is missing"):
        bench.runnable_backends(["second"], asked=True)
    monkeypatch.setitem(contract.PEERS, "absent", "no_such_module_here:backward")
    assert "does not import" in bench.backend_unavailable("absent")
    # Its call is its function, with no backend= (the fake takes none: one would be a TypeError).
    args = _model_shape_args()
    want = bench.backend_call("model", args)()
    assert bench.same_bits(bench.backend_call("second", args, dict(block_h=16))(), want)


# ---------------------------------------------------------------------------
# GPU: the reference on the device, and one small measurement with every backend here
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_float64_reference_on_the_gpu_matches_the_numpy_oracle():
    case = Case(B=2, S=6, S_kv=300, H=64, L=257, d_k=576, d_v=512, invalid=ALL_INVALID_KINDS, hole_rate=0.2,
                duplicates=True, empty_rows=1, sink="random", seed=9)
    host = case.inputs()
    tensors = to_framework(host, "torch", "cuda")
    got = bench.reference_float64(tuple(tensors[name] for name in SPEC_ARGS), budget_bytes=1 << 24)
    assert _worst_relative_gap([x.cpu() for x in got], _numpy_oracle(host)) <= REFERENCE_GAP


@pytest.mark.gpu
@NEEDS_HOPPER
def test_one_small_measurement_with_every_backend_here():
    chosen, skipped = bench.runnable_backends(bench.parse_backends(None), asked=False)
    rows = bench.measure(dict(B=1, S=256, S_kv=2048, H=64, L=512), tuple(chosen), warmup=1, repeats=2)
    print(bench.table(rows), skipped)
    assert [r.backend for r in rows] == chosen
    for r in rows:
        assert set(r.error) == set(OUTPUT_NAMES) and all(0 < e < 2e-2 for e in r.error.values()), r
        assert 0 < r.queued_ms < math.inf, r
    assert rows[0].det_over_atomic is not None and rows[0].error_over_atomic is not None
    assert ("cudnn" in chosen) == (rows[0].det_over_cudnn is not None) == (rows[0].queued_det_over_cudnn is not None)
