"""What the main kernel's global dKV adds cost: every variant times the same
calls with all of them, every other slot's, none, or all but a row's last
slot block's (GPU only).

    python benchmarks/add_cost.py [--H 64] [--S 4096] [--S_kv 8192] [--L 2048] [--repeats 7] [--adds all half none tail]

The variants are copies of ``mqa_bwd.kernels`` whose add guards also test the
slot (``slot % 2 == 0`` for half, never for none); everything else, the dKV
GEMMs included, runs as is. Their outputs are wrong: only the time means
anything. Both the fixed-point design and the atomic control are timed,
interleaved in one process. Halving the adds tells a shared resource that
saturates (the L2 reduction units: the time drops by more than half the
adds' cost) from adds that hide behind the tensor cores (it does not move).
"tail" drops only the adds issued after a row's slot loop (its last block's,
which no GEMM is left to hide): what a kernel that carried them into the
next row's first block could save.
"""

import argparse
import inspect
import statistics

from mqa_bwd import kernels
from mqa_bwd.bench import add_shape_arguments, kernels_module_from_source, production_inputs, time_with_kernels

# The guards in front of the adds (main_bwd_program's add_piece, and add_chunk
# of the 64-head tile): one each for the fixed-point adds (its warp's slot),
# and for the atomic control's, two in add_piece (per slot of the piece: value
# part and tail) and one in add_chunk (per slot of the block).
# Each starts at a line start, so that one indentation never matches inside another.
FIXED_GUARDS = (
    "\n                if (kv_row[0] >= 0) and (kv_row[0] < NKV):\n",
    "\n                if (0 <= kv_row[0]) and (kv_row[0] < NKV):\n",
)
ATOMIC_GUARDS = (
    "\n                if (slots[k * piece + j] >= 0) and (slots[k * piece + j] < NKV):\n",
    "\n                    if (slots[k * piece + j] >= 0) and (slots[k * piece + j] < NKV):\n",
    "\n                if (slots[j] >= 0) and (slots[j] < NKV):\n",
)
# Extra condition per variant: (fixed: on the warp, whose slot is warp + i *
# n_warps with n_warps even; atomic: on the slot within the piece).
DROPS = {"all": None, "half": ("warp % 2 == 0", "j % 2 == 0"), "none": ("warp < 0", "j < 0"), "tail": "tail"}
# The two loops over a row's last block's pieces, after the slot loop (one
# head group, a cluster); "tail" makes them run zero times.
TAIL_LOOP = "\n                        for k in T.unroll(PIECES):\n"
TAIL_LOOPS = 2


def variant_source(adds: str, source: str | None = None) -> str:
    """mqa_bwd.kernels' source with the adds of ``DROPS[adds]`` dropped."""
    source = inspect.getsource(kernels) if source is None else source
    if DROPS[adds] is None:
        return source
    if adds == "tail":
        if source.count(TAIL_LOOP) != TAIL_LOOPS:
            raise RuntimeError(f"add_cost: the last block's add loop {TAIL_LOOP.strip()!r} is not in mqa_bwd.kernels "
                               f"{TAIL_LOOPS} times; update this tool")
        return source.replace(TAIL_LOOP, TAIL_LOOP.replace("T.unroll(PIECES)", "T.serial(0)"))
    fixed_cond, atomic_cond = DROPS[adds]
    # The fixed-point guard is in add_piece (one path for one head group and
    # clusters alike) and in add_chunk; the atomic control's guards once each.
    for guard, cond in tuple((g, fixed_cond) for g in FIXED_GUARDS) + tuple((g, atomic_cond) for g in ATOMIC_GUARDS):
        if source.count(guard) != 1:
            raise RuntimeError(f"add_cost: the add guard {guard.strip()!r} is not in mqa_bwd.kernels once; "
                               "update this tool")
        source = source.replace(guard, guard.replace(":\n", f" and ({cond}):\n"))
    return source


def variant_module(adds: str):
    """The kernels module of a variant (TileLang parses kernels from their file, so it gets one)."""
    if DROPS[adds] is None:
        return kernels
    return kernels_module_from_source(variant_source(adds), f"kernels_adds_{adds}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--adds", nargs="+", choices=list(DROPS), default=list(DROPS),
                        help="variants to time (all is always timed: the others are measured against it)")
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    chosen = ["all"] + [adds for adds in a.adds if adds != "all"]
    modules = {adds: variant_module(adds) for adds in chosen}
    variants = [(design, adds) for design in ("fixed", "atomic") for adds in chosen]
    times = time_with_kernels(args, {v: (modules[v[1]], v[0] == "fixed") for v in variants}, a.repeats)
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}: whole calls, median of {a.repeats} (interleaved)")
    print(f"{'design':<8} {'adds':<6} {'ms':>8} {'min':>8} {'saved':>8}")
    for design, adds in variants:
        ms = statistics.median(times[(design, adds)])
        saved = statistics.median(times[(design, "all")]) - ms
        print(f"{design:<8} {adds:<6} {ms:>8.2f} {min(times[(design, adds)]):>8.2f} {saved:>8.2f}")


if __name__ == "__main__":
    main()
