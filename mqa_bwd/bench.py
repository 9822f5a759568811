"""Benchmark: deterministic vs atomic backward at named or given shapes.

What is measured, and why it is fair:

* Both backends run on the same device tensors (causal top-k indices, built
  once per shape), in one process, and their timed repeats are interleaved
  (det, atomic, det, atomic, ...) so that clock and thermal drift fall on both
  alike. Each is warmed up first (kernel compilation and caches).
* Time is the whole public call (validation, layout, every kernel), as a
  training step pays it: CUDA events around it, median of the repeats.
* TFLOP/s by docs/SPEC.md's count per query row: 2 * (H*Dv*L + 3*H*Dk*L + H*Dv*L).
* Peak scratch: the most memory allocated during one call beyond the inputs
  and the three outputs (the int64 or fp32 dKV accumulator, padded copies).
* The outputs of the two backends are compared once (relative L2 per output):
  a fast variant that skips work shows up as a disagreement, not as a speed-up.

Needs a CUDA GPU with the TileLang kernels (Hopper); the CPU tile model is a
correctness artifact, never timed.
"""

import dataclasses
import json
import statistics

from .contract import GPU_BACKENDS

SHAPES = {
    "dsv32": [dict(B=1, S=4096, S_kv=8192, H=64, L=2048), dict(B=1, S=4096, S_kv=8192, H=128, L=2048)],
    "fleet": [dict(B=1, S=8192, S_kv=8192, H=64, L=640)],
}
SHAPE_KEYS = ("B", "S", "S_kv", "H", "L")
#: Outputs of two backends that differ more than this (relative L2) do not compute the same thing.
AGREEMENT_RTOL = 2e-2


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
    #: max relative L2 distance of (dq, dkv, d_attn_sink) from the first backend's, None for the first
    rel_l2_vs_first: float | None = None

    @property
    def shape(self) -> tuple:
        return (self.B, self.S, self.S_kv, self.H, self.L, self.d_k, self.d_v)

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


def production_inputs(B, S, S_kv, H, L, d_k=576, d_v=512, seed=0, device="cuda"):
    """Random q, kv, grad_out, sink and causal top-k indices, built on the device,
    with out and lse from the forward (so that every head's softmax mass is at
    most 1, as in training: the fixed-point design checks it)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((B, S, H, d_k), device=device, generator=g).bfloat16()
    kv = torch.randn((B, S_kv, d_k), device=device, generator=g).bfloat16()
    grad_out = torch.randn((B, S, H, d_v), device=device, generator=g).bfloat16()
    sink = torch.randn((H,), device=device, generator=g)
    visible = torch.arange(S, device=device) + (S_kv - S) + 1
    idx = (torch.rand((B, S, L), device=device, generator=g) * visible.clamp(min=1).view(1, S, 1)).to(torch.int32)
    sm_scale = d_k**-0.5
    out, lse = _forward(q, kv, idx, sink, sm_scale, d_v)
    return (q, kv, out, grad_out, lse, sink, idx, sm_scale)


def _forward(q, kv, idx, sink, sm_scale, d_v, rows_per_step=128):
    """(out bf16, lse fp32) of SPEC's forward, in fp32, a block of query rows at a time."""
    import torch

    B, S, H, _ = q.shape
    out = torch.empty((B, S, H, d_v), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((B, S, H), dtype=torch.float32, device=q.device)
    for b in range(B):
        for s0 in range(0, S, rows_per_step):
            rows = slice(s0, min(S, s0 + rows_per_step))
            keys = kv[b][idx[b, rows].long()].float()  # [n, L, Dk]; every index here is valid
            logits = torch.einsum("nhd,nld->nhl", q[b, rows].float(), keys) * sm_scale
            lse_rows = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - torch.logaddexp(lse_rows, sink.view(1, H)).unsqueeze(-1))
            out[b, rows] = torch.einsum("nhl,nld->nhd", p, keys[..., :d_v]).bfloat16()
            lse[b, rows] = lse_rows
    return out, lse


def _event_time(fn) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def prepared_wrapper_call(args, launcher):
    """One whole wrapper call on ``args`` (production_inputs' tuple) with ``launcher``, as
    a no-argument callable returning (dq, dkv, d_attn_sink); validated here, once, so
    that timing the callable leaves validation out. An A/B of two launchers (or of two
    packages, benchmarks/package_ab.py) passes each its own launcher."""
    import functools

    from . import wrapper

    plan = wrapper.validate(*args, None, None, launcher)
    return functools.partial(wrapper.run, plan, *args, launcher)


def timed_wrapper_call(args, launcher) -> tuple:
    """(ms, (dq, dkv, d_attn_sink)) of one whole wrapper call (prepared_wrapper_call)."""
    call = prepared_wrapper_call(args, launcher)
    outputs = []
    ms = _event_time(lambda: outputs.append(call()))
    return ms, outputs[0]


def same_bits(outputs, others) -> bool:
    """Whether two calls' outputs (dq, dkv, d_attn_sink) are bitwise equal."""
    import torch

    return all(torch.equal(x, y) for x, y in zip(outputs, others))


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


def time_interleaved(calls: dict, warmup=3, repeats=10) -> dict:
    """name -> list of ms; repeats of all calls interleaved, after each call's warm-up."""
    import torch

    for fn in calls.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(_event_time(fn))
    return times


def peak_scratch_bytes(fn) -> int:
    """Peak memory allocated during one call beyond what existed before it and its outputs."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    outputs = sum(t.numel() * t.element_size() for t in result)
    peak = torch.cuda.max_memory_allocated()
    del result
    return max(0, peak - base - outputs)


def rel_l2(a, b) -> float:
    """Relative L2 distance; inf when either side is not finite (a NaN never passes as agreement)."""
    import torch

    a, b = a.float(), b.float()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return float("inf")
    denominator = float(b.norm())
    return float((a - b).norm()) / denominator if denominator else float((a - b).norm())


def measure(shape: dict, backends=GPU_BACKENDS, d_k=576, d_v=512, warmup=3, repeats=10, **call_kw) -> list:
    import torch

    from . import mqa_latent_sparse_bwd

    args = production_inputs(shape["B"], shape["S"], shape["S_kv"], shape["H"], shape["L"], d_k, d_v)

    def caller(backend):
        return lambda: mqa_latent_sparse_bwd(*args, backend=backend, **call_kw)

    calls = {backend: caller(backend) for backend in backends}
    times = time_interleaved(calls, warmup, repeats)
    first = calls[backends[0]]()
    rows = []
    for backend in backends:
        disagreement = None
        if backend != backends[0]:
            other = calls[backend]()
            disagreement = max(rel_l2(x, y) for x, y in zip(other, first))
            del other
        ms = statistics.median(times[backend])
        rows.append(Row(shape["B"], shape["S"], shape["S_kv"], shape["H"], shape["L"], d_k, d_v, backend, ms,
                        flops(shape["B"], shape["S"], shape["H"], shape["L"], d_k, d_v) / (ms * 1e-3) / 1e12,
                        peak_scratch_bytes(calls[backend]) / 2**30, min(times[backend]), max(times[backend]),
                        repeats, rel_l2_vs_first=disagreement))
    del first
    torch.cuda.empty_cache()
    return with_ratios(rows)


def with_ratios(rows) -> list:
    """Fill det_over_atomic on each deterministic row that has an atomic row of the same shape."""
    atomic = {r.shape: r.ms for r in rows if r.backend.endswith("atomic")}
    for r in rows:
        if not r.backend.endswith("atomic") and r.shape in atomic:
            r.det_over_atomic = r.ms / atomic[r.shape]
    return rows


def table(rows) -> str:
    header = (f"{'B':>2} {'S':>5} {'S_kv':>5} {'H':>4} {'L':>5} {'backend':>16} {'ms':>9} {'TFLOP/s':>8} "
              f"{'scratch GiB':>11} {'det/atomic':>10} {'rel L2':>8}")
    lines = [header]
    for r in rows:
        ratio = f"{r.det_over_atomic:.2f}" if r.det_over_atomic is not None else ""
        agree = "" if r.rel_l2_vs_first is None else f"{r.rel_l2_vs_first:.1e}"
        if r.rel_l2_vs_first is not None and r.rel_l2_vs_first > AGREEMENT_RTOL:
            agree += " DISAGREE"
        lines.append(f"{r.B:>2} {r.S:>5} {r.S_kv:>5} {r.H:>4} {r.L:>5} {r.backend:>16} {r.ms:>9.3f} {r.tflops:>8.1f} "
                     f"{r.peak_scratch_gib:>11.2f} {ratio:>10} {agree:>8}")
    return "\n".join(lines)


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    try:
        import tilelang

        info["tilelang"] = tilelang.__version__
    except Exception:
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
        rest = ", ".join(f"{k}={getattr(r, k)}" for k in others)
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
