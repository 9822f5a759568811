"""Could a sample of query rows set exact fp32 sums' scales? Per-row Bounds for a study (GPU,
then CPU).

    python benchmarks/sample_scales.py collect --out DIR [--cases dsv32:1,fleet:4,...]   # GPU
    python benchmarks/sample_scales.py analyze DIR                                       # CPU

Exact fp32 sums (experiments/exact_f32.patch, at 231a86d) need a scale per kv row that puts its Bound (the
sum over its contributions of each one's largest |scaled value|) just below 2**24: too low and
dkv's error grows, too high and the call is redone. The bound is known only once the
contributions are. ``collect`` runs, per case (shape and temperature T, q scaled by T before
the forward), the deterministic call on all query rows and on two samples of them (every 16th
row from row 0 and from row 8), and saves each run's per-kv-row Bound in real units (the
kernel's Bound divided by the scale it rounded at), the slot counts per kv row, and dkv.
``analyze`` then prices scale rules offline: per rule, whether any row's Bound of the rows
outside the sample would reach 2**24 (a redo), and a model of dkv's added error: n roundings
of one quantum q per element add n q^2 / 12 in quadrature, against the control's 2.34e-3 (rel
L2 at every bench shape).
"""

import argparse
import math
import os

import torch

PHASES = (0, 8)
STEP = 16
LIMIT = 2.0**24
CONTROL_ERROR = 2.34e-3
SHAPES = {"dsv32": dict(B=1, S=4096, S_kv=8192, H=64, L=2048), "dsv32h128": dict(B=1, S=4096, S_kv=8192, H=128, L=2048),
          "fleet": dict(B=1, S=8192, S_kv=8192, H=64, L=640), "causal": dict(B=1, S=4096, S_kv=4096, H=64, L=2048)}


def collect(out: str, cases: list) -> None:
    from mqa_bwd import bench, fixed_point, launch, wrapper

    class Recorder(launch.TileLangLauncher):
        def plan(self, *args, **kw):
            self.row_scale, allowance = super().plan(*args, **kw)
            return self.row_scale, allowance

        def main_bwd(self, *args, bound=None, **kw):
            if bound is not None:
                self.bound = bound
            super().main_bwd(*args, bound=bound, **kw)

    def run(args):
        recorder = Recorder(True)
        _, dkv, _ = wrapper.backward_with(recorder, *args)
        # The launcher's plan gives the scale the launches round at: the plan's times 2**(lanes_gain - 30).
        real = recorder.bound.double() / recorder.row_scale.double()
        plan_scale = recorder.row_scale.double() / fixed_point.lanes_factor(recorder.lanes_gain)
        idx = args[6].reshape(-1).long()
        counts = torch.bincount(idx[idx >= 0], minlength=args[1].shape[1])
        return real.cpu(), counts.cpu(), dkv.float().reshape(-1, dkv.shape[-1]).cpu(), plan_scale.cpu()

    os.makedirs(out, exist_ok=True)
    for case in cases:
        name, temperature = case.split(":")
        shape = dict(SHAPES[name])
        indices = "indexer" if name == "causal" else "uniform"
        q, kv, o, do, lse, sink, idx, sm_scale = bench.production_inputs(**shape, indices=indices,
                                                                          temperature=float(temperature))
        full = run((q, kv, o, do, lse, sink, idx, sm_scale))
        saved = {"bound": full[0], "counts": full[1], "dkv_norm": float(full[2].double().norm()), "columns": full[2].shape[1],
                 "plan_scale": full[3], "heads": shape["H"]}
        for phase in PHASES:
            rows = slice(phase, None, STEP)
            sample = tuple(t[:, rows].contiguous() for t in (q, o, do, lse, idx))
            bound, counts, _, _ = run((sample[0], kv, sample[1], sample[2], sample[3], sink, sample[4], sm_scale))
            saved[f"bound{phase}"], saved[f"counts{phase}"] = bound, counts
        torch.save(saved, os.path.join(out, f"{name}_T{temperature}.pt"))
        print(f"{case}: largest Bound 2^{math.log2(float(full[0].max())):.2f} real units", flush=True)


def added_error(quantum: torch.Tensor, roundings: torch.Tensor, norm: float, columns: int) -> float:
    """The model's relative L2 error a rounding per contribution adds to dkv (of L2 norm ``norm``):
    n q^2 / 12 per element."""
    return math.sqrt(float((roundings.double() * quantum.double() ** 2).sum()) * columns / 12) / norm


def ratio(extra: float) -> float:
    return math.sqrt(1 + (extra / CONTROL_ERROR) ** 2)


def rules(case: dict) -> dict:
    """name -> (row scales for the rows outside the sample; their Bound's largest log2 at those
    scales; whether the rule covers every row, as a fixed gain does, or the rows outside the sample)."""
    full = case["bound"]
    rest = full - case["bound0"]
    out = {}
    live = full > 0
    fixed = {f"every row, fixed gain {g}": case["plan_scale"] * 2.0 ** (g - 30) for g in (14, 15, 16)}
    for target in (23.0, 23.5):
        # one scale for the batch element, from the sample's largest Bound times 16 (the prototype)
        s = 2.0 ** target / (STEP * case["bound0"].max())
        out[f"element, max x16 -> 2^{target}"] = torch.full_like(full, float(s))
        # per kv row, from the sample's Bound times 16; rows the sample never reached get the element's
        per_row = 2.0 ** target / (STEP * case["bound0"]).clamp(min=1e-300)
        out[f"row, x16 -> 2^{target}"] = torch.where(case["bound0"] > 0, per_row, float(s))
        # per kv row, the smaller of two samples' estimates (a heavy contribution shows in one only)
        low = torch.minimum(case["bound0"], case["bound8"])
        per_row2 = 2.0 ** target / (STEP * low).clamp(min=1e-300)
        out[f"row, min of 2 x16 -> 2^{target}"] = torch.where(low > 0, per_row2, float(s))
        # per kv row, the mean sampled bound per slot times the row's slot count outside the sample
        per_slot = case["bound0"] / case["counts0"].clamp(min=1)
        mean_slot = float(case["bound0"].sum() / case["counts0"].sum())
        est = torch.where(case["counts0"] >= 8, per_slot, mean_slot) * (case["counts"] - case["counts0"])
        out[f"row, per-slot x count -> 2^{target}"] = 2.0 ** target / est.clamp(min=1e-300)
    # the best single scale, for reference: the element's largest rest Bound put at 2^23.9
    out["element, best (2^23.9)"] = torch.full_like(full, float(2.0**23.9 / rest.max()))
    # scales are powers of two in the design
    out = {k: torch.exp2(torch.floor(torch.log2(v))) for k, v in out.items()}
    result = {k: (v, math.log2(float((full * v)[live].max())), True) for k, v in fixed.items()}
    result.update({k: (v, math.log2(float((rest * v)[live].max())), False) for k, v in out.items()})
    return result


def analyze(directory: str) -> None:
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".pt"):
            continue
        case = torch.load(os.path.join(directory, name))
        rest_counts = case["counts"] - case["counts0"]
        launches = max(1, case["heads"] // 64)
        print(f"{name}: largest Bound 2^{math.log2(float(case['bound'].max())):.2f}")
        print("  rule                                   largest rest Bound  redo   dkv err / control (model)")
        for rule, (scale, largest, every) in rules(case).items():
            err = added_error(1 / scale, (case["counts"] if every else rest_counts) * launches, case["dkv_norm"], case["columns"])
            print(f"  {rule:38s}  2^{largest:6.2f}          {'yes' if largest >= 24 else 'no ':3s}    {ratio(err):.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    c.add_argument("--cases", default="dsv32:1,dsv32:4,fleet:1,fleet:4,causal:1,dsv32h128:1,dsv32:8,fleet:8")
    a = sub.add_parser("analyze")
    a.add_argument("directory")
    args = parser.parse_args()
    if args.command == "collect":
        collect(args.out, args.cases.split(","))
    else:
        analyze(args.directory)


if __name__ == "__main__":
    main()
