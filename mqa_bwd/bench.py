"""Benchmark: deterministic vs atomic backward at named or given shapes.

Times with CUDA events (median of repeats, after warm-up), in one process, so
the ratio deterministic / atomic is measured side by side. FLOPs by SPEC.md's
count per query row: 2 * (H*Dv*L + 3*H*Dk*L + H*Dv*L).
"""

import dataclasses
import json
import statistics

SHAPES = {
    "dsv32": [dict(B=1, S=4096, S_kv=8192, H=64, L=2048), dict(B=1, S=4096, S_kv=8192, H=128, L=2048)],
    "fleet": [dict(B=1, S=8192, S_kv=8192, H=64, L=640)],
}


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

    def as_dict(self):
        return dataclasses.asdict(self)


def flops(B, S, H, L, d_k, d_v) -> float:
    return float(B * S) * 2.0 * (H * d_v * L + 3 * H * d_k * L + H * d_v * L)


def production_inputs(B, S, S_kv, H, L, d_k=576, d_v=512, seed=0, device="cuda"):
    """Random inputs with causal top-k indices, built on the device."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((B, S, H, d_k), device=device, generator=g).bfloat16()
    kv = torch.randn((B, S_kv, d_k), device=device, generator=g).bfloat16()
    out = (torch.randn((B, S, H, d_v), device=device, generator=g) * 0.1).bfloat16()
    grad_out = torch.randn((B, S, H, d_v), device=device, generator=g).bfloat16()
    lse = torch.randn((B, S, H), device=device, generator=g) + 8.0
    sink = torch.randn((H,), device=device, generator=g)
    visible = torch.arange(S, device=device) + (S_kv - S) + 1
    idx = (torch.rand((B, S, L), device=device, generator=g) * visible.clamp(min=1).view(1, S, 1)).to(torch.int32)
    return (q, kv, out, grad_out, lse, sink, idx, d_k**-0.5)


def time_call(fn, warmup=3, repeats=10):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(shape: dict, backends=("tilelang", "tilelang-atomic"), d_k=576, d_v=512, warmup=3, repeats=10, **call_kw):
    import torch

    from . import mqa_latent_sparse_bwd

    args = production_inputs(shape["B"], shape["S"], shape["S_kv"], shape["H"], shape["L"], d_k, d_v)
    rows = []
    for backend in backends:
        def call():
            return mqa_latent_sparse_bwd(*args, backend=backend, **call_kw)

        ms = time_call(call, warmup, repeats)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = call()
        torch.cuda.synchronize()
        outputs = sum(t.numel() * t.element_size() for t in result)
        scratch = torch.cuda.max_memory_allocated() - base - outputs
        del result
        rows.append(Row(shape["B"], shape["S"], shape["S_kv"], shape["H"], shape["L"], d_k, d_v, backend, ms,
                        flops(shape["B"], shape["S"], shape["H"], shape["L"], d_k, d_v) / (ms * 1e-3) / 1e12,
                        scratch / 2**30))
    return rows


def table(rows) -> str:
    lines = [f"{'B':>2} {'S':>5} {'S_kv':>5} {'H':>4} {'L':>5} {'backend':>16} {'ms':>9} {'TFLOP/s':>8} {'scratch GiB':>11} {'det/atomic':>10}"]
    atomic = {(r.B, r.S, r.S_kv, r.H, r.L): r.ms for r in rows if r.backend.endswith("atomic")}
    for r in rows:
        key = (r.B, r.S, r.S_kv, r.H, r.L)
        ratio = f"{r.ms / atomic[key]:.2f}" if not r.backend.endswith("atomic") and key in atomic else ""
        lines.append(f"{r.B:>2} {r.S:>5} {r.S_kv:>5} {r.H:>4} {r.L:>5} {r.backend:>16} {r.ms:>9.3f} {r.tflops:>8.1f} {r.peak_scratch_gib:>11.2f} {ratio:>10}")
    return "\n".join(lines)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="dsv32", help=f"named shape set: {sorted(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None, help="write rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for shape in SHAPES[args.shapes]:
        rows += measure(shape, repeats=args.repeats)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
