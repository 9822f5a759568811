"""Time and peak memory of the oracle's forward + backward at the issue's size.

Target (issue 2): B=1 S=256 S_kv=512 H=64 L=256 Dk=576 Dv=512 in at most 3 s
on the 2-core CI machine, peak memory under 2 GiB.

    python benchmarks/bench_oracle.py [--precision float32|float64] [--repeat N]
"""

import argparse
import os
import resource
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import oracle  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="float32", choices=["float32", "float64"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    B, S, S_kv, H, L, Dk, Dv = 1, 256, 512, 64, 256, 576, 512
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, S, H, Dk), dtype=np.float32)
    kv = rng.standard_normal((B, S_kv, Dk), dtype=np.float32)
    grad_out = rng.standard_normal((B, S, H, Dv), dtype=np.float32)
    idx = np.stack([rng.permutation(S_kv)[:L] for _ in range(B * S)]).reshape(B, S, L).astype(np.int32)
    idx[:, :, -8:] = -1  # some invalid slots, as in real top-k tails
    sink = rng.standard_normal(H).astype(np.float32)
    scale = Dk ** -0.5

    def run():
        out, lse = oracle.forward(q, kv, idx, sink, scale, Dv, precision=args.precision)
        return oracle.backward(q, kv, out, grad_out, lse, sink, idx, scale, precision=args.precision)

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    # Separate pass: tracemalloc slows allocation, so it is not timed.
    tracemalloc.start()
    run()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    print(f"shape B={B} S={S} S_kv={S_kv} H={H} L={L} Dk={Dk} Dv={Dv} precision={args.precision}")
    print(f"forward+backward time: best {min(times):.3f} s, median {sorted(times)[len(times) // 2]:.3f} s "
          f"over {len(times)} runs (target <= 3 s)")
    print(f"peak traced memory (tracemalloc): {peak / 2**20:.1f} MiB (target < 2048 MiB)")
    print(f"max RSS growth during timed runs: {(rss1 - rss0) / 2**10:.1f} MiB; max RSS {rss1 / 2**10:.1f} MiB")
    ok = min(times) <= 3.0 and peak < 2 * 2**30
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
