"""The project's own tests: the mutant kill matrix, printed once at the end of a session.

The property suite's plugin (properties.plugin) is registered by the package's
pytest11 entry point; nothing here is needed to run the suite itself.
"""

import json

_KILL_ROWS = []


def pytest_runtest_logreport(report):
    # In an xdist session the controller sees every worker's reports, with their user properties.
    props = dict(report.user_properties)
    if "mqa_kill_row" in props and report.when == "call":  # record_property's entries ride on every later phase
        _KILL_ROWS.append(props["mqa_kill_row"])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _KILL_ROWS:
        from mqa_bwd.mutants import MUTANTS
        from properties.kills import format_kill_matrix

        terminalreporter.write_sep("=", "mutant kill matrix (CPU model)")
        terminalreporter.write_line(format_kill_matrix([json.loads(r) for r in _KILL_ROWS], tuple(MUTANTS)))
