"""Where a backward call's host time goes, line by line (GPU).

    python benchmarks/host_lines.py [--H 64] [--S 4096] [--S_kv 8192] [--L 2048] [--calls 30]
        [--atomic] [--min-us 2]

A call timed alone (as ``mqa-bwd bench`` times it) waits for the host until the host has
enqueued its main launch: the kernels before it take less GPU time than the host takes to
enqueue them (``benchmarks/host_overhead.py`` says how much less). This says where that host
time goes: the wrapper's functions and the launcher's methods on the path (FUNCTIONS) are
recompiled from their source with a clock read before every statement, and a prepared call
(validation, then ``wrapper.run``, the public call's steps) runs ``--calls`` times, each on an
idle GPU. For every statement, the median over the calls of its microseconds a call, from its
clock read to the next one (any function's: a call into another listed function is that
function's lines, not the caller's; a statement in a loop summed within the call), in source
order; statements under ``--min-us`` are left out. The clock reads themselves cost some 0.1 us
each.
"""

import argparse
import ast
import dataclasses
import inspect
import statistics
import textwrap
import time

import torch

from mqa_bwd import bench, launch, wrapper

#: The functions whose statements are timed: (owner, attribute). Methods are timed on a
#: subclass of the launcher; the wrapper's replaceable steps through wrapper.Steps.
FUNCTIONS = (
    (wrapper, "run"),
    (wrapper, "global_slots"),
    (wrapper, "row_terms"),
    (wrapper, "pad_heads"),
    (wrapper, "validate"),
    (launch.Launcher, "zeros_together"),
    (launch.Launcher, "empty"),
    (launch.Launcher, "zeros"),
    (launch.TileLangLauncher, "delta"),
    (launch.TileLangLauncher, "sorted_slots"),
    (launch.TileLangLauncher, "row_blocks"),
    (launch.TileLangLauncher, "plan"),
    (launch.TileLangLauncher, "main_bwd"),
)


class _Clocked(ast.NodeTransformer):
    """Puts ``__marks__.append((line, __clock__()))`` before every statement of every body."""

    def __init__(self, file: str, first_line: int):
        self.file, self.offset = file, first_line - 1

    def _mark(self, line: int) -> ast.stmt:
        call = ast.parse(f"__marks__.append((({self.file!r}, {line + self.offset}), __clock__()))").body[0]
        return ast.fix_missing_locations(call)

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            if isinstance(statements, list) and statements and isinstance(statements[0], ast.stmt):
                setattr(node, field, [x for s in statements for x in (self._mark(s.lineno), s)])
        return node


def clocked(function, marks: list):
    """``function`` recompiled from its source with a clock read before each statement, appended
    to ``marks`` as ((its file, line), seconds)."""
    lines, first = inspect.getsourcelines(function)
    file = inspect.getsourcefile(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    definition = tree.body[0]
    definition.decorator_list = []
    _Clocked(file, first).visit(definition)
    namespace = dict(function.__globals__, __marks__=marks, __clock__=time.perf_counter)
    exec(compile(tree, file, "exec"), namespace)
    return namespace[definition.name]


def lined_call(args, launcher_class, deterministic: bool, marks: list):
    """A no-argument call of validation, then wrapper.run, on ``args``, with a ``launcher_class``
    launcher (the TileLang launcher on a GPU; any launcher of this package), every function of
    FUNCTIONS it runs clocked; the clock reads go to ``marks``."""
    methods = {name: clocked(getattr(owner, name), marks) for owner, name in FUNCTIONS
               if isinstance(owner, type) and issubclass(launcher_class, owner)}
    launcher = type("Lined", (launcher_class,), methods)(deterministic)
    own = {name: clocked(getattr(owner, name), marks) for owner, name in FUNCTIONS if not isinstance(owner, type)}
    # The public steps, each one FUNCTIONS lists clocked.
    steps = dataclasses.replace(wrapper.STEPS, **{f.name: own[f.name] for f in dataclasses.fields(wrapper.Steps)
                                                  if f.name in own})
    run = own["run"]

    def call():
        problem = steps.validate(*args, None, None, launcher, steps=steps, design=deterministic)
        out = run(problem, *args, launcher, steps)
        marks.append((None, time.perf_counter()))
        return out

    return call


def line_costs(call, marks: list, calls: int, synchronize=torch.cuda.synchronize) -> tuple:
    """({(file, line): [microseconds a call]}, {(file, line): times it runs a call}) over ``calls``
    calls, each after ``synchronize`` (on a GPU: each on an idle GPU, as a call timed alone runs);
    a statement that runs several times a call (in a loop) is summed within the call."""
    costs: dict = {}
    runs: dict = {}
    for _ in range(calls):
        synchronize()
        marks.clear()
        call()
        this_call: dict = {}
        for (line, start), (_, end) in zip(marks, marks[1:]):
            total, count = this_call.get(line, (0.0, 0))
            this_call[line] = (total + (end - start) * 1e6, count + 1)
        for line, (total, count) in this_call.items():
            costs.setdefault(line, []).append(total)
            runs[line] = count
    synchronize()
    return costs, runs


def report(costs: dict, runs: dict, min_us: float) -> list:
    """Lines of text: each function of FUNCTIONS with its statements' median microseconds a call
    (line_costs' figures), those under ``min_us`` left out, and the functions' totals."""
    out = []
    grand = 0.0
    for owner, name in FUNCTIONS:
        function = getattr(owner, name)
        lines, first = inspect.getsourcelines(function)
        file = inspect.getsourcefile(function)
        rows = [(first + i, statistics.median(costs[key]), runs[key], text.strip())
                for i, text in enumerate(lines) if (key := (file, first + i)) in costs]
        if not rows:
            continue
        total = sum(row[1] for row in rows)
        grand += total
        out.append(f"== {owner.__name__.rpartition('.')[2]}.{name}: {total:8.1f} us a call")
        for line, us, times, text in rows:
            if us >= min_us:
                out.append(f"   {line:5d} {us:8.1f} us{f' x{times}' if times > 1 else '':5}  {text[:100]}")
    out.append(f"== all the listed functions: {grand:.1f} us a call")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_shape_arguments(parser, repeats=None)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--atomic", action="store_true", help="the atomic control, not the deterministic design")
    parser.add_argument("--min-us", type=float, default=2.0)
    a = parser.parse_args()
    args = bench.production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    marks: list = []
    call = lined_call(args, launch.TileLangLauncher, not a.atomic, marks)
    for _ in range(3):  # compilation, the allocator's pools
        call()
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}, {'atomic' if a.atomic else 'deterministic'}, "
          f"{a.calls} calls")
    print("\n".join(report(*line_costs(call, marks, a.calls), a.min_us)))


if __name__ == "__main__":
    main()
