"""What a query row costs a backward call beside what its slots cost (GPU).

    python benchmarks/row_cost.py [--slots 8388608] [--L 512,1024,2048] [--S_kv N] [--H 64]
        [--backends tilelang,tilelang-atomic,cudnn] [--indices uniform] [--repeats 6]

A query row's prologue (Q and dO in), the gather that fills its pipeline, its drain and its
epilogue (dQ out) are paid once a row, however few slot blocks the row has (the narrow main
kernels give a row a CTA; the persistent wide tile overlaps one row's fill with the row
before's drain, so what is left of it there is what the overlap does not hide). At a fixed number of (row, slot) pairs the slots' work is the same at every L,
so timing calls at S = slots / L for several L and fitting

    time = k + a * S

separates what a row costs (a, over the whole GPU; a times the SMs is what one row holds one
SM for) from everything else (k: the slots' work, per-call kernels, the host). a is the whole
call's per-row cost: the main kernel's (its CTA's prologue, fill, drain and epilogue) and the
other kernels' reads of a row's O, dO and Q (call_trace.py gives those apart). Every call keeps
S_kv: by default the least with which every causal row sees at least L kv rows (S + L - 1 for
the shortest L), so that no row's slots pile onto fewer than L kv rows. The causal rows still
weigh the first kv rows more the longer S is (at L = 512, S = 16384: about 3.6 times the
average row's contributions), and the fit takes that in with the rows. Printed per backend: the
medians at each L, a in ns a row and in us of one SM, and the share of each call that the
rows take. Fleet (L = 640) has 3.2 times dsv32's rows per slot.
"""

import argparse


def fit_row_cost(rows, times) -> tuple:
    """Least squares of times = k + a * rows: (a, k), in the units of times per row and of times."""
    n = len(rows)
    if n < 2 or len(set(rows)) < 2 or len(times) != n:
        raise ValueError(f"rows: need two or more distinct row counts with a time each, got {rows} and {times}")
    mean_rows, mean_times = sum(rows) / n, sum(times) / n
    spread = sum((s - mean_rows) ** 2 for s in rows)
    a = sum((s - mean_rows) * (t - mean_times) for s, t in zip(rows, times)) / spread
    return a, mean_times - a * mean_rows


def main():
    from mqa_bwd import bench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=4096 * 2048, help="(row, slot) pairs of every call")
    parser.add_argument("--L", default="512,1024,2048", help="top-k values; S = slots / L")
    parser.add_argument("--S_kv", type=int, default=None,
                        help="kv rows of every call (default: the least that gives every row L visible kv rows)")
    parser.add_argument("--H", type=int, default=64)
    parser.add_argument("--backends", default="tilelang,tilelang-atomic")
    parser.add_argument("--indices", default="uniform", choices=bench.INDEX_PATTERNS)
    parser.add_argument("--repeats", type=int, default=6)
    a = parser.parse_args()

    import statistics

    import torch

    tops = [int(x) for x in a.L.split(",")]
    least_kv = max(a.slots // L + L - 1 for L in tops)
    S_kv = least_kv if a.S_kv is None else a.S_kv
    if S_kv < least_kv:
        parser.error(f"--S_kv {S_kv}: the causal rows of the shortest L would see fewer than L kv rows; "
                     f"give at least {least_kv}")
    backends, _ = bench.runnable_backends(bench.parse_backends(a.backends), asked=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    medians = {backend: [] for backend in backends}
    rows = []
    for L in tops:
        S = a.slots // L
        rows.append(S)
        args = bench.production_inputs(1, S, S_kv, a.H, L, indices=a.indices)
        times = bench.time_interleaved({b: bench.backend_call(b, args) for b in backends}, repeats=a.repeats)
        line = ", ".join(f"{b} {statistics.median(times[b]):.3f}" for b in backends)
        print(f"S={S} L={L} S_kv={S_kv} H={a.H}: {line} ms", flush=True)
        for b in backends:
            medians[b].append(statistics.median(times[b]))
        del args, times
        torch.cuda.empty_cache()
    print(f"time = k + a * S over L = {a.L} ({a.slots} row-slot pairs a call, {sms} SMs):")
    for b in backends:
        per_row, rest = fit_row_cost(rows, medians[b])
        shares = ", ".join(f"L={L} {per_row * S / t:.0%}" for L, S, t in zip(tops, rows, medians[b]))
        print(f"  {b:16s} a = {per_row * 1e6:7.1f} ns a row ({per_row * 1e3 * sms:6.2f} us of one SM), "
              f"k = {rest:.3f} ms; the rows' share: {shares}")


if __name__ == "__main__":
    main()
