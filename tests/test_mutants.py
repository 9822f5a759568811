"""Self-test of the property suite: every mutant of our implementation is killed.

One test per mutant (properties/mutants.py) on the CPU tile model. Each runs
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

from properties import mutants
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
    mutants.check_buildable(name, ours)


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_killed(name, ours, record_property):
    mutant = mutants.MUTANTS[name]
    row = mutants.kill_row(name, ours)
    record_property("mqa_kill_row", json.dumps(row))
    killers = [prop for prop, kill in row["kills"].items() if kill]
    assert killers, f"mutant {name} ({mutant.bug}) SURVIVED every property\n" + mutants.kill_details(row)
    assert mutant.designated in killers, (
        f"mutant {name} ({mutant.bug}) was not caught by {mutant.designated}, the property designed for it; "
        f"caught by: {', '.join(killers)}\n" + mutants.kill_details(row)
    )

