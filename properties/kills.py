"""The mutant self-test's machinery: does a property catch a deliberately broken implementation?

A ``Mutant`` is any function with the SPEC signature that carries one known
bug class, the property designed to catch it, and a benign case on which the
bug cannot show (where it must equal the original bit for bit: a mutant that
crashes everywhere would be "killed" by every property and prove nothing). A
kill is a generated case on which the property fails for the mutant and holds
for the original. The mutants of this project's own implementation are in
``mqa_bwd.mutants``; a kernel team can build theirs the same way.
"""

import dataclasses
from typing import Callable

from hypothesis import Verbosity, given, settings

from . import checks, profiles, strategies
from .case import Case
from .target import Target


class MutantUnbuildable(RuntimeError):
    """A mutant no longer runs as built (the seam it uses changed): update it, do not trust its kills."""


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    function: Callable
    bug: str
    #: The property designed to catch this bug class (others may catch it too).
    designated: str
    #: A case on which the bug cannot show: the mutant must equal the original bitwise there.
    benign: Case
    #: How --impl names it, for REPRO lines.
    spec: str = ""


def mutant_target(mutant: Mutant, original: Target) -> Target:
    return original.with_function(mutant.function, mutant.spec or mutant.name)


def check_buildable(mutant: Mutant, original: Target) -> None:
    """Run the mutant on its benign case: it must run and equal the original bitwise (else MutantUnbuildable)."""
    from .case import to_framework

    tensors = to_framework(mutant.benign.inputs(), "torch", original.device)
    want = original(tensors)
    got = mutant_target(mutant, original)(tensors)
    for output, a, b in zip(("dq", "dkv", "d_attn_sink"), got, want):
        diff = checks.bitwise_difference(output, a, b)
        if diff:
            raise MutantUnbuildable(f"mutant {mutant.name} differs from the original on its benign case "
                                    f"{mutant.benign.to_json()}: {diff}")


class _Killed(Exception):
    pass


def find_kill(prop: str, mutant: Target, ours: Target, options: checks.Options, space: strategies.Space,
              search_settings: settings) -> dict | None:
    """The first generated case on which ``prop`` fails for the mutant and holds for ours, or None."""
    found = {}

    @settings(search_settings, verbosity=Verbosity.quiet)
    @given(case=strategies.cases(space))
    def search(case):
        if found:
            raise _Killed()  # Hypothesis replays the failing example: it is the one already found
        verdict = checks.run_property(prop, mutant, case, options)
        if verdict.ok:
            return
        if not checks.run_property(prop, ours, case, options).ok:
            return  # the original fails here too: not evidence against the mutant
        found.update(case=case.to_json(), report=verdict.report)
        raise _Killed()

    try:
        search()
    except Exception:  # noqa: BLE001 - _Killed, or Hypothesis' wrapping of it
        if not found:
            raise
    return found or None


#: Examples and determinism reruns per cell of the matrix. The designated
#: property gets the dev profile's examples and the full reruns; the other
#: cells, which only show what else notices the bug, get a cheaper search.
OTHER_CELL_EXAMPLES = 20
OTHER_CELL_REPEATS = 5


def kill_row(m: Mutant, ours: Target, options: checks.Options = checks.Options(),
             space: strategies.Space = strategies.Space(), search_settings: settings | None = None) -> dict:
    """One row of the kill matrix: for every property, the killing case (or None)."""
    search_settings = search_settings or profiles.examples_for_mutant_kills()
    check_buildable(m, ours)  # an unbuildable mutant would raise everywhere: "killed" by every property
    mutant = mutant_target(m, ours)
    kills = {}
    for prop in checks.PROPERTY_NAMES:
        if prop in checks.SPAWNING and prop != m.designated:
            continue  # each example starts processes: only where it is the property designed for the mutant
        if prop == m.designated:
            cell_settings, cell_options = search_settings, options
        else:
            cell_settings = settings(search_settings, max_examples=min(OTHER_CELL_EXAMPLES, search_settings.max_examples))
            cell_options = dataclasses.replace(options, repeats=min(OTHER_CELL_REPEATS, options.repeats))
        kills[prop] = find_kill(prop, mutant, ours, cell_options, space, cell_settings)
    return {"mutant": m.name, "bug": m.bug, "designated": m.designated, "backend": ours.backend,
            "examples": search_settings.max_examples, "other_examples": min(OTHER_CELL_EXAMPLES, search_settings.max_examples),
            "kills": kills}


def format_kill_matrix(rows: list, order: tuple = ()) -> str:
    """Mutants down (in ``order``, then the rest), properties across: KILL where the property caught
    the mutant (* = the designated property)."""
    props = [p for p in checks.PROPERTY_NAMES if any(p in r["kills"] for r in rows)]
    order = list(order)
    rows = sorted(rows, key=lambda r: order.index(r["mutant"]) if r["mutant"] in order else len(order))
    width = max([len(r["mutant"]) for r in rows] + [6])
    header = "mutant".ljust(width) + "  " + "  ".join(p.ljust(max(len(p), 5)) for p in props) + "  verdict"
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = []
        for p in props:
            mark = "KILL" if r["kills"].get(p) else "-"
            if p == r["designated"]:
                mark += "*"
            cells.append(mark.ljust(max(len(p), 5)))
        killed = any(r["kills"].values())
        lines.append(r["mutant"].ljust(width) + "  " + "  ".join(cells) + "  " + ("killed" if killed else "SURVIVED"))
    designated = max(r.get("examples", 0) for r in rows)
    other = max(r.get("other_examples", 0) for r in rows)
    lines.append(f"(* = the property designed for that bug class, searched with up to {designated} generated examples; "
                 f"other cells up to {other} (determinism with {OTHER_CELL_REPEATS} reruns); derandomized; "
                 f"a kill needs the original to pass the same case)")
    return "\n".join(lines)


def kill_details(row: dict) -> str:
    lines = [f"{row['mutant']} ({row['bug']}):"]
    for prop, kill in row["kills"].items():
        if kill:
            lines.append(f"  {prop}: killed by {kill['case']}\n    " + kill["report"].replace("\n", "\n    "))
        else:
            lines.append(f"  {prop}: survived")
    return "\n".join(lines)
