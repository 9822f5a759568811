"""Where a block's time goes in the 64-head tile, warpgroup by warpgroup (GPU; a patched package).

    bash scripts/ab-packages.sh experiments/block_timeline.patch
    python benchmarks/block_timeline.py --package .ab/block_timeline/mqa_bwd [--shape B=1,S=4096,S_kv=8192,H=64,L=2048]
        [--indices uniform] [--atomic] [--save stamps.npz]

experiments/block_timeline.patch makes the wide tile's lanes (or control) launch stamp the SM's
clock64 at fixed points of each block, from thread 0 of each warpgroup (and where each warp ends
its adds, from its lane 0), for the first 2048 blocks of every CTA (wide.py's TRACE_BLOCKS: all of
them at the bench shapes). This runs one call of the patched package and prints, per phase between
two stamps, its median cycles, its 10th and 90th percentiles, its share of the median block period
and its mean: which warpgroup waits for which handoff, and how long; the means add up to about the
mean period, so they say which phases the slow blocks are slow in. Then each CTA's cycles a block
(first stamp to last over its blocks: the row changes included), and the clock that the slowest
CTA's span and the traced kernel time imply; how far apart each warpgroup's four warps end their
adds (the earliest then waits at the next barrier or handoff); with uniform indices (every row the
same count of blocks), each phase's mean in the rows' first blocks against the others. Then the
share of a CTA's traced time in which a warpgroup's dKV adds are under way (warpgroup 0 from its
chunk GEMMs' wait to its last add; warpgroup 1 from KV_FREE to its last pair's adds, which holds
its pairs' GEMMs too), by neither, one or both: when neither adds, the SM sends the L2 only its
gathers. Where the patch stamps the global timer and a row's change, the rate clock64 runs at, each
CTA's entry and exit, each step from a row's last block to the next row's first, and how many CTAs
have adds under way at once over the kernel's time (the L2 takes reductions at its full rate from
about half the SMs: load_under_reds.py). The stamps
cost a store each and may move ptxas's schedule: the tool prints the traced call's main kernel
time beside the untraced one's for that reason (ours, the same shape).
"""

import argparse
import math
import os
import sys

import numpy as np

#: Events (wide.py in the patch): warpgroup 0's block starts (0), after its KV_FREE wait (1), the
#: gather landed (2), S done (3; dP's last GEMM may still run), dQ's GEMM issued (4), after its
#: PDS_FREE wait (5), P and dS handed over (6), its chunk GEMMs done (7), its adds done (8);
#: warpgroup 1's block starts (9), after its PDS_READY wait (10), after its KV_FREE arrival (11),
#: its first pair's adds done (12), after its PEAKS_READY wait and PDS_FREE arrival (13), its
#: chunks done (14), its bounds done (15).
#: Phases: (warpgroup, name, first event, last event, whether the last is the next block's).
PHASES = (
    (0, "wait for KV_FREE", 0, 1, False),
    (0, "slots, gather lands", 1, 2, False),
    (0, "S, gather's rest", 2, 3, False),
    (0, "P, dP's end, dS, dQ GEMM", 3, 4, False),
    (0, "wait for PDS_FREE", 4, 5, False),
    (0, "P and dS stored", 5, 6, False),
    (0, "its chunks' GEMMs", 6, 7, False),
    (0, "its chunks' adds", 7, 8, False),
    (0, "peaks, to next block", 8, 0, True),
    (1, "wait for PDS_READY", 9, 10, False),
    (1, "dQ GEMMs, first pair's", 10, 11, False),
    (1, "first pair's adds", 11, 12, False),
    (1, "pairs to PDS_FREE", 12, 13, False),
    (1, "last adds", 13, 14, False),
    (1, "chunks, adds (control)", 11, 14, False),  # where the pairs' stamps are absent
    (1, "bounds", 14, 15, False),
    (1, "to next block", 15, 9, True),
)
#: The events that open and close each warpgroup's block period.
PERIOD_EVENT = {0: 0, 1: 9}
#: Each warpgroup's four per-warp stamps (warp w at first + w), where its warps end their adds:
#: warpgroup 0's at event 8 (before the peaks' merge and PEAKS_READY), warpgroup 1's at event 14
#: (before the bounds' barrier).
WARP_EVENTS = {0: 20, 1: 16}
#: Each warpgroup's span of adds (first event, last event).
ADDS_SPANS = {0: (7, 8), 1: (11, 14)}
#: The clock64 events (block stamps and the warps'); a trace may hold more after them: the global
#: timer's nanoseconds beside events 0 and 15 (NS_EVENTS), and in block 0 each CTA's entry and each
#: warpgroup's exit, as (clock64, ns) pairs (ENTRY_EVENTS, EXIT_EVENTS).
CLOCK_EVENTS = 24
NS_EVENTS = {0: 24, 15: 25}
ENTRY_EVENTS, EXIT_EVENTS = (26, 27), {0: (28, 29), 1: (30, 31)}
#: A row's change, warpgroup by warpgroup: (event, in the row before's last block or the row's
#: first), in the order the warpgroup passes them; events 32-39 are the patch's row stamps (its
#: block count, waits and loads at a row's start, its dQ stores at a row's end), the others the
#: block stamps. A row's first block is one whose event 32 is stamped.
ROW_CHANGE = {
    0: ((8, "last"), (37, "last"), (32, "first"), (33, "first"), (34, "first"), (35, "first"), (36, "first"),
        (0, "first"), (6, "first")),
    1: ((13, "last"), (15, "last"), (38, "last"), (39, "first"), (9, "first"), (10, "first")),
}
ROW_EVENT_NAMES = {0: "block start", 6: "P and dS handed over", 8: "adds done", 9: "block start", 10: "PDS_READY passed",
                   13: "PDS_FREE arrived", 15: "bounds done", 32: "block count", 33: "KV_FREE passed",
                   34: "block 0's gather issued", 35: "PDS_FREE passed", 36: "Q, dO issued", 37: "dQ stored",
                   38: "dQ stored", 39: "item taken, block count"}
FIRST_OF_ROW = 32


def _span_matrix(trace: np.ndarray, first: int, last: int, next_block: bool) -> tuple:
    """(cycles, stamped): [CTAs, blocks] arrays (a block fewer with ``next_block``) of the cycles from
    event ``first`` of each block to event ``last`` of the same block (or of the block after it), and
    whether both were stamped."""
    start = trace[:, :-1, first] if next_block else trace[:, :, first]
    end = trace[:, 1:, last] if next_block else trace[:, :, last]
    return end - start, (start != 0) & (end != 0)


def _spans(trace: np.ndarray, first: int, last: int, next_block: bool) -> np.ndarray:
    """Cycles from event ``first`` of each traced block to event ``last`` of the same block (or,
    with ``next_block``, of the block after it), wherever both were stamped."""
    cycles, stamped = _span_matrix(trace, first, last, next_block)
    return cycles[stamped]


def row_starts_against_rest(trace: np.ndarray, blocks_per_row: int) -> list:
    """[(warpgroup, name, mean cycles in the rows' first blocks, in the others)] for each phase and
    each warpgroup's period ("period"), where every row of every CTA has ``blocks_per_row`` blocks
    (uniform indices), so that a CTA's block t is its row's first where t % blocks_per_row == 0."""
    rows = []
    spans = list(PHASES) + [(wg, "period", event, event, True) for wg, event in PERIOD_EVENT.items()]
    for wg, name, first, last, next_block in spans:
        cycles, stamped = _span_matrix(trace, first, last, next_block)
        first_block = (np.arange(cycles.shape[1]) % blocks_per_row == 0)[None, :]
        starts, rest = cycles[stamped & first_block], cycles[stamped & ~first_block]
        if starts.size and rest.size:
            rows.append((wg, name, float(starts.mean()), float(rest.mean())))
    return rows


def phase_cycles(trace: np.ndarray) -> dict:
    """{(warpgroup, phase name): cycles of every traced block where both its stamps are set}.
    ``trace`` is the patch's [CTAs, blocks, events] int64 clock64 stamps (0: not stamped). The
    control's warpgroup 1 has no pairs: one phase from KV_FREE to its chunks' end stands for the
    lanes' three."""
    found = {}
    for wg, name, first, last, next_block in PHASES:
        cycles = _spans(trace, first, last, next_block)
        if cycles.size:
            found[(wg, name)] = cycles
    if (1, "first pair's adds") in found:  # the lanes: their pairs' phases say it finer
        del found[(1, "chunks, adds (control)")]
    return found


def periods(trace: np.ndarray) -> dict:
    """{warpgroup: cycles from one block's start to the next's, over the traced blocks}."""
    return {wg: _spans(trace, event, event, next_block=True) for wg, event in PERIOD_EVENT.items()}


def adds_overlap(trace: np.ndarray) -> tuple:
    """(neither, one, both): shares of the CTAs' traced time (each CTA's first to last stamp) in
    which no warpgroup, one or both are within their span of adds (ADDS_SPANS)."""
    totals = np.zeros(3)
    for cta in trace:
        stamped = cta[cta != 0]
        if stamped.size == 0:
            continue
        lo, hi = int(stamped.min()), int(stamped.max())
        # (time, +1 opens a span, -1 closes one)
        edges = sorted(edge for start, end in _adds_spans(cta) for edge in ((start, 1), (end, -1)))
        depth, now = 0, lo
        for t, step in edges:
            totals[min(depth, 2)] += t - now
            depth, now = depth + step, t
        totals[min(depth, 2)] += hi - now
    whole = totals.sum()
    return tuple(totals / whole) if whole else (float("nan"),) * 3


def _adds_spans(cta: np.ndarray) -> list:
    """A CTA's [(start, end)] clock64 spans of adds (ADDS_SPANS), each warpgroup's in each block
    where both ends are stamped."""
    spans = []
    for first, last in ADDS_SPANS.values():
        ok = (cta[:, first] != 0) & (cta[:, last] != 0)
        spans += list(zip(cta[ok, first].tolist(), cta[ok, last].tolist()))
    return spans


def _adds_intervals(cta: np.ndarray) -> list:
    """A CTA's [start, end) clock64 intervals in which some warpgroup is within its span of adds,
    merged."""
    merged = []
    for lo, hi in sorted(_adds_spans(cta)):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def _timer_stamps(trace: np.ndarray) -> tuple | None:
    """(CTAs with an entry and both exits stamped, as a mask; and for those, their entry's clock64
    and ns, their last exit's clock64 and ns), or None where the trace has no timer stamps or no
    such CTA."""
    if trace.shape[2] <= max(max(EXIT_EVENTS.values())):
        return None
    head = trace[:, 0]
    entered = (head[:, ENTRY_EVENTS[0]] != 0) & (head[:, ENTRY_EVENTS[1]] != 0)
    exits = np.stack([head[:, list(pair)] for pair in EXIT_EVENTS.values()])  # [warpgroup, CTA, (clock, ns)]
    done = entered & (exits != 0).all(axis=(0, 2))
    if not done.any():
        return None
    return (done, head[done, ENTRY_EVENTS[0]], head[done, ENTRY_EVENTS[1]], exits[:, done, 0].max(axis=0),
            exits[:, done, 1].max(axis=0))


def ctas_adding(trace: np.ndarray) -> np.ndarray | None:
    """[n + 1] shares of the kernel's time (the earliest CTA entry to the last exit, by the global
    timer) in which exactly k of the n traced CTAs have adds under way, each CTA's clock64 placed on
    the global timer by its own entry and exit stamps (outside_blocks' rate); None where the trace
    has no timer stamps. The L2 takes its reductions at its full rate from about half the SMs
    (benchmarks/load_under_reds.py): the time with fewer adding is time it may idle."""
    stamps = _timer_stamps(trace)
    if stamps is None:
        return None
    done, clocks_in, ns_ins, clocks_out, ns_outs = stamps
    edges = []
    for c, clock_in, ns_in, clock_out, ns_out in zip(np.flatnonzero(done), clocks_in.tolist(), ns_ins.tolist(),
                                                     clocks_out.tolist(), ns_outs.tolist()):
        ns_per_cycle = (ns_out - ns_in) / (clock_out - clock_in)
        for lo, hi in _adds_intervals(trace[c, :, :CLOCK_EVENTS]):
            edges += [(ns_in + (lo - clock_in) * ns_per_cycle, 1), (ns_in + (hi - clock_in) * ns_per_cycle, -1)]
    start, end = float(ns_ins.min()), float(ns_outs.max())
    shares = np.zeros(int(done.sum()) + 1)
    depth, now = 0, start
    for t, step in sorted(edges):
        shares[depth] += t - now
        depth, now = depth + step, t
    shares[depth] += end - now
    return shares / (end - start)


def cta_spans(trace: np.ndarray) -> tuple:
    """(each traced CTA's cycles from its first stamp to its last, its blocks stamped)."""
    spans, blocks = [], []
    for cta in trace:
        stamped = cta[cta != 0]
        if stamped.size:
            spans.append(int(stamped.max() - stamped.min()))
            blocks.append(int((cta[:, PERIOD_EVENT[0]] != 0).sum()))
    return np.array(spans), np.array(blocks)


def warp_skew(trace: np.ndarray) -> dict:
    """{warpgroup: cycles from its first warp's end of adds to its last's, in each traced block where
    all four stamped}: how long the earliest warp waits at the barrier or handoff that follows."""
    skew = {}
    if trace.shape[2] < max(WARP_EVENTS.values()) + 4:
        return skew  # a trace without the warps' stamps
    for wg, first in WARP_EVENTS.items():
        ends = trace[:, :, first:first + 4]
        stamped = (ends != 0).all(axis=2)
        skew[wg] = (ends.max(axis=2) - ends.min(axis=2))[stamped]
    return skew


def outside_blocks(trace: np.ndarray) -> dict | None:
    """What the global timer says, where the trace has it (None where not): each CTA's clock64 rate
    in MHz (cycles over nanoseconds from its entry to its last exit), its cycles from entry to its
    first block's start and from its last block stamp to its exit, and in microseconds from the
    earliest CTA entry: each CTA's entry and exit."""
    stamps = _timer_stamps(trace)
    if stamps is None:
        return None
    done, clock_in, ns_in, clock_out, ns_out = stamps
    blocks = trace[done, :, :CLOCK_EVENTS]
    first_start = blocks[:, 0, PERIOD_EVENT[0]]
    last_stamp = np.where(blocks != 0, blocks, np.iinfo(np.int64).min).max(axis=(1, 2))
    origin = ns_in.min()
    return {"mhz": (clock_out - clock_in) / (ns_out - ns_in) * 1e3, "prologue": first_start - clock_in,
            "epilogue": clock_out - last_stamp, "entry_us": (ns_in - origin) / 1e3, "exit_us": (ns_out - origin) / 1e3}


def row_change(trace: np.ndarray) -> dict | None:
    """{warpgroup: [(from event, to event, cycles at each row's change)]} along ROW_CHANGE, over the
    changes where every step is stamped (None where the trace has no row stamps)."""
    if trace.shape[2] <= FIRST_OF_ROW:
        return None
    ctas, blocks = np.nonzero(trace[:, 1:, FIRST_OF_ROW])  # a row's first block, past the CTA's first
    blocks = blocks + 1
    found = {}
    for wg, steps in ROW_CHANGE.items():
        stamps = np.stack([trace[ctas, blocks - (where == "last"), event] for event, where in steps])
        stamped = (stamps != 0).all(axis=0)
        found[wg] = [(steps[i][0], steps[i + 1][0], (stamps[i + 1] - stamps[i])[stamped]) for i in range(len(steps) - 1)]
    return found


def report(trace: np.ndarray, kernel_ms: float = math.nan, blocks_per_row: int = 0) -> list:
    """The tool's table, as lines; ``kernel_ms``, the traced main kernel's time, gives the clock;
    ``blocks_per_row`` (uniform indices), the rows' first blocks against the rest."""
    timer, rows, adding = outside_blocks(trace), row_change(trace), ctas_adding(trace)
    trace = trace[:, :, :CLOCK_EVENTS]
    lines = []
    period = periods(trace)
    found = phase_cycles(trace)
    for wg in (0, 1):
        p = period[wg]
        median = float(np.median(p)) if p.size else float("nan")
        mean = float(np.mean(p)) if p.size else float("nan")
        lines.append(f"warpgroup {wg}: block period median {median:.0f} cycles, mean {mean:.0f}, over {p.size} blocks")
        for (owner, name), cycles in found.items():
            if owner != wg:
                continue
            q10, q50, q90 = np.percentile(cycles, (10, 50, 90))
            lines.append(f"  {name:<24} {q50:8.0f} cycles  (p10 {q10:.0f}, p90 {q90:.0f})  {q50 / median:6.1%} of the period"
                         f"  mean {np.mean(cycles):.0f}")
    spans, blocks = cta_spans(trace)
    if spans.size:
        per_block = spans / np.maximum(blocks, 1)
        line = (f"CTAs: {np.median(per_block):.0f} cycles a block (median over {spans.size} CTAs, first stamp to "
                f"last, rows' changes included), slowest CTA {spans.max():.0f} cycles over {blocks[spans.argmax()]} blocks")
        if not math.isnan(kernel_ms):
            line += f": {spans.max() / kernel_ms / 1e3:.0f} MHz over the traced kernel's {kernel_ms:.3f} ms"
        lines.append(line)
    for wg, cycles in warp_skew(trace).items():
        if cycles.size:
            q50, q90 = np.percentile(cycles, (50, 90))
            lines.append(f"warpgroup {wg}: its warps end their adds {q50:.0f} cycles apart (median; p90 {q90:.0f}, "
                         f"mean {cycles.mean():.0f})")
    if blocks_per_row > 1:
        lines.append(f"means, the rows' first blocks (one in {blocks_per_row}) against the others; what the first "
                     "blocks add to the mean period:")
        found_rows = row_starts_against_rest(trace, blocks_per_row)
        for wg, name, starts, rest in found_rows:
            lines.append(f"  warpgroup {wg} {name:<24} {starts:8.0f} against {rest:6.0f}  "
                         f"{(starts - rest) / blocks_per_row:+6.0f} a block")
    if timer is not None:
        q10, q50, q90 = np.percentile(timer["mhz"], (10, 50, 90))
        lines.append(f"global timer: clock64 runs at {q50:.0f} MHz (median over {timer['mhz'].size} CTAs; p10 {q10:.0f}, "
                     f"p90 {q90:.0f}); a CTA's entry to its first block {np.median(timer['prologue']):.0f} cycles, its "
                     f"last block stamp to its exit {np.median(timer['epilogue']):.0f} (medians; max "
                     f"{timer['prologue'].max():.0f} and {timer['epilogue'].max():.0f})")
        line = (f"  CTAs enter over {timer['entry_us'].max():.1f} us; they exit from {timer['exit_us'].min():.1f} us to "
                f"{timer['exit_us'].max():.1f} us after the first entry (median {np.median(timer['exit_us']):.1f})")
        if not math.isnan(kernel_ms):
            line += f", in a kernel of {kernel_ms * 1e3:.1f} us"
        lines.append(line)
    if rows is not None:
        for wg, steps in rows.items():
            changes = steps[0][2].size if steps else 0
            lines.append(f"warpgroup {wg} at a row's change (median and mean cycles over {changes} changes):")
            for first, last, cycles in steps:
                if cycles.size:
                    lines.append(f"  {ROW_EVENT_NAMES[first]:>24} -> {ROW_EVENT_NAMES[last]:<24} {np.median(cycles):7.0f} "
                                 f"{cycles.mean():7.0f}")
    neither, one, both = adds_overlap(trace)
    lines.append(f"dKV adds under way: neither warpgroup {neither:.1%}, one {one:.1%}, both {both:.1%} of the traced time")
    if adding is not None:
        n = adding.size - 1
        counts = np.arange(n + 1)
        quarters = ", ".join(f"fewer than {q * n // 4} {np.sum(adding[counts < q * n // 4]):.1%}" for q in (1, 2, 3))
        lines.append(f"CTAs with adds under way at once, of {n}: mean {np.dot(counts, adding):.1f}; share of the kernel's "
                     f"time with {quarters}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", required=True, help="the patched copy of mqa_bwd (scripts/ab-packages.sh)")
    parser.add_argument("--shape", default="B=1,S=4096,S_kv=8192,H=64,L=2048")
    parser.add_argument("--indices", default="uniform")
    parser.add_argument("--atomic", action="store_true", help="the control's launch instead of the lanes'")
    parser.add_argument("--save", help="write the stamps ([CTAs, blocks, events] int64, up to the last block stamped) "
                        "to this .npz file, compressed, as `stamps`")
    a = parser.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import importlib

    import torch
    from package_ab import load_package

    from mqa_bwd import bench, launch, wrapper
    from mqa_bwd.kernels.config import WIDE_SLOTS

    other = load_package(a.package)
    traced_launch, traced_wrapper = (importlib.import_module(f"{other.__name__}.{m}") for m in ("launch", "wrapper"))
    shape = bench.parse_shape(a.shape)
    args = bench.production_inputs(**shape, indices=a.indices)
    ours = launch.TileLangLauncher(not a.atomic)
    traced = traced_launch.TileLangLauncher(not a.atomic)
    for _ in range(3):  # compile and warm both
        wrapper.backward_with(ours, *args)
        traced_wrapper.backward_with(traced, *args)
    torch.cuda.synchronize()
    kernels = {}
    for label, launcher, run in (("untraced", ours, wrapper), ("traced", traced, traced_wrapper)):
        trace = bench.kernel_trace(lambda: run.backward_with(launcher, *args), calls=2)
        kernels[label] = sum(ms for name, ms, _ in trace if name.startswith("main_bwd"))
    traced_wrapper.backward_with(traced, *args)  # the stamps of a call outside the profiler
    torch.cuda.synchronize()
    stamps = traced.trace.cpu().numpy()
    print(f"{a.shape}, {a.indices} indices, {'control' if a.atomic else 'lanes'}: main kernel "
          f"{kernels['traced']:.3f} ms traced, {kernels['untraced']:.3f} untraced")
    if a.save:
        blocks = int(np.flatnonzero(stamps.any(axis=(0, 2))).max(initial=-1)) + 1
        np.savez_compressed(a.save, stamps=stamps[:, :blocks])
    # Uniform indices give every row all of its L slots, so each row has the same count of blocks.
    blocks_per_row = math.ceil(shape["L"] / WIDE_SLOTS) if a.indices == "uniform" else 0
    for line in report(stamps, kernels["traced"], blocks_per_row):
        print(line)


if __name__ == "__main__":
    main()
