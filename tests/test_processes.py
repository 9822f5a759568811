"""process_determinism: the same call in fresh processes, and the implementation whose bits follow the process.

The bad implementation here sums d_attn_sink over the query rows in an order
drawn from its process (its pid and the address of a buffer it allocated
first): stable within a process, so the in-process determinism property
passes it, and different in every other process, which only fresh processes
can show. process_determinism must fail it.
"""

import os
import re

import numpy as np
import pytest
import torch

from mqa_bwd import edge
from mqa_bwd.wrapper import mqa_latent_sparse_bwd
from properties import checks, processes
from properties.case import Case
from properties.target import Target

#: 64 query rows: d_attn_sink is a sum of 64 fp32 terms per head, whose order shows in its bits.
TALL = Case(B=1, S=64, S_kv=16, H=16, L=8, d_k=32, d_v=16, sink="random", seed=3)

_first_buffer = []


def process_key() -> int:
    """Fixed within a process, different in another: the pid and where the allocator put a first buffer."""
    if not _first_buffer:
        _first_buffer.append(torch.empty(1 << 16, dtype=torch.uint8))
    return (os.getpid() << 20) ^ (_first_buffer[0].data_ptr() >> 12)


def sink_terms(out, grad_out, lse, attn_sink) -> torch.Tensor:
    """[B*S, H] fp32: each query row's term of d_attn_sink, -p_sink * Delta."""
    delta = (out.float() * grad_out.float()).sum(-1)
    p_sink = torch.exp(attn_sink - torch.logaddexp(lse, attn_sink))
    return (-p_sink * delta).reshape(-1, attn_sink.shape[0])


def sum_in_order(terms: torch.Tensor, key: int) -> torch.Tensor:
    total = torch.zeros(terms.shape[1], dtype=torch.float32, device=terms.device)
    for r in np.random.default_rng(key).permutation(terms.shape[0]):
        total = total + terms[int(r)]
    return total


def reduces_in_an_order_chosen_by_the_process(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale,
                                              **kwargs):
    dq, dkv, dsink = mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs)
    if attn_sink is None:
        return dq, dkv, dsink
    t = {n: edge.to_torch(x, n) for n, x in (("out", out), ("grad_out", grad_out), ("lse", lse), ("attn_sink", attn_sink))}
    total = sum_in_order(sink_terms(t["out"], t["grad_out"], t["lse"], t["attn_sink"]), process_key())
    return dq, dkv, edge.from_torch(total, edge.framework_of(dsink))


BAD = Target(reduces_in_an_order_chosen_by_the_process, f"{__name__}:reduces_in_an_order_chosen_by_the_process",
             "model", "cpu")


def test_the_bad_implementations_order_shows_in_the_bits():
    # The precondition of the test below: on this case, other orders give other bits.
    t = {n: edge.numpy_to_torch(a) for n, a in TALL.inputs().items() if n in ("out", "grad_out", "lse", "attn_sink")}
    terms = sink_terms(t["out"], t["grad_out"], t["lse"], t["attn_sink"])
    sums = {sum_in_order(terms, key).numpy().tobytes() for key in range(6)}
    assert len(sums) == 6


def test_an_implementation_whose_bits_follow_the_process_fails_it_and_passes_in_process_reruns():
    assert checks.determinism(BAD, TALL, checks.Options(repeats=3)).ok  # one process cannot see it
    verdict = checks.process_determinism(BAD, TALL)
    assert not verdict.ok, verdict.report
    assert verdict.findings["d_attn_sink"] is False and verdict.findings["dq"] and verdict.findings["dkv"]
    assert verdict.findings["processes"], verdict.report  # both children answered
    assert "d_attn_sink: fresh process" in verdict.report and "differs from this process" in verdict.report
    assert verdict.report.count("history") >= 2  # each child says what its history was


def test_a_target_whose_spec_names_another_function_is_refused_without_a_process():
    def unnamed(*args, **kwargs):
        return mqa_latent_sparse_bwd(*args, **kwargs)

    verdict = checks.process_determinism(Target(unnamed, backend="model"), TALL)  # spec: ours, not this function
    assert not verdict.ok and "cannot run the implementation in a fresh process" in verdict.report


def test_a_child_answers_with_digests_and_reports_errors_in_process():
    answer = processes.serve({"impl": "mqa_bwd:mqa_latent_sparse_bwd", "backend": "model", "device": "cpu",
                              "history": 3, "case": Case(H=3, seed=1).to_dict(), "options": {}})
    assert answer["error"] is None and set(answer["digests"]) == {"dq", "dkv", "d_attn_sink"}
    assert answer["did"][0] == "7 of 13 allocations held" and len(answer["did"]) == 4  # + three warm-ups
    want = mqa_latent_sparse_bwd(*[edge.numpy_to_torch(v) if isinstance(v, np.ndarray) else v
                                   for v in Case(H=3, seed=1).inputs().values()], backend="model")
    assert answer["digests"]["dkv"] == processes.digest(want[1])
    broken = processes.serve({"impl": "no_such_module_xyz:f", "device": "cpu", "case": Case().to_dict()})
    assert broken["digests"] == {} and "cannot import module" in broken["error"]


def test_inputs_travel_between_processes_bit_for_bit(tmp_path):
    host = Case(H=3, sink="none", seed=2).inputs()
    path = processes.save_inputs(tmp_path / "inputs.safetensors", host)
    back = processes.load_inputs(path)
    assert back["attn_sink"] is None and back["sm_scale"] == host["sm_scale"]
    for name in ("query", "kv", "out", "grad_out", "lse", "token_indices"):
        assert back[name].dtype == host[name].dtype and back[name].tobytes() == host[name].tobytes(), name
    # The same safetensors reading as a capture's (mqa_bwd.files): a cut file is refused, naming it.
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=re.escape(f"inputs {path}: not a complete safetensors file")):
        processes.load_inputs(path)


def test_histories_differ_and_the_call_comes_first_without_one():
    assert processes.disturb_allocator(0, "cpu") == [] and processes.warm_up_cases(0, 16, 32, 16) == []
    sizes = [[t.numel() for t in processes.disturb_allocator(h, "cpu")] for h in (1, 2)]
    assert sizes[0] != sizes[1]
    assert [c.H for c in processes.warm_up_cases(1, 16, 32, 16)] == [64]
    assert [c.H for c in processes.warm_up_cases(2, 16, 32, 16)] == [16, 64]


def test_a_child_that_cannot_run_is_a_failure_with_its_reason():
    (answer,) = processes.run_children(processes.requests_for("no_such_module_xyz:f", None, "cpu", 1, case=Case()))
    assert answer.error and "cannot import module" in answer.error and answer.pid
