"""``mqa-bwd``: the correctness gate, drift reproduction, fuzzing and the benchmark, as commands.

Exit codes, for every subcommand: 0 everything held; 1 something did not
(a property failed, a replay drifted or disagreed with the oracle, fuzzing
found a failure or a crash); 2 the command could not do its job (bad
argument, unreadable or damaged input, no GPU where one is needed).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from properties.plugin import DEFAULT_FAILURES_DIR, REGRESSIONS_DIR, SUITE_MODULE, add_finding_counts

from .console import LiveProgress, _fmt_seconds, _print_process_replay, _print_repro, _styled, make_console

#: The property suite, shipped in the package: it runs wherever mqa-bwd is installed.
DEFAULT_SUITE = Path(__file__).resolve().parent.parent / Path(*SUITE_MODULE.split(".")).with_suffix(".py")
PROFILES = ("ci", "dev", "fuzz", "repro")
MAX_HEADS = 128  # shown in --help; parse_heads enforces properties.strategies.MAX_HEADS
FUZZ_FAILURES_DIR = "fuzz-failures"
#: Where check keeps the pytest output of a run that did not hold, in its failures folder.
CHECK_LOG = Path("logs") / "check.log"
#: Fuzz rounds shorter than this are not worth a pytest start-up.
MIN_ROUND_S = 20.0

MAIN_HELP = """\
Correctness and determinism gate for the backward of sparse absorbed MQA with
an attention sink (docs/SPEC.md). Five jobs:

  check   run the property suite (ci profile) on the best backend here:
          the TileLang kernel on a Hopper GPU, the CPU tile model elsewhere
  repro   replay a failing case, or tensors captured from a training step,
          N times: bitwise verdict per output, error against the oracle
  fuzz    run the properties for M minutes with many random cases, one
          worker per GPU; every failure and crash saved as a replayable file
  bench   time the deterministic backward against the atomic one (GPU)
  promote make a saved failing case one of the suite's replayed regressions

Run 'mqa-bwd COMMAND --help' for what each prints and its options.
Exit codes: 0 all held, 1 something failed, 2 could not run (bad input, no GPU).
"""

CHECK_HELP = """\
Runs every property of the suite (properties/test_properties.py, shipped in
the package) under the 'ci'
Hypothesis profile (derandomized, fixed example counts), shows progress per
property, and ends with a table: property x verdict x cases x time. Exit 0
only when every property that ran holds; 1 when one fails; 2 when none ran
(every one skipped, none selected by -k, arguments the suite refuses) or a
signal stopped the run first.

A failing property's report (worst elements, ULP distances, a REPRO line) is
printed after the table, and each failing case is saved as JSON in
.mqa-failures/ (in the working directory) or in --failures-dir;
'mqa-bwd repro FILE' replays it, and 'mqa-bwd promote FILE' makes it one of
the regressions every later run replays first. The full pytest output of a
run that does not hold is kept there too, as logs/check.log (replaced by the
next such run; a run that holds writes none), and each failed property's
report as reports/NAME.txt: its first failing case as soon as it fails, the
whole (shrunk) report as the property ends (a run stopped later, even while
shrinking, keeps a case to replay).

Another implementation is drawn only inside its domain: what it declares as
its function's 'domain' attribute (mqa_bwd.contract.Domain), with the fields
--domain names replaced. How it behaves just outside each boundary is probed
once at the end and printed as findings (a ValueError naming the argument is
the right answer), never as failures. --buckets takes shapes from a few fixed
buckets (a kernel that compiles per shape compiles once per bucket);
--minutes-per-property ends a property that has found nothing by then (it
passes, saying how many cases it ran); --known-failures FILE is the ledger of
properties known to fail (reported as known failures; an unexpected pass
fails). On a GPU, determinism_at_scale reruns one production-shape call.

examples:
  mqa-bwd check                              best backend on this machine
  mqa-bwd check --backend model              the CPU tile model
  mqa-bwd check --impl mypkg.ops:bwd         any function with the SPEC signature
  mqa-bwd check --impl mypkg.ops:bwd --domain heads=16-128,topk_multiple=64
  mqa-bwd check --impl mypkg.ops:bwd --buckets --minutes-per-property 2
  mqa-bwd check --known-failures known-failures.toml
  mqa-bwd check --profile dev -k agreement   a quick loop on one property
  mqa-bwd check -- -x                        extra pytest arguments after --
"""

REPRO_HELP = """\
Replays one call of the backward N times (default 100) on the same tensors
and reports, per output (dq, dkv, d_attn_sink): bitwise identical or not, how
many distinct results, the first run and element that differ from run 0 (with
both values), the largest absolute and ULP distance, and the error of run 0
against the float64 oracle by the tolerance rule (2x the bf16 baseline's error
plus a float32 floor).

SOURCE is one of:
  a case JSON          a bare Case dict, or a failure file from check/fuzz
                       ({"case": ..., "property": ..., "backend": ..., ...})
  a capture            tensors saved from a training step with
                       mqa_bwd.capture.save(path, query=..., kv=..., ...);
                       a damaged or incomplete capture is refused, naming why

A failure file of any property but determinism and agreement (which the
reruns and the oracle check) also replays that property on the recorded case
(in the domain the file records) and ends with its verdict: exit 1 while it
still fails.

A call the implementation refuses with a ValueError (the case, or options
such as --dkv-buf-bytes, outside what it accepts) is bad input: REFUSED, with
its reason, and exit 2.

--processes N replays the call once in each of N fresh processes instead
(process 0 runs it first thing; process k first allocates and frees tensors
of sizes drawn from k and runs small other calls, so that its buffers and
its kernels' order differ) and prints each output's SHA-256 per process and
which processes agree.

The backend defaults to the one the source names (failure files, captures),
else the best one here. --against runs a second implementation on the same
tensors and shows how far the two are apart and which one drifts.

examples:
  mqa-bwd repro fuzz-failures/crash-gw0-1234.safetensors
  mqa-bwd repro case.json --runs 1000 --backend tilelang
  mqa-bwd repro step1234.safetensors --against tilelang-atomic --json report.json
  mqa-bwd repro step1234.safetensors --processes 4     the same call in 4 fresh processes
"""

FUZZ_HELP = """\
Runs the properties under the 'fuzz' profile (many random cases) for
--minutes, through pytest-xdist with one worker per GPU (worker i pinned with
CUDA_VISIBLE_DEVICES=i); on the CPU model where there is no GPU. Shows live
progress (cases tried, failures, crashes) and ends with a table per property.

Every failure is saved in --failures-dir: failing cases as JSON (by the
property suite), crashes as captures. Each call's inputs are written before
the call runs, so a worker that dies (illegal memory access, abort) loses no
case: its record becomes crash-*.safetensors. Replay any of them with
'mqa-bwd repro FILE'. Exit 0 when nothing failed or crashed.

--domain, --buckets and --known-failures work as for 'check'; the probe just
outside the domain runs once, in the first round.

examples:
  mqa-bwd fuzz --heads 1-64 --minutes 30       all GPUs, heads 1..64
  mqa-bwd fuzz --heads 1-16 --workers 1        one GPU (or the CPU model)
  mqa-bwd fuzz --backend model --minutes 2     the CPU tile model
"""

PROMOTE_HELP = """\
Copies one saved failing case into the suite's regressions folder, which
every later run of the suite replays first, before any generated case (in a
source checkout: properties/regressions/, to commit with the fix). The case
is checked first: a file that is not a case is refused. Failure files keep
their property (and report); the name is <property>-<hash>.json.

examples:
  mqa-bwd promote .mqa-failures/determinism-3f2a9c1b7d0e.json
  mqa-bwd promote case.json --property memory_safety
"""

BENCH_HELP = """\
Times the deterministic backward ('tilelang') against the atomic variant
('tilelang-atomic') and cuDNN-frontend's DSA backward ('cudnn', when the
'cudnn' extra is installed) on one GPU: median ms of CUDA-event-timed repeats
(interleaved, after warm-up), TFLOP/s by docs/SPEC.md's count, peak scratch GiB,
the ratios det/atomic and det/cuDNN, the queued ms (a call's cost where the host
runs ahead of the GPU, as in a training step: calls enqueued back to back behind
a spin of the stream) with its det/cuDNN, the relative L2 distance of each backend's
outputs from the first's (a fast variant that skips work shows as DISAGREE),
and per output (dq, dkv, d_attn_sink) the relative L2 error against a float64
reference, with the largest ratio to the atomic control's error (OVER: above
1.1, issue 30's admissibility standard). Prints a table; --json writes the
rows, --plot a PNG of time against H or L, --trace each backend's GPU kernels and
its main kernel (the longest) beside the others'.

shapes:
  dsv32   B=1 S=4096 S_kv=8192 L=2048, H=64 and H=128  (default)
  fleet   B=1 S=8192 S_kv=8192 H=64 L=640
  causal  B=1 S=4096 S_kv=4096 H=64 L=2048 (S = S_kv, as in training)
  --shape B=1,S=4096,S_kv=8192,H=32,L=2048   any shape (repeatable)
  --sweep H=16,32,64,128                     each shape at these H (or L=...)

indices (--indices, each shape with each; the table shows the pattern and the
share of a row's slots that the previous query row also names):
  uniform   L independent uniform draws over the row's visible kv rows (default):
            neighbouring rows share almost nothing, the worst case for reuse; a
            row may name a kv row twice
  distinct  L different visible kv rows drawn uniformly: as uniform, but no row
            names a kv row twice (as with a real indexer)
  indexer   the L best of one score per kv row plus per-row noise, as DSA's
            indexer picks them: distinct, neighbouring rows share most

examples:
  mqa-bwd bench --shapes dsv32,fleet --json bench.json
  mqa-bwd bench --shapes dsv32 --indices uniform,distinct,indexer
  mqa-bwd bench --shapes fleet --sweep H=8,16,32,64,128 --plot time-vs-h.png
  mqa-bwd bench --shapes fleet --trace 3          each backend's GPU kernels too
  mqa-bwd bench --from-json bench.json --plot time-vs-h.png     no GPU needed
"""


# ---------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------


def parse_index_patterns(text: str) -> tuple:
    """'uniform,indexer' -> ('uniform', 'indexer'): bench.INDEX_PATTERNS, each once."""
    from .bench import INDEX_PATTERNS

    patterns = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in patterns if p not in INDEX_PATTERNS]
    if unknown or not patterns:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(INDEX_PATTERNS)}, got {text!r}")
    return patterns


def parse_heads(text: str) -> tuple:
    """'1-64' or '8' -> (lo, hi), 1 <= lo <= hi <= 128: the plugin's own rule."""
    from properties.strategies import parse_heads as parse

    try:
        return parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_domain(text: str) -> str:
    """A Domain text ('heads=2-128,topk_multiple=64', 'spec'), checked here and passed on as given."""
    from .contract import Domain

    try:
        Domain.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--domain: ")) from None
    return text


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


positive_int = _positive(int)
positive_float = _positive(float)


def _backend_choice(text: str) -> str:
    from .backends import BACKENDS

    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(BACKENDS)}, got {text!r}")
    return text


# ---------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="mqa-bwd", description=MAIN_HELP, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def suite_options(p, failures_default):
        p.add_argument("--backend", type=_backend_choice, help="tilelang, tilelang-atomic, model or "
                       "model-atomic, passed as backend= (default: the best one here)")
        p.add_argument("--impl", metavar="MODULE:FUNCTION", help="test this function (SPEC signature) "
                       "instead of ours; imported from the Python path as given")
        p.add_argument("--heads", type=parse_heads, metavar="LO-HI", help="restrict the head counts drawn "
                       f"(1..{MAX_HEADS})")
        p.add_argument("--repeats", type=positive_int, metavar="N", help="reruns per example in the "
                       "determinism property")
        p.add_argument("--failures-dir", type=Path, metavar="DIR", help="where failing cases are saved "
                       f"(default: {failures_default})")
        p.add_argument("--domain", type=parse_domain, metavar="TEXT",
                       help="what the implementation supports, e.g. heads=2-128,topk_multiple=64,sink=required "
                            "(fields: heads, heads_multiple, topk_min, topk_multiple, widths=576x512+512x512, "
                            "batch_max, sink, invalid_indices, causal_indices, frameworks); these replace the "
                            "fields its domain attribute declares; 'spec': all of SPEC")
        p.add_argument("--buckets", action="store_true", help="shapes from a small fixed set of buckets, so that "
                       "a kernel that compiles per shape compiles once per bucket")
        p.add_argument("--known-failures", type=Path, metavar="FILE", help="ledger of properties known to fail "
                       "(TOML or JSON, each entry with its reason): reported as known failures; an unexpected "
                       "pass fails")
        p.add_argument("-k", dest="keyword", metavar="EXPR", help="only properties matching this pytest -k expression")
        p.add_argument("--tests", type=Path, default=None, metavar="PATH",
                       help=f"the property suite to run (default: the installed {SUITE_MODULE})")
        p.add_argument("pytest_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    check = sub.add_parser("check", help="run the correctness gate (ci profile) on the best backend",
                           description=CHECK_HELP, formatter_class=fmt)
    suite_options(check, f"{DEFAULT_FAILURES_DIR}/ in the working directory")
    check.add_argument("--profile", choices=PROFILES, default="ci", help="Hypothesis profile (default: ci)")
    check.add_argument("--workers", type=positive_int, default=1, metavar="N",
                       help="pytest-xdist workers (default 1; on GPUs, worker i is pinned to GPU i mod count)")
    check.add_argument("--summary-json", type=Path, metavar="PATH", help="keep the suite's summary JSON here")
    check.add_argument("--minutes-per-property", type=positive_float, metavar="M",
                       help="end each property after M minutes without a failure (it passes, saying so)")
    check.set_defaults(handler=cmd_check)

    promote = sub.add_parser("promote", help="make a saved failing case a replayed regression of the suite",
                             description=PROMOTE_HELP, formatter_class=fmt)
    promote.add_argument("source", type=Path, metavar="FILE", help="a failure file from check or fuzz, or Case JSON")
    promote.add_argument("--property", metavar="NAME", help="replay it for this property only (default: the "
                         "property the failure file names; all properties for bare Case JSON)")
    promote.add_argument("--regressions-dir", type=Path, default=REGRESSIONS_DIR, metavar="DIR",
                         help=f"the suite's regressions, created if missing (default: {REGRESSIONS_DIR})")
    promote.set_defaults(handler=cmd_promote)

    repro = sub.add_parser("repro", help="replay a case or a capture N times: determinism and accuracy",
                           description=REPRO_HELP, formatter_class=fmt)
    repro.add_argument("source", type=Path, metavar="SOURCE", help="case JSON, failure file or capture")
    repro.add_argument("--runs", type=positive_int, default=100, metavar="N", help="reruns (default 100)")
    repro.add_argument("--processes", type=positive_int, metavar="N", help="instead of reruns in this process: "
                       "one call in each of N fresh processes, each with its own allocator history, compared "
                       "by the SHA-256 of the outputs")
    repro.add_argument("--backend", type=_backend_choice, help="backend to replay on, passed as backend= "
                       "(default: the one the source names, else the best one here)")
    repro.add_argument("--impl", metavar="MODULE:FUNCTION", help="replay on this function (SPEC signature) "
                       "instead of ours")
    repro.add_argument("--against", metavar="BACKEND|cudnn|MODULE:FUNCTION",
                       help="also replay on this implementation and compare the two ('cudnn': "
                            "cuDNN-frontend's DSA backward, mqa_bwd.cudnn, where .[cudnn] is installed)")
    repro.add_argument("--block-h", type=int, choices=(16, 32), help="head-group width of the call")
    repro.add_argument("--dkv-buf-bytes", type=positive_int, metavar="BYTES", help="scratch budget of the call")
    repro.add_argument("--framework", choices=("torch", "paddle"), help="hand the tensors over in this "
                       "framework (default: as recorded, else torch)")
    repro.add_argument("--device", help="device for --impl (default: cuda when available, else cpu)")
    repro.add_argument("--no-oracle", action="store_true", help="skip the float64 oracle (slow at "
                       "production shapes on a CPU)")
    repro.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    repro.set_defaults(handler=cmd_repro)

    fuzz = sub.add_parser("fuzz", help="fuzz the properties for M minutes across GPUs",
                          description=FUZZ_HELP, formatter_class=fmt)
    suite_options(fuzz, FUZZ_FAILURES_DIR + "/")
    fuzz.add_argument("--minutes", type=positive_float, default=10.0, metavar="M", help="time budget (default 10)")
    fuzz.add_argument("--workers", type=positive_int, metavar="N",
                      help="pytest-xdist workers (default: one per GPU, or 1 on the CPU model)")
    fuzz.add_argument("--seed", type=int, help="Hypothesis seed of the first round (default: random)")
    fuzz.set_defaults(handler=cmd_fuzz)

    bench = sub.add_parser("bench", help="time deterministic vs atomic backward (GPU)",
                           description=BENCH_HELP, formatter_class=fmt)
    bench.add_argument("--shapes", action="append", default=[], metavar="SET[,SET]",
                       help="named shape sets: dsv32, fleet, causal (repeatable or comma-separated)")
    bench.add_argument("--shape", action="append", default=[], metavar="B=..,S=..,S_kv=..,H=..,L=..",
                       help="any shape (repeatable)")
    bench.add_argument("--sweep", metavar="H=v,.. | L=v,..", help="measure each shape at these H or L values")
    bench.add_argument("--d-k", type=positive_int, default=576, help="query/key width (default 576)")
    bench.add_argument("--d-v", type=positive_int, default=512, help="value width (default 512)")
    bench.add_argument("--backends", default=None, metavar="B[,B]",
                       help="comma-separated, of tilelang, tilelang-atomic, cudnn (default: all three, cudnn "
                       "skipped with its reason when not installed); the first is the reference for the "
                       "agreement column")
    bench.add_argument("--indices", type=parse_index_patterns, default=("uniform",), metavar="P[,P]",
                       help="top-k index patterns, each shape measured with each: uniform (default), distinct, "
                       "indexer")
    bench.add_argument("--warmup", type=positive_int, default=3, help="untimed calls per backend (default 3)")
    bench.add_argument("--repeats", type=positive_int, default=10, help="timed calls per backend (default 10)")
    bench.add_argument("--trace", type=positive_int, metavar="CALLS",
                       help="also profile CALLS more calls of each backend and print its GPU kernels "
                            "(torch profiler, each kernel's median over the calls): where each backend's time goes, "
                            "then each backend's main kernel (its longest) side by side")
    bench.add_argument("--block-h", type=int, choices=(16, 32), help="head-group width")
    bench.add_argument("--dkv-buf-bytes", type=positive_int, metavar="BYTES", help="scratch budget")
    bench.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON here")
    bench.add_argument("--plot", type=Path, metavar="PNG", help="write a PNG of time against H or L "
                       "(needs matplotlib: the 'plot' extra)")
    bench.add_argument("--from-json", type=Path, metavar="PATH", help="measure nothing: show (and --plot) the "
                       "rows of an earlier --json file, e.g. on a machine without a GPU")
    bench.set_defaults(handler=cmd_bench)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # 'module:function' in the current directory is importable, as with 'python -m' (the console script's
    # own sys.path starts at its bin folder); pytest children get it through PYTHONPATH.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return args.handler(args)
    except (ValueError, OSError) as e:
        print(f"mqa-bwd {args.command}: error: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------
# check and fuzz: shared set-up
# ---------------------------------------------------------------------------


def _suite_path(args) -> Path:
    tests = args.tests or DEFAULT_SUITE
    if not tests.exists():
        raise ValueError(f"--tests: the property suite {str(tests)!r} does not exist (run from a clone of the "
                         "project, or point --tests at a suite)")
    return tests.resolve()


def _suite_cwd(tests: Path) -> Path:
    """A source checkout's root for its own suite (so the project's pytest settings load), else the
    suite's folder."""
    checkout = _checkout_of(tests)
    return checkout if checkout is not None else tests.parent


def _checkout_of(tests: Path) -> Path | None:
    for folder in tests.parents:
        if (folder / "pyproject.toml").is_file() and (folder / "properties").is_dir():
            return folder
    return None


def _isolation_args(tests: Path) -> list:
    """An installed suite runs with no configuration file: whatever project the caller's virtualenv
    lives in, its pytest settings do not apply to the gate."""
    if _checkout_of(tests) is not None:
        return []
    return ["-c", os.devnull, "--rootdir", str(tests.parent)]


def _resolve_target(args) -> tuple:
    """(backend, impl or None, needs_gpu) after checking that this machine can run them."""
    from . import backends

    backend = args.backend
    if args.impl:
        from .repro import import_function

        function = import_function(args.impl, "--impl")  # fail here, cleanly, rather than inside every worker
        if backend is None and not callable(getattr(function, "default_backend", None)):
            # A function that does not say how it picks a backend gets no backend= (it may take none, as
            # cuDNN's adapter); its tensors go where a GPU is.
            return None, args.impl, _cuda_available()
    backend = backend or backends.default_backend()  # what the suite would pick, made explicit
    if backend.startswith("tilelang") and not backends.hopper_available():
        raise ValueError(f"--backend: {backend!r} needs a Hopper GPU (sm_90) and tilelang; this machine has none "
                         "(use --backend model for the CPU tile model)")
    return backend, args.impl, backend.startswith("tilelang")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _known_failures(args) -> Path | None:
    """The ledger, read once here so that a bad one is refused before pytest starts."""
    if not args.known_failures:
        return None
    from properties import ledger

    ledger.load(args.known_failures, option="--known-failures")
    return args.known_failures.resolve()


def _extra_pytest_args(args) -> list:
    extra = list(args.pytest_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.keyword:
        extra = ["-k", args.keyword] + extra
    return extra


def _new_files(directory: Path, before: set) -> list:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and p not in before and not p.name.startswith(".")
                  and p.suffix in (".json", ".safetensors"))


# ---------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------


def cmd_check(args) -> int:
    from . import fuzz

    console = make_console()
    tests = _suite_path(args)
    backend, impl, needs_gpu = _resolve_target(args)
    gpus = fuzz.count_gpus() if needs_gpu else 0
    # Failing cases go to an untracked folder; 'mqa-bwd promote' makes one a replayed regression.
    failures_dir = (args.failures_dir or DEFAULT_FAILURES_DIR).resolve()
    before = set(failures_dir.iterdir()) if failures_dir.is_dir() else set()
    known_failures = _known_failures(args)
    target = " with ".join(filter(None, (impl, f"backend {backend!r}" if backend else None)))
    console.print(f"mqa-bwd check: profile {args.profile!r} on {target}, suite {tests}"
                  + (f", {args.workers} workers" if args.workers > 1 else "")
                  + (", shapes from buckets" if args.buckets else "")
                  + (f", {args.minutes_per_property:g} min per property" if args.minutes_per_property else ""),
                  markup=False)
    with tempfile.TemporaryDirectory(prefix="mqa-bwd-check-") as tmp:
        tmp = Path(tmp)
        (tmp / "progress").mkdir()
        summary_path = args.summary_json or tmp / "summary.json"
        command = fuzz.build_pytest_command(
            tests, profile=args.profile, summary_json=summary_path.resolve(),
            failures_dir=failures_dir.resolve(),
            backend=backend, impl=impl, heads=args.heads, repeats=args.repeats, workers=args.workers, gpus=gpus,
            domain=args.domain, buckets=args.buckets, minutes_per_property=args.minutes_per_property,
            known_failures=known_failures, extra=_isolation_args(tests) + _extra_pytest_args(args))
        budget = f", {args.minutes_per_property:g} min per property" if args.minutes_per_property else ""
        with LiveProgress(console, f"check ({args.profile}{budget})") as view:
            run = fuzz.run_suite(command, cwd=_suite_cwd(tests), progress_dir=tmp / "progress", records_dir=None,
                                 log_path=tmp / "pytest.log", summary_json=summary_path, on_update=view.update)
        return _check_report(console, run, failures_dir, before, summary_path)


def _check_report(console, run, failures_dir: Path, before: set, summary_path: Path) -> int:
    from rich.table import Table

    from . import fuzz
    from .console import print_outside_domain, verdict_cells

    properties = (run.summary or {}).get("properties", {})
    skip_reasons = {p.name: p.reason for p in run.progress.values() if p.reason}
    cells = {name: verdict_cells(result, skip_reasons.get(name)) for name, result in properties.items()}
    stopped = _cut_short(run, properties)
    for name, progress in stopped.items():
        # The suite counts a test's cases when it ends: a test stopped while it ran counts none.
        cells[name] = ("stopped", f"interrupted while it ran, after {progress.cases} cases")
        properties[name] = {**properties[name], "cases": progress.cases}
    if stopped and Path(summary_path).is_file():  # the summary JSON keeps what the table shows
        from .files import write_json_atomic

        write_json_atomic(summary_path, {**run.summary, "properties": properties})
    with_notes = any(note for _, note in cells.values())
    table = Table(title="mqa-bwd check", title_justify="left")
    for column, justify in (("property", "left"), ("verdict", "left"), ("cases", "right"), ("time", "right")):
        table.add_column(column, justify=justify)
    if with_notes:
        table.add_column("notes", justify="left")
    for name, result in sorted(properties.items()):
        verdict, note = cells[name]
        row = [name, _styled(verdict), str(result.get("cases", "")), _fmt_seconds(result.get("seconds"))]
        table.add_row(*row, *([note] if with_notes else []))
    if properties:
        console.print(table)
    if run.summary:
        domain = run.summary.get("domain") or {}
        if domain.get("source") not in (None, "spec"):
            console.print(f"domain: {domain.get('text')} ({domain.get('source')}); cases were drawn inside it",
                          markup=False)
        print_outside_domain(console, run.summary)
    verdicts = [str(r.get("verdict")) for r in properties.values()]
    failed = "fail" in verdicts or run.returncode == 1
    held = run.returncode == 0 and not failed and ("pass" in verdicts or "xfail" in verdicts)
    kept = None if held else _keep_log(console, run.log_path, failures_dir)
    if run.summary is None:
        console.print(f"the property suite wrote no summary (pytest exit code {run.returncode}); "
                      f"the end of its output:\n{fuzz.log_tail(run.log_path)}", markup=False, style="bold red")
    elif not held:
        section = fuzz.failures_section(kept or run.log_path, name_log=kept is not None)
        if section:
            console.print(section, markup=False)
        elif run.returncode != 0:
            console.print(fuzz.log_tail(run.log_path), markup=False)
    saved = [p for p in _new_files(failures_dir, before) if p.resolve() != Path(summary_path).resolve()]  # a summary is no case
    for path in saved:
        console.print(f"saved failing case: {path}   replay: mqa-bwd repro {path}", markup=False)
    if kept is not None:
        console.print(f"full pytest output: {kept}", markup=False)
    passed, known, skipped = verdicts.count("pass"), verdicts.count("xfail"), verdicts.count("skip")
    if run.interrupted:  # a failure found before the signal still fails the run; else it could not finish
        # pytest's exit code after a signal says nothing of the properties: its own handling of the
        # interrupt can end in an error of pytest's (exit code 1). Only a failure it reported counts;
        # a test the signal cut short reads "crashed", so a worker that crashed before the signal
        # (--workers) reads the same and the run DID NOT FINISH (exit 2: never a pass either).
        reported = "fail" in verdicts or any(p.outcome == "failed" or p.failed_cases for p in run.progress.values())
        console.print(f"{'DOES NOT HOLD' if reported else 'DID NOT FINISH'}: {run.interrupted} after "
                      f"{_fmt_seconds(run.seconds)}; {passed} of {len(verdicts)} properties had passed", markup=False)
        return 1 if reported else 2
    # Exit code 2 only where pytest says nothing was run for a reason of the invocation (usage
    # error, nothing selected) or every property skipped. A pytest that died (a crash of the
    # implementation: a signal's negative code) or stopped on an error found something: 1.
    if not (held or failed) and run.returncode in (0, 4, 5):
        console.print(f"COULD NOT RUN: {_why_no_property_ran(run, properties)} (pytest exit code {run.returncode} "
                      f"after {_fmt_seconds(run.seconds)})", markup=False)
        return 2
    if not (held or failed):
        console.print(f"DOES NOT HOLD: pytest ended abnormally (exit code {run.returncode}: a crash of the "
                      f"implementation, or of pytest) after {_fmt_seconds(run.seconds)}; {passed} of {len(verdicts)} "
                      f"properties had passed", markup=False)
        return 1
    # A skipped property (a GPU-only probe on the CPU) did not run: it counts neither way.
    console.print(f"{'HOLDS' if held else 'DOES NOT HOLD'}: {passed} of {len(verdicts) - skipped} properties passed"
                  + (f", {known} known failure{'s' if known > 1 else ''} (the ledger)" if known else "")
                  + (f", {skipped} skipped (see the table)" if skipped else "")
                  + f" in {_fmt_seconds(run.seconds)} (pytest exit code {run.returncode})", markup=False)
    return 0 if held else 1


def _cut_short(run, properties: dict) -> dict:
    """name -> progress of each property the suite says was stopped while it ran (its verdict
    'stopped'), where the progress files counted its cases."""
    progress = {p.name: p for p in run.progress.values()}
    return {name: progress[name] for name, result in properties.items()
            if result.get("verdict") == "stopped" and name in progress}


def _keep_log(console, log: Path, failures_dir: Path) -> Path | None:
    """Keep the pytest output of a run that did not hold, beside its failing cases (the run's own
    copy goes with its temporary folder). One file, CHECK_LOG, replaced by the next such run: it
    is where the user already looks, and it cannot pile up as a file per run would. None, with a
    note, where it cannot be written."""
    kept = failures_dir / CHECK_LOG
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_bytes(Path(log).read_bytes())
    except OSError as e:
        console.print(f"note: could not keep the pytest output in {kept} ({e.strerror or e})", markup=False)
        return None
    return kept


def _why_no_property_ran(run, properties: dict) -> str:
    """Why a check run that neither held nor failed ran no property, for its last line."""
    if run.returncode == 4:
        return "the property suite refused its arguments (the usage error above)"
    if run.returncode == 5 or (run.summary is not None and not properties):
        return "no property was selected (see -k and any pytest arguments after --)"
    if run.summary is None:
        return "the property suite wrote no summary (the end of its output is above)"
    reasons = {r.get("skip_reason") for r in properties.values()}
    reasons = sorted(filter(None, reasons | {p.reason for p in run.progress.values() if p.outcome == "skipped"}))
    return "every property was skipped" + (f": {reasons[0]}" if len(reasons) == 1 else " (see the table)")


# ---------------------------------------------------------------------------
# promote
# ---------------------------------------------------------------------------


def cmd_promote(args) -> int:
    from properties import checks
    from properties.plugin import load_case_text, regression_name

    from .files import write_json_atomic

    try:
        text = args.source.read_text()
    except OSError as e:
        raise ValueError(f"FILE: cannot read {str(args.source)!r} ({e.strerror or e})") from None
    try:
        case, recorded = load_case_text(text)
    except (ValueError, TypeError) as e:
        raise ValueError(f"FILE: {str(args.source)!r} is not a case or failure file ({e})") from None
    prop = args.property or recorded
    if prop is not None and prop not in checks.PROPERTIES:
        raise ValueError(f"--property: expected one of {', '.join(checks.PROPERTIES)}, got {prop!r}")
    data = json.loads(text)
    record = dict(data) if "case" in data else {"case": case.to_dict()}
    record["case"] = case.to_dict()
    if prop is not None:
        record["property"] = prop
    else:
        record.pop("property", None)
    if args.regressions_dir.exists() and not args.regressions_dir.is_dir():
        raise ValueError(f"--regressions-dir: {str(args.regressions_dir)!r} is not a folder")
    try:  # a first regression starts its folder
        args.regressions_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--regressions-dir: cannot create {str(args.regressions_dir)!r} "
                         f"({e.strerror or e})") from None
    path = args.regressions_dir / regression_name(prop, case)
    write_json_atomic(path, record)
    print(f"promoted {args.source} -> {path} (replayed first by "
          + (f"property {prop}" if prop else "every property") + ")")
    return 0


# ---------------------------------------------------------------------------
# fuzz
# ---------------------------------------------------------------------------


def cmd_fuzz(args) -> int:
    from . import fuzz

    console = make_console()
    tests = _suite_path(args)
    backend, impl, needs_gpu = _resolve_target(args)
    gpus = fuzz.count_gpus() if needs_gpu else 0
    workers = args.workers or max(1, gpus)
    failures_dir = args.failures_dir or Path(FUZZ_FAILURES_DIR)
    failures_dir.mkdir(parents=True, exist_ok=True)
    failures_dir = failures_dir.resolve()
    logs = failures_dir / "logs"
    logs.mkdir(exist_ok=True)
    # The round logs are this run's: an earlier run's would be appended to, and pile up, where the
    # failing cases and crash records it saved stay until the user removes them.
    for old_log in logs.glob("round*.log"):
        old_log.unlink()
    before = set(failures_dir.iterdir())
    target = impl or backend
    known_failures = _known_failures(args)
    pinning = f"pinned to GPUs {', '.join(str(i % gpus) for i in range(workers))}" if gpus else "no GPU pinning"
    console.print(f"mqa-bwd fuzz: {args.minutes:g} min on {target!r}, {workers} worker(s), {pinning}, "
                  f"heads {'%d-%d' % args.heads if args.heads else 'all'}; failures -> {failures_dir}", markup=False)

    start = time.time()
    deadline = start + args.minutes * 60.0
    totals = {}  # nodeid -> dict(cases, outcome, reason, seconds)
    findings = {}  # property -> finding -> {"held": n, "failed": m}, over the rounds
    records, done, stop_reason, round_no, first_summary, signalled = [], set(), None, 0, None, False
    with tempfile.TemporaryDirectory(prefix="mqa-bwd-fuzz-") as tmp:
        while True:
            round_no += 1
            progress_dir = Path(tmp) / f"round{round_no}"
            progress_dir.mkdir()
            summary = Path(tmp) / f"summary{round_no}.json"
            command = fuzz.build_pytest_command(
                tests, profile="fuzz", summary_json=summary, failures_dir=failures_dir,
                backend=backend, impl=fuzz.GUARD, heads=args.heads, repeats=args.repeats, workers=workers,
                gpus=gpus, xdist=True, seed=None if args.seed is None else args.seed + round_no - 1,
                deselect=sorted(done), domain=args.domain, buckets=args.buckets, known_failures=known_failures,
                outside_probe=round_no == 1,  # once per fuzz run, not per round
                extra=_isolation_args(tests) + _extra_pytest_args(args))
            env = {fuzz.ENV_TARGET: target, fuzz.ENV_RECORDS: str(failures_dir)}

            def remaining():
                left = max(0.0, deadline - time.time())
                return f"round {round_no}, {_fmt_seconds(time.time() - start)} of {_fmt_seconds(args.minutes * 60)}" \
                       + (f", {_fmt_seconds(left)} left" if left else ", finishing")

            with LiveProgress(console, remaining) as view:
                run = fuzz.run_suite(command, cwd=_suite_cwd(tests), progress_dir=progress_dir,
                                     records_dir=failures_dir, log_path=logs / f"round{round_no}.log",
                                     summary_json=summary, env=env, deadline=deadline, on_update=view.update)
            records += run.records
            for name, result in (run.summary or {}).get("properties", {}).items():
                add_finding_counts(findings.setdefault(name, {}), result.get("findings", {}))
            if first_summary is None:
                first_summary = run.summary
            for path in _new_files(failures_dir, before):
                if path.suffix == ".json":
                    fuzz.name_real_target(path, target)
            for nodeid, p in run.progress.items():
                t = totals.setdefault(nodeid, {"cases": 0, "outcome": None, "reason": "", "seconds": 0.0, "rounds": 0})
                t["cases"] += p.cases
                t["seconds"] += p.seconds
                t["rounds"] += 1
                if p.outcome in ("failed", "crashed") or t["outcome"] not in ("failed", "crashed"):
                    t["outcome"], t["reason"] = p.outcome, p.reason
                if p.outcome in ("failed", "crashed") or fuzz.is_known_failure(p):
                    done.add(nodeid)
            if run.interrupted:
                stop_reason, signalled = run.interrupted, run.signalled
                break
            if not run.progress or run.returncode not in (0, 1):
                stop_reason = f"pytest exit code {run.returncode}"
                if not any(p.cases for p in run.progress.values()):
                    console.print(f"the property suite did not run; the end of its output:\n"
                                  f"{fuzz.log_tail(run.log_path)}", markup=False)
                    return 2
                break
            if deadline - time.time() < MIN_ROUND_S:
                stop_reason = "time budget used"
                break
            if all(n in done for n in totals):
                stop_reason = "every property has failed (or is a known failure)"
                break
    return _fuzz_report(console, totals, records, failures_dir, before, stop_reason, time.time() - start, findings,
                        first_summary, signalled)


def findings_lines(findings: dict) -> list:
    """One line per property: how often each of its sub-checks failed, of the examples that ran it
    (the inputs-untouched checks together). Counts include the replays Hypothesis makes of a failure."""

    def grouped(finding: str) -> str:
        return "inputs untouched" if finding.startswith("input ") and finding.endswith(" untouched") else finding

    lines = []
    for name, checks in sorted(findings.items()):
        if not checks:  # nothing counted (the property did not run): no line to print
            continue
        merged = add_finding_counts({}, checks, key=grouped)
        parts = [f"{finding} {c['failed']} failed of {c['held'] + c['failed']}" for finding, c in merged.items()]
        lines.append(f"{name} checks: " + ", ".join(parts))
    return lines


def _fuzz_report(console, totals, records, failures_dir, before, stop_reason, seconds, findings=None,
                 summary=None, signalled=False) -> int:
    from rich.table import Table

    from properties.ledger import KNOWN_FAILURE

    from .console import print_outside_domain
    from .fuzz import property_name

    table = Table(title=f"mqa-bwd fuzz: stopped after {_fmt_seconds(seconds)} ({stop_reason})", title_justify="left")
    for column, justify in (("property", "left"), ("cases", "right"), ("verdict", "left"), ("time", "right")):
        table.add_column(column, justify=justify)
    for nodeid, t in sorted(totals.items()):
        outcome = t["outcome"] or "not finished"
        if outcome == "skipped" and t["reason"].startswith("fuzz time slice used up"):
            verdict = "no failure (time slice used up)"
        elif outcome == "passed":
            verdict = "no failure (all examples ran)"
        elif outcome == "skipped" and t["reason"].startswith(KNOWN_FAILURE):
            verdict = t["reason"]
        else:
            verdict = outcome + (f" ({t['reason']})" if t["reason"] else "")
        table.add_row(property_name(nodeid), str(t["cases"]), _styled(verdict), _fmt_seconds(t["seconds"]))
    console.print(table)
    for line in findings_lines(findings or {}):
        console.print(line, markup=False)
    if summary:
        print_outside_domain(console, summary)
    saved = [p for p in _new_files(failures_dir, before) if p not in records]
    for path in saved:
        console.print(f"failing case: {path}\n    replay: mqa-bwd repro {path}", markup=False)
    for path in records:
        kind = "stalled call (did not return)" if path.name.startswith("stalled-") else "crash"
        console.print(f"{kind}: {path}\n    replay: mqa-bwd repro {path}", markup=False)
    failed = any(t["outcome"] in ("failed", "crashed") for t in totals.values()) or bool(records) or bool(saved)
    total = sum(t["cases"] for t in totals.values())
    if signalled and not failed:  # cut short before its time: nothing found is not "no failure"
        console.print(f"DID NOT FINISH: {stop_reason} after {total} cases; nothing had failed", markup=False)
        return 2
    console.print(f"{'FAILURES FOUND' if failed else 'no failure'}: {total} cases, {len(saved)} failing case files, "
                  f"{len(records)} crash records", markup=False)
    return 1 if failed else 0


# ---------------------------------------------------------------------------
# repro
# ---------------------------------------------------------------------------


def cmd_repro(args) -> int:
    from . import repro

    console = make_console()
    source = repro.load_source(args.source)
    recorded_impl, recorded_backend = repro.recorded_target(source)
    impl_spec = args.impl or recorded_impl
    backend = args.backend or recorded_backend
    recorded = " with ".join(filter(None, (recorded_impl, f"backend {recorded_backend!r}" if recorded_backend
                                            else None)))
    option = "--backend"
    if backend and not args.backend:
        option = f"the backend recorded in {args.source} (override with --backend)"
    config = dict(source.config)
    if args.block_h is not None:
        config["block_h"] = args.block_h
    if args.dkv_buf_bytes is not None:
        config["dkv_buf_bytes"] = args.dkv_buf_bytes
    framework = args.framework or source.framework
    impl = repro.resolve(impl_spec, backend, option=option, device=args.device, framework=framework, **config)
    against = None
    if args.against:
        other_impl, other_backend = repro.parse_target(args.against)
        against = repro.resolve(other_impl, other_backend or (backend if other_impl else None), option="--against",
                                device=args.device if other_impl else None, framework=framework, **config)

    console.print(f"mqa-bwd repro: {source.describe()}", markup=False)
    crash_record = Path(args.source).name.startswith(("crash-", "stalled-"))
    if source.recorded.get("property"):
        what = "call that crashed a fuzz worker in" if crash_record else "failure of"
        console.print(f"recorded {what} property {source.recorded['property']!r}"
                      + (f" on {recorded}" if recorded else ""), markup=False)
    if crash_record and not (args.impl or args.backend):
        console.print(f"note: replaying a crash on {impl.label} may end this process the same way; on a GPU, "
                      f"'compute-sanitizer python -m mqa_bwd repro {args.source} --runs 1' locates the access",
                      markup=False)
    if source.recorded.get("report"):
        console.print("recorded report:\n" + str(source.recorded["report"]).rstrip(), markup=False)
    prop = repro.recorded_property(source)
    if source.kind == "case" and source.recorded.get("property") and prop is None \
            and source.recorded["property"] not in repro.RERUN_PROPERTIES:
        console.print(f"note: the recorded property {source.recorded['property']!r} is none of this suite's; "
                      "replaying the call only", markup=False)
    settings = ", ".join(f"{k}={v}" for k, v in config.items()) or "default call options"
    if args.processes:
        if against is not None:
            raise ValueError("--processes: replays one implementation; leave out --against")
        console.print(f"replaying one call in each of {args.processes} fresh processes on {impl.label} "
                      f"({impl.device}, {framework}; {settings})", markup=False)
        replayed = repro.replay_in_processes(source, impl, args.processes)
        _print_process_replay(console, replayed, scope="call replay " if prop else "")
        report = replayed.as_dict()
        code = 0 if replayed.ok else 1
        if prop:
            code = _replay_recorded_property(console, repro, source, impl, prop, report, code)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=str))
            console.print(f"report written to {args.json}", markup=False)
        return code
    console.print(f"replaying {args.runs} runs on {impl.label} ({impl.device}, {framework}; {settings})"
                  + (f" and on {against.label}" if against else ""), markup=False)
    oracle = not args.no_oracle
    if oracle and repro.oracle_macs(source.inputs) > repro.ORACLE_SLOW_MACS:
        console.print("note: the float64 oracle at this shape takes minutes on a CPU (--no-oracle skips it)",
                      markup=False)

    from rich.progress import Progress

    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        tasks = {}

        def on_run(label, run):
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=args.runs)
            bar.update(tasks[label], completed=run + 1)

        result = repro.replay(source, impl, runs=args.runs, against=against, oracle=oracle, on_run=on_run)
    _print_repro(console, result, scope="call replay " if prop else "")
    report = result.as_dict()
    # A refused call is bad input (the case or the call options), not a failure: nothing was replayed.
    code = 0 if result.ok else (2 if result.bad_input else 1)
    if prop:
        code = _replay_recorded_property(console, repro, source, impl, prop, report, code)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
        console.print(f"report written to {args.json}", markup=False)
    return code


def _replay_recorded_property(console, repro, source, impl, prop, report: dict, call_code: int) -> int:
    """Replay the property a failure file records after the call replay (whose exit code is
    ``call_code``); print its report and, last, the verdict of both; add it to the JSON ``report``.
    Returns the exit code: 1 while the property fails, whatever the call replay said."""
    console.print(f"replaying property {prop!r} on the recorded case on {impl.label}", markup=False)
    verdict = repro.replay_property(source, impl, prop)
    console.print(verdict.report.rstrip(), markup=False)
    report["property_replay"] = {"property": prop, "ok": verdict.ok, "report": verdict.report}
    if not verdict.ok:
        console.print(f"FAILED: property {prop!r} still fails on the recorded case", markup=False)
        return 1
    if call_code == 0:
        console.print(f"OK: property {prop!r} holds on the recorded case, and the call replay too", markup=False)
    else:
        console.print(f"{'REFUSED' if call_code == 2 else 'FAILED'}: property {prop!r} holds on the recorded case, "
                      "but the call replay did not (above)", markup=False)
    return call_code


# ---------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from . import bench

    if args.from_json:
        return _bench_from_json(args)

    named = [name for group in args.shapes for name in group.split(",") if name]
    given = [bench.parse_shape(text) for text in args.shape]
    sweep = bench.parse_sweep(args.sweep) if args.sweep else None
    shapes = bench.plan(named, given, sweep)
    chosen = bench.parse_backends(args.backends)
    if args.plot:
        bench.require_matplotlib()
        bench.plot_axis([bench.Row(**s, d_k=0, d_v=0, backend="", ms=0, tflops=0, peak_scratch_gib=0)
                         for s in shapes])
    chosen, skipped = bench.runnable_backends(chosen, asked=args.backends is not None)
    for backend, why in skipped.items():
        print(f"{backend}: skipped: {why}", file=sys.stderr)
    call_kw = {k: v for k, v in (("block_h", args.block_h), ("dkv_buf_bytes", args.dkv_buf_bytes)) if v is not None}
    rows = []
    for shape in shapes:
        here = []
        for backend in chosen:
            why = bench.outside_domain(backend, shape, args.d_k, args.d_v)
            if why is None:
                here.append(backend)
            else:
                where = f"{backend} at {bench.describe(shape)}"
                skipped[where] = why
                print(f"{where}: skipped: {why}", file=sys.stderr)
        if not here:
            continue
        for indices in args.indices:
            print(f"measuring {shape}, {indices} indices ...", file=sys.stderr, flush=True)
            rows += bench.measure(shape, tuple(here), args.d_k, args.d_v, args.warmup, args.repeats, indices,
                                  trace=args.trace or 0, **call_kw)
    print(bench.table(rows))
    if notes := bench.clock_notes(rows):
        print(notes)
    if args.trace:
        print(bench.traces(rows))
    if args.json:
        args.json.write_text(bench.to_json(rows, dict(bench.environment(), skipped=skipped)))
        print(f"rows written to {args.json}", file=sys.stderr)
    if args.plot:
        axis = bench.plot(rows, args.plot)
        print(f"plot of ms against {axis} written to {args.plot}", file=sys.stderr)
    disagreeing = [r for r in rows if r.rel_l2_vs_first is not None and r.rel_l2_vs_first > bench.AGREEMENT_RTOL]
    return 1 if disagreeing else 0


def _bench_from_json(args) -> int:
    import json

    from . import bench

    try:
        data = json.loads(args.from_json.read_text())
        rows = [bench.Row(**row) for row in data["rows"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--from-json: {args.from_json} is not a bench JSON file ({e})") from None
    print(bench.table(rows))
    if notes := bench.clock_notes(rows):
        print(notes)
    if any(r.kernels for r in rows):
        print(bench.traces(rows))
    if args.plot:
        axis = bench.plot(rows, args.plot)
        print(f"plot of ms against {axis} written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
