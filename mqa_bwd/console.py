"""What the command line prints: the console, live progress of a suite run, the repro report.

Rendering only; ``mqa_bwd.cli`` decides what runs.
"""

import sys
import time


def make_console(stderr=False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Logs and pipes get a wide fixed width, so tables stay one line per row.
    return Console(file=stream, highlight=False, soft_wrap=True, width=None if stream.isatty() else 200)


def _fmt_seconds(s) -> str:
    if s is None:
        return ""
    return f"{s:.1f} s" if s < 120 else f"{int(s // 60)} min {int(s % 60)} s"


_VERDICT_STYLE = {"pass": "green", "passed": "green", "ok": "green", "yes": "green", "fail": "bold red",
                  "failed": "bold red", "crashed": "bold red", "MISMATCH": "bold red", "NO": "bold red",
                  "skip": "yellow", "skipped": "yellow", "stopped": "bold yellow", "known": "yellow",
                  "note": "yellow", "BAD": "bold red"}


def _styled(text: str):
    """A table cell: the text as is (never parsed as markup), coloured by its first word."""
    from rich.text import Text

    return Text(text, style=_VERDICT_STYLE.get(text.split()[0] if text else "", ""))


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def verdict_cells(result: dict, skip_reason: str | None = None) -> tuple:
    """(verdict, note) of one property in the check table, from the suite's summary JSON: a
    known failure says the ledger's reason, a pass ended by the time budget says so, a failure
    gives the first line of its report (the determinism property's: first divergence, distinct
    results), a skip its reason."""
    verdict = str(result.get("verdict", "?"))
    notes = result.get("notes") or []
    if isinstance(notes, str):  # one note written as a string, not a list of one
        notes = [notes]
    if verdict == "xfail":  # the ledger entry's reason and what the run saw (properties.ledger.Tally)
        known = result.get("known_failure") or {}
        seen = known.get("seen")
        return "known failure", _shorten(str(known.get("reason", "")) + (f" | {seen}" if seen else ""))
    if verdict == "pass" and result.get("budget"):
        return "pass (time budget)", _shorten(str(result["budget"]))
    skip_reason = result.get("skip_reason") or skip_reason  # the summary's own, where it has one
    if verdict == "skip" and skip_reason:
        return f"skip ({skip_reason})", ""
    return verdict, _shorten(notes[0]) if notes else ""


def print_outside_domain(console, summary: dict) -> None:
    """The outside-domain findings of a run (properties/outside.py): one line per boundary probed."""
    from rich.text import Text

    findings = summary.get("outside_domain")
    if not findings:
        return
    domain = summary.get("domain") or {}
    console.print(f"just outside the domain {domain.get('text', '?')} ({domain.get('source', '?')}), one call each "
                  "(findings, not verdicts; a ValueError naming the argument is the right answer):", markup=False)
    for f in findings:
        mark = "ok" if f.get("right") else ("note" if f.get("behaviour") == "accepted_agrees" else "BAD")
        console.print(Text(f"  {mark:<4} ", style=_VERDICT_STYLE[mark]) + Text(str(f.get("text", ""))))


class LiveProgress:
    """Live table on a terminal; one line per finished property (and a heartbeat) elsewhere."""

    def __init__(self, console, title, heartbeat_s=15.0):
        self.console, self.title, self.heartbeat_s = console, title, heartbeat_s
        self.live = None
        self.reported = set()
        self.last_beat = time.time()

    def __enter__(self):
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self._render({}, []), console=self.console, refresh_per_second=4, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def _render(self, progress, records):
        from rich.table import Table
        from rich.text import Text

        total = sum(p.cases for p in progress.values())
        failures = sum(1 for p in progress.values() if p.outcome in ("failed", "crashed"))
        table = Table(title=f"{self.title() if callable(self.title) else self.title}  |  cases {total}  |  "
                            f"failing properties {failures}  |  crash records {len(records)}",
                      title_justify="left")
        table.add_column("property")
        table.add_column("cases", justify="right")
        table.add_column("status")
        table.add_column("time", justify="right")
        for p in sorted(progress.values(), key=lambda p: p.nodeid):
            status = p.outcome or ("running" if p.running else "waiting")
            if p.running and p.failed_cases:
                status = "failing, shrinking"
            table.add_row(Text(p.name), str(p.cases), _styled(status), _fmt_seconds(p.seconds))
        return table

    def update(self, progress, records):
        if self.live is not None:
            self.live.update(self._render(progress, records))
            return
        for p in sorted(progress.values(), key=lambda p: p.nodeid):
            if p.outcome and p.nodeid not in self.reported:
                self.reported.add(p.nodeid)
                reason = f" ({_shorten(p.reason, 120)})" if p.reason else ""
                self.console.print(f"  {p.name}: {p.outcome}{reason}, {p.cases} cases, {_fmt_seconds(p.seconds)}",
                                   markup=False)
        if time.time() - self.last_beat >= self.heartbeat_s:
            self.last_beat = time.time()
            total = sum(p.cases for p in progress.values())
            running = [p.name for p in progress.values() if p.running]
            self.console.print(f"  ... {total} cases so far; running: {', '.join(running) or '-'}; "
                               f"crash records: {len(records)}", markup=False)


def _fmt_index(index) -> str:
    return "-" if index is None else "(" + ",".join(map(str, index)) + ")"


def _fmt_value(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _fmt_shape(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


_SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


def _print_repro(console, result, scope: str = "") -> None:
    """The rerun tables and, last, the verdict line, prefixed with ``scope`` where a property's
    replay follows (its line is then the headline)."""
    from rich.table import Table
    from rich.text import Text

    from .repro import OUTPUT_NAMES

    for report in (result.primary, result.other):
        if report is None:
            continue
        if result.was_refused(report):  # no run to tabulate: say why instead
            console.print(f"{report.implementation} refused the call: {type(report.run0_error).__name__}: "
                          f"{report.run0_error}", markup=False)
            continue
        table = Table(title=f"{report.implementation} on {report.device}: {report.runs_requested} runs",
                      title_justify="left")
        for column in ("output", "bitwise", "distinct", "first diff run", "first diff element: run 0 vs it",
                       "max |diff|", "max ulp", "vs oracle: error vs tol"):
            table.add_column(column, no_wrap=True)
        for name in OUTPUT_NAMES:
            s = report.reruns.get(name)
            c = report.oracle.get(name)
            oracle_text = "-" if c is None else (
                f"{'ok' if c.ok else 'MISMATCH'} {c.max_err:.1e} {'<=' if c.ok else '>'} {c.tolerance:.1e}")
            if s is None:
                table.add_row(name, "-", "-", "-", "-", "-", "-", _styled(oracle_text))
                continue
            element = "-"
            if s.first_diverging_run is not None:
                a, b = s.first_values
                element = f"{_fmt_index(s.first_element)}: {_fmt_value(a)} vs {_fmt_value(b)} " \
                          f"({s.differing_elements} differ)"
            run = "-" if s.first_diverging_run is None else str(s.first_diverging_run)
            table.add_row(Text(f"{name} {_fmt_shape(s.shape)} {_SHORT_DTYPE.get(s.dtype, s.dtype)}"),
                          _styled("yes" if s.bitwise else "NO"),
                          f"{s.distinct} of {s.runs}", run, Text(element), f"{s.max_abs_diff:.3e}", str(s.max_ulp),
                          _styled(oracle_text))
        console.print(table)
        for problem in report.problems:
            console.print(f"problem: {problem}", markup=False)
        for name, c in report.oracle.items():
            if not c.ok:
                console.print(c.report(), markup=False)
    if result.cross:
        table = Table(title=f"A = {result.primary.implementation} vs B = {result.other.implementation} "
                            "(run 0 of each)", title_justify="left")
        for column in ("output", "equal", "elements differing", "max |diff|", "max ulp", "first difference: A vs B",
                       "rerun drift A / B", "oracle error A / B"):
            table.add_column(column)
        for name, x in result.cross.items():
            first = "-" if x.first_values is None else \
                f"{_fmt_index(x.first_element)}: {_fmt_value(x.first_values[0])} vs {_fmt_value(x.first_values[1])}"
            drift = " / ".join(f"{r.reruns[name].max_abs_diff:.1e}" if name in r.reruns else "-"
                               for r in (result.primary, result.other))
            error = " / ".join(f"{r.oracle[name].max_err:.1e}" if name in r.oracle else "-"
                               for r in (result.primary, result.other))
            table.add_row(name, "yes" if x.bitwise_equal else "no", f"{x.differing_elements} of {x.total}",
                          f"{x.max_abs_diff:.3e}", str(x.max_ulp), Text(first), drift, error)
        console.print(table)
    if result.oracle_skipped:
        console.print(f"oracle: {result.oracle_skipped}", markup=False)
    verdicts = []
    for r in (result.primary, result.other):
        if r is None:
            continue
        if result.rejected_as_spec_requires is not None:
            verdicts.append(f"{r.implementation}: " + ("rejected the call with a ValueError, as SPEC requires" if r.rejected
                                                      else "did NOT reject a call that breaks SPEC with a ValueError"))
        elif result.was_refused(r):
            verdicts.append(f"{r.implementation}: refused the call with a ValueError (above); nothing was replayed "
                            "on it: the case or the call options are outside what it accepts")
        elif r.problems:
            verdicts.append(f"{r.implementation}: {len(r.problems)} problem(s)")
        elif not r.bitwise:
            drifting = [n for n, s in r.reruns.items() if not s.bitwise]
            verdicts.append(f"{r.implementation}: NOT bitwise reproducible ({', '.join(drifting)})")
        elif any(not c.ok for c in r.oracle.values()):
            verdicts.append(f"{r.implementation}: bitwise reproducible but outside the oracle tolerance")
        else:
            verdicts.append(f"{r.implementation}: bitwise reproducible" + (", within tolerance" if r.oracle else ""))
    outcome = "OK: " if result.ok else ("REFUSED: " if result.bad_input else "FAILED: ")
    console.print(scope + outcome + "; ".join(verdicts), markup=False)


def _print_process_replay(console, replay, scope: str = "") -> None:
    from rich.table import Table

    from .repro import OUTPUT_NAMES

    table = Table(title=f"{replay.implementation} on {replay.device}: one call in each of {len(replay.answers)} "
                        "fresh processes (sha256 of the outputs' bytes)", title_justify="left")
    for column in ("process", "pid", "before the call") + OUTPUT_NAMES:
        table.add_column(column, no_wrap=column != "before the call")
    for i, a in enumerate(replay.answers):
        digests = [a.digests[n]["sha256"][:16] if n in a.digests else "-" for n in OUTPUT_NAMES]
        table.add_row(str(i), str(a.pid), ", ".join(a.did) or "nothing", *digests)
    console.print(table)
    for problem in replay.problems:
        console.print(f"problem: {problem}", markup=False)
    answered = sum(1 for a in replay.answers if not a.error)
    for name in OUTPUT_NAMES:
        groups = replay.groups(name)
        if len(groups) <= 1:
            console.print(f"{name}: identical in all {answered} processes that answered", markup=False)
        else:
            parts = "; ".join(f"{sha[:16]} in process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))}"
                              for sha, ps in groups.items())
            console.print(f"{name}: {len(groups)} distinct results: {parts}", markup=False)
    if replay.ok:
        console.print(f"{scope}OK: {replay.implementation}: bitwise identical in {answered} fresh processes",
                      markup=False)
    else:
        why = [f"differs between processes ({', '.join(replay.differing)})"] if replay.differing else []
        why += [f"{len(replay.problems)} process(es) gave no result"] if replay.problems else []
        console.print(f"{scope}FAILED: {replay.implementation}: " + "; ".join(why), markup=False)
