"""Where one main_bwd launch stalls, per SASS instruction (ncu source counters).

    python benchmarks/ncu_stalls.py profile --design fixed --H 64 --out DIR   # GPU, ncu
    python benchmarks/ncu_stalls.py summarize DIR/sass.csv [--top 25]                          # anywhere

``profile`` runs ``benchmarks/one_call.py`` under ``ncu --clock-control none``
with warp-state sampling and source counters on the first main_bwd launch of
the last call, and exports the per-instruction page as ``DIR/sass.csv`` (and
the section details as ``DIR/details.csv``). ``summarize`` reads that CSV and
prints:

- the stall reasons, as shares of all warp samples;
- the opcodes where warps stall, each with its three main reasons;
- shared-memory wavefronts against the ideal per opcode (bank conflicts);
- the instructions with the most samples, with their index in the listing;
- where each warpgroup waits (``handoffs``): the listing cut at its EXITs into the CTA's
  prologue and one region per warpgroup, each region's share of the samples, and the share
  of its samples at each mbarrier wait (named by the wide tile's handoffs, the out-of-line
  retry loops included), named barrier, wgmma wait, cp.async wait, global reduction and the
  rest of the add stretches (``adds`` below): a warpgroup that spends its samples waiting on
  the other's handoff is not the one that sets the pace;
- with ``DIR/details.csv`` beside the CSV: the floor the shared-memory data
  pipe sets (all shared wavefronts, wgmma operand reads included, at one
  per SM per cycle) against the launch's duration;
- what the launch asks of the L2 (``l2_traffic``): per global or local memory
  opcode, its sectors (ncu's theoretical count: excess from uncoalesced
  addresses included), requests and instructions, and, from details.csv,
  how busy ncu found the L2 and the DRAM: a launch at 80 % or more of the
  L2's throughput is bound by it, whatever its SM does.

``adds`` reads the same CSV for the stretches of straight-line code that issue global
reductions (the chunks' and pairs' adds): the listing cut at every wgmma, wgmma wait,
mbarrier, named barrier, cp.async wait and EXIT, each stretch with four reductions or more
listed with its samples per reduction (where a warp's time between two adds goes, in sampling
units), its stall reasons, the opcodes that hold its samples and its scoreboard waits traced
to the shuffle, shared load or global load that wrote the waiting instruction's registers;
``--lines`` prints the instructions of the stretches with most samples, each with its reasons:

    python benchmarks/ncu_stalls.py adds DIR/sass.csv [--lines 2]                            # anywhere

``compare`` sets profiles side by side (their totals, and each one's L2
view), e.g. the deterministic kernel, the atomic control and cuDNN's:

    python benchmarks/ncu_stalls.py profile --program "python3 -m mqa_bwd bench --backends cudnn --shape \
        B=1,S=4096,S_kv=8192,H=64,L=2048 --repeats 1" --kernel regex:dsa_bwd_sm90F --out DIR   # GPU, cuDNN's
    python benchmarks/ncu_stalls.py compare det=DIR1 atomic=DIR2 cudnn=DIR3                       # anywhere

Both wins of the 2026-11-30 stop came from this view: 4-way conflicted float2
stores of the dKV tile, and barriers that waited on global loads issued just
before them.
"""

import argparse
import collections
import csv
import math
import os
import re
import shlex
import subprocess
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
#: The per-instruction L2 counters: sectors of global and of local (spilled) memory, and requests.
L2_SECTORS, L2_EXCESS, L2_LOCAL = ("L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Excessive",
                                   "L2 Theoretical Sectors Local")
L2_REQUESTS = "L1 Tag Requests Global"
WAVEFRONTS, IDEAL = "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"
EXECUTED = "Instructions Executed"
SECTIONS = ("SpeedOfLight", "WarpStateStats", "SourceCounters", "SchedulerStats", "MemoryWorkloadAnalysis", "LaunchStats")
#: ncu scales units to the value; these bring them to GHz and ms.
TO_GHZ = {"hz": 1e-9, "khz": 1e-6, "mhz": 1e-3, "ghz": 1.0}
TO_MS = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}


def read_listing(path: str):
    """(header, rows) of ncu's ``--page source --csv --print-source sass`` export."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    for i, line in enumerate(lines):
        if "Address" in line and "Source" in line and SAMPLES in line:
            return line, [dict(zip(line, row)) for row in lines[i + 1 :] if len(row) >= len(line) // 2]
    raise ValueError(f"{path}: no per-instruction header with {SAMPLES!r} (export with --page source --print-source sass)")


def _number(value: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def opcode(sass: str, full: bool = False) -> str:
    """The mnemonic of one SASS line ("@P0 LDS.64 R1, [R2]" -> "LDS", or "LDS.64" when full)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    if not words:
        return ""
    return words[0] if full else words[0].split(".")[0]


def stall_columns(header) -> list:
    """The export's stall-reason columns ("stall_short_sb", ...), the "(Not Issued)" ones left out."""
    return [h for h in header if h.startswith("stall_") and "Not Issued" not in h]


def reason_name(column: str) -> str:
    """A stall column's reason ("stall_short_sb" -> "short_sb")."""
    return column[len("stall_"):]


def total_samples(rows) -> float:
    """The listing's warp samples (NaN where it has none, so that shares of it are NaN, not an error)."""
    return sum(_number(r[SAMPLES]) for r in rows) or math.nan


def stall_counts(rows, reasons) -> tuple:
    """(samples by stall reason, samples by opcode then reason) over ``rows``, for the ``reasons``
    columns (stall_columns)."""
    by_reason, by_opcode = collections.Counter(), collections.defaultdict(collections.Counter)
    for r in rows:
        op = opcode(r["Source"])
        for reason in reasons:
            v = _number(r[reason])
            by_reason[reason] += v
            by_opcode[op][reason] += v
    return by_reason, by_opcode


def summarize(header, rows, top: int = 25) -> dict:
    """The tables of the module docstring, as data (shares in percent of all samples)."""
    reasons = stall_columns(header)
    total = total_samples(rows)
    by_reason, by_opcode = stall_counts(rows, reasons)
    shared = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        if WAVEFRONTS in r and _number(r[WAVEFRONTS]) > 0:
            entry = shared[opcode(r["Source"], full=True)]
            entry[0] += _number(r[WAVEFRONTS])
            entry[1] += _number(r[IDEAL])
            entry[2] += _number(r.get(EXECUTED))
    ranked = sorted(range(len(rows)), key=lambda i: -_number(rows[i][SAMPLES]))[:top]
    return {
        "samples": total,
        "reasons": [(k, 100 * v / total) for k, v in by_reason.most_common() if v > 0],
        "opcodes": sorted(
            ((op, 100 * sum(c.values()) / total, [(k, 100 * v / total) for k, v in c.most_common(3) if v > 0])
             for op, c in by_opcode.items() if sum(c.values()) > 0),
            key=lambda x: -x[1]),
        # most excess wavefronts (bank conflicts) first
        "shared": sorted(((op, w, i, n) for op, (w, i, n) in shared.items()), key=lambda x: x[2] - x[1]),
        "top": [(i, rows[i]["Source"].strip(), 100 * _number(rows[i][SAMPLES]) / total,
                 [(k, 100 * _number(rows[i][k]) / total) for k in reasons if _number(rows[i][k]) > 0.002 * total])
                for i in sorted(ranked)],
    }


#: The wide tile's mbarriers from the first (kernels/wide.py's PDS_READY, KV_FREE, PDS_FREE, PEAKS_READY):
#: the names ``handoffs`` gives by default (``summarize --mbarriers`` gives others).
HANDOFFS = ("PDS_READY", "KV_FREE", "PDS_FREE", "PEAKS_READY")
#: Named barriers by id: the CTA's, then wide.py's GATHER_BARRIER and BOUNDS_BARRIER; others are TileLang's.
NAMED_BARRIERS = {0: "CTA barrier", 1: "gather barrier", 2: "bounds barrier"}
#: The global reductions' opcodes.
REDUCTIONS = ("RED", "REDG", "ATOMG")
_REGISTER = re.compile(r"^U?R(\d+|Z)$")


def _operands(sass: str) -> list:
    """The operands of one SASS line, predicate guard and mnemonic left out (as ``opcode`` reads them)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return [w.strip() for w in " ".join(words[1:]).split(",") if w.strip()]


def _mbarrier_address(sass: str):
    """(base registers, byte offset) of a SYNCS instruction's [address], e.g. ``[UR4+0x34208]`` ->
    (("UR4",), 0x34208); None for other instructions or an address of another form."""
    if not opcode(sass).startswith("SYNCS"):
        return None
    found = re.search(r"\[([^\]]*)\]", sass)
    if not found:
        return None
    base, offset = [], 0
    for term in re.findall(r"[+-]?[^+-]+", found.group(1).replace(" ", "")):
        sign, term = (-1, term[1:]) if term.startswith("-") else (1, term.lstrip("+"))
        if _REGISTER.match(term):
            if not term.endswith("Z"):
                base.append(term)
        elif re.fullmatch(r"0x[0-9a-fA-F]+|\d+", term):
            offset += sign * int(term, 0)
        else:
            return None
    return tuple(base), offset


def _wait_kind(sass: str, mbarrier) -> str | None:
    """What an instruction waits on, named (``mbarrier`` names a SYNCS wait's address); None for
    other instructions."""
    full = opcode(sass, full=True)
    if full.startswith("SYNCS.PHASECHK"):
        return f"wait {mbarrier(_mbarrier_address(sass))}"
    if full.startswith("BAR.SYNC") or full.startswith("BAR.RED"):
        ids = [w for w in _operands(sass) if not re.fullmatch(r"!?(P\d|PT|UP\d|UPT)", w)]
        if not ids or not re.fullmatch(r"0x[0-9a-fA-F]+|\d+", ids[0]):
            return "named barrier ?"
        bar = int(ids[0], 0)
        return NAMED_BARRIERS.get(bar, f"named barrier {bar}")
    if full.startswith("WARPGROUP.DEPBAR"):
        return "wgmma wait"
    if full.startswith("DEPBAR"):
        return "cp.async wait"
    if opcode(sass) in REDUCTIONS:
        return "global reductions"
    return None


def handoffs(rows, names=HANDOFFS) -> list:
    """[(region, share of all samples, [(what, share of the region's samples), ...])]: the listing
    cut at each EXIT (the first region split again at the last CTA-wide barrier before the first
    mbarrier wait, the prologue every thread runs); a region is named by the mbarriers its
    inline waits read, and the out-of-line retry loops after the last EXIT count in the region
    whose inline wait reads their mbarrier. An mbarrier is named from ``names`` by its offset
    from the lowest that SYNCS instructions address from the base register most of them use,
    where every such offset is one of len(names) consecutive 8-byte words; else by its base
    and that offset ("mbarrier ?" where the address has another form)."""
    addresses = [a for a in (_mbarrier_address(r["Source"]) for r in rows) if a is not None]
    lowest, uses = {}, collections.Counter(base for base, _ in addresses)
    for base, offset in addresses:
        lowest[base] = min(offset, lowest.get(base, offset))
    array = uses.most_common(1)[0][0] if uses else None  # the base that addresses the kernel's mbarriers
    named = {array} if array is not None and all(
        (o - lowest[array]) % 8 == 0 and (o - lowest[array]) // 8 < len(names) for b, o in addresses if b == array) else set()

    def mbarrier(address):
        if address is None:
            return "mbarrier ?"
        base, offset = address
        k = (offset - lowest[base]) // 8
        return names[k] if base in named else f"mbarrier {'+'.join(base) or '0'}+{offset - lowest[base]:#x}"

    waits = [i for i, r in enumerate(rows) if opcode(r["Source"], full=True).startswith("SYNCS.PHASECHK")]
    exits = [i for i, r in enumerate(rows) if opcode(r["Source"]) == "EXIT"]
    if not waits or not exits:
        return []
    cta_bars = [i for i in range(waits[0]) if _wait_kind(rows[i]["Source"], mbarrier) == "CTA barrier"]
    cuts = sorted({0, (cta_bars[-1] + 1) if cta_bars else 0} | {e + 1 for e in exits})
    spans = [(a, b) for a, b in zip(cuts, cuts[1:] + [len(rows)]) if a < b]
    tail = spans.pop() if spans and spans[-1][0] == exits[-1] + 1 else None
    owner, regions = {}, []
    for a, b in spans:
        mine = [mbarrier(_mbarrier_address(rows[i]["Source"])) for i in waits if a <= i < b]
        if regions and not mine and regions[-1][0] != "prologue":  # a warpgroup's code between two EXITs
            regions[-1][1].extend(range(a, b))
            continue
        for name in mine:
            owner.setdefault(name, len(regions))
        label = ("prologue" if not regions and a == 0 and cta_bars else
                 "waits on " + ", ".join(dict.fromkeys(mine)) if mine else f"lines {a}-{b - 1}")
        regions.append([label, list(range(a, b))])
    if tail:  # retry loops, each ending in a branch back: to the region whose inline wait reads its mbarrier
        regions.append(["after the last EXIT", []])
        block = []
        for i in range(*tail):
            block.append(i)
            sass = rows[i]["Source"].split()
            if i == tail[1] - 1 or (sass and sass[0] == "BRA"):
                wait = next((j for j in block if j in waits), None)
                name = None if wait is None else mbarrier(_mbarrier_address(rows[wait]["Source"]))
                regions[owner.get(name, len(regions) - 1)][1].extend(block)
                block = []
    total = total_samples(rows)
    adding = {i for first, last in _stretch_spans(rows) for i in range(first, last + 1)}
    out = []
    for label, lines in regions:
        if not lines:
            continue
        samples = sum(_number(rows[i][SAMPLES]) for i in lines)
        by = collections.Counter()
        for i in lines:
            kind = _wait_kind(rows[i]["Source"], mbarrier) or ("add stretches" if i in adding else "other")
            by[kind] += _number(rows[i][SAMPLES])
        out.append((label, 100 * samples / total, [(k, 100 * v / samples) for k, v in by.most_common() if v > 0]
                    if samples else []))
    return out


def read_details(path: str) -> dict:
    """(section, metric) -> (value, unit) of ncu's ``--page details --csv`` export (numbers
    without their thousands separators; rule rows, which have no unit column, are skipped)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    found = {}
    for r in rows:
        if r.get("Metric Name") and r.get("Metric Value") not in (None, ""):
            value = _number(r["Metric Value"].replace(",", ""))
            found[(r["Section Name"], r["Metric Name"])] = (value, (r.get("Metric Unit") or "").lower())
    return found


def launch_ms(details: dict):
    """The launch's duration in ms from ``read_details``' figures; None where it is missing or in
    a unit TO_MS does not know."""
    duration = details.get(("GPU Speed Of Light Throughput", "Duration"))
    return duration[0] * TO_MS[duration[1]] if duration and duration[1] in TO_MS else None


def shared_pipe(shared: list, details: dict) -> dict:
    """What the shared-memory data pipe costs the launch: its wavefronts (``summarize``'s
    "shared" rows), the share of them that wgmma operand reads take, and, where ``details``
    has the SM count, clock and duration, the time those wavefronts need at the pipe's
    peak of one per SM per cycle."""
    total = sum(w for _, w, _, _ in shared)
    gmma = sum(w for op, w, _, _ in shared if op.startswith("HGMMA"))
    result = {"wavefronts": total, "gmma_share": 100 * gmma / total if total else math.nan}
    sms, clock = (details.get(key) for key in (
        ("Launch Statistics", "# SMs"), ("GPU Speed Of Light Throughput", "SM Frequency")))
    ms = launch_ms(details)
    if sms and clock and ms is not None and clock[1] in TO_GHZ:
        ghz = clock[0] * TO_GHZ[clock[1]]
        result.update(sms=sms[0], ghz=ghz, duration_ms=ms, floor_ms=total / sms[0] / (ghz * 1e9) * 1e3)
    return result


#: details.csv's figures of the memory system that ``l2_traffic`` reports, by name.
MEMORY_DETAILS = {
    "l2_busy": ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    "dram_busy": ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    "l2_hit_rate": ("Memory Workload Analysis", "L2 Hit Rate"),
    "spill_requests": ("Memory Workload Analysis", "Local Memory Spilling Requests"),
}


def l2_traffic(rows, details: dict) -> dict:
    """What one launch asks of the L2: per full opcode with any global or local sectors,
    (opcode, sectors, excess sectors, local sectors, requests, instructions), most sectors
    first; their totals; and MEMORY_DETAILS's figures and the launch's duration_ms where
    ``details`` has them (percent of peak for l2_busy and dram_busy). Local sectors are spills:
    they reach the L2 whenever the L1 misses, which it mostly does beside a tile that fills
    shared memory."""
    by = collections.defaultdict(lambda: [0.0] * 5)
    for r in rows:
        sectors, local = _number(r.get(L2_SECTORS)), _number(r.get(L2_LOCAL))
        if sectors <= 0 and local <= 0:
            continue
        entry = by[opcode(r["Source"], full=True)]
        for k, value in enumerate((sectors, _number(r.get(L2_EXCESS)), local, _number(r.get(L2_REQUESTS)),
                                   _number(r.get(EXECUTED)))):
            entry[k] += value
    table = sorted(((op, *v) for op, v in by.items()), key=lambda x: -(x[1] + x[3]))
    totals = dict(zip(("sectors", "excess", "local", "requests", "instructions"),
                      (sum(x[k] for x in table) for k in range(1, 6))))
    found = {name: details[key][0] for name, key in MEMORY_DETAILS.items() if key in details}
    ms = launch_ms(details)
    if ms is not None:
        found["duration_ms"] = ms
    return {"opcodes": table, **totals, **found}


def print_l2(l2: dict, top: int = 8) -> None:
    if not l2["opcodes"]:
        print("\nL2: no sector counts in this export")
        return
    busy = ", ".join(f"{label} {l2[key]:.1f} %" for key, label in (
        ("l2_busy", "L2 throughput"), ("dram_busy", "DRAM throughput"), ("l2_hit_rate", "L2 hit rate")) if key in l2)
    spills = f" in {l2['spill_requests'] / 1e6:.1f}M requests" if "spill_requests" in l2 else ""
    print(f"\nL2: {l2['sectors'] / 1e6:.1f}M global sectors ({l2['excess'] / 1e6:.1f}M excess), {l2['local'] / 1e6:.1f}M "
          f"local (spills{spills}), {l2['requests'] / 1e6:.1f}M global requests" + (f"; {busy}" if busy else ""))
    print("opcode                               sectors   excess    local  requests  sectors/req  instructions")
    for op, sectors, excess, local, requests, n in l2["opcodes"][:top]:
        per = f"{sectors / requests:11.2f}" if requests else f"{'-':>11}"
        print(f"{op[:34]:<34} {sectors / 1e6:9.1f}M {excess / 1e6:7.1f}M {local / 1e6:7.1f}M {requests / 1e6:8.1f}M "
              f"{per} {n / 1e6:12.1f}M")


def print_summary(s: dict, top_opcodes: int = 15) -> None:
    print(f"{s['samples']:.0f} warp samples")
    print("stall reasons: " + ", ".join(f"{reason_name(k)} {v:.1f}%" for k, v in s["reasons"][:10]))
    print("\nopcode      share  main reasons")
    for op, share, main in s["opcodes"][:top_opcodes]:
        print(f"{op:<10} {share:5.1f}%  " + ", ".join(f"{reason_name(k)} {v:.1f}" for k, v in main))
    print("\nshared memory   wavefronts      ideal   x ideal   instructions")
    for op, w, i, n in s["shared"]:
        print(f"{op:<16} {w / 1e6:9.1f}M {i / 1e6:9.1f}M {w / i if i else math.inf:8.2f} {n / 1e6:11.1f}M")
    pipe = s.get("pipe")
    if pipe:
        floor = (f"; at one per SM per cycle ({pipe['sms']:.0f} SMs, {pipe['ghz']:.2f} GHz) {pipe['floor_ms']:.2f} ms of "
                 f"the launch's {pipe['duration_ms']:.2f} ms" if "floor_ms" in pipe
                 else " (no SM count, clock or duration in details.csv: no floor)")
        print(f"shared-memory pipe: {pipe['wavefronts'] / 1e6:.1f}M wavefronts, {pipe['gmma_share']:.1f} % of them wgmma "
              f"operand reads{floor}")
    if s.get("l2"):
        print_l2(s["l2"])
    if s.get("handoffs"):
        print("\nregion (the listing cut at its EXITs)        samples  where its samples are (mbarriers: the wide tile's "
              "names unless --mbarriers)")
        for label, share, parts in s["handoffs"]:
            print(f"{label[:44]:<44} {share:6.1f}%  " + ", ".join(f"{k} {v:.1f}%" for k, v in parts[:7]))
    print("\nline  samples  instruction  (reasons above 0.2%)")
    for i, sass, share, main in s["top"]:
        print(f"{i:5d} {share:6.2f}%  {sass[:60]:<60} " + ", ".join(f"{reason_name(k)} {v:.2f}" for k, v in main))


#: What ends a stretch of add code: the instructions a warp waits at for another unit or warp.
FENCES = ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "DEPBAR", "EXIT")
#: The opcodes whose results a scoreboard wait in an add stretch is traced to (``scoreboard_waits``).
PRODUCERS = ("SHFL", "LDS", "LDSM", "LDG", "LDL", "S2R", "MUFU")
_GPR = re.compile(r"\bR(\d+)\b")  # a general register operand's number (not UR, not RZ)


def _registers(sass: str) -> tuple:
    """(registers written, registers read) of one SASS line, as numbers: a load's .64 or .128
    writes 2 or 4, an [Rn.64] address reads Rn and Rn + 1, SHFL's first operand is a predicate,
    and stores and reductions write none."""
    op, ops = opcode(sass), _operands(sass)
    if not ops:
        return (), ()
    first = 1 if op == "SHFL" else 0
    if op in REDUCTIONS or op.startswith("ST"):
        written, read = [], ops
    else:
        written, read = [int(n) for n in _GPR.findall(ops[first])], ops[first + 1:]
        full = opcode(sass, full=True)
        width = 4 if ".128" in full else 2 if ".64" in full else 1
        if written and op.startswith("LD"):
            written = [written[0] + k for k in range(width)]
    numbers = [int(n) for o in read for n in _GPR.findall(o)]
    numbers += [int(n) + 1 for o in read for n in re.findall(r"\bR(\d+)\.64", o)]
    return tuple(written), tuple(numbers)


def scoreboard_waits(rows, lines) -> collections.Counter:
    """Samples of ``lines`` that wait on a scoreboard (short_sb, long_sb), by the opcode that last
    wrote one of the waiting instruction's registers within the lines, if it is one of PRODUCERS:
    {("short_sb", "SHFL"): samples, ...}; "other" where none is (a register written before the
    stretch, or a reduction that still holds its registers: ptxas reuses them)."""
    last, waits = {}, collections.Counter()
    for i in lines:
        written, read = _registers(rows[i]["Source"])
        for reason in ("stall_short_sb", "stall_long_sb"):
            v = _number(rows[i].get(reason))
            if v:
                found = {opcode(rows[last[n]]["Source"]) for n in read if n in last}
                waits[(reason, "+".join(sorted(found & set(PRODUCERS))) or "other")] += v
        for n in written:
            last[n] = i
    return waits


def _stretch_spans(rows, least: int = 4) -> list:
    """[(first row, last row)] of the stretches ``add_stretches`` describes."""
    cuts = [i for i, r in enumerate(rows) if opcode(r["Source"]) in FENCES]
    return [(a + 1, b - 1) for a, b in zip([-1] + cuts, cuts + [len(rows)])
            if sum(opcode(rows[i]["Source"]) in REDUCTIONS for i in range(a + 1, b)) >= least]


def add_stretches(header, rows, least: int = 4) -> list:
    """The listing's stretches of straight-line code with ``least`` global reductions or more: the
    rows between two FENCES. Each is a dict: first and last row, addresses, instructions,
    reductions, share (of all samples, percent), per_add (the stretch's samples per executed
    reduction), samples, reasons, opcodes and waits (each as [(name, percent of the stretch's samples)],
    opcodes with their main reason, waits as scoreboard_waits names them: "short_sb on SHFL")."""
    reasons = stall_columns(header)
    total = total_samples(rows)
    found = []
    for first, last in _stretch_spans(rows, least):
        lines = range(first, last + 1)
        reds = [i for i in lines if opcode(rows[i]["Source"]) in REDUCTIONS]
        samples = sum(_number(rows[i][SAMPLES]) for i in lines)
        executed = sum(_number(rows[i].get(EXECUTED)) for i in reds)
        by_reason, by_opcode = stall_counts([rows[i] for i in lines], reasons)
        share = lambda v: 100 * v / samples if samples else math.nan  # noqa: E731
        found.append({
            "first": first, "last": last, "addresses": (rows[first]["Address"], rows[last]["Address"]),
            "instructions": len(lines), "reductions": len(reds), "samples": samples, "share": 100 * samples / total,
            "per_add": samples / executed if executed else math.nan,
            "reasons": [(k, share(v)) for k, v in by_reason.most_common() if v > 0],
            "opcodes": sorted(((op, share(sum(c.values())), c.most_common(1)[0][0]) for op, c in by_opcode.items()
                               if sum(c.values()) > 0), key=lambda x: -x[1]),
            "waits": [(f"{reason_name(reason)} on {what}", share(v))
                      for (reason, what), v in scoreboard_waits(rows, lines).most_common()],
        })
    return found


def print_add_stretches(header, rows, lines: int = 0) -> None:
    stretches = add_stretches(header, rows)
    print("rows         addresses            instr  adds  samples  per add  main reasons (% of the stretch)")
    for s in stretches:
        print(f"{s['first']:5d}-{s['last']:<5d} {s['addresses'][0]:>9}-{s['addresses'][1]:<9} {s['instructions']:6d} "
              f"{s['reductions']:5d} {s['share']:7.2f}% {s['per_add']:8.3f}  "
              + ", ".join(f"{reason_name(k)} {v:.1f}" for k, v in s["reasons"][:6]))
        print("    opcodes: " + ", ".join(f"{op} {v:.1f} ({reason_name(k)})" for op, v, k in s["opcodes"][:8]))
        print("    scoreboard waits: " + ", ".join(f"{k} {v:.1f}" for k, v in s["waits"][:6]))
    reasons = stall_columns(header)
    for s in sorted(stretches, key=lambda s: -s["share"])[:lines]:
        samples = s["samples"] or math.nan
        print(f"\nrows {s['first']}-{s['last']}: samples (% of the stretch), instruction, reasons")
        for i in range(s["first"], s["last"] + 1):
            r = rows[i]
            main = sorted(((_number(r[k]), k) for k in reasons if _number(r[k]) > 0), reverse=True)[:3]
            print(f"{i:6d} {100 * _number(r[SAMPLES]) / samples:5.1f}  {r['Source'].strip()[:58]:<58} "
                  + ", ".join(f"{reason_name(k)} {100 * v / samples:.1f}" for v, k in main))


def main_launches_per_call(H: int, design: str) -> int:
    """main_bwd launches of one call (kernels.main_launches: one per head group, or per pair
    of groups or grid of wide tiles that runs as one launch), with the corrections launch and
    the gated int64 redo that follow a deterministic call's lanes launches (the same kernel name)."""
    from mqa_bwd import kernels

    block_h = 32 if H % 32 == 0 else 16  # the wrapper's default width (SPEC)
    groups = -(-H // block_h)
    launches = kernels.main_launches(groups, block_h, 576, 512, design == "fixed")
    return len(launches) + 2 * sum(config.accumulate == "lanes" for _, config in launches)


def profile(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    report = os.path.join(a.out, "report")
    if a.program:  # another program's kernel: its own launches, one a call
        kernel, skip, program = a.kernel, a.calls - 1, shlex.split(a.program)
    else:
        kernel, skip = "regex:main_bwd", (a.calls - 1) * main_launches_per_call(a.H, a.design)
        program = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "one_call.py"),
                   "--design", a.design, "--H", str(a.H), "--calls", str(a.calls)]
        for key in ("B", "S", "S_kv", "L"):
            program += [f"--{key}", str(getattr(a, key))]
    command = ["ncu", "--clock-control", "none", "-k", kernel, "--launch-skip", str(skip), "-c", "1", "-f", "-o", report]
    for section in SECTIONS:
        command += ["--section", section]
    command += program
    subprocess.run(command, check=True)
    for page, name in (("source", "sass.csv"), ("details", "details.csv")):
        extra = ["--print-source", "sass"] if page == "source" else []
        with open(os.path.join(a.out, name), "w") as f:
            subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", page, "--csv"] + extra, stdout=f, check=True)
    print(f"wrote {a.out}/sass.csv and {a.out}/details.csv")
    print_summary(summary_of(os.path.join(a.out, "sass.csv"), a.top))


def summary_of(listing: str, top: int, mbarriers=HANDOFFS) -> dict:
    """``summarize`` of an exported listing, with ``handoffs`` (mbarriers named by ``mbarriers``) and
    ``shared_pipe`` from the details.csv beside it if there is one."""
    header, rows = read_listing(listing)
    s = summarize(header, rows, top=top)
    s["handoffs"] = handoffs(rows, mbarriers)
    path = os.path.join(os.path.dirname(os.path.abspath(listing)), "details.csv")
    details = read_details(path) if os.path.exists(path) else {}
    s["pipe"] = shared_pipe(s["shared"], details)
    s["l2"] = l2_traffic(rows, details)
    return s


def compare(profiles: list, top: int = 6) -> None:
    """Profiles side by side: ``profiles`` is [(label, summary_of's dict)]; one line of totals
    each (launch time, warp samples, shared wavefronts, L2 sectors and requests, how busy the
    L2 was), then each one's L2 view."""
    print(f"{'profile':<12} {'ms':>7} {'samples':>9} {'shared':>9} {'L2 sectors':>11} {'local':>7} {'requests':>9} "
          f"{'L2 busy':>8} {'L2 busy ms':>10}")
    for label, s in profiles:
        pipe, l2 = s["pipe"], s["l2"]
        ms, busy = l2.get("duration_ms", math.nan), l2.get("l2_busy", math.nan)
        print(f"{label[:12]:<12} {ms:7.2f} {s['samples'] / 1e3:8.0f}k {pipe['wavefronts'] / 1e6:8.1f}M "
              f"{l2['sectors'] / 1e6:10.1f}M {l2['local'] / 1e6:6.1f}M {l2['requests'] / 1e6:8.1f}M {busy:7.1f}% "
              f"{ms * busy / 100:10.2f}")
    print("(L2 busy ms: the launch's time at the L2 throughput ncu measured, the time the same L2 work "
          "would take at its peak)")
    for label, s in profiles:
        print(f"\n== {label}", end="")
        print_l2(s["l2"], top)


def _profile_dir(text: str) -> tuple:
    """'label=DIR' (or a bare DIR, labelled by its name) -> (label, DIR/sass.csv)."""
    label, _, folder = text.rpartition("=")
    folder = folder or label
    listing = os.path.join(folder, "sass.csv")
    if not os.path.exists(listing):
        raise argparse.ArgumentTypeError(f"{folder}: no sass.csv (a folder that 'profile --out' wrote)")
    return label or os.path.basename(os.path.normpath(folder)), listing


def main():
    from mqa_bwd.bench import add_shape_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="run ncu on one main_bwd launch (GPU)")
    p.add_argument("--design", choices=("fixed", "atomic"), default="fixed")
    add_shape_arguments(p, repeats=None)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--program", help="profile this command's kernel instead of one_call.py's main_bwd (it must make "
                                      "--calls launches of --kernel, e.g. another revision's benchmarks/one_call.py)")
    p.add_argument("--kernel", default="regex:main_bwd", help="ncu's kernel filter for --program")
    p.add_argument("--out", required=True)
    p.add_argument("--top", type=int, default=25)
    s = sub.add_parser("summarize", help="the tables of an exported per-instruction CSV")
    s.add_argument("csv")
    s.add_argument("--top", type=int, default=25)
    s.add_argument("--mbarriers", type=lambda text: tuple(text.split(",")), default=HANDOFFS, metavar="NAME,...",
                   help="names of the kernel's mbarriers from the lowest address (default: the wide tile's, "
                        + ",".join(HANDOFFS) + ")")
    d = sub.add_parser("adds", help="the stretches of code that issue global reductions, where their samples go")
    d.add_argument("csv")
    d.add_argument("--lines", type=int, default=0, help="print the instructions of this many stretches (most samples first)")
    c = sub.add_parser("compare", help="profiles side by side: their totals and L2 views")
    c.add_argument("profiles", nargs="+", type=_profile_dir, metavar="LABEL=DIR")
    a = parser.parse_args()
    if a.command == "profile":
        profile(a)
    elif a.command == "adds":
        print_add_stretches(*read_listing(a.csv), lines=a.lines)
    elif a.command == "compare":
        compare([(label, summary_of(listing, top=1)) for label, listing in a.profiles])
    else:
        print_summary(summary_of(a.csv, a.top, a.mbarriers))


if __name__ == "__main__":
    main()
