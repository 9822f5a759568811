"""Benchmark: the deterministic backward beside the atomic control and cuDNN, at named or given shapes.

What is measured, and why it is fair:

* Every backend runs on the same device tensors (causal top-k indices, built
  once per shape), in one process, and their timed repeats are interleaved
  (det, atomic, cudnn, det, ...) so that clock and thermal drift fall on all
  alike. Each is warmed up first (kernel compilation and caches).
* Backends: ours ('tilelang', 'tilelang-atomic') and the peers of
  contract.PEERS, cuDNN-frontend's DSA backward ('cudnn', through
  mqa_bwd.cudnn), where they run; each peer's function says where it runs,
  why not and its domain. The default run skips a peer that cannot run here
  and says why.
* Time is the whole public call (validation, layout, every kernel), as a
  call alone pays it: CUDA events around it, median of the repeats.
* Queued time is what a call costs where the host runs ahead of the GPU,
  as in a training step's queue: QUEUE_DEPTH calls enqueued back to back
  behind a spin of the stream, their event time over their count
  (queued_time). It holds the calls' kernels and the gaps between them,
  and none of the host's time, unless a call's host time exceeds its GPU
  time or the call synchronises.
* The SM clock during each backend's timed calls (NVML samples, gpu_clocks):
  a ratio compares kernels only where both ran at one clock.
* TFLOP/s by docs/SPEC.md's count per query row: 2 * (H*Dv*L + 3*H*Dk*L + H*Dv*L).
* Peak scratch: the most memory allocated during one call beyond the inputs
  and the three outputs (the int64 or fp32 dKV accumulator, padded copies).
* The outputs of the backends are compared once (relative L2 per output)
  with the first's: a fast variant that skips work shows up as a
  disagreement, not as a speed-up.
* Error: per output (dq, dkv, d_attn_sink), the relative L2 error against a
  float64 reference on the same inputs, and its ratio to the atomic
  control's error. A deterministic design is admissible (issue 30) when
  every ratio is at most ADMISSIBLE_ERROR_RATIO. The reference is SPEC's
  backward in float64 torch on the GPU, a bounded block of query rows at a
  time (the NumPy oracle is far too slow at these shapes; the tests hold the
  two to each other on small ones).

The table is COLUMNS: a new column is a Row field and one Column entry.

Needs a CUDA GPU with the TileLang kernels (Hopper); the CPU tile model is a
correctness artifact, never timed (its errors are computed the same way in
the tests).
"""

import collections
import dataclasses
import json
import math
import statistics
from typing import Callable

from . import gpu_clocks
from .contract import BACKENDS, GPU_BACKENDS, OUTPUT_NAMES, PEERS, Instruments, peer, peer_function

SHAPES = {
    "dsv32": [dict(B=1, S=4096, S_kv=8192, H=64, L=2048), dict(B=1, S=4096, S_kv=8192, H=128, L=2048)],
    "fleet": [dict(B=1, S=8192, S_kv=8192, H=64, L=640)],
    # Training's causal self-attention (S = S_kv): with indexer indices the first L rows have an
    # empty tail of slots, which the wide tile skips (issue 30's first shape).
    "causal": [dict(B=1, S=4096, S_kv=4096, H=64, L=2048)],
}
SHAPE_KEYS = ("B", "S", "S_kv", "H", "L")
#: Outputs of two backends that differ more than this (relative L2) do not compute the same thing.
AGREEMENT_RTOL = 2e-2
#: cuDNN-frontend's DSA backward (mqa_bwd.cudnn), the peer the det/cuDNN column divides by.
CUDNN = "cudnn"
#: Ours, then the peers (contract.PEERS), which are timed beside ours where they run.
BENCH_BACKENDS = GPU_BACKENDS + tuple(PEERS)
DEFAULT_BACKENDS = BENCH_BACKENDS
#: Issue 30's admissibility standard: per output, at most this times the atomic control's error.
ADMISSIBLE_ERROR_RATIO = 1.1
#: The queued time (queued_time): calls enqueued back to back in a round, rounds a backend.
QUEUE_DEPTH = 8
QUEUE_ROUNDS = 3
#: GPU cycles a queued round's spin holds the stream before its first call (some 2 ms at
#: Hopper's clocks): the host enqueues that call's launches while the GPU spins, so that not
#: even the first call waits for the host.
QUEUE_HEAD_START_CYCLES = 4_000_000
#: Device memory one block of the float64 reference may take.
REFERENCE_BLOCK_BYTES = 1 << 30
#: How the bench draws each query row's top-k indices (production_inputs' ``indices``):
#: "uniform", L independent uniform draws over the row's visible kv rows, the worst case for
#: kv rows shared by neighbouring query rows (a row may name a kv row twice); "distinct", L
#: different visible kv rows drawn uniformly: neighbouring rows share what chance gives, as with
#: uniform, and no row names a kv row twice, as with a real indexer; "indexer", the L best of one
#: score per kv row plus per-row noise, as DSA's indexer picks them: distinct, and neighbouring
#: rows' sets overlap. Distinct between the two others tells which of their differences a
#: kernel's time follows.
INDEX_PATTERNS = ("uniform", "distinct", "indexer")
#: The "indexer" pattern's per-row noise, in units of the shared score's spread.
INDEXER_NOISE = 0.5


@dataclasses.dataclass
class Row:
    B: int
    S: int
    S_kv: int
    H: int
    L: int
    d_k: int
    d_v: int
    backend: str
    ms: float
    tflops: float
    peak_scratch_gib: float
    ms_min: float = 0.0
    ms_max: float = 0.0
    repeats: int = 0
    det_over_atomic: float | None = None
    det_over_cudnn: float | None = None
    #: ms a call with the host ahead of the GPU (queued_time), median of the rounds; its
    #: deterministic/cuDNN ratio on our deterministic rows. None in runs before it was measured.
    queued_ms: float | None = None
    queued_det_over_cudnn: float | None = None
    #: max relative L2 distance of (dq, dkv, d_attn_sink) from the first backend's, None for the first
    rel_l2_vs_first: float | None = None
    #: output name -> relative L2 error against the float64 reference
    error: dict | None = None
    #: output name -> error / the atomic control's error at this shape; None for the control itself
    error_over_atomic: dict | None = None
    #: the least dkv_buf_bytes the call accepts (wrapper.scratch_bytes), in GiB; None for a peer
    min_budget_gib: float | None = None
    #: whether the judged call redid its wide launches in int64 (a lanes bound failed; then
    #: its time is about twice the lanes'); None where the call has no lanes launch
    lanes_redone: bool | None = None
    #: the pattern of the top-k indices (INDEX_PATTERNS) and the share of a row's valid slots
    #: that the previous query row also names (index_overlap)
    indices: str = "uniform"
    index_overlap: float | None = None
    #: with --trace: the GPU kernels of a call, [name, ms a call, launches a call], most time first
    kernels: list | None = None
    #: the GPU's clocks during this backend's timed calls (gpu_clocks.ClockSummary as a dict);
    #: None where no sample fell in them, and then clocks_unavailable may say why
    clocks: dict | None = None
    clocks_unavailable: str | None = None

    @property
    def shape(self) -> tuple:
        """What rows are compared within (ratios, errors): the shape and the index pattern."""
        return (self.B, self.S, self.S_kv, self.H, self.L, self.d_k, self.d_v, self.indices)

    @property
    def label(self) -> str:
        """The row's shape as the bench's notes name it: 'B=1,S=4096,...' (describe)."""
        return describe(dict(B=self.B, S=self.S, S_kv=self.S_kv, H=self.H, L=self.L))

    def as_dict(self):
        return dataclasses.asdict(self)


def flops(B, S, H, L, d_k, d_v) -> float:
    return float(B * S) * 2.0 * (H * d_v * L + 3 * H * d_k * L + H * d_v * L)


def parse_shape(text: str, option: str = "--shape") -> dict:
    """'B=1,S=4096,S_kv=8192,H=64,L=2048' -> dict; every key of SHAPE_KEYS, positive integers."""
    shape = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in SHAPE_KEYS:
            raise ValueError(f"{option}: expected KEY=VALUE with KEY in {SHAPE_KEYS}, got {part!r}")
        try:
            shape[key] = int(value)
        except ValueError:
            raise ValueError(f"{option}: {key} must be an integer, got {value!r}") from None
        if shape[key] < 1:
            raise ValueError(f"{option}: {key} must be >= 1, got {shape[key]}")
    missing = [k for k in SHAPE_KEYS if k not in shape]
    if missing:
        raise ValueError(f"{option}: missing {', '.join(missing)} in {text!r} (give all of {', '.join(SHAPE_KEYS)})")
    return shape


def add_ab_shape_arguments(parser, default: str) -> None:
    """The A/B tools' (benchmarks/package_ab.py, config_ab.py) shape options: --shapes (named
    sets; ``default``, kept as default_shapes, when no --shape is given), --shape (repeatable)
    and --indices, which ab_shapes and production_inputs read."""
    parser.set_defaults(default_shapes=default)
    parser.add_argument("--shapes", help=f"named shape sets (bench.SHAPES), comma-separated (default {default}, or none "
                                         "when --shape is given)")
    parser.add_argument("--shape", action="append", default=[], metavar="B=..,S=..,S_kv=..,H=..,L=..",
                        help="a shape of its own (repeat it), measured after the named sets")
    parser.add_argument("--indices", choices=INDEX_PATTERNS, default="uniform")


def ab_shapes(named, given=(), default: str = "dsv32") -> list:
    """The shapes an A/B tool (benchmarks/package_ab.py, config_ab.py) times: the named sets
    (``named``, comma-separated; None: ``default`` when no shape is given, else none), then the
    given ones (parse_shape's form)."""
    if named is None:
        named = "" if given else default
    return plan([name for name in named.split(",") if name], [parse_shape(text) for text in given])


def describe(shape: dict) -> str:
    """{'B': 1, 'S': 4096, ...} -> 'B=1,S=4096,...' (parse_shape's form)."""
    return ",".join(f"{k}={shape[k]}" for k in SHAPE_KEYS)


def parse_sweep(text: str) -> tuple:
    """'H=16,32,64' -> ('H', [16, 32, 64]); only H or L sweep."""
    key, sep, values = text.partition("=")
    if not sep or key not in ("H", "L"):
        raise ValueError(f"--sweep: expected H=v1,v2,... or L=v1,v2,..., got {text!r}")
    try:
        numbers = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep: values must be integers, got {values!r}") from None
    if not numbers or min(numbers) < 1:
        raise ValueError(f"--sweep: expected positive integers, got {values!r}")
    return key, numbers


def plan(named=(), given=(), sweep=None) -> list:
    """The shapes to measure: named sets, then given shapes, each expanded by the sweep; duplicates once."""
    shapes = []
    for name in named:
        if name not in SHAPES:
            raise ValueError(f"--shapes: unknown shape set {name!r}; known: {sorted(SHAPES)}")
        shapes += [dict(s) for s in SHAPES[name]]
    shapes += [dict(s) for s in given]
    if not shapes:
        shapes = [dict(s) for s in SHAPES["dsv32"]]
    if sweep is not None:
        key, values = sweep
        shapes = [dict(s, **{key: v}) for s in shapes for v in values]
    unique = []
    for s in shapes:
        if s not in unique:
            unique.append(s)
    return unique


def check_index_pattern(indices) -> None:
    """ValueError unless ``indices`` names one of INDEX_PATTERNS."""
    if indices not in INDEX_PATTERNS:
        raise ValueError(f"indices: {indices!r} is none of {', '.join(INDEX_PATTERNS)}")


def production_inputs(B, S, S_kv, H, L, d_k=576, d_v=512, seed=0, device="cuda", indices="uniform", temperature=1.0):
    """Random q, kv, grad_out, sink and causal top-k indices (``indices``: one of INDEX_PATTERNS),
    built on the device, with out and lse from the forward (so that every head's softmax mass is
    at most 1, as in training: the fixed-point design checks it). ``temperature`` scales q (in
    bf16) before the forward: above 1 it concentrates P, as trained attention's is."""
    import torch

    check_index_pattern(indices)  # before the first allocation, not at the draw
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((B, S, H, d_k), device=device, generator=g).bfloat16()
    kv = torch.randn((B, S_kv, d_k), device=device, generator=g).bfloat16()
    grad_out = torch.randn((B, S, H, d_v), device=device, generator=g).bfloat16()
    sink = torch.randn((H,), device=device, generator=g)
    if temperature != 1:  # after every draw, so that the other inputs stay the same
        q = (q.float() * temperature).bfloat16()
    idx = draw_indices(B, S, S_kv, L, indices, g)
    sm_scale = d_k**-0.5
    out, lse = _forward(q, kv, idx, sink, sm_scale, d_v)
    return (q, kv, out, grad_out, lse, sink, idx, sm_scale)


def draw_indices(B, S, S_kv, L, indices, generator):
    """[B, S, L] int32 causal top-k indices of the pattern ``indices`` (INDEX_PATTERNS) on the
    generator's device: query row s sees kv rows 0 .. s + S_kv - S (at least row 0)."""
    import torch

    check_index_pattern(indices)
    device = generator.device
    visible = (torch.arange(S, device=device) + (S_kv - S) + 1).clamp(min=1)  # kv rows 0 .. visible - 1
    if indices == "uniform":
        return (torch.rand((B, S, L), device=device, generator=generator) * visible.view(1, S, 1)).to(torch.int32)
    return best_visible(B, S, S_kv, L, visible, generator, shared_score=indices == "indexer")


def best_visible(B, S, S_kv, L, visible, generator, shared_score: bool, rows_per_step=256):
    """[B, S, L] int32: each query row's L best visible kv rows, best first, -1 in the slots past
    a row's visible count. The score is noise[b, s, j] alone (L distinct rows drawn uniformly), or
    with ``shared_score`` score[b, j] + INDEXER_NOISE noise[b, s, j]: one score per kv row is what
    makes neighbouring rows pick the same rows, as a real indexer's do."""
    import torch

    device = visible.device
    idx = torch.full((B, S, L), -1, dtype=torch.int32, device=device)
    k = min(L, S_kv)
    columns = torch.arange(S_kv, device=device)
    for b in range(B):
        shared = torch.randn((S_kv,), device=device, generator=generator) if shared_score else None
        for s0 in range(0, S, rows_per_step):
            rows = slice(s0, min(S, s0 + rows_per_step))
            noise = torch.randn((rows.stop - s0, S_kv), device=device, generator=generator)
            score = noise if shared is None else shared + INDEXER_NOISE * noise
            score = score.masked_fill(columns >= visible[rows].view(-1, 1), -math.inf)
            best, where = torch.topk(score, k, dim=1)
            idx[b, rows, :k] = torch.where(best == -math.inf, -1, where).to(torch.int32)
    return idx


def index_overlap(idx) -> float:
    """The share of the valid slots (index >= 0) of query rows 1 .. S - 1 whose kv row the
    previous query row of the batch element also names: 0 for disjoint neighbours, 1 for equal."""
    import torch

    B, S, L = idx.shape
    if S < 2:
        return 0.0
    ordered = idx.to(torch.int64).sort(dim=-1).values
    previous, current = ordered[:, :-1].contiguous(), ordered[:, 1:].contiguous()
    where = torch.searchsorted(previous, current).clamp(max=L - 1)
    shared = (previous.gather(-1, where) == current) & (current >= 0)
    valid = int((current >= 0).sum())
    return float(shared.sum()) / valid if valid else 0.0


def _forward(q, kv, idx, sink, sm_scale, d_v, rows_per_step=128):
    """(out bf16, lse fp32) of SPEC's forward, in fp32, a block of query rows at a time."""
    import torch

    B, S, H, _ = q.shape
    out = torch.empty((B, S, H, d_v), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((B, S, H), dtype=torch.float32, device=q.device)
    for b in range(B):
        for s0 in range(0, S, rows_per_step):
            rows = slice(s0, min(S, s0 + rows_per_step))
            slots = idx[b, rows].long()
            invalid = slots < 0  # the indexer pattern's slots past a row's visible kv rows
            keys = kv[b][slots.clamp(min=0)].float()  # [n, L, Dk]
            logits = torch.einsum("nhd,nld->nhl", q[b, rows].float(), keys) * sm_scale
            logits = logits.masked_fill(invalid.unsqueeze(1), -math.inf)
            lse_rows = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - torch.logaddexp(lse_rows, sink.view(1, H)).unsqueeze(-1))
            out[b, rows] = torch.einsum("nhl,nld->nhd", p, keys[..., :d_v]).bfloat16()
            lse[b, rows] = lse_rows
    return out, lse


def event_time(fn) -> float:
    """Event ms of one call of ``fn``: from the moment it is called, host time included."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def prepared_wrapper_call(args, launcher, steps=None):
    """One whole wrapper call on ``args`` (production_inputs' tuple) with ``launcher``, as
    a no-argument callable returning (dq, dkv, d_attn_sink); validated here, once, so
    that timing the callable leaves validation out. An A/B of two launchers (or of two
    packages, benchmarks/package_ab.py) passes each its own launcher; of two sets of the
    wrapper's steps (wrapper.Steps; None: wrapper.STEPS), each its own ``steps``."""
    import functools

    from . import wrapper

    steps = wrapper.STEPS if steps is None else steps
    plan = wrapper.validate(*args, None, None, launcher, steps=steps, design=launcher.deterministic)
    return functools.partial(wrapper.run, plan, *args, launcher, steps)


def timed_wrapper_call(args, launcher) -> tuple:
    """(ms, (dq, dkv, d_attn_sink)) of one whole wrapper call (prepared_wrapper_call)."""
    call = prepared_wrapper_call(args, launcher)
    outputs = []
    ms = event_time(lambda: outputs.append(call()))
    return ms, outputs[0]


def same_bits(outputs, others) -> bool:
    """Whether two calls' outputs (dq, dkv, d_attn_sink) are bitwise equal, output by output
    (edge.same_bits)."""
    from .edge import same_bits as same_tensor_bits

    return len(outputs) == len(others) and all(same_tensor_bits(x, y) for x, y in zip(outputs, others))


#: compute-sanitizer's summary lines (one group: the count): racecheck's hazards, and the
#: errors of memcheck, synccheck and racecheck.
RACECHECK_HAZARDS = r"RACECHECK SUMMARY: (\d+) hazards? displayed"
SANITIZER_ERRORS = r"ERROR SUMMARY: (\d+) errors?"


def compute_sanitizer() -> str | None:
    """The compute-sanitizer executable (kernels.cuda_tool: CUDA_HOME's, else PATH's), or None."""
    from .kernels import cuda_tool

    return cuda_tool("compute-sanitizer")


def build_cuda_program(source: str, directory: str, name: str) -> str:
    """A plain CUDA program (a benchmark's probe) built for sm_90a with the machine's
    nvcc in ``directory``: the executable's path."""
    import os
    import subprocess

    from .kernels import require_nvcc

    nvcc = require_nvcc()
    src, exe = os.path.join(directory, f"{name}.cu"), os.path.join(directory, name)
    with open(src, "w") as f:
        f.write(source)
    subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-o", exe, src], check=True, capture_output=True)
    return exe


def add_shape_arguments(parser, repeats: int | None = 7) -> None:
    """--B --S --S_kv --H --L (dsv32 H=64 by default) for the benchmark scripts, and
    --repeats unless ``repeats`` is None."""
    for key, default in (("B", 1), ("S", 4096), ("S_kv", 8192), ("H", 64), ("L", 2048)):
        parser.add_argument(f"--{key}", type=int, default=default)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats)


def time_interleaved(calls: dict, warmup=3, repeats=10, spans: dict | None = None) -> dict:
    """name -> list of ms; repeats of all calls interleaved, after each call's warm-up. With
    ``spans``, each timed call's (start, end) in time.monotonic() goes to spans[name] too: the
    call's whole GPU work lies inside it (the event that ends it is waited for)."""
    import time

    import torch

    for fn in calls.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.monotonic()
            times[name].append(event_time(fn))
            if spans is not None:
                spans.setdefault(name, []).append((start, time.monotonic()))
    return times


def queued_time(fn, calls: int = QUEUE_DEPTH) -> float:
    """Event ms a call of ``calls`` calls of ``fn`` enqueued back to back behind a spin of the
    stream (QUEUE_HEAD_START_CYCLES), so that the GPU never waits for the host: the calls' GPU
    kernels and the gaps between them."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(QUEUE_HEAD_START_CYCLES)
    return event_time(lambda: [fn() for _ in range(calls)]) / calls


def time_queued(calls: dict, rounds: int = QUEUE_ROUNDS) -> dict:
    """name -> list of queued_time ms, one a round, the rounds interleaved over ``calls`` (which
    time_interleaved has warmed up)."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(queued_time(fn))
    return times


def interleaved_report(calls: dict, control: str, repeats: int) -> list:
    """time_interleaved's medians and minima of ``calls`` (two warm-up calls each), one line a
    call, with each median's ratio to the median of ``calls[control]``."""
    times = time_interleaved(calls, warmup=2, repeats=repeats)
    reference = statistics.median(times[control])
    width = max(map(len, times))
    return [f"   {name:<{width}} median {statistics.median(t):7.3f} ms  min {min(t):7.3f}  "
            f"/atomic {statistics.median(t) / reference:.3f}" for name, t in times.items()]


#: Characters of a kernel's name a trace keeps (torch's templated names run to thousands): kernels
#: whose names differ only past them are summed as one.
KERNEL_NAME_WIDTH = 90


def per_kernel(events, calls: int, width: int = KERNEL_NAME_WIDTH) -> list:
    """[[name, ms a call, launches a call]] from (kernel name, device microseconds) pairs of
    ``calls`` calls, most time first, names cut to ``width`` characters."""
    time, count = collections.Counter(), collections.Counter()
    for name, micros in events:
        key = name[:width]
        time[key] += micros / 1000 / calls
        count[key] += 1
    return [[name, ms, count[name] / calls] for name, ms in time.most_common()]


def median_kernels(per_call: list) -> list:
    """per_kernel's rows of several calls (a list a call) as one: each kernel's median ms and
    launches over the calls (0 in a call that did not launch it), most time first."""
    names = dict.fromkeys(name for rows in per_call for name, *_ in rows)
    calls = [{name: (ms, n) for name, ms, n in rows} for rows in per_call]
    rows = [[name, statistics.median(c.get(name, (0.0, 0))[0] for c in calls),
             statistics.median(c.get(name, (0.0, 0))[1] for c in calls)] for name in names]
    return sorted(rows, key=lambda row: -row[1])


def kernel_trace(call, calls: int = 3) -> list:
    """The GPU kernels of ``calls`` calls of ``call`` (after one more, untraced), each call
    under a torch profiler of its own: every GPU kernel, torch's small ops and a peer's
    included, as each kernel's median over the calls (median_kernels), so that one slow call
    does not move a kernel's time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(calls):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        per_call.append(per_kernel([(e.name, e.device_time) for e in prof.events()
                                    if e.device_type == torch.autograd.DeviceType.CUDA], 1))
    return median_kernels(per_call)


def trace_lines(label: str, kernels: list, top: int = 12) -> list:
    """A trace (per_kernel's or median_kernels' rows) as text: its total and launches a call,
    then its ``top`` kernels, the rest summed."""
    total, launches = sum(ms for _, ms, _ in kernels), sum(n for *_, n in kernels)
    lines = [f"== {label}: {total:.3f} ms of GPU kernels a call, {launches:g} launches"]
    lines += [f"  {ms:8.3f} ms  x{n:<4g} {name}" for name, ms, n in kernels[:top]]
    rest = kernels[top:]
    if rest:
        lines.append(f"  {sum(ms for _, ms, _ in rest):8.3f} ms  ({len(rest)} more kernels)")
    return lines


def scratch_and_outputs(fn) -> tuple:
    """(the peak memory allocated during one call beyond what existed before it and its
    outputs, the outputs)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    outputs = sum(t.numel() * t.element_size() for t in result)
    peak = torch.cuda.max_memory_allocated()
    return max(0, peak - base - outputs), result


def rel_l2(a, b) -> float:
    """Relative L2 distance; inf when either side is not finite (a NaN never passes as agreement)."""
    import torch

    a, b = a.float(), b.float()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return float("inf")
    denominator = float(b.norm())
    return float((a - b).norm()) / denominator if denominator else float((a - b).norm())


def rel_l2_float64(got, want) -> float:
    """Relative L2 error of ``got`` against a float64 ``want``, in float64; inf when ``got`` is not finite."""
    import torch

    diff = got.double() - want
    if not bool(torch.isfinite(diff).all()):
        return math.inf
    return _relative(float(diff.square().sum()), float(want.double().square().sum()))


def _relative(diff_squares: float, want_squares: float) -> float:
    """sqrt(diff / want), the plain norm of the difference where want is zero (a sink-less d_attn_sink)."""
    if not math.isfinite(diff_squares):
        return math.inf
    return math.sqrt(diff_squares / want_squares) if want_squares else math.sqrt(diff_squares)


# ---------------------------------------------------------------------------
# The float64 reference
# ---------------------------------------------------------------------------


def reference_rows_per_block(H, L, d_k, budget_bytes=REFERENCE_BLOCK_BYTES) -> int:
    """Query rows per block of the float64 reference: its gathered kv rows and dKV contributions
    (L x Dk each, and a third for the value part), the score-sized tensors, the q, dO and dq rows."""
    per_row = 8 * (3 * L * d_k + 6 * H * L + 4 * H * d_k)
    return max(1, budget_bytes // per_row)


def reference_float64(args, on_dq_block: Callable | None = None, keep_dq=True, budget_bytes=REFERENCE_BLOCK_BYTES):
    """docs/SPEC.md's backward in float64 torch on the inputs' device: (dq or None, dkv, d_attn_sink).

    ``args``: the SPEC tuple (production_inputs'). A block of query rows at a time
    (``budget_bytes`` of device memory); ``on_dq_block(b, rows, dq_block)`` sees each block's
    float64 dq [n, H, Dk] of batch element b, query rows ``rows`` (a slice). ``keep_dq=False``
    returns no dq, so that its float64 copy never exists whole. Invalid slots (outside
    [0, S_kv)) contribute nothing; a row with no valid slot has zero gradients. dKV sums
    with index_add_, in float64: its order moves only the last bits, far below any bf16 error.
    """
    import torch

    q, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale = args
    B, S, H, d_k = q.shape
    S_kv, d_v, L = kv.shape[1], out.shape[3], token_indices.shape[2]
    f64 = torch.float64
    device = q.device
    sink = (torch.full((H,), -math.inf, dtype=f64, device=device) if attn_sink is None
            else attn_sink.to(device=device, dtype=f64))
    dq = torch.empty((B, S, H, d_k), dtype=f64, device=device) if keep_dq else None
    dkv = torch.zeros((B, S_kv, d_k), dtype=f64, device=device)
    d_sink = torch.zeros((H,), dtype=f64, device=device)
    step = reference_rows_per_block(H, L, d_k, budget_bytes)
    for b in range(B):
        kv_b = kv[b].to(f64)
        for s0 in range(0, S, step):
            rows = slice(s0, min(S, s0 + step))
            index = token_indices[b, rows].to(torch.int64)
            valid = (index >= 0) & (index < S_kv)
            safe = torch.where(valid, index, 0)
            keys = kv_b[safe]  # [n, L, Dk]
            keys.masked_fill_(~valid.unsqueeze(-1), 0.0)  # no value of an unselected row can reach a result
            q_b, do_b = q[b, rows].to(f64), grad_out[b, rows].to(f64)
            delta = (out[b, rows].to(f64) * do_b).sum(-1)  # [n, H]
            logits = torch.matmul(q_b, keys.transpose(1, 2)) * float(sm_scale)  # [n, H, L]
            logits.masked_fill_(~valid.unsqueeze(1), -math.inf)
            total = torch.logaddexp(lse[b, rows].to(f64), sink)  # sink-inclusive
            total = torch.where(torch.isfinite(total), total, torch.zeros((), dtype=f64, device=device))
            p = torch.exp(logits - total.unsqueeze(-1))
            p_sink = torch.exp(sink - total)
            dp = torch.matmul(do_b, keys[..., :d_v].transpose(1, 2))
            ds = p * (dp - delta.unsqueeze(-1)) * float(sm_scale)
            dq_block = torch.matmul(ds, keys)
            del logits, dp
            contribution = torch.matmul(ds.transpose(1, 2), q_b)  # [n, L, Dk]
            contribution[..., :d_v] += torch.matmul(p.transpose(1, 2), do_b)
            contribution.masked_fill_(~valid.unsqueeze(-1), 0.0)
            dkv[b].index_add_(0, safe.reshape(-1), contribution.reshape(-1, d_k))
            has_valid = valid.any(dim=1, keepdim=True)
            d_sink -= torch.where(has_valid, p_sink * delta, torch.zeros((), dtype=f64, device=device)).sum(0)
            if on_dq_block is not None:
                on_dq_block(b, rows, dq_block)
            if keep_dq:
                dq[b, rows] = dq_block
    return dq, dkv, d_sink


def oracle_errors(args, outputs: dict, budget_bytes=REFERENCE_BLOCK_BYTES) -> dict:
    """backend -> {output name: relative L2 error against reference_float64 on ``args``}.

    ``outputs``: backend -> its (dq, dkv, d_attn_sink) on ``args``. dq's error is summed
    block by block, so no float64 dq is ever whole."""
    squares = {backend: 0.0 for backend in outputs}
    want_squares = [0.0]

    def on_dq_block(b, rows, want):
        want_squares[0] += float(want.square().sum())
        for backend, (dq, _, _) in outputs.items():
            squares[backend] += float((dq[b, rows].double() - want).square().sum())  # inf or NaN: not finite

    _, dkv, d_sink = reference_float64(args, on_dq_block, keep_dq=False, budget_bytes=budget_bytes)
    return {backend: dict(zip(OUTPUT_NAMES, (_relative(squares[backend], want_squares[0]),
                                             rel_l2_float64(got[1], dkv), rel_l2_float64(got[2], d_sink))))
            for backend, got in outputs.items()}


# ---------------------------------------------------------------------------
# Backends, one shape's measurement, the table
# ---------------------------------------------------------------------------


def backend_unavailable(backend: str) -> str | None:
    """Why ``backend`` (BENCH_BACKENDS, or a model for the tests) cannot run here, or None.
    A peer says it itself (contract.peer), and its ``device`` must be CUDA."""
    if backend not in PEERS:
        from . import backends

        return backends.unavailable(backend)
    function, reason = peer(backend)
    device = getattr(function, "device", "cuda")
    if function is not None and device != "cuda":
        return f"{PEERS[backend]} runs on {device}; bench times on a CUDA GPU"
    return reason


def parse_backends(text: str | None) -> list:
    """'--backends' text (None: DEFAULT_BACKENDS) -> the backend names, each one of BENCH_BACKENDS."""
    chosen = list(DEFAULT_BACKENDS) if text is None else [b.strip() for b in text.split(",") if b.strip()]
    for b in chosen:
        if b not in BENCH_BACKENDS:
            raise ValueError(f"--backends: {b!r} is not a GPU backend {BENCH_BACKENDS} (the CPU tile model "
                             "is never timed)")
    if not chosen:
        raise ValueError("--backends: give at least one backend")
    return chosen


def runnable_backends(chosen, asked: bool) -> tuple:
    """(the backends of ``chosen`` that run here, {skipped backend: why}).

    ``asked``: the user named them. A named backend that cannot run here is a ValueError;
    of the defaults, a peer (an optional extra, such as cuDNN) is skipped with its reason,
    ours are required."""
    runnable, skipped = [], {}
    for b in chosen:
        why = backend_unavailable(b)
        if why is None:
            runnable.append(b)
        elif b in PEERS and not asked:
            skipped[b] = why
        elif b in PEERS:
            raise ValueError(f"--backends: {b!r} cannot run here: {why}")
        else:
            raise ValueError("bench times the TileLang kernels with CUDA events and needs a Hopper GPU (sm_90) and "
                             f"tilelang; this machine has none ({why})")
    return runnable, skipped


def outside_domain(backend: str, shape: dict, d_k: int, d_v: int) -> str | None:
    """Why ``backend`` declares it cannot take ``shape`` (a peer's ``domain``, read as the harness
    reads it), or None. Ours take every shape."""
    function = peer_function(backend)
    if function is None:
        return None
    from properties.target import declared_domain

    why = declared_domain(function, "--backends").violations(batch=shape["B"], heads=shape["H"], topk=shape["L"],
                                                             widths=(d_k, d_v))
    return "; ".join(why) or None


def backend_call(backend: str, args, call_kw=None) -> Callable:
    """One whole public call of ``backend`` on ``args``, as a no-argument callable."""
    call_kw = dict(call_kw or {})
    function = peer_function(backend)
    if function is not None:  # a peer takes no backend=
        return lambda: function(*args, **call_kw)
    from . import mqa_latent_sparse_bwd

    return lambda: mqa_latent_sparse_bwd(*args, backend=backend, **call_kw)


@dataclasses.dataclass
class Quality:
    """One backend's outputs on a shape's inputs, judged: distance from the first backend's, error."""

    rel_l2_vs_first: float | None
    error: dict


def assess(args, calls: dict, budget_bytes=REFERENCE_BLOCK_BYTES) -> dict:
    """backend -> Quality: each of ``calls`` (backend -> no-argument call, the first the reference
    for agreement) called once on ``args``, against the first's outputs and the float64 reference."""
    return assess_outputs(args, {backend: call() for backend, call in calls.items()}, budget_bytes)


def assess_outputs(args, outputs: dict, budget_bytes=REFERENCE_BLOCK_BYTES) -> dict:
    """backend -> Quality of ``outputs`` (backend -> its (dq, dkv, d_attn_sink) on ``args``, the
    first the reference for agreement)."""
    first = next(iter(outputs.values()))
    errors = oracle_errors(args, outputs, budget_bytes)
    qualities = {}
    for n, (backend, got) in enumerate(outputs.items()):
        disagreement = None if n == 0 else max(rel_l2(x, y) for x, y in zip(got, first))
        qualities[backend] = Quality(disagreement, errors[backend])
    return qualities


def measure(shape: dict, backends=GPU_BACKENDS, d_k=576, d_v=512, warmup=3, repeats=10, indices="uniform",
            trace=0, **call_kw) -> list:
    """The rows of one shape and index pattern, a row a backend; with ``trace`` > 0, each row
    also holds its backend's GPU kernels over that many more calls (kernel_trace)."""
    import torch

    args = production_inputs(shape["B"], shape["S"], shape["S_kv"], shape["H"], shape["L"], d_k, d_v, indices=indices)
    overlap = index_overlap(args[6])
    calls = {backend: backend_call(backend, args, call_kw) for backend in backends}
    spans = {}
    with gpu_clocks.Sampler() as sampler:
        times = time_interleaved(calls, warmup, repeats, spans)
    clocks = {backend: sampler.summary(spans[backend]) for backend in backends}
    queued = time_queued(calls)
    # One more call each: its scratch, the outputs that are judged, and (ours) whether it redid
    # its lanes in int64.
    scratch, outputs, redone = {}, {}, {}
    for backend, call in calls.items():
        instruments = Instruments() if backend in BACKENDS else None
        if instruments is not None:
            call = backend_call(backend, args, dict(call_kw, instruments=instruments))
        scratch[backend], outputs[backend] = scratch_and_outputs(call)
        redone[backend] = lanes_redone(instruments)
    quality = assess_outputs(args, outputs)
    del outputs
    kernels = {backend: kernel_trace(call, trace) if trace else None for backend, call in calls.items()}
    rows = []
    for backend in backends:
        ms = statistics.median(times[backend])
        rows.append(Row(shape["B"], shape["S"], shape["S_kv"], shape["H"], shape["L"], d_k, d_v, backend, ms,
                        flops(shape["B"], shape["S"], shape["H"], shape["L"], d_k, d_v) / (ms * 1e-3) / 1e12,
                        scratch[backend] / 2**30, min(times[backend]), max(times[backend]), repeats,
                        rel_l2_vs_first=quality[backend].rel_l2_vs_first, error=quality[backend].error,
                        min_budget_gib=min_budget_gib(shape, d_k, d_v, backend, call_kw.get("block_h")),
                        lanes_redone=redone[backend], indices=indices, index_overlap=overlap,
                        kernels=kernels[backend], queued_ms=statistics.median(queued[backend]),
                        clocks=None if clocks[backend] is None else clocks[backend].as_dict(),
                        clocks_unavailable=sampler.unavailable))
    del quality
    torch.cuda.empty_cache()
    return with_error_ratios(with_ratios(rows))


def lanes_redone(instruments) -> bool | None:
    """Whether a call seen by ``instruments`` (mqa_bwd.Instruments, or None) redid its lanes in
    int64; None where it had no lanes launch or nothing was seen. Synchronises."""
    if instruments is None or not instruments.redone:
        return None
    return any(int(flag.item()) != 0 for flag in instruments.redone)


def min_budget_gib(shape: dict, d_k: int, d_v: int, backend: str, block_h=None) -> float | None:
    """The smallest scratch budget (dkv_buf_bytes) our backends accept at this shape, in GiB."""
    from .wrapper import scratch_bytes

    if backend not in BACKENDS:
        return None
    return scratch_bytes(shape["B"], shape["S"], shape["S_kv"], shape["H"], shape["L"], d_k, d_v,
                         block_h=block_h, backend=backend) / 2**30


def is_atomic_control(backend: str) -> bool:
    return backend.endswith("-atomic")


def is_ours_deterministic(backend: str) -> bool:
    return backend in ("tilelang", "model")


def with_ratios(rows) -> list:
    """Fill det_over_atomic and det_over_cudnn (and queued_det_over_cudnn, where both rows hold
    a queued time) on each deterministic row of ours that has an atomic-control (or cuDNN) row
    of the same shape."""
    atomic = {r.shape: r.ms for r in rows if is_atomic_control(r.backend)}
    peer = {r.shape: r for r in rows if r.backend == CUDNN}
    for r in rows:
        if is_ours_deterministic(r.backend):
            if r.shape in atomic:
                r.det_over_atomic = r.ms / atomic[r.shape]
            if r.shape in peer:
                r.det_over_cudnn = r.ms / peer[r.shape].ms
                if r.queued_ms is not None and peer[r.shape].queued_ms is not None:
                    r.queued_det_over_cudnn = r.queued_ms / peer[r.shape].queued_ms
    return rows


def error_ratio(error: float, control: float) -> float:
    if control > 0:
        return error / control
    return 1.0 if error == 0 else math.inf


def error_ratios(error: dict, control: dict) -> dict:
    """Output name -> ``error``'s over ``control``'s (error_ratio), for every output of ``error``."""
    return {name: error_ratio(error[name], control[name]) for name in error}


def within_standard(ratios: dict) -> bool:
    """Issue 30's standard on error_ratios: every output at most ADMISSIBLE_ERROR_RATIO."""
    return all(ratio <= ADMISSIBLE_ERROR_RATIO for ratio in ratios.values())


def with_error_ratios(rows) -> list:
    """Fill error_over_atomic (per output) on every row with errors whose shape has an
    atomic-control row with errors; the control's own stays None."""
    control = {r.shape: r.error for r in rows if is_atomic_control(r.backend) and r.error}
    for r in rows:
        if r.error and r.shape in control and not is_atomic_control(r.backend):
            r.error_over_atomic = error_ratios(r.error, control[r.shape])
    return rows


def admissible(row) -> bool | None:
    """Issue 30's standard on one row: every output's error at most ADMISSIBLE_ERROR_RATIO times the
    control's; None where there is no ratio to judge."""
    if not row.error_over_atomic:
        return None
    return within_standard(row.error_over_atomic)


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of the table: its header, width, and the text of a row's cell."""

    header: str
    width: int
    cell: Callable


def _optional(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _agreement(row) -> str:
    if row.rel_l2_vs_first is None:
        return ""
    return f"{row.rel_l2_vs_first:.1e}" + (" DISAGREE" if row.rel_l2_vs_first > AGREEMENT_RTOL else "")


def _error(name: str) -> Callable:
    return lambda row: "" if not row.error else f"{row.error[name]:.2e}"


def _error_ratio(row) -> str:
    """The largest of the per-output ratios, flagged when over the admissibility standard."""
    if not row.error_over_atomic:
        return ""
    worst = max(row.error_over_atomic.values())
    return f"{worst:.2f}" + ("" if admissible(row) else " OVER")


COLUMNS = [
    Column("B", 2, lambda r: str(r.B)),
    Column("S", 5, lambda r: str(r.S)),
    Column("S_kv", 5, lambda r: str(r.S_kv)),
    Column("H", 4, lambda r: str(r.H)),
    Column("L", 5, lambda r: str(r.L)),
    Column("indices", 13, lambda r: r.indices + ("" if r.index_overlap is None else f" {r.index_overlap:.2f}")),
    Column("backend", 16, lambda r: r.backend),
    Column("ms", 9, lambda r: f"{r.ms:.3f}"),
    Column("TFLOP/s", 8, lambda r: f"{r.tflops:.1f}"),
    Column("scratch GiB", 11, lambda r: f"{r.peak_scratch_gib:.2f}"),
    Column("min budget", 10, lambda r: _optional(r.min_budget_gib, ".3f")),
    Column("det/atomic", 10, lambda r: _optional(r.det_over_atomic, ".2f")),
    Column("det/cuDNN", 9, lambda r: _optional(r.det_over_cudnn, ".2f")),
    Column("queued ms", 9, lambda r: _optional(r.queued_ms, ".3f")),
    Column("queued det/cuDNN", 16, lambda r: _optional(r.queued_det_over_cudnn, ".2f")),
    Column("rel L2", 8, _agreement),
    Column("err dq", 8, _error("dq")),
    Column("err dkv", 8, _error("dkv")),
    Column("err dsink", 9, _error("d_attn_sink")),
    Column("err/atomic", 10, _error_ratio),
    Column("redo", 4, lambda r: "" if r.lanes_redone is None else ("yes" if r.lanes_redone else "no")),
    Column("SM MHz", 7, lambda r: _sm_clock(r.clocks)),
]


def _clock_summary(clocks: dict | None) -> gpu_clocks.ClockSummary | None:
    """A Row's clocks (a dict, from measure or from JSON) as a ClockSummary."""
    return None if clocks is None else gpu_clocks.ClockSummary(**{**clocks, "reasons": tuple(clocks["reasons"])})


def _sm_clock(clocks: dict | None) -> str:
    """The median SM clock of a row's calls, starred where it sat below the top clock while NVML
    gave a slowdown reason (ClockSummary.slowed)."""
    summary = _clock_summary(clocks)
    return "" if summary is None else f"{summary.sm_mhz_median:.0f}" + ("*" if summary.slowed else "")


def clock_notes(rows) -> str:
    """Under the table: each starred row's clock range and reasons; once, why no clock was sampled."""
    lines = []
    for r in rows:
        c = _clock_summary(r.clocks)
        if c is not None and c.slowed:
            shape = f"{r.label} {r.indices}, {r.backend}"
            top = "" if c.sm_mhz_top is None else f" (top {c.sm_mhz_top})"
            limit = "" if c.power_limit_w is None else f" of a {c.power_limit_w:.0f} W limit"
            lines.append(f"* {shape}: SM {c.sm_mhz_min}-{c.sm_mhz_max} MHz{top} over {c.samples} samples, "
                         f"{c.power_w_max:.0f} W{limit} (NVML's average), {c.temperature_c_max} C; "
                         f"held down by {', '.join(c.reasons)}")
    lines += dict.fromkeys(r.clocks_unavailable for r in rows if r.clocks is None and r.clocks_unavailable)
    return "\n".join(lines)


def table(rows, columns=None) -> str:
    """The rows as a text table of ``columns`` (None: COLUMNS)."""
    columns = COLUMNS if columns is None else columns
    lines = [" ".join(f"{c.header:>{c.width}}" for c in columns)]
    for r in rows:
        lines.append(" ".join(f"{c.cell(r):>{c.width}}" for c in columns))
    return "\n".join(lines)


def traces(rows, top: int = 12) -> str:
    """The GPU kernels of every row that holds a trace (measure's ``trace``), a block a row, then
    the main kernels side by side (main_kernel_lines)."""
    blocks = []
    for r in rows:
        if r.kernels:
            blocks.append("\n".join(trace_lines(f"{r.label} {r.indices}, {r.backend}", r.kernels, top)))
    return "\n".join(blocks + main_kernel_lines(rows))


def main_kernel_lines(rows) -> list:
    """A line a traced shape and index pattern: each backend's main kernel, its longest GPU kernel
    a call (ours: main_bwd's launches together), and det/cuDNN and det/atomic of those. The
    kernels are where the backends differ most, without the host's front or the short launches.
    Rows are compared as with_ratios compares them (Row.shape)."""
    groups = {}
    for r in rows:
        if r.kernels:
            groups.setdefault(r.shape, []).append((r, max(ms for _, ms, _ in r.kernels)))
    lines = []
    for group in groups.values():
        first = group[0][0]
        mains = [(r.backend, ms) for r, ms in group]
        line = f"main kernels, {first.label} {first.indices}: " + ", ".join(f"{b} {ms:.3f} ms" for b, ms in mains)
        det = next((ms for b, ms in mains if is_ours_deterministic(b)), None)
        ratios = []
        for label, is_peer in (("det/cuDNN", lambda b: b == CUDNN), ("det/atomic", is_atomic_control)):
            peer = next((ms for b, ms in mains if is_peer(b)), None)
            if det is not None and peer is not None:
                ratios.append(f"{label} {det / peer:.3f}")
        lines.append(line + ("; " + ", ".join(ratios) if ratios else ""))
    return lines


def environment() -> dict:
    import torch

    from importlib import metadata

    info = {"torch": torch.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    try:
        import tilelang

        info["tilelang"] = tilelang.__version__
    except Exception:
        pass
    for distribution in ("nvidia-cudnn-frontend", "nvidia-cutlass-dsl"):
        try:
            info[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            pass
    return info


def to_json(rows, env=None) -> str:
    return json.dumps({"environment": env or {}, "rows": [r.as_dict() for r in rows]}, indent=1)


def plot_axis(rows) -> str:
    """The axis a plot of these rows runs along: H or L, whichever varies (H when both do)."""
    for key in ("H", "L"):
        if len({getattr(r, key) for r in rows}) > 1:
            return key
    raise ValueError("--plot: the rows differ in neither H nor L; add --sweep H=... or --sweep L=...")


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot: needs matplotlib (pip install 'mqa-bwd[plot]')") from None
    return plt


def plot(rows, path, axis=None) -> str:
    """PNG of ms against H or L, one line per backend and fixed rest of the shape; returns the axis."""
    plt = require_matplotlib()
    axis = axis or plot_axis(rows)
    others = [k for k in ("B", "S", "S_kv", "H", "L") if k != axis]
    lines = {}
    for r in rows:
        rest = ", ".join(f"{k}={getattr(r, k)}" for k in others) + ("" if r.indices == "uniform" else f", {r.indices}")
        lines.setdefault(f"{r.backend} ({rest})", []).append((getattr(r, axis), r.ms))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in sorted(lines.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel(axis)
    ax.set_ylabel("ms (median, CUDA events)")
    ax.set_title("sparse MQA backward: deterministic vs atomic")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return axis
