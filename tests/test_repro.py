"""mqa_bwd.repro and ``mqa-bwd repro``: sources, rerun verdicts, oracle verdicts, two implementations."""

import json

import numpy as np

import pytest
import torch

from mqa_bwd import capture, cli, repro
from mqa_bwd.wrapper import mqa_latent_sparse_bwd
from properties.case import Case, to_framework

SMALL = Case(H=5, S=3, L=9, seed=3, sink="random")
#: Many fp32 dKV contributions per kv row and many elements: the atomic model's random
#: addition order shows in the bf16 dkv on most runs (7 of 10 and 17 of 20 distinct, measured),
#: so 12 runs all alike would take odds of about 0.3**11. Only model-atomic runs it (the
#: deterministic model needs seconds per call at this size).
CONTENDED = Case(B=1, S=64, S_kv=32, H=16, L=64, d_k=512, d_v=256, seed=1)


def _source(case: Case) -> repro.Source:
    return repro.Source(path="test", kind="case", inputs=case.inputs(), case=case)


# ---------------------------------------------------------------------------
# Implementations used to prove that the verdicts can fail
# ---------------------------------------------------------------------------

_calls = {"n": 0}


def flips_one_element_on_odd_calls(*args, **kwargs):
    """Ours, but dkv[0, 2, 5] gets one more bf16 ulp on every second call."""
    dq, dkv, dsink = mqa_latent_sparse_bwd(*args, **kwargs)
    _calls["n"] += 1
    if _calls["n"] % 2 == 0:
        dkv = dkv.clone()
        dkv.view(torch.int16)[0, 2, 5] += 1
    return dq, dkv, dsink


def doubles_dq(*args, **kwargs):
    dq, dkv, dsink = mqa_latent_sparse_bwd(*args, **kwargs)
    return dq * 2, dkv, dsink


def writes_into_lse(query, kv, out, grad_out, lse, *rest, **kwargs):
    result = mqa_latent_sparse_bwd(query, kv, out, grad_out, lse.clone(), *rest, **kwargs)
    lse.add_(1.0)
    return result


def raises_on_second_call(*args, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == 2:
        raise RuntimeError("kernel launch failed")
    return mqa_latent_sparse_bwd(*args, **kwargs)


def returns_fp32_dq(*args, **kwargs):
    dq, dkv, dsink = mqa_latent_sparse_bwd(*args, **kwargs)
    return dq.float(), dkv, dsink


@pytest.fixture(autouse=True)
def _reset_calls():
    _calls["n"] = 0


def _impl(name):
    return repro.resolve(f"{__name__}:{name}", "model")


# ---------------------------------------------------------------------------
# Reruns
# ---------------------------------------------------------------------------


def test_the_deterministic_model_is_bitwise_reproducible_and_within_tolerance():
    result = repro.replay(_source(SMALL), repro.resolve(None, "model"), runs=5)
    assert result.ok
    for name, stats in result.primary.reruns.items():
        assert stats.bitwise and stats.distinct == 1 and stats.runs == 5, name
        assert stats.first_diverging_run is None and stats.max_ulp == 0
        assert result.primary.oracle[name].ok


def test_the_atomic_model_is_caught_drifting_in_dkv_only():
    result = repro.replay(_source(CONTENDED), repro.resolve(None, "model-atomic"), runs=12, oracle=False)
    dkv = result.primary.reruns["dkv"]
    assert not result.ok and not result.primary.bitwise
    assert not dkv.bitwise and dkv.distinct > 1
    assert dkv.first_diverging_run >= 1 and dkv.differing_elements >= 1 and dkv.max_ulp >= 1
    assert len(dkv.first_element) == 3 and dkv.first_values[0] != dkv.first_values[1]
    assert result.primary.reruns["dq"].bitwise and result.primary.reruns["d_attn_sink"].bitwise


def test_first_divergence_is_located_exactly():
    result = repro.replay(_source(SMALL), _impl("flips_one_element_on_odd_calls"), runs=6, oracle=False)
    dkv = result.primary.reruns["dkv"]
    assert dkv.distinct == 2 and dkv.first_diverging_run == 1
    assert dkv.first_element == (0, 2, 5) and dkv.differing_elements == 1 and dkv.max_ulp == 1
    reference = mqa_latent_sparse_bwd(*[to_framework(SMALL.inputs())[k] for k in repro.SPEC_ARGS],
                                      backend="model")[1]
    assert dkv.first_values[0] == float(reference[0, 2, 5])
    assert result.primary.reruns["dq"].bitwise and not result.ok


def test_error_against_the_oracle_fails_a_bitwise_stable_implementation():
    result = repro.replay(_source(SMALL), _impl("doubles_dq"), runs=3)
    assert result.primary.bitwise
    assert not result.primary.oracle["dq"].ok and result.primary.oracle["dkv"].ok
    assert not result.ok


@pytest.mark.parametrize("impl, problem", [
    ("writes_into_lse", "lse: the implementation modified this input"),
    ("raises_on_second_call", "run 1 raised RuntimeError: kernel launch failed"),
    ("returns_fp32_dq", "dq: dtype float32, expected bfloat16"),
])
def test_problems_of_the_implementation_are_reported_not_raised(impl, problem):
    result = repro.replay(_source(SMALL), _impl(impl), runs=3, oracle=False)
    assert problem in result.primary.problems
    assert not result.ok


def test_ulp_distance_counts_representable_values_in_the_outputs_dtype():
    from mqa_bwd.edge import to_numpy
    from properties.compare import ulp_distance

    a = torch.tensor([1.0, -0.0, 0.0, -1.0, 1.0]).bfloat16()
    b = torch.tensor([1.0078125, 0.0, -0.0, -1.0078125, 1.015625]).bfloat16()
    assert ulp_distance(to_numpy(a), to_numpy(b)).tolist() == [1, 0, 0, 1, 2]
    tiny = torch.tensor([1e-45, 1.0])
    assert ulp_distance(to_numpy(tiny), to_numpy(-tiny)).tolist()[0] == 2  # across zero
    assert ulp_distance(to_numpy(torch.tensor([1.0])), to_numpy(torch.tensor([1.0000001]))).tolist() == [1]
    assert ulp_distance(np.array([1.0]), np.array([np.nextafter(1.0, 2.0)])).tolist() == [1]  # float64 too


def test_the_bitwise_comparison_the_tests_use_sees_every_bit():
    # properties.checks.bitwise_difference: what the tests' bit-for-bit assertions rely on.
    from properties.checks import bitwise_difference

    bf16 = torch.tensor([1.0, -0.0, float("nan"), 3.0]).bfloat16()
    fp32 = torch.tensor([1.0, 0.0, float("nan"), -2.5])
    for x in (bf16, fp32):
        assert bitwise_difference("x", x.clone(), x) is None  # NaN is its own bits, not unequal
        for i in range(x.numel()):
            flipped = x.clone()
            flipped.view({2: torch.int16, 4: torch.int32}[x.element_size()])[i] ^= 1
            assert bitwise_difference("x", flipped, x) is not None, (x.dtype, i)  # a NaN payload at i=2
    assert bitwise_difference("x", -fp32[1:2], fp32[1:2]) is not None  # -0.0 == 0.0, but not bitwise
    assert bitwise_difference("x", fp32.double(), fp32) is not None
    assert bitwise_difference("x", fp32[:3], fp32) is not None
    assert bitwise_difference("x", fp32[::2], fp32.clone()[::2]) is None  # strided views compare their elements


def test_output_checksums_see_every_single_bit_and_a_cancelling_pair():
    from properties.compare import OutputChecksums

    outputs = [torch.randn(3, 5).bfloat16(), torch.randn(7)]
    checksum = OutputChecksums(outputs)
    reference = checksum(outputs)
    assert torch.equal(checksum([x.clone() for x in outputs]), reference)
    for k, x in enumerate(outputs):
        words = OutputChecksums.words(x)
        for i in range(words.numel()):
            for bit in range(16):
                changed = [y.clone() for y in outputs]
                flipped = OutputChecksums.words(changed[k])
                flipped[i] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
                got = checksum(changed)
                assert got[k] != reference[k] and got[1 - k] == reference[1 - k], (k, i, bit)
    pair = [y.clone() for y in outputs]
    OutputChecksums.words(pair[0])[0] += 1
    OutputChecksums.words(pair[0])[1] -= 1  # a plain sum of the words cannot see this
    assert checksum(pair)[0] != reference[0]


def test_against_compares_two_implementations_on_the_same_tensors():
    result = repro.replay(_source(SMALL), repro.resolve(None, "model"), runs=3,
                          against=_impl("doubles_dq"))
    assert result.cross["dkv"].bitwise_equal and result.cross["d_attn_sink"].bitwise_equal
    dq = result.cross["dq"]
    assert not dq.bitwise_equal and dq.differing_elements > 0 and dq.max_abs_diff > 0
    assert result.primary.ok and not result.other.ok and not result.ok


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


def test_sources_bare_case_failure_file_and_capture_give_the_same_inputs(tmp_path):
    bare = tmp_path / "case.json"
    bare.write_text(SMALL.to_json())
    failure = tmp_path / "failure.json"
    failure.write_text(json.dumps({"case": json.loads(SMALL.to_json()), "property": "determinism",
                                   "backend": "model-atomic", "impl": repro.OURS, "report": "dkv differs"}))
    cap = capture.save(tmp_path / "c.safetensors", **to_framework(SMALL.inputs(), "torch"), backend="model",
                       block_h=16)
    sources = [repro.load_source(p) for p in (bare, failure, cap)]
    assert [s.kind for s in sources] == ["case", "case", "capture"]
    for s in sources[1:]:
        for name in repro.SPEC_ARGS[:-1]:
            a, b = sources[0].inputs[name], s.inputs[name]
            assert a.tobytes() == b.tobytes(), name
    assert repro.recorded_target(sources[1]) == (repro.OURS, "model-atomic")
    assert sources[1].recorded["property"] == "determinism"
    assert repro.recorded_target(sources[2]) == (None, "model") and sources[2].config == {"block_h": 16}


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ('{"H": 0}', "not a valid Case"),
    ('{"heads": 4}', "not a valid Case"),
    ('{"case": 3}', "'case' is not a JSON object"),
])
def test_bad_case_files_are_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        repro.load_source(path)


def test_backends_this_machine_cannot_run_are_refused_naming_the_option():
    from mqa_bwd import backends

    if backends.hopper_available():
        pytest.skip("this machine has a Hopper GPU: tilelang is available")
    with pytest.raises(ValueError, match="--against: 'tilelang-atomic' needs a Hopper GPU"):
        repro.resolve(None, "tilelang-atomic", option="--against")
    with pytest.raises(ValueError, match="--impl: cannot import module"):
        repro.resolve("no_such_module_xyz:f", "model")


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def test_cli_repro_of_a_case_file_holds_and_writes_json(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_text(SMALL.to_json())
    report = tmp_path / "report.json"
    assert cli.main(["repro", str(path), "--runs", "4", "--backend", "model", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "OK: backend 'model': bitwise reproducible, within tolerance" in out
    data = json.loads(report.read_text())
    assert data["ok"] and data["implementations"][0]["outputs"]["dkv"]["distinct"] == 1
    assert data["implementations"][0]["outputs"]["dq"]["oracle"]["ok"]


def test_cli_repro_of_a_capture_catches_the_atomic_model(tmp_path, capsys):
    path = capture.save(tmp_path / "step.safetensors", **to_framework(CONTENDED.inputs(), "torch"),
                        backend="model-atomic")
    assert cli.main(["repro", str(path), "--runs", "12", "--no-oracle"]) == 1
    out = capsys.readouterr().out
    assert "replaying 12 runs on backend 'model-atomic'" in out  # the backend the capture names
    assert "FAILED: backend 'model-atomic': NOT bitwise reproducible (dkv)" in out


def test_cli_repro_against_shows_both_implementations(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_text(SMALL.to_json())
    assert cli.main(["repro", str(path), "--runs", "2", "--backend", "model",
                     "--against", f"{__name__}:doubles_dq"]) == 1
    out = capsys.readouterr().out
    assert f"A = backend 'model' vs B = {__name__}:doubles_dq (backend 'model')" in out
    assert "bitwise reproducible but outside the oracle tolerance" in out


def accepts_anything(*args, **kwargs):
    """Ours, but a float32 grad_out is cast instead of rejected."""
    args = list(args)
    args[3] = args[3].to(torch.bfloat16)
    return mqa_latent_sparse_bwd(*args, **kwargs)


class ShapeError(ValueError):
    """A framework's own refusal: still a ValueError, as SPEC asks."""


def refuses_with_a_subclass(*args, **kwargs):
    raise ShapeError("grad_out: expected bfloat16")


@pytest.mark.parametrize("impl, code, verdict", [
    (None, 0, "rejected the call with a ValueError, as SPEC requires"),
    (f"{__name__}:refuses_with_a_subclass", 0, "rejected the call with a ValueError, as SPEC requires"),
    (f"{__name__}:accepts_anything", 1, "did NOT reject a call that breaks SPEC with a ValueError"),
])
def test_cli_repro_replays_a_fuzz_record_of_a_call_that_breaks_spec(tmp_path, capsys, impl, code, verdict):
    # A worker killed inside one of the rejection property's calls leaves a record of inputs
    # SPEC refuses; its replay checks the refusal (an ordinary capture like it is refused to load).
    inputs = to_framework(SMALL.inputs(), "torch")
    inputs["grad_out"] = inputs["grad_out"].float()
    path = capture.write(tmp_path / "crash-gw1-99.safetensors", inputs,
                         {"record": capture.CALL_RECORD, "backend": "model", "property": "rejection"}, check=False)
    argv = ["repro", str(path), "--runs", "2"] + (["--impl", impl, "--backend", "model"] if impl else [])
    assert cli.main(argv) == code
    out = capsys.readouterr().out
    assert "the recorded call breaks SPEC (grad_out: dtype torch.float32" in out and verdict in out
    plain = capture.write(tmp_path / "plain.safetensors", inputs, {}, check=False)
    with pytest.raises(ValueError, match="grad_out"):
        capture.load(plain)


def test_cli_repro_refuses_a_damaged_capture_with_exit_code_2(tmp_path, capsys):
    path = capture.save(tmp_path / "step.safetensors", **to_framework(SMALL.inputs(), "torch"))
    path.write_bytes(path.read_bytes()[:-10])
    assert cli.main(["repro", str(path), "--runs", "2", "--backend", "model"]) == 2
    err = capsys.readouterr().err
    assert "mqa-bwd repro: error: capture" in err and "not a complete safetensors file" in err


def test_cli_repro_names_a_recorded_backend_this_machine_lacks(tmp_path, capsys):
    from mqa_bwd import backends

    if backends.hopper_available():
        pytest.skip("this machine has a Hopper GPU: tilelang is available")
    path = tmp_path / "gpu-failure.json"
    path.write_text(json.dumps({"case": json.loads(SMALL.to_json()), "property": "agreement",
                                "backend": "tilelang", "impl": repro.OURS, "report": "..."}))
    assert cli.main(["repro", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the backend recorded in" in err and "override with --backend" in err and "'tilelang'" in err
    assert cli.main(["repro", str(path), "--runs", "2", "--backend", "model"]) == 0


# ---------------------------------------------------------------------------
# Fresh processes
# ---------------------------------------------------------------------------


def test_cli_repro_replays_a_capture_in_fresh_processes(tmp_path, capsys):
    from properties import processes

    path = capture.save(tmp_path / "step.safetensors", **to_framework(SMALL.inputs(), "torch"), backend="model",
                        block_h=16)
    report = tmp_path / "processes.json"
    assert cli.main(["repro", str(path), "--processes", "2", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "one call in each of 2 fresh processes on backend 'model'" in out and "block_h=16" in out
    assert "dkv: identical in all 2 processes that answered" in out
    assert "OK: backend 'model': bitwise identical in 2 fresh processes" in out
    data = json.loads(report.read_text())
    assert data["ok"] and [p["history"] for p in data["processes"]] == [0, 1]
    assert data["processes"][0]["did"] == [] and data["processes"][1]["did"]  # process 0: the call first
    # The children ran the capture with its recorded configuration: the digests are this process's.
    here = mqa_latent_sparse_bwd(*[to_framework(SMALL.inputs())[k] for k in repro.SPEC_ARGS], backend="model",
                                 block_h=16)
    for name, x in zip(repro.OUTPUT_NAMES, here):
        assert data["outputs"][name]["distinct"] == 1
        assert data["processes"][1]["sha256"][name] == processes.digest(x)["sha256"], name


def test_cli_repro_in_fresh_processes_catches_bits_that_follow_the_process(tmp_path, capsys):
    from test_processes import TALL

    path = capture.save(tmp_path / "step.safetensors", **to_framework(TALL.inputs(), "torch"))
    impl = "test_processes:reduces_in_an_order_chosen_by_the_process"
    assert cli.main(["repro", str(path), "--processes", "2", "--impl", impl, "--backend", "model"]) == 1
    out = capsys.readouterr().out
    assert "d_attn_sink: 2 distinct results" in out and "dkv: identical in all 2 processes" in out
    assert "FAILED:" in out and "differs between processes (d_attn_sink)" in out


def test_against_cudnn_names_the_peer_and_refuses_it_where_it_cannot_run(tmp_path, capsys):
    from mqa_bwd import cudnn

    assert repro.parse_target("cudnn") == ("mqa_bwd.cudnn:cudnn_backward", None)
    reason = cudnn.unavailable()
    if reason is None:
        pytest.skip("cuDNN's DSA backward runs here: nothing to refuse")
    path = tmp_path / "case.json"
    path.write_text(SMALL.to_json())
    assert cli.main(["repro", str(path), "--runs", "1", "--backend", "model", "--against", "cudnn"]) == 2
    err = capsys.readouterr().err
    assert "--against: mqa_bwd.cudnn:cudnn_backward cannot run here" in err and reason in err


def test_a_second_peer_is_replayed_by_what_its_function_declares(monkeypatch):
    # One entry in contract.PEERS and the attributes on its function: no branch in repro.
    import domain_fakes
    from mqa_bwd import contract

    monkeypatch.setitem(contract.PEERS, "second", "domain_fakes:second_peer")
    impl, backend = repro.parse_target("second")
    assert (impl, backend) == ("domain_fakes:second_peer", None)
    # Asked beside the model, it drops the backend (it takes none) and runs on the device it declares.
    against = repro.resolve(impl, "model", option="--against")
    assert (against.device, against.kwargs, against.spec) == ("cpu", {}, impl)
    result = repro.replay(_source(SMALL), repro.resolve(None, "model"), runs=2, against=against, oracle=False)
    assert result.ok and all(c.bitwise_equal for c in result.cross.values())
    with pytest.raises(ValueError, match=r"^--backend: domain_fakes:second_peer takes no backend="):
        repro.resolve(impl, "model")
    monkeypatch.setattr(domain_fakes.second_peer, "backend_unavailable", lambda backend: "its library is missing")
    with pytest.raises(ValueError, match=r"^--against: domain_fakes:second_peer cannot run here: its library is"):
        repro.resolve(impl, None, option="--against")
    # A function that declares no device is no peer: it is handed the backend.
    assert repro.resolve(f"{__name__}:doubles_dq", "model").kwargs == {"backend": "model"}


# ---------------------------------------------------------------------------
# A saved failure of a property the reruns cannot see
# ---------------------------------------------------------------------------


def _saved_failure(tmp_path, impl, prop, case):
    """The failure file the suite's plugin writes for ``prop`` failing on ``case`` (its own save_failure)."""
    from properties import checks, plugin

    harness = plugin._build(impl, "model", plugin.DEFAULT_REPEATS, None, "ci", None, tmp_path)
    verdict = checks.run_property(prop, harness.target, case, harness.options)
    assert not verdict.ok, verdict.report  # the mutant does fail there
    return harness.save_failure(prop, case, verdict.report)


@pytest.mark.parametrize("mutant, prop, case", [
    ("dtype_unchecked", "rejection", Case(H=2, S=2, L=4, seed=1)),
    ("slots_in_caller_order", "slot_order", Case(H=3, S=2, L=8, seed=2)),
])
def test_cli_repro_replays_the_property_a_failure_file_records(tmp_path, capsys, mutant, prop, case):
    # Reruns and the oracle see nothing wrong with these mutants' single calls: only the recorded
    # property does, so repro must replay it.
    path = _saved_failure(tmp_path, f"mqa_bwd.mutants:{mutant}", prop, case)
    report = tmp_path / "report.json"
    assert cli.main(["repro", str(path), "--runs", "2", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert f"replaying property '{prop}' on the recorded case" in out
    assert f"\nFAILED: property '{prop}' still fails on the recorded case\n" in out
    replayed = json.loads(report.read_text())["property_replay"]
    assert replayed["property"] == prop and replayed["ok"] is False and replayed["report"] in out
    # Ours on the same file: the property holds, and the reruns too.
    assert cli.main(["repro", str(path), "--runs", "2", "--impl", repro.OURS]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith(f"OK: property '{prop}' holds")


def wrong_dq(*args, **kwargs):
    """Ours with dq doubled: outside the oracle tolerance, bitwise reproducible."""
    dq, dkv, dsink = mqa_latent_sparse_bwd(*args, **kwargs)
    return dq * 2, dkv, dsink


def test_cli_repro_fails_an_implementation_that_ran_wrong_whatever_the_other_refused(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_text(SMALL.to_json())
    code = cli.main(["repro", str(path), "--runs", "2", "--backend", "model", "--impl", f"{__name__}:wrong_dq",
                     "--against", f"{__name__}:refuses_with_a_subclass"])
    out = capsys.readouterr().out
    assert code == 1, out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("FAILED: "), out[-3000:]


def test_cli_repro_of_a_call_every_implementation_refuses_says_why_no_oracle_ran(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_text(SMALL.to_json())
    report = tmp_path / "report.json"
    assert cli.main(["repro", str(path), "--runs", "2", "--impl", f"{__name__}:refuses_with_a_subclass",
                     "--json", str(report)]) == 2
    capsys.readouterr()
    assert json.loads(report.read_text())["oracle_skipped"] == "no implementation returned outputs to compare"


def test_cli_repro_of_a_call_the_implementation_refuses_cannot_run(tmp_path, capsys):
    # A scratch budget below what the call needs is refused with a ValueError naming it, as
    # SPEC allows: bad input, so exit code 2 and the reason, not a failure of the implementation.
    path = tmp_path / "case.json"
    path.write_text(SMALL.to_json())
    report = tmp_path / "report.json"
    assert cli.main(["repro", str(path), "--runs", "2", "--backend", "model", "--dkv-buf-bytes", "1",
                     "--json", str(report)]) == 2
    out = capsys.readouterr().out
    assert "backend 'model' refused the call: ValueError: dkv_buf_bytes: 1 is below" in out
    assert out.rstrip().splitlines()[-2].startswith("REFUSED: backend 'model': refused the call")
    assert json.loads(report.read_text())["refused"][0].startswith("backend 'model': ValueError: dkv_buf_bytes")
