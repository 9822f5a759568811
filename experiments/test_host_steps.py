"""experiments/host_steps.py against the wrapper's own steps, on the H200:

    python -m pytest -m experiments experiments/test_host_steps.py
"""

import math

import pytest
import torch

from mqa_bwd import backends, wrapper
from properties.case import ALL_INVALID_KINDS, Case
from properties.checks import bitwise_difference

pytestmark = [pytest.mark.experiments, pytest.mark.gpu,
              pytest.mark.skipif(not backends.hopper_available(), reason="needs a Hopper (sm_90) CUDA GPU and tilelang")]


@pytest.mark.parametrize("B,S,S_kv,L,dtype", [(1, 64, 128, 64, torch.int32), (3, 5, 70, 37, torch.int64),
                                              (2, 7, 40, 129, torch.int32), (2, 4, 33, 8, torch.int16)])
def test_kernel_slots_are_the_wrappers(B, S, S_kv, L, dtype):
    case = Case(B=B, S=S, S_kv=S_kv, H=16, L=L, invalid=ALL_INVALID_KINDS, hole_rate=0.3, duplicates=True, seed=L)
    idx = torch.from_numpy(case.indices())
    info = torch.iinfo(dtype)
    idx = idx.clamp(info.min, info.max).to(dtype).cuda()
    p = wrapper.Problem(B=B, S=S, S_kv=S_kv, H=16, L=L, d_k=64, d_v=32, block_h=16, dkv_buf_bytes=None)
    from experiments import host_steps

    assert bitwise_difference("slots", host_steps.global_slots(idx, p), wrapper.global_slots(idx, p)) is None


def test_kernel_lse_keeps_the_rule_and_the_values():
    g = torch.Generator().manual_seed(0)
    lse = (torch.randn((300, 40), generator=g) * 5).cuda()
    sink = torch.randn((40,), generator=g).cuda()
    lse[0, :4] = torch.tensor([-math.inf, math.inf, math.nan, 0.0])
    sink[5], sink[6], sink[7] = math.nan, math.inf, -math.inf
    from experiments import host_steps

    got, got_sink = host_steps.kernel_lse(lse, sink)
    want, want_sink = wrapper.kernel_lse(lse, sink)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got).any())
    finite = ~torch.isnan(want)
    assert torch.equal(torch.isinf(got[finite]), torch.isinf(want[finite]))
    assert float(((got - want)[finite & torch.isfinite(want)]).abs().max()) <= 4e-6 * float(want.abs().max())
    assert bitwise_difference("sink2", got_sink, want_sink) is None
