"""This tree's whole package against another version of it: wrapper, launcher,
plan and kernels together (GPU only): the one way to time against another
revision (no tool swaps modules or rewrites kernel source). Two variants of
this tree's kernels are two configurations (mqa_bwd.kernels.MainConfig), not
two revisions.

    git archive <commit> mqa_bwd | tar -x -C /tmp/other     # where git is (not on the device)
    python benchmarks/package_ab.py --against /tmp/other/mqa_bwd [--against ...] [--shapes dsv32,fleet]
        [--shape B=1,S=4096,S_kv=4096,H=64,L=2048 --indices indexer] [--repeats 12] [--trace 3] [--errors]

Each other package is imported under a name of its own, so all run in one
process: per shape, every version's deterministic call and atomic control,
interleaved (bench.time_interleaved), with medians, minima and the
ratio to this tree's control, and whether each deterministic call gives this tree's bits;
with --trace, each call's GPU kernels, so that a kernel's change shows beside the whole call's;
with --errors, each call's error against the float64 reference (bench.oracle_errors) and its
ratio to this tree's control: issue 30's standard for a version whose bits differ.
"""

import argparse
import importlib.util
import os
import sys

from mqa_bwd import bench, launch
from mqa_bwd.contract import OUTPUT_NAMES
from mqa_bwd.edge import same_bits as same_tensor_bits

OTHER = "mqa_bwd_other"


def load_package(path: str, name: str = OTHER):
    """The package at ``path`` (a copy of mqa_bwd/) imported as ``name``; ValueError naming
    --against when it is not one."""
    init = os.path.join(path, "__init__.py")
    if not all(os.path.exists(os.path.join(path, f)) for f in ("__init__.py", "wrapper.py", "launch.py", "bench.py")):
        raise ValueError(f"--against: {path} is not a copy of the mqa_bwd package (no __init__, wrapper, launch or bench)")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[path])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def add_against_argument(parser):
    """--against, repeatable: the copies of other versions' mqa_bwd/ a tool sets beside this tree."""
    parser.add_argument("--against", required=True, action="append",
                        help="a copy of another version's mqa_bwd/ directory (repeat it for several)")


def check_against(paths: list):
    """ValueError naming --against where ``paths`` name one package twice (before any loads)."""
    if len({os.path.abspath(p) for p in paths}) < len(paths):
        raise ValueError(f"--against: the same package twice in {paths}")


def load_against(paths: list) -> list:
    """The packages at --against's ``paths``, each imported under a name of its own (OTHER where
    there is one)."""
    check_against(paths)
    return [load_package(os.path.abspath(path), OTHER if len(paths) == 1 else f"{OTHER}{i}")
            for i, path in enumerate(paths)]


def error_lines(errors: dict, control: str) -> list:
    """One line a call of ``errors`` (label -> {output: relative L2 error against the float64
    reference}): each output's error and its ratio to ``control``'s, and, for the others, whether
    every ratio meets issue 30's standard (at most bench.ADMISSIBLE_ERROR_RATIO)."""
    lines = []
    for label, error in errors.items():
        ratios = bench.error_ratios(error, errors[control])
        cells = ", ".join(f"{name} {value:.3e} ({ratios[name]:.2f}x)" for name, value in error.items())
        if label == control:
            verdict = "the control"
        elif bench.within_standard(ratios):
            verdict = "admissible"
        else:
            verdict = f"NOT admissible (over {bench.ADMISSIBLE_ERROR_RATIO}x)"
        lines.append(f"  error, {label}: {cells}; {verdict}")
    return lines


def bits_equal(mine, theirs) -> str:
    """'True' or 'False (dq False, dkv True, d_attn_sink True)': whether two calls' outputs have
    the same bits, and where they do not, output by output (a version that sums dQ in another
    slot order keeps dkv's and d_attn_sink's)."""
    each = [(name, same_tensor_bits(x, y)) for name, x, y in zip(OUTPUT_NAMES, mine, theirs)]
    if len(mine) == len(theirs) and all(same for _, same in each):
        return "True"
    return "False (" + ", ".join(f"{name} {same}" for name, same in each) + ")"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_against_argument(parser)
    bench.add_ab_shape_arguments(parser, default="dsv32,fleet")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--trace", type=int, default=0, metavar="CALLS",
                        help="also profile CALLS more calls of each and print its GPU kernels (bench.kernel_trace)")
    parser.add_argument("--errors", action="store_true",
                        help="also print each call's error against the float64 reference and its ratio to "
                             "this tree's control (issue 30's standard)")
    a = parser.parse_args()
    check_against(a.against)
    shapes = bench.ab_shapes(a.shapes, a.shape, a.default_shapes)  # a ValueError before anything loads
    others = [(path if len(a.against) > 1 else "--against", importlib.import_module(f"{package.__name__}.bench"),
               importlib.import_module(f"{package.__name__}.launch"))
              for path, package in zip(a.against, load_against(a.against))]
    for shape in shapes:
        args = bench.production_inputs(**shape, indices=a.indices)
        calls = {"fixed, this tree": bench.prepared_wrapper_call(args, launch.TileLangLauncher(True))}
        for label, other_bench, other_launch in others:
            calls[f"fixed, {label}"] = other_bench.prepared_wrapper_call(args, other_launch.TileLangLauncher(True))
        calls["atomic, this tree"] = bench.prepared_wrapper_call(args, launch.TileLangLauncher(False))
        for label, other_bench, other_launch in others:
            calls[f"atomic, {label}"] = other_bench.prepared_wrapper_call(args, other_launch.TileLangLauncher(False))
        mine = calls["fixed, this tree"]()
        for label, _, _ in others:
            print(f"{shape}, {a.indices} indices: fixed bits equal, this tree and {label}: "
                  f"{bits_equal(mine, calls[f'fixed, {label}']())}")
        if a.errors:
            errors = bench.oracle_errors(args, {label: call() for label, call in calls.items()})
            print("\n".join(error_lines(errors, "atomic, this tree")))
        print("\n".join(bench.interleaved_report(calls, "atomic, this tree", a.repeats)))
        for label, call in calls.items() if a.trace > 0 else ():
            print("\n".join(bench.trace_lines(label, bench.kernel_trace(call, a.trace))))


if __name__ == "__main__":
    main()
