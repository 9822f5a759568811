"""Self-test of the property suite: every mutant of our implementation is killed.

One test per mutant (mqa_bwd/mutants.py, searched by properties/kills.py) on the CPU tile model. Each runs
every property over derandomized generated examples (the dev example count,
no shrinking) until the property fails on the mutant for a case where it
holds for ours. The test fails when the mutant survives the property
designed for its bug class. The kill matrix (mutants x properties) is
printed at the end of the session.

Regression cases are left out on purpose: each kill must come from the
strategies alone, so the matrix says what the generated cases can find.
"""

import json

import pytest

from mqa_bwd import mutants
from properties import checks, kills
from properties.target import Target

#: The self-test always runs on the CPU model: there the bounds checks and the
#: NaN-poisoned allocations make every bug class observable.
BACKEND = "model"


@pytest.fixture(scope="module")
def ours():
    return Target.load(None, BACKEND)


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_killed(name, ours, record_property):
    mutant = mutants.MUTANTS[name]
    # kill_row first runs the mutant on its benign case, where it must be bit-for-bit ours (else
    # MutantUnbuildable, naming the case and the first differing element): a mutant that failed
    # for an unrelated reason would be "killed" by every property and prove nothing.
    row = kills.kill_row(mutant, ours)
    record_property("mqa_kill_row", json.dumps(row))
    killers = [prop for prop, kill in row["kills"].items() if kill]
    assert killers, f"mutant {name} ({mutant.bug}) SURVIVED every property\n" + kills.kill_details(row)
    assert mutant.designated in killers, (
        f"mutant {name} ({mutant.bug}) was not caught by {mutant.designated}, the property designed for it; "
        f"caught by: {', '.join(killers)}\n" + kills.kill_details(row)
    )


def _pytest(*args, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_a_failure_is_saved_summarised_and_its_repro_line_replays_it(tmp_path):
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    failures, summary = tmp_path / "failures", tmp_path / "summary.json"
    first = _pytest("--pyargs", "properties.test_properties::test_property_output_contract", "--impl", "mqa_bwd.mutants:pad_dq_unsliced",
                    "--backend", BACKEND, "--failures-dir", str(failures), "--summary-json", str(summary), cwd=root)
    assert first.returncode == 1, first.stdout[-3000:]
    (saved,) = failures.glob("output_contract-*.json")
    record = json.loads(saved.read_text())
    assert record["property"] == "output_contract" and record["impl"] == "mqa_bwd.mutants:pad_dq_unsliced"
    assert record["backend"] == BACKEND and "dq: shape" in record["report"]
    verdicts = json.loads(summary.read_text())
    assert verdicts["properties"]["output_contract"]["verdict"] == "fail"
    assert verdicts["impl"] == "mqa_bwd.mutants:pad_dq_unsliced" and verdicts["backend"] == BACKEND
    repro_lines = [line.split("REPRO: ", 1)[1] for line in first.stdout.splitlines() if "REPRO: " in line]
    assert repro_lines, first.stdout[-3000:]
    words = shlex.split(repro_lines[-1])
    assert words[:3] == ["python", "-m", "pytest"] and json.loads(words[words.index("--replay") + 1]) == record["case"]
    again = _pytest(*words[3:], "--failures-dir", str(tmp_path / "again"), cwd=root)
    assert again.returncode == 1 and "1 failed" in again.stdout, again.stdout[-3000:]
    assert "dq: shape" in again.stdout


# -- the rejection property's classes, each caught in a deliberately bad implementation --------


def _ours(*args, **kwargs):
    from mqa_bwd import wrapper

    return wrapper.mqa_latent_sparse_bwd(*args, **kwargs)


def _accepts_bad_sm_scale(*args, **kwargs):
    args = list(args)
    scale = args[7]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        args[7] = 0.125
    return _ours(*args, **kwargs)


def _accepts_empty_dimensions(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs):
    import torch

    if 0 in tuple(query.shape) + tuple(kv.shape) + tuple(token_indices.shape) + tuple(out.shape):
        B, S, H, d_k = query.shape
        return (torch.zeros(B, S, H, d_k, dtype=torch.bfloat16), torch.zeros(kv.shape, dtype=torch.bfloat16),
                torch.zeros(H))
    return _ours(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs)


def _no_device_check(query, *rest, **kwargs):
    # Moves every tensor to query's device instead of refusing: a meta tensor cannot move.
    moved = [x.to(query.device) if hasattr(x, "to") and hasattr(x, "device") else x for x in rest]
    return _ours(query, *moved, **kwargs)


def _converts_anything(*args, **kwargs):
    import numpy as np
    import torch

    def tensor(x):
        if isinstance(x, list):
            return torch.tensor(x, dtype=torch.int32)
        if isinstance(x, np.ndarray):
            from mqa_bwd import edge

            return edge.numpy_to_torch(x)
        return x

    return _ours(*[tensor(x) for x in args], **kwargs)


def _ignores_the_budget(*args, dkv_buf_bytes=None, **kwargs):
    return _ours(*args, **kwargs)


@pytest.mark.parametrize("bad,labels", [
    (_accepts_bad_sm_scale, ["sm_scale=nan", "sm_scale=inf", "sm_scale=-0.125", "sm_scale=0.0", "sm_scale=None",
                             "sm_scale='0.125'", "sm_scale=True"]),
    (_accepts_empty_dimensions, ["B = 0 (an empty batch)", "S = 0 (no query rows)", "S_kv = 0 (no kv rows)",
                                 "L = 0 (no slots)"]),
    (_no_device_check, ["kv on another device than query", "token_indices on another device than query"]),
    (_converts_anything, ["query a NumPy array, not a tensor", "token_indices a list, not a tensor"]),
    (_ignores_the_budget, ["dkv_buf_bytes=0", "dkv_buf_bytes=-8", "dkv_buf_bytes=1.5", "dkv_buf_bytes='4096'"]),
], ids=lambda x: getattr(x, "__name__", ""))
def test_rejection_catches_a_missing_check_of_each_class(ours, bad, labels):
    from properties.case import Case

    case = Case(B=2, S=3, S_kv=9, H=5, L=5, d_k=32, d_v=16, seed=5)
    assert checks.rejection(ours, case).ok
    verdict = checks.rejection(ours.with_function(bad, bad.__name__), case)
    assert not verdict.ok
    assert {label: verdict.findings[label] for label in labels} == {label: False for label in labels}, verdict.report


def _case_trying(label, **fields):
    from properties.case import Case

    base = Case(B=2, S=3, S_kv=9, H=5, L=5, d_k=32, d_v=16, sink="random", empty_rows=1, **fields)
    return next(c for c in (base.replace(seed=i) for i in range(500)) if checks.answered_class(c).label == label)


def _nan_to_num(*args, **kwargs):
    """Ours, with NaN outputs made numbers: every NaN the rule asks for becomes a silent 0."""
    import torch

    return tuple(torch.nan_to_num(x, nan=0.0) for x in _ours(*args, **kwargs))


def _rejects_non_finite(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs):
    """A foreign implementation that checks lse and the sink on the host: SPEC's other answer."""
    import torch

    for name, x in (("lse", lse), ("attn_sink", attn_sink)):
        if x is not None and not bool(torch.isfinite(x[x != float("-inf")]).all()):
            raise ValueError(f"{name}: NaN or +inf")
    return _ours(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **kwargs)


@pytest.mark.parametrize("label", [d.label for d in checks.ANSWERED])
def test_rejection_holds_each_answered_class_to_specs_answer(ours, label):
    case = _case_trying(label)
    assert checks.rejection(ours, case).ok
    rejecting = checks.rejection(ours.with_function(_rejects_non_finite, "rejects_non_finite"), case)
    if label.startswith(("lse", "attn_sink")):
        assert rejecting.ok, rejecting.report  # a ValueError naming the argument is right too
        bad = _nan_to_num
    else:
        bad = mutants.grad_recorded
    verdict = checks.rejection(ours.with_function(bad, bad.__name__), case)
    assert verdict.findings[label] is False, verdict.report
    if "+inf" in label:
        unpoisoned = checks.rejection(ours.with_function(mutants.non_finite_unpoisoned, "unpoisoned"), case)
        assert unpoisoned.findings[label] is False, unpoisoned.report


def test_rejection_catches_torch_names_in_a_paddle_callers_messages(ours):
    pytest.importorskip("paddle")
    from properties.case import Case

    case = Case(B=1, S=2, S_kv=4, H=3, L=5, d_k=32, d_v=16, seed=9, framework="paddle")
    assert checks.rejection(ours, case).ok
    verdict = checks.rejection(ours.with_function(mutants.messages_in_torch, "messages_in_torch"), case)
    labels = [f"{n} float32 instead of bfloat16" for n in ("query", "kv", "out", "grad_out")]
    assert [verdict.findings[label] for label in labels] == [False] * 4, verdict.report
    assert "speaks torch to a paddle caller" in verdict.report
