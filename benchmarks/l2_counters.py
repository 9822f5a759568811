"""What one backward's main kernel asks of the L2: ncu's L2 counters, design beside design (GPU, ncu).

    python benchmarks/l2_counters.py [--designs fixed,atomic,cudnn] [--H 64] [--indices indexer] [--out DIR]

Both main kernels are bound by the L2 (ncu_stalls.py's speed-of-light section), where the
KV gather and the dKV adds meet. This says which of the L2's units is the limit and what
the adds cost it: for each design, ``benchmarks/one_call.py`` runs under ``ncu
--clock-control none`` and the profiled kernels of its last call print with

- the L2 throughput and its breakdown (the sub-metrics ncu takes its maximum of), the
  largest first;
- reduction requests and sectors (``red``: the adds), read requests and sectors (the
  gathers and loads), and the hit rate.

fixed and atomic profile the main_bwd launch of the last call; cudnn (where cuDNN-frontend
is installed) every kernel of the last call, inside its NVTX range.
"""

import argparse
import csv
import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
THROUGHPUT = "lts__throughput.avg.pct_of_peak_sustained_elapsed"
#: Those this GPU's ncu does not list (``--query-metrics``) are left out, not guessed.
COUNTERS = (
    "gpu__time_duration.sum",
    "lts__t_requests_srcunit_tex_op_red.sum",
    "lts__t_sectors_srcunit_tex_op_red.sum",
    "lts__t_requests_srcunit_tex_op_atom.sum",
    "lts__t_requests_srcunit_tex_op_read.sum",
    "lts__t_sectors_srcunit_tex_op_read.sum",
    "lts__t_sectors_op_red.sum",
    "lts__t_sector_hit_rate.pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
)


def raw_rows(text: str) -> list[dict]:
    """The kernels' rows of ncu's ``--page raw --csv`` output: metric name -> value (strings);
    the unit row that follows the header is skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if start is None:
        raise RuntimeError("no kernel rows in ncu's output:\n" + text[-2000:])
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    rows = list(reader)
    return [row for row in rows if row.get("ID", "").strip().isdigit()]


def number(value: str) -> float:
    return float(value.replace(",", "")) if value not in ("", "n/a") else float("nan")


def listed_counters() -> tuple:
    """COUNTERS whose base name this GPU's ncu lists."""
    listing = subprocess.run(["ncu", "--query-metrics"], check=True, capture_output=True, text=True).stdout
    names = {line.split()[0] for line in listing.splitlines() if line.strip() and "__" in line.split()[0]}
    return tuple(c for c in COUNTERS if c.split(".")[0] in names)


def one_call_program(design: str, calls: int, a) -> list:
    """benchmarks/one_call.py's command line for ``calls`` calls of ``design`` at a's shape and indices."""
    program = [sys.executable, os.path.join(HERE, "one_call.py"), "--design", design, "--calls", str(calls)]
    for key in ("B", "S", "S_kv", "H", "L", "indices"):
        program += [f"--{key}", str(getattr(a, key))]
    return program


def last_main_launch(design: str, calls: int, H: int) -> list:
    """ncu's filter for our design's first main_bwd launch of the last of ``calls`` calls."""
    sys.path.insert(0, HERE)
    from ncu_stalls import main_launches_per_call

    return ["-k", "regex:main_bwd", "--launch-skip", str((calls - 1) * main_launches_per_call(H, design)), "-c", "1"]


def profile(design: str, counters: tuple, a) -> list[dict]:
    calls = 3
    program = one_call_program(design, calls, a)
    metrics = ",".join((f"breakdown:{THROUGHPUT}", THROUGHPUT) + counters)
    if design == "cudnn":
        # Every kernel inside the last call's "backward" range (the first call compiles).
        select = ["--nvtx", "--nvtx-include", "backward/", "--launch-skip", "0"]
    else:
        select = last_main_launch(design, calls, a.H)
    log = os.path.join(a.out, f"{design}.csv")
    command = ["ncu", "--clock-control", "none", *select, "--metrics", metrics, "--csv", "--page", "raw",
               "--print-units", "base", "--log-file", log, *program]
    subprocess.run(command, check=True)
    with open(log) as f:
        rows = raw_rows(f.read())
    if design == "cudnn":  # the last call's kernels: as many as the call launches
        rows = rows[-(len(rows) // calls):]
    return rows


def print_rows(design: str, rows: list[dict], counters: tuple, top: int) -> None:
    for row in rows:
        name = row.get("Kernel Name", "?")[:60]
        ms = number(row.get("gpu__time_duration.sum", "nan")) / 1e6
        print(f"{design}: {name}  {ms:.3f} ms  L2 throughput {number(row.get(THROUGHPUT, 'nan')):.1f} %")
        parts = sorted(((number(v), k) for k, v in row.items() if k.startswith("lts__") and k != THROUGHPUT
                        and k.endswith("pct_of_peak_sustained_elapsed")), reverse=True)
        for value, key in parts[:top]:
            print(f"    {value:6.1f} %  {key}")
        for key in counters:
            print(f"    {key:<52} {number(row.get(key, 'nan')):>16,.1f}")


def main():
    sys.path.insert(0, os.path.dirname(HERE))
    from mqa_bwd.bench import INDEX_PATTERNS, add_shape_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--designs", default="fixed,atomic")
    add_shape_arguments(parser, repeats=None)
    parser.add_argument("--indices", choices=INDEX_PATTERNS, default="uniform", help="the top-k index pattern")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/l2_counters"))
    parser.add_argument("--top", type=int, default=6, help="breakdown entries to print")
    a = parser.parse_args()
    designs = a.designs.split(",")
    for design in designs:
        if design not in ("fixed", "atomic", "cudnn"):
            raise ValueError(f"--designs: {design!r} is none of fixed, atomic, cudnn")
    os.makedirs(a.out, exist_ok=True)
    counters = listed_counters()
    left_out = sorted(set(COUNTERS) - set(counters))
    if left_out:
        print(f"not listed by this ncu, left out: {', '.join(left_out)}")
    for design in designs:
        print_rows(design, profile(design, counters, a), counters, a.top)


if __name__ == "__main__":
    main()
