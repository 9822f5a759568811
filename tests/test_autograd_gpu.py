"""mqa_bwd.autograd on a Hopper GPU: the tiny model on the TileLang kernel, the atomic control's
drift caught by the drift check at a production-like shape, and its capture replayed.

Skipped with a reason on machines without a Hopper GPU and tilelang (CI).
Run on the H200 with: ``pytest -m gpu tests/test_autograd_gpu.py``.
"""

import shlex

import pytest

torch = pytest.importorskip("torch")

from mqa_bwd import capture, cli, repro  # noqa: E402
from mqa_bwd.autograd import DriftCheck, DriftWarning, reference_forward, sparse_mqa_attention  # noqa: E402
from mqa_bwd.edge import to_numpy  # noqa: E402
from mqa_bwd.wrapper import mqa_latent_sparse_bwd  # noqa: E402
from properties.case import INVALID_KINDS, Case, expected, to_framework  # noqa: E402
from properties.checks import bitwise_difference  # noqa: E402
from properties.compare import compare  # noqa: E402

from hopper import ON_HOPPER  # noqa: E402
from tiny_model import differing_gradients, the_drift_warning, train  # noqa: E402

pytestmark = ON_HOPPER

#: The kernels' widths; 16 heads (one 16-head group) and 64 (the wide tile) both run.
GPU_MODEL = dict(vocab=64, width=32, d_k=576, d_v=512)
GPU_BATCH = dict(S=64, L=32, vocab=64)


@pytest.mark.parametrize("heads", [16, 64])
def test_two_training_steps_on_tilelang_have_bitwise_equal_gradients(heads):
    options = dict(model_options=dict(GPU_MODEL, heads=heads), batch_options=GPU_BATCH, device="cuda",
                   backward_backend="tilelang")
    first = train(seed=3, steps=2, **options)
    second = train(seed=3, steps=2, **options)
    assert all(bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0 for step in first for g in step.values())
    assert differing_gradients(first, second) == []


def test_the_op_on_tilelang_equals_a_direct_call_and_agrees_with_the_oracle():
    case = Case(B=2, S=8, S_kv=96, H=24, L=80, d_k=576, d_v=512, invalid=INVALID_KINDS, hole_rate=0.2,
                empty_rows=1, sink="random", seed=11)
    t = to_framework(case.inputs(), "torch", "cuda")
    q, kv, sink = (t[k].clone().requires_grad_() for k in ("query", "kv", "attn_sink"))
    out = sparse_mqa_attention(q, kv, sink, t["token_indices"], case.sm_scale, d_v=case.d_v,
                               backward_backend="tilelang")
    out.backward(t["grad_out"])
    _, lse = reference_forward(t["query"], t["kv"], t["attn_sink"], t["token_indices"], case.sm_scale, case.d_v)
    direct = mqa_latent_sparse_bwd(t["query"], t["kv"], out.detach(), t["grad_out"], lse, t["attn_sink"],
                                   t["token_indices"], case.sm_scale, backend="tilelang")
    for name, got, want in zip(("dq", "dkv", "d_attn_sink"), (q.grad, kv.grad, sink.grad), direct):
        assert bitwise_difference(name, got, want) is None
    host = dict(case.inputs(), out=to_numpy(out), lse=to_numpy(lse))
    for name, got, want64, baseline in zip(("dq", "dkv", "d_attn_sink"), (q.grad, kv.grad, sink.grad), *expected(host)):
        verdict = compare(name, got, want64, baseline)
        assert verdict.ok, verdict.report()


def _cancelling_inputs(S=512, S_kv=1024, H=64, L=256, d_k=576, d_v=512, seed=0):
    """dsv32-like tensors on the GPU whose query rows come in cancelling pairs (2k, 2k+1): same q
    and indices, opposite grad_out (properties.case's cancelling_rows), so dkv is the rounding
    residue of the adds and shows any change of their order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((1, S, H, d_k), device="cuda", generator=g).bfloat16()
    q[:, 1::2] = q[:, 0::2]
    kv = torch.randn((1, S_kv, d_k), device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, S_kv, (1, S, L), device="cuda", generator=g, dtype=torch.int32)
    idx[:, 1::2] = idx[:, 0::2]
    grad_out = torch.randn((1, S, H, d_v), device="cuda", generator=g).bfloat16()
    grad_out[:, 1::2] = -grad_out[:, 0::2]
    sink = torch.randn((H,), device="cuda", generator=g)
    return q, kv, sink, idx, grad_out, d_k**-0.5


def _step(inputs, **options):
    q, kv, sink, idx, grad_out, scale = inputs
    leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out = sparse_mqa_attention(*leaves[:3], idx, scale, d_v=grad_out.shape[3], **options)
    out.backward(grad_out)
    torch.cuda.synchronize()


def test_the_drift_check_catches_tilelang_atomic_and_its_capture_replays(tmp_path, capsys):
    inputs = _cancelling_inputs()
    quiet = DriftCheck(every=1, on_drift="raise", capture_dir=tmp_path / "deterministic")
    for _ in range(3):
        _step(inputs, backward_backend="tilelang", drift_check=quiet)
    assert (quiet.checks, quiet.drifts) == (3, 0)

    check = DriftCheck(every=1, on_drift="warn", capture_dir=tmp_path / "atomic")
    with pytest.warns(DriftWarning) as caught:
        _step(inputs, backward_backend="tilelang-atomic", drift_check=check)
    warning = the_drift_warning(caught)
    assert (check.checks, check.drifts, check.captures) == (1, 1, [warning.capture])
    assert "dkv:" in str(warning) and warning.command == f"mqa-bwd repro {warning.capture} --backend tilelang-atomic"
    assert capture.load(warning.capture).meta["backend"] == "tilelang-atomic"
    source = repro.load_source(warning.capture)
    result = repro.replay(source, repro.resolve(*repro.recorded_target(source)), runs=5, oracle=False)
    assert not result.primary.reruns["dkv"].bitwise and result.primary.reruns["dq"].bitwise
    # The warning's command, as a user runs it (the float64 oracle at this shape is minutes on a CPU).
    assert cli.main(shlex.split(warning.command)[1:] + ["--runs", "5", "--no-oracle"]) == 1
    assert cli.main(shlex.split(warning.command)[1:] + ["--runs", "5", "--no-oracle", "--backend", "tilelang"]) == 0
    capsys.readouterr()
