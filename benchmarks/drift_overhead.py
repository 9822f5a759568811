"""What the drift check costs a training step: forward + backward through mqa_bwd.autograd.

    python benchmarks/drift_overhead.py                  # dsv32 H=64, every 10th step
    python benchmarks/drift_overhead.py --H 128 --every 20 --rounds 7

The shape is mqa-bwd bench's "dsv32" set (B=1 S=4096 S_kv=8192 L=2048, Dk=576,
Dv=512) at --H; the tensors are bench.production_inputs', built once. Three
settings run side by side in one process on the same tensors: the drift
check off, on every step, and on every --every-th step. A timed block is
--every steps of one setting (so the N-th-step setting pays its one check in
each block), timed with CUDA events; the blocks of the three settings are
interleaved (bench.time_interleaved) after one warm-up block each, and the
figure is the median block time divided by --every. The forward is the op's
default (reference_forward); the backward is the deterministic kernel
("tilelang"), so no check finds drift and nothing is written. Needs a Hopper
GPU and tilelang; elsewhere it says so and exits 2.
"""

import argparse
import statistics
import sys
import tempfile

from mqa_bwd import bench
from mqa_bwd.cli import positive_int

BACKEND = "tilelang"



def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    heads = sorted(s["H"] for s in bench.SHAPES["dsv32"])
    parser.add_argument("--H", type=int, choices=heads, default=64, help="which dsv32 shape (default 64)")
    parser.add_argument("--every", type=positive_int, default=10, help="the sparse setting checks every N-th step "
                        "(default 10); also the steps in a timed block")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed blocks per setting (default 5)")
    args = parser.parse_args(argv)
    args.shape = next(dict(s) for s in bench.SHAPES["dsv32"] if s["H"] == args.H)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from mqa_bwd import backends

    reason = backends.unavailable(BACKEND)
    if reason is not None:
        print(f"drift_overhead.py: needs a Hopper GPU and tilelang to time the kernels ({reason}); "
              "nothing measured", file=sys.stderr)
        return 2
    from mqa_bwd.autograd import DriftCheck, sparse_mqa_attention

    s = args.shape
    q, kv, _, grad_out, _, sink, idx, sm_scale = bench.production_inputs(s["B"], s["S"], s["S_kv"], s["H"], s["L"])
    leaves = [t.requires_grad_() for t in (q, kv, sink)]
    n = args.every
    with tempfile.TemporaryDirectory() as captures:
        settings = {
            "off": False,
            "every step": DriftCheck(every=1, on_drift="raise", capture_dir=captures),
            f"every {n}th step": DriftCheck(every=n, on_drift="raise", capture_dir=captures),
        }

        def block(check):
            def steps():
                for _ in range(n):
                    for t in leaves:
                        t.grad = None
                    out = sparse_mqa_attention(q, kv, sink, idx, sm_scale, d_v=512, backward_backend=BACKEND,
                                               drift_check=check)
                    out.backward(grad_out)
            return steps

        times = bench.time_interleaved({name: block(c) for name, c in settings.items()}, warmup=1,
                                       repeats=args.rounds)
    per_step = {name: [t / n for t in ts] for name, ts in times.items()}
    base = statistics.median(per_step["off"])
    print(f"drift check overhead, forward + backward through mqa_bwd.autograd ({BACKEND!r}), "
          f"B={s['B']} S={s['S']} S_kv={s['S_kv']} H={s['H']} L={s['L']} Dk=576 Dv=512; "
          f"median of {args.rounds} blocks of {n} steps, {bench.environment()}")
    print(f"{'drift check':>16} {'ms/step':>9} {'min':>9} {'max':>9} {'overhead ms':>11} {'overhead':>9} {'checks':>7}")
    for name, ts in per_step.items():
        ms = statistics.median(ts)
        check = settings[name]
        checks = check.checks if check else 0
        print(f"{name:>16} {ms:>9.3f} {min(ts):>9.3f} {max(ts):>9.3f} {ms - base:>11.3f} "
              f"{100 * (ms / base - 1):>8.1f}% {checks:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
