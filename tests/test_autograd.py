"""mqa_bwd.autograd on the CPU: the op in a model, its gradients, its reference forward, the drift check.

The GPU half (the same model on the TileLang kernels, the atomic control's drift
at a production-like shape) is tests/test_autograd_gpu.py.
"""

import shlex
import sys
import types
import warnings

import numpy as np
import pytest
import torch

import oracle
from mqa_bwd import autograd as ag
from mqa_bwd import capture, cli, repro
from mqa_bwd.autograd import DriftCheck, DriftError, DriftWarning, reference_forward, sparse_mqa_attention
from mqa_bwd.contract import PEERS
from mqa_bwd.edge import to_numpy
from mqa_bwd.wrapper import mqa_latent_sparse_bwd
from properties.case import ALL_INVALID_KINDS, Case, expected, to_framework
from properties.checks import bitwise_difference
from properties.compare import bf16_ulp_distance, compare

from tiny_model import differing_gradients, the_drift_warning, train

#: Every SPEC kind of invalid index, duplicates, a row with no valid slot, two batch elements.
SMALL = Case(B=2, S=6, S_kv=12, H=4, L=10, d_k=32, d_v=16, invalid=ALL_INVALID_KINDS, hole_rate=0.25,
             duplicates=True, empty_rows=1, sink="random", seed=5)
#: Cancelling query-row pairs (properties.case): dkv is rounding residue whose bits follow the
#: order of the adds, so the atomic model's fresh random order shows on every call (30 distinct
#: dkv in 30 calls, measured).
CANCELLING = Case(B=1, S=8, S_kv=16, H=4, L=16, d_k=32, d_v=16, cancelling_rows=True, seed=1)


def _leaves(case: Case):
    """(q, kv, attn_sink, token_indices, grad_out, sm_scale) of a case as torch tensors, q/kv/sink leaves."""
    t = to_framework(case.inputs())
    q = t["query"].clone().requires_grad_()
    kv = t["kv"].clone().requires_grad_()
    s = t["attn_sink"].clone().requires_grad_() if t["attn_sink"] is not None else None
    return q, kv, s, t["token_indices"], t["grad_out"], case.sm_scale


def _op(case: Case, **options):
    """The op's out and the gradients of (q, kv, attn_sink) for the case's grad_out."""
    q, kv, s, idx, grad_out, scale = _leaves(case)
    out = sparse_mqa_attention(q, kv, s, idx, scale, d_v=case.d_v, **options)
    out.backward(grad_out)
    return out.detach(), (q.grad, kv.grad, None if s is None else s.grad)


# ---------------------------------------------------------------------------
# The reference forward against the NumPy oracle's
# ---------------------------------------------------------------------------


def forward_disagreement(forward, case: Case) -> list:
    """How ``forward`` departs from oracle.forward on the case: in float64 (1e-10 relative), and in
    bf16/fp32 (out within one bf16 ulp of the fp32 oracle's, lse within 1e-5); empty list: none."""
    host = case.inputs()
    t = to_framework(host)
    args = (host["query"], host["kv"], host["token_indices"], host["attn_sink"], case.sm_scale, case.d_v)
    found = []
    sink64 = None if t["attn_sink"] is None else t["attn_sink"].double()
    out64, lse64 = forward(t["query"].double(), t["kv"].double(), sink64, t["token_indices"], case.sm_scale, case.d_v)
    want_out64, want_lse64 = oracle.forward(*args, precision="float64")
    if not np.allclose(out64.numpy(), want_out64, rtol=1e-10, atol=1e-12):
        found.append(f"float64 out: max |diff| {np.abs(out64.numpy() - want_out64).max():.3e}")
    if not np.array_equal(np.isneginf(lse64.numpy()), np.isneginf(want_lse64)) or not np.allclose(
            lse64.numpy(), want_lse64, rtol=1e-10, atol=1e-12):
        found.append("float64 lse differs")
    out, lse = forward(t["query"], t["kv"], t["attn_sink"], t["token_indices"], case.sm_scale, case.d_v)
    want_out, want_lse = oracle.forward(*args)
    if out.dtype != torch.bfloat16 or lse.dtype != torch.float32:
        found.append(f"dtypes out {out.dtype}, lse {lse.dtype}")
    elif bf16_ulp_distance(to_numpy(out), want_out).max() > 1:
        found.append(f"bf16 out: {bf16_ulp_distance(to_numpy(out), want_out).max()} bf16 ulp from the oracle")
    if not np.array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse)) or not np.allclose(
            lse.numpy(), want_lse, rtol=1e-5, atol=1e-5):
        found.append("fp32 lse differs")
    return found


@pytest.mark.parametrize("sink", ["random", "none", "neg_inf", "neg_1e30", "large"])
def test_reference_forward_matches_the_oracle(sink):
    for case in (SMALL.replace(sink=sink), SMALL.replace(sink=sink, pattern="causal", B=1, seed=8)):
        assert forward_disagreement(reference_forward, case) == [], case


def _clamps_invalid_indices(q, kv, sink, idx, scale, d_v):
    return reference_forward(q, kv, sink, idx.clamp(0, kv.shape[1] - 1), scale, d_v)


def _ignores_the_sink(q, kv, sink, idx, scale, d_v):
    return reference_forward(q, kv, None, idx, scale, d_v)


def _base_two_lse(q, kv, sink, idx, scale, d_v):
    out, lse = reference_forward(q, kv, sink, idx, scale, d_v)
    return out, lse * 1.4426950408889634


@pytest.mark.parametrize("wrong", [_clamps_invalid_indices, _ignores_the_sink, _base_two_lse])
def test_the_forward_comparison_catches_a_wrong_forward(wrong):
    assert forward_disagreement(wrong, SMALL)


#: Powers of two (bf16-exact) for SMALL's six query rows: row 0's logits reach hundreds, row 1's
#: stay near 0. A softmax shift shared by a block of rows (not one a row) would take row 1's
#: exponentials below fp32's least value: its lse -inf, its out NaN.
ROW_SCALES = (2.0**8, 2.0**-8, 1.0, 2.0**6, 2.0**-4, 4.0)


@pytest.mark.parametrize("row_scales", [None, ROW_SCALES], ids=["unit-logits", "logits-spanning-hundreds"])
def test_the_reference_forward_gives_the_same_bits_one_row_at_a_time(monkeypatch, row_scales):
    t = to_framework(SMALL.inputs())
    q = t["query"]
    if row_scales is not None:
        q = (q.float() * torch.tensor(row_scales).view(1, -1, 1, 1)).to(torch.bfloat16)
    args = (q, t["kv"], t["attn_sink"], t["token_indices"], SMALL.sm_scale, SMALL.d_v)
    out, lse = reference_forward(*args)
    monkeypatch.setattr(ag, "FORWARD_BLOCK_BYTES", 1)  # one query row a block
    row_out, row_lse = reference_forward(*args)
    # A row's numbers come from that row alone, by the same operations in a block or alone: the same bits.
    assert bitwise_difference("out", row_out, out) is None
    assert bitwise_difference("lse", row_lse, lse) is None


# ---------------------------------------------------------------------------
# Gradients: the backward called directly, the oracle, float64 gradcheck
# ---------------------------------------------------------------------------


def test_the_op_gradients_equal_a_direct_backward_call_and_agree_with_the_oracle():
    out, grads = _op(SMALL, backward_backend="model")
    t = to_framework(SMALL.inputs())
    ref_out, lse = reference_forward(t["query"], t["kv"], t["attn_sink"], t["token_indices"], SMALL.sm_scale,
                                     SMALL.d_v)
    assert bitwise_difference("out", out, ref_out) is None
    direct = mqa_latent_sparse_bwd(t["query"], t["kv"], out, t["grad_out"], lse, t["attn_sink"], t["token_indices"],
                                   SMALL.sm_scale, backend="model")
    for name, got, want in zip(("dq", "dkv", "d_attn_sink"), grads, direct):
        assert bitwise_difference(name, got, want) is None
    host = dict(SMALL.inputs(), out=to_numpy(out), lse=to_numpy(lse))
    for name, got, want64, baseline in zip(("dq", "dkv", "d_attn_sink"), grads, *expected(host)):
        verdict = compare(name, got, want64, baseline)
        assert verdict.ok, verdict.report()


def test_gradients_are_none_where_not_required():
    q, kv, _, idx, grad_out, scale = _leaves(SMALL)
    kv.requires_grad_(False)
    sink = torch.from_numpy(SMALL.attn_sink())  # a sink that is not learned
    out = sparse_mqa_attention(q, kv, sink, idx, scale, d_v=SMALL.d_v, backward_backend="model")
    out.backward(grad_out)
    assert q.grad is not None and kv.grad is None and sink.grad is None
    q2, kv2, _, idx, grad_out, scale = _leaves(SMALL)
    out = sparse_mqa_attention(q2, kv2, None, idx, scale, d_v=SMALL.d_v, backward_backend="model")
    out.backward(grad_out)
    assert q2.grad.dtype == kv2.grad.dtype == torch.bfloat16


def test_what_is_saved_for_backward_is_the_tensors_themselves():
    q, kv, s, idx, grad_out, scale = _leaves(SMALL)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = sparse_mqa_attention(q, kv, s, idx, scale, d_v=SMALL.d_v, backward_backend="model")
    pointers = [t.data_ptr() for t in saved]
    assert pointers[:5] == [x.data_ptr() for x in (q, kv, s, idx, out)]
    assert len(saved) == 6 and saved[5].shape == (SMALL.B, SMALL.S, SMALL.H) and saved[5].dtype == torch.float32


TINY = Case(B=1, S=3, S_kv=5, H=2, L=4, d_k=6, d_v=4, invalid=("minus_one", "s_kv"), hole_rate=0.3, seed=2)


def _float64_leaves(case):
    t = to_framework(case.inputs())
    return (t["query"].double().requires_grad_(), t["kv"].double().requires_grad_(),
            t["attn_sink"].double().requires_grad_(), t["token_indices"])


def test_float64_gradcheck_of_the_reference_forward():
    q, kv, sink, idx = _float64_leaves(TINY)
    assert torch.autograd.gradcheck(lambda q, kv, s: reference_forward(q, kv, s, idx, TINY.sm_scale, TINY.d_v),
                                    (q, kv, sink))
    # A row with no valid slot: lse is -inf there (no finite difference), out 0 with zero gradients.
    q, kv, sink, idx = _float64_leaves(TINY.replace(empty_rows=1))
    assert torch.autograd.gradcheck(lambda q, kv, s: reference_forward(q, kv, s, idx, TINY.sm_scale, TINY.d_v)[0],
                                    (q, kv, sink))
    # It can fail: the same forward with its keys cut off from the gradient.
    q, kv, sink, idx = _float64_leaves(TINY)
    assert not torch.autograd.gradcheck(
        lambda q, kv, s: reference_forward(q, kv.detach(), s, idx, TINY.sm_scale, TINY.d_v),
        (q, kv, sink), raise_exception=False)


def autograd_against_oracle(forward, case) -> list:
    """Outputs whose float64 autograd gradient (through ``forward``) departs from oracle.backward."""
    q, kv, sink, idx = _float64_leaves(case)
    out, lse = forward(q, kv, sink, idx, case.sm_scale, case.d_v)
    host = case.inputs()
    grad_out = host["grad_out"].astype(np.float64)
    out.backward(torch.from_numpy(grad_out))
    want = oracle.backward(q.detach().numpy(), kv.detach().numpy(), out.detach().numpy(), grad_out,
                           lse.detach().numpy(), sink.detach().numpy(), host["token_indices"], case.sm_scale,
                           precision="float64")
    return [name for name, got, w in zip(("dq", "dkv", "d_attn_sink"), (q.grad, kv.grad, sink.grad), want)
            if not np.allclose(got.numpy(), w, rtol=1e-9, atol=1e-12)]


def _scales_the_sink(q, kv, sink, idx, scale, d_v):
    return reference_forward(q, kv, sink / scale, idx, scale, d_v)


def test_the_oracle_backward_is_the_gradient_of_the_reference_forward_in_float64():
    for case in (TINY, TINY.replace(empty_rows=1, duplicates=True, seed=4), SMALL.replace(B=1, S=3)):
        assert autograd_against_oracle(reference_forward, case) == [], case
    assert autograd_against_oracle(_scales_the_sink, TINY)  # the comparison can fail


# ---------------------------------------------------------------------------
# A tiny model, end to end
# ---------------------------------------------------------------------------


def test_two_training_steps_from_one_seed_have_bitwise_equal_gradients():
    first = train(seed=3, steps=2, backward_backend="model")
    second = train(seed=3, steps=2, backward_backend="model")
    assert set(first[0]) == {"embed.weight", "q_proj.weight", "kv_proj.weight", "sink", "head.weight", "head.bias"}
    assert all(float(g.abs().sum()) > 0 for step in first for g in step.values())
    assert differing_gradients(first, second) == []


def _noisy_forward(q, kv, sink, idx, scale, d_v):
    out, lse = reference_forward(q, kv, sink, idx, scale, d_v)
    out.view(torch.int16).view(-1)[int(torch.randint(0, out.numel(), ()))] ^= 1  # one bf16 ulp, anywhere
    return out, lse


def test_the_comparison_of_two_runs_sees_a_nondeterministic_step():
    first = train(seed=3, steps=1, backward_backend="model", forward=_noisy_forward)
    second = train(seed=3, steps=1, backward_backend="model", forward=_noisy_forward)
    assert "step 0 head.weight" in differing_gradients(first, second)


# ---------------------------------------------------------------------------
# The drift check
# ---------------------------------------------------------------------------


def test_the_drift_check_catches_the_atomic_control_and_its_capture_replays(tmp_path, capsys):
    check = DriftCheck(every=1, on_drift="warn", capture_dir=tmp_path / "drift")
    with pytest.warns(DriftWarning) as caught:
        _op(CANCELLING, backward_backend="model-atomic", drift_check=check)
    warning = the_drift_warning(caught)
    assert (check.backwards, check.checks, check.drifts, check.captures) == (1, 1, 1, [warning.capture])
    assert warning.capture.is_file() and warning.capture.parent == (tmp_path / "drift").resolve()
    assert str(warning.capture) in str(warning) and warning.command in str(warning)
    assert "dkv:" in str(warning) and "dq:" not in str(warning)
    assert warning.command == f"mqa-bwd repro {warning.capture} --backend model-atomic"
    saved = capture.load(warning.capture)
    assert saved.meta["backend"] == "model-atomic" and saved.meta["differing"] == ["dkv"]
    source = repro.load_source(warning.capture)
    result = repro.replay(source, repro.resolve(*repro.recorded_target(source)), runs=4, oracle=False)
    assert not result.primary.reruns["dkv"].bitwise and result.primary.reruns["dq"].bitwise
    # The command the warning gives, as a user runs it: drift (exit 1); the deterministic backend holds.
    assert cli.main(shlex.split(warning.command)[1:] + ["--runs", "4"]) == 1
    assert cli.main(shlex.split(warning.command)[1:] + ["--runs", "2", "--backend", "model"]) == 0
    capsys.readouterr()


def test_the_drift_check_is_silent_on_the_deterministic_backend_and_counts(tmp_path):
    check = DriftCheck(every=2, capture_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DriftWarning)
        for _ in range(3):
            _op(CANCELLING, backward_backend="model", drift_check=check)
    assert (check.backwards, check.checks, check.drifts, check.captures) == (3, 1, 0, [])
    assert list(tmp_path.iterdir()) == []


#: The module of the cuDNN peer (contract.PEERS), which the tests replace.
CUDNN_MODULE = PEERS["cudnn"].partition(":")[0]


def _fake_cudnn(flip=None, reason=None):
    """A stand-in for mqa_bwd.cudnn: fixed gradients; ``flip`` names an output that gets one
    bit flipped on every second call; ``reason``: what its backend_unavailable(None) says."""
    calls = []

    def cudnn_backward(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
                       dkv_buf_bytes=None):
        calls.append(dict(grad_out=grad_out, block_h=block_h, dkv_buf_bytes=dkv_buf_bytes))
        g = torch.Generator().manual_seed(0)
        outputs = [torch.randn(query.shape, generator=g).bfloat16(), torch.randn(kv.shape, generator=g).bfloat16(),
                   torch.randn(query.shape[2], generator=g)]
        if flip is not None and len(calls) % 2 == 0:
            t = outputs[("dq", "dkv", "d_attn_sink").index(flip)]
            t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).view(-1)[3] ^= 1
        return tuple(outputs)

    cudnn_backward.backend_unavailable = lambda backend: reason
    return types.SimpleNamespace(cudnn_backward=cudnn_backward, calls=calls)


@pytest.mark.parametrize("flip", ["dq", "dkv", "d_attn_sink"])
def test_the_drift_check_compares_every_output_and_can_raise(flip, tmp_path, monkeypatch):
    fake = _fake_cudnn(flip)
    monkeypatch.setitem(sys.modules, CUDNN_MODULE, fake)
    check = DriftCheck(every=1, on_drift="raise", capture_dir=tmp_path)
    q, kv, s, idx, grad_out, scale = _leaves(SMALL)
    out = sparse_mqa_attention(q, kv, s, idx, scale, d_v=SMALL.d_v, backward_backend="cudnn", drift_check=check,
                               block_h=16)
    with pytest.raises(DriftError) as raised:
        out.backward(grad_out.transpose(1, 2).contiguous().transpose(1, 2))  # a non-contiguous gradient
    assert f"{flip}:" in str(raised.value) and "1 of" in str(raised.value)
    assert raised.value.command == (f"mqa-bwd repro {raised.value.capture} --impl mqa_bwd.cudnn:cudnn_backward "
                                    "--device cpu --block-h 16")
    assert capture.load(raised.value.capture).meta["impl"] == "mqa_bwd.cudnn:cudnn_backward"
    assert [c["grad_out"].is_contiguous() and c["grad_out"].dtype == torch.bfloat16 for c in fake.calls] == [True] * 2
    assert fake.calls[0]["block_h"] == 16 and check.drifts == 1


def test_the_cudnn_backend_gives_its_gradients(monkeypatch):
    fake = _fake_cudnn()
    monkeypatch.setitem(sys.modules, CUDNN_MODULE, fake)
    _, grads = _op(SMALL, backward_backend="cudnn", drift_check=False)
    q, kv, _, _, _, _ = _leaves(SMALL)
    for name, got, want in zip(("dq", "dkv", "d_attn_sink"), grads, fake.cudnn_backward(q, kv, *[None] * 6)):
        assert bitwise_difference(name, got, want) is None


@pytest.mark.parametrize("module, says", [(None, "does not import"),
                                          (_fake_cudnn(reason="cudnn-frontend is not installed"),
                                           "cudnn-frontend is not installed")])
def test_cudnn_that_cannot_run_is_a_value_error_naming_backward_backend(module, says, monkeypatch):
    monkeypatch.setitem(sys.modules, CUDNN_MODULE, module)  # None: import fails, even where the file exists
    q, kv, s, idx, _, scale = _leaves(SMALL)
    with pytest.raises(ValueError, match="backward_backend") as raised:
        sparse_mqa_attention(q, kv, s, idx, scale, d_v=SMALL.d_v, backward_backend="cudnn")
    assert says in str(raised.value)


def test_a_peers_budget_goes_by_its_own_scratch_account(monkeypatch):
    # contract.PEERS: a peer that gives scratch_bytes(problem) takes a budget at or above it; one
    # that gives none refuses any budget, naming dkv_buf_bytes, before the forward runs.
    fake = _fake_cudnn()
    monkeypatch.setitem(sys.modules, CUDNN_MODULE, fake)
    q, kv, s, idx, _, scale = _leaves(SMALL)
    with pytest.raises(ValueError, match="dkv_buf_bytes: backward_backend 'cudnn' does not say"):
        sparse_mqa_attention(q, kv, s, idx, scale, d_v=SMALL.d_v, backward_backend="cudnn", dkv_buf_bytes=1 << 30)
    fake.cudnn_backward.scratch_bytes = lambda problem: 4096
    with pytest.raises(ValueError, match="dkv_buf_bytes"):
        sparse_mqa_attention(q, kv, s, idx, scale, d_v=SMALL.d_v, backward_backend="cudnn", dkv_buf_bytes=4095)
    _op(SMALL, backward_backend="cudnn", dkv_buf_bytes=4096, drift_check=False)
    assert fake.calls[-1]["dkv_buf_bytes"] == 4096 and not fake.calls[:-1]


def test_the_environment_turns_the_drift_check_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, CUDNN_MODULE, _fake_cudnn("dkv"))
    monkeypatch.setenv(ag.ENV_EVERY, "2")
    monkeypatch.setenv(ag.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ag.ENV_ON_DRIFT, "raise")
    check = ag.environment_drift_check()
    assert check is ag.environment_drift_check() and check.every == 2 and check.on_drift == "raise"
    _op(SMALL, backward_backend="cudnn")  # backward 1: not checked
    with pytest.raises(DriftError):
        _op(SMALL, backward_backend="cudnn")
    _op(SMALL, backward_backend="cudnn", drift_check=False)  # off, whatever the environment says
    assert (check.backwards, check.checks, check.drifts, len(check.captures)) == (2, 1, 1, 1)
    assert check.captures[0].parent == tmp_path.resolve()
    monkeypatch.setenv(ag.ENV_EVERY, "0")
    assert ag.environment_drift_check() is None


# ---------------------------------------------------------------------------
# Bad arguments: ValueError naming the argument, before the forward runs
# ---------------------------------------------------------------------------


#: (the argument named, what is changed in a good call)
BAD_CALLS = [
    ("backward_backend", lambda a: dict(backward_backend="cuda")),
    ("backward_backend", lambda a: dict(backward_backend="tilelang")),  # on a machine without a Hopper GPU
    ("drift_check", lambda a: dict(drift_check="yes")),
    ("q", lambda a: dict(q=a["q"].float())),
    ("q", lambda a: dict(q=a["q"][0])),
    ("kv", lambda a: dict(kv=a["kv"][:, :, :16])),
    ("kv", lambda a: dict(kv=a["kv"].detach().to("meta"))),  # another device than q's
    ("attn_sink", lambda a: dict(attn_sink=a["attn_sink"].half())),
    ("token_indices", lambda a: dict(token_indices=a["token_indices"].float())),
    ("token_indices", lambda a: dict(token_indices=a["token_indices"][:, :2])),
    ("sm_scale", lambda a: dict(sm_scale=-1.0)),
    ("d_v", lambda a: dict(d_v=0)),
    ("d_v", lambda a: dict(d_v=SMALL.d_k + 16)),
    ("block_h", lambda a: dict(block_h=8)),
    ("dkv_buf_bytes", lambda a: dict(dkv_buf_bytes=0)),
    ("forward", lambda a: dict(forward="flash_mla")),
    ("kv", lambda a: dict(kv=None)),
    ("token_indices", lambda a: dict(token_indices=None)),
    ("d_v", lambda a: dict(d_v=8)),
    ("block_h", lambda a: dict(block_h=16.0)),
    ("dkv_buf_bytes", lambda a: dict(dkv_buf_bytes=8)),  # positive, below the scratch the call needs
    ("q", lambda a: dict(q=a["q"][:, :0], token_indices=a["token_indices"][:, :0])),  # no query rows
]


@pytest.mark.parametrize("name, change", BAD_CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CALLS)])
def test_bad_arguments_are_value_errors_naming_them_before_the_forward(name, change):
    from mqa_bwd import backends

    q, kv, s, idx, _, scale = _leaves(SMALL)
    ran = []
    good = dict(q=q, kv=kv, attn_sink=s, token_indices=idx, sm_scale=scale, d_v=SMALL.d_v, backward_backend="model",
                forward=lambda *a: ran.append(a) or reference_forward(*a))
    call = dict(good, **change(good))
    if call["backward_backend"] == "tilelang" and backends.hopper_available():
        pytest.skip("this machine has a Hopper GPU: 'tilelang' runs here")
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        sparse_mqa_attention(call.pop("q"), call.pop("kv"), call.pop("attn_sink"), call.pop("token_indices"),
                             call.pop("sm_scale"), **call)
    assert ran == []


@pytest.mark.parametrize("kwargs, name", [
    (dict(every=0), "drift_check.every"), (dict(every=True), "drift_check.every"),
    (dict(every=2.5), "drift_check.every"), (dict(on_drift="ignore"), "drift_check.on_drift"), (dict(capture_dir=3), "drift_check.capture_dir"),
    (dict(capture_dir=""), "drift_check.capture_dir"),
])
def test_bad_drift_settings_are_value_errors_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        DriftCheck(**kwargs)


@pytest.mark.parametrize("variable, value", [(ag.ENV_EVERY, "often"), (ag.ENV_EVERY, "-1"), (ag.ENV_ON_DRIFT, "log")])
def test_bad_drift_environment_is_a_value_error_naming_the_variable(variable, value, monkeypatch):
    monkeypatch.setenv(ag.ENV_EVERY, "1")
    monkeypatch.setenv(variable, value)
    q, kv, s, idx, _, scale = _leaves(SMALL)
    with pytest.raises(ValueError, match=rf"^{variable}:"):
        sparse_mqa_attention(q, kv, s, idx, scale, d_v=SMALL.d_v, backward_backend="model")


@pytest.mark.parametrize("result", [
    lambda out, lse: (out.float(), lse), lambda out, lse: (out, lse.double()), lambda out, lse: (out[:, :1], lse),
    lambda out, lse: out,
])
def test_a_forward_returning_the_wrong_thing_is_a_value_error_naming_forward(result):
    q, kv, s, idx, _, scale = _leaves(SMALL)
    with pytest.raises(ValueError, match="^forward:"):
        sparse_mqa_attention(q, kv, s, idx, scale, d_v=SMALL.d_v, backward_backend="model",
                             forward=lambda *a: result(*reference_forward(*a)))


# ---------------------------------------------------------------------------
# paddle tensors: the PyLayer twin
# ---------------------------------------------------------------------------


@pytest.mark.paddle
def test_paddle_gradients_equal_the_torch_path_bitwise():
    pytest.importorskip("paddle")
    out, grads = _op(SMALL, backward_backend="model")
    p = to_framework(SMALL.inputs(), "paddle")
    leaves = [p["query"].clone(), p["kv"].clone(), p["attn_sink"].clone()]
    for t in leaves:
        t.stop_gradient = False
    got = sparse_mqa_attention(*leaves, p["token_indices"], SMALL.sm_scale, d_v=SMALL.d_v, backward_backend="model")
    got.backward(p["grad_out"])
    assert type(got).__module__.startswith("paddle") and bitwise_difference("out", got, out) is None
    for name, t, want in zip(("dq", "dkv", "d_attn_sink"), leaves, grads):
        assert bitwise_difference(name, t.grad, want) is None


@pytest.mark.paddle
def test_a_paddle_callers_bad_argument_is_named_in_paddles_names():
    paddle = pytest.importorskip("paddle")
    p = to_framework(SMALL.inputs(), "paddle")
    with pytest.raises(ValueError, match=r"^q: expected dtype paddle\.bfloat16, got paddle\.float32$"):
        sparse_mqa_attention(p["query"].astype(paddle.float32), p["kv"], p["attn_sink"], p["token_indices"],
                             SMALL.sm_scale, d_v=SMALL.d_v, backward_backend="model")
