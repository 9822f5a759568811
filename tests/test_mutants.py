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
from properties import kills
from properties.target import Target

#: The self-test always runs on the CPU model: there the bounds checks and the
#: NaN-poisoned allocations make every bug class observable.
BACKEND = "model"


@pytest.fixture(scope="module")
def ours():
    return Target.load(None, BACKEND)


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_equals_ours_where_its_bug_cannot_show(name, ours):
    # A mutant that failed for an unrelated reason would be "killed" by every
    # property and prove nothing: on a case outside its bug class it must be
    # bit-for-bit ours.
    kills.check_buildable(mutants.MUTANTS[name], ours)


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_killed(name, ours, record_property):
    mutant = mutants.MUTANTS[name]
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
