"""The L2's throughput over one main kernel's run, sample by sample (GPU, ncu's PM sampling).

    python benchmarks/l2_timeline.py profile --designs fixed,atomic[,cudnn] [--H 64 ...] [--out DIR]   # GPU, ncu
    python benchmarks/l2_timeline.py summarize DIR/fixed.csv DIR/atomic.csv ...                        # anywhere

Every main kernel here is bound by the L2 (l2_counters.py, ncu_stalls.py), and ncu's one
figure for it, the launch's mean throughput, cannot say whether a kernel that keeps the L2
less busy than another does so all along (the kind of requests it sends) or in stretches
(a launch's ramp and tail, or moments when too few SMs add). ``profile`` runs
``benchmarks/one_call.py`` under ``ncu --section PmSampling`` (one sample every few
microseconds over the whole launch, in one pass) on the first main launch of the last call
(cuDNN's main kernel with --kernel), and exports the samples as ``DIR/DESIGN.csv``.
``summarize`` reads those exports and prints, for each:

- the active span (from the first to the last sample at 5 % of the L2's throughput or more);
- the steady level: the median over the span's middle 80 %, with its 10th and 90th percentiles;
- the ramp up and the tail: how long the L2 takes to reach 90 % of that level, and how long
  it stays below it at the end, with the share of the span's mean they cost;
- the tensor pipe's mean activity over the span;
- the span cut into 40 equal parts (fewer where it has fewer samples), each part's mean L2
  throughput.
"""

import argparse
import os
import shlex
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from l2_counters import last_main_launch, number, one_call_program, raw_rows  # noqa: E402

#: The PM sampling section's series this reads (ncu 2025's TriageCompute configuration).
L2 = "LTS.TriageCompute.lts__throughput.avg.pct_of_peak_sustained_elapsed"
TENSOR = "TPC.TriageCompute.sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed"
INTERVAL = "profiler__pmsampler_interval_time"
#: Samples below this share of the L2's throughput lie outside the launch's active span.
ACTIVE = 5.0
#: The ramp and the tail: samples below this fraction of the steady level.
NEAR = 0.9
BINS = 40


def series(cell: str) -> list[float]:
    """A PM-sampled metric's samples from its raw-page cell, ``TOTAL (v1; v2; ...)``."""
    if "(" not in cell:
        raise ValueError(f"not a sampled metric's cell (no instance values): {cell[:80]!r}")
    inner = cell[cell.index("(") + 1:cell.rindex(")")]
    return [number(v.strip()) for v in inner.split(";")]


def read_samples(path: str) -> dict:
    """The exported kernel's L2 and tensor series and the sampling interval (us)."""
    with open(path) as f:
        rows = raw_rows(f.read())
    if len(rows) != 1:
        raise ValueError(f"{path}: {len(rows)} kernels in the export, where profile writes one")
    row = rows[0]
    missing = [key for key in (L2, TENSOR, INTERVAL) if key not in row]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} (was it profiled with --section PmSampling?)")
    return {"kernel": row.get("Kernel Name", "?"), "l2": series(row[L2]), "tensor": series(row[TENSOR]),
            "interval_us": number(row[INTERVAL].split("(")[0])}


def summarize(samples: dict) -> dict:
    l2, tensor, dt = samples["l2"], samples["tensor"], samples["interval_us"]
    active = [i for i, v in enumerate(l2) if v >= ACTIVE]
    if not active:
        raise ValueError(f"no sample at {ACTIVE} % of the L2's throughput or more")
    first, last = active[0], active[-1]
    span = l2[first:last + 1]
    n = len(span)
    if any(v != v for v in span):  # NaN: ncu wrote "n/a" for a sample inside the launch
        raise ValueError(f"{sum(v != v for v in span)} of the launch's {n} samples have no value")
    middle = span[n // 10:n - n // 10] or span
    steady = float(np.median(middle))
    up = next(i for i, v in enumerate(span) if v >= NEAR * steady)
    down = n - 1 - next(i for i, v in enumerate(reversed(span)) if v >= NEAR * steady)
    mean = sum(span) / n
    # What the ramp and the tail cost the span's mean: their shortfall from the steady level.
    lost = sum(steady - v for v in span[:up] + span[down + 1:] if v < steady) / n
    bins = [sum(part) / len(part) for part in (span[k * n // BINS:(k + 1) * n // BINS] for k in range(BINS)) if part]
    return {
        "kernel": samples["kernel"], "interval_us": dt, "samples": n, "span_us": n * dt,
        "mean": mean, "steady": steady, "p10": float(np.percentile(middle, 10)),
        "p90": float(np.percentile(middle, 90)),
        "ramp_up_us": up * dt, "tail_us": (n - 1 - down) * dt, "ramp_and_tail_cost": lost,
        "tensor": sum(tensor[first:last + 1]) / n if len(tensor) == len(l2) else float("nan"), "bins": bins,
    }


def print_summary(name: str, s: dict) -> None:
    print(f"{name}: {s['kernel'][:60]}, {s['samples']} samples of {s['interval_us']:g} us ({s['span_us'] / 1e3:.2f} ms)")
    print(f"  L2 throughput: mean {s['mean']:.1f} %, steady {s['steady']:.1f} % (p10 {s['p10']:.1f}, p90 {s['p90']:.1f})")
    print(f"  ramp up {s['ramp_up_us']:.0f} us, tail {s['tail_us']:.0f} us: {s['ramp_and_tail_cost']:.1f} points of the mean")
    print(f"  tensor pipe active {s['tensor']:.1f} %")
    print(f"  L2 % in {len(s['bins'])} equal parts of the span: " + " ".join(f"{v:.0f}" for v in s["bins"]))


def profile(design: str, a) -> str:
    out = os.path.join(a.out, f"{design}.csv")
    report = os.path.join(a.out, design)
    calls = 2
    program = one_call_program(design, calls, a)
    if design == "cudnn":  # its main kernel, one launch a call
        select = ["-k", a.cudnn_kernel, "--launch-skip", str(calls - 1), "-c", "1"]
    else:
        select = last_main_launch(design, calls, a.H)
    command = ["ncu", "--clock-control", "none", *select, "--section", "PmSampling", "-f", "-o", report, *program]
    print("$ " + shlex.join(command), flush=True)
    subprocess.run(command, check=True)
    with open(out, "w") as f:
        subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "raw", "--csv", "--print-metric-instances", "values"],
                       stdout=f, check=True)
    return out


def main():
    sys.path.insert(0, os.path.dirname(HERE))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="PM-sample one main launch of each design (GPU, ncu)")
    from mqa_bwd.bench import INDEX_PATTERNS, add_shape_arguments

    p.add_argument("--designs", default="fixed,atomic")
    add_shape_arguments(p, repeats=None)
    p.add_argument("--indices", choices=INDEX_PATTERNS, default="uniform", help="the top-k index pattern")
    p.add_argument("--cudnn-kernel", default="regex:dsa_bwd_sm90F",
                   help="ncu's filter for cuDNN's main kernel (its other kernels are dsa_bwd_sm90_...)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/l2_timeline"))
    s = sub.add_parser("summarize", help="print what the exports show (anywhere)")
    s.add_argument("exports", nargs="+", help="DESIGN.csv files written by profile")
    a = parser.parse_args()
    if a.command == "profile":
        designs = a.designs.split(",")
        for design in designs:
            if design not in ("fixed", "atomic", "cudnn"):
                raise ValueError(f"--designs: {design!r} is none of fixed, atomic, cudnn")
        os.makedirs(a.out, exist_ok=True)
        exports = [profile(design, a) for design in designs]
    else:
        exports = a.exports
    for path in exports:
        print_summary(os.path.splitext(os.path.basename(path))[0], summarize(read_samples(path)))


if __name__ == "__main__":
    main()
