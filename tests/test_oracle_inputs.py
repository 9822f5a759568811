"""The oracle's input handling: accepted dtypes, and a ValueError naming the
argument for every malformed input."""

import ml_dtypes
import numpy as np
import pytest

import oracle

B, S, S_kv, H, L, Dk, Dv = 1, 3, 5, 2, 4, 6, 4


@pytest.fixture
def args():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, H, Dk)).astype(np.float32)
    kv = rng.standard_normal((B, S_kv, Dk)).astype(np.float32)
    idx = rng.integers(-1, S_kv, size=(B, S, L)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    out, lse = oracle.forward(q, kv, idx, sink, 0.5, Dv)
    grad_out = rng.standard_normal((B, S, H, Dv)).astype(np.float32)
    return dict(q=q, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=sink, token_indices=idx, sm_scale=0.5)


def fwd(a, d_v=Dv, **kw):
    return oracle.forward(a["q"], a["kv"], a["token_indices"], a["attn_sink"], a["sm_scale"], d_v, **kw)


def bwd(a, fn=oracle.backward, **kw):
    keys = ("q", "kv", "out", "grad_out", "lse", "attn_sink", "token_indices", "sm_scale")
    return fn(*(a[k] for k in keys), **kw)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_any_float_dtype_in_float32_or_float64_out(args, dtype):
    a = {k: (v.astype(dtype) if k in ("q", "kv", "out", "grad_out") else v) for k, v in args.items()}
    for precision, want in (("float32", np.float32), ("float64", np.float64)):
        out, lse = fwd(a, precision=precision)
        grads = bwd(a, precision=precision)
        assert [x.dtype for x in (out, lse) + grads] == [want] * 5
        assert out.shape == (B, S, H, Dv) and lse.shape == (B, S, H)
        assert [g.shape for g in grads] == [(B, S, H, Dk), (B, S_kv, Dk), (H,)]
    assert [x.dtype for x in bwd(a, fn=oracle.backward_bf16_baseline)] == [np.float32] * 3


def test_no_sink_gives_zero_sink_gradient(args):
    args["attn_sink"] = None
    args["out"], args["lse"] = fwd(args)
    for fn in (oracle.backward, oracle.backward_bf16_baseline):
        np.testing.assert_array_equal(bwd(args, fn=fn)[2], np.zeros(H, np.float32))


BAD_FORWARD = [
    ("q", lambda a: a.update(q=a["q"].astype(np.int32))),
    ("q", lambda a: a.update(q=a["q"][0])),
    ("q", lambda a: a.update(q=None)),
    ("q", lambda a: a.update(q=a["q"].astype(np.complex64))),
    ("kv", lambda a: a.update(kv=a["kv"][..., :-1])),
    ("kv", lambda a: a.update(kv=a["kv"][None])),
    ("kv", lambda a: a.update(kv=np.concatenate([a["kv"], a["kv"]]))),
    ("kv", lambda a: a.update(kv=a["kv"][:, :0])),
    ("token_indices", lambda a: a.update(token_indices=a["token_indices"].astype(np.float32))),
    ("token_indices", lambda a: a.update(token_indices=a["token_indices"][:, :-1])),
    ("token_indices", lambda a: a.update(token_indices=a["token_indices"][..., :0])),
    ("token_indices", lambda a: a.update(token_indices=a["token_indices"] > 0)),
    ("attn_sink", lambda a: a.update(attn_sink=np.zeros(H + 1, np.float32))),
    ("attn_sink", lambda a: a.update(attn_sink=np.array([np.nan, 0.0]))),
    ("attn_sink", lambda a: a.update(attn_sink=np.array([np.inf, 0.0]))),
    ("attn_sink", lambda a: a.update(attn_sink=np.zeros(H, np.int64))),
    ("sm_scale", lambda a: a.update(sm_scale=float("nan"))),
    ("sm_scale", lambda a: a.update(sm_scale="0.5")),
    ("sm_scale", lambda a: a.update(sm_scale=None)),
]


@pytest.mark.parametrize("name,spoil", BAD_FORWARD)
def test_bad_forward_input_names_the_argument(args, name, spoil):
    spoil(args)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        fwd(args)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        bwd(args)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        bwd(args, fn=oracle.backward_bf16_baseline)


@pytest.mark.parametrize("d_v", [0, Dk + 1, 2.0, None, True])
def test_bad_d_v(args, d_v):
    with pytest.raises(ValueError, match=r"^d_v\b"):
        fwd(args, d_v=d_v)


def test_d_v_may_be_any_integer_type_up_to_dk(args):
    out, _ = fwd(args, d_v=np.int64(Dk))
    assert out.shape[-1] == Dk


BAD_BACKWARD = [
    ("out", lambda a: a.update(out=a["out"][:, :-1])),
    ("out", lambda a: a.update(out=a["out"].astype(np.int16))),
    ("out", lambda a: a.update(out=np.zeros((B, S, H, Dk + 1), np.float32))),  # Dv > Dk
    ("grad_out", lambda a: a.update(grad_out=a["grad_out"][..., :-1])),
    ("grad_out", lambda a: a.update(grad_out=None)),
    ("lse", lambda a: a.update(lse=a["lse"][..., None])),
    ("lse", lambda a: a.update(lse=a["lse"][:, :, :1])),
    ("lse", lambda a: a.update(lse=np.where(a["lse"] > 0, np.nan, a["lse"]))),
    ("lse", lambda a: a.update(lse=np.full_like(a["lse"], np.inf))),
]


@pytest.mark.parametrize("name,spoil", BAD_BACKWARD)
def test_bad_backward_input_names_the_argument(args, name, spoil):
    spoil(args)
    for fn in (oracle.backward, oracle.backward_bf16_baseline):
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            bwd(args, fn=fn)


@pytest.mark.parametrize("precision", ["float16", "bfloat16", None, "fp32"])
def test_bad_precision(args, precision):
    with pytest.raises(ValueError, match=r"^precision\b"):
        fwd(args, precision=precision)
    with pytest.raises(ValueError, match=r"^precision\b"):
        bwd(args, precision=precision)
