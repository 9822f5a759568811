"""Comparisons with reports a kernel engineer can act on.

Tolerance rule (FlashAttention's): an output passes when its max absolute
error against the float64 oracle is at most twice the max absolute error of
the oracle's bf16 baseline on the same case, plus a float32 floor:
1e-5 x max(max |reference|, 1). The 1 covers outputs that are exactly zero
by cancellation (L = 1: dP - Delta = 0), where float32 leaves ~1e-7 behind;
the cases' inputs are of unit scale, so it is an absolute floor for them. Reports say how many elements exceed the
tolerance, the worst ones, their indices, both values and the bf16 ULP
distance (as torch.testing.assert_close does).
"""

import dataclasses

import ml_dtypes
import numpy as np

FLOOR_REL = 1e-5  # float32 accumulation floor, relative to max |reference|
FACTOR = 2.0


def to_numpy(x) -> np.ndarray:
    """torch / paddle / numpy -> numpy (bf16 stays ml_dtypes.bfloat16), on the host."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if mod.startswith("paddle"):
        import paddle

        if x.dtype == paddle.bfloat16:
            return x.cpu().numpy().view(np.uint16).view(ml_dtypes.bfloat16)
        return x.cpu().numpy()
    return np.asarray(x)


def bf16_ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of bf16 values between a and b (both rounded to bf16 first)."""

    def ordered(x):
        bits = np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, 0x8000 - bits, bits)  # monotone in the value; -0 == +0

    return np.abs(ordered(a) - ordered(b))


def f32_ulp_distance(a, b) -> np.ndarray:
    """Number of float32 values between a and b."""

    def ordered(x):
        bits = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # monotone in the value; -0 == +0

    return np.abs(ordered(a) - ordered(b))


@dataclasses.dataclass
class Comparison:
    name: str
    ok: bool
    max_err: float
    tolerance: float
    baseline_err: float
    mismatched: int
    total: int
    worst: list  # [(index tuple, got, want, ulp)]
    nonfinite: int
    #: Why no element-wise comparison was possible (a shape mismatch), else "".
    problem: str = ""

    def report(self) -> str:
        if self.problem:
            return f"{self.name}: MISMATCH: {self.problem}"
        verdict = "ok" if self.ok else "MISMATCH"
        lines = [
            f"{self.name}: {verdict}: max abs error {self.max_err:.3e} vs tolerance {self.tolerance:.3e} "
            f"(= {FACTOR:g} x bf16-baseline error {self.baseline_err:.3e} + floor); "
            f"{self.mismatched} of {self.total} elements over tolerance"
            + (f", {self.nonfinite} non-finite" if self.nonfinite else "")
        ]
        for index, got, want, ulp in self.worst:
            lines.append(f"    at {index}: got {got:.6e}, want {want:.6e}, |diff| {abs(got - want):.3e}, {ulp} bf16 ulp")
        return "\n".join(lines)


def compare(name, got, want, baseline, worst: int = 3) -> Comparison:
    """got: implementation output; want: float64 oracle; baseline: oracle's bf16 baseline."""
    got = np.asarray(to_numpy(got), dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    baseline = np.asarray(baseline, dtype=np.float64)
    if got.shape != want.shape:
        return Comparison(name, False, np.inf, 0.0, 0.0, want.size, want.size, [], 0,
                          problem=f"shape {got.shape}, want {want.shape}")
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    baseline_err = float(np.max(np.abs(baseline - want))) if want.size else 0.0
    tol = FACTOR * baseline_err + FLOOR_REL * max(scale, 1.0)
    diff = np.abs(got - want)
    nonfinite = int(np.count_nonzero(~np.isfinite(got)))
    diff = np.where(np.isfinite(got), diff, np.inf)
    over = diff > tol
    order = np.argsort(diff, axis=None, kind="stable")[::-1][:worst] if want.size else []
    ulps = bf16_ulp_distance(got, want) if want.size else np.zeros(0)
    worst_list = [
        (tuple(int(i) for i in np.unravel_index(k, want.shape)), float(got.flat[k]), float(want.flat[k]), int(ulps.flat[k]))
        for k in order
    ]
    max_err = float(diff.max()) if want.size else 0.0
    return Comparison(name, not over.any(), max_err, tol, baseline_err, int(over.sum()), want.size, worst_list, nonfinite)


def _bits(x: np.ndarray) -> np.ndarray:
    """[..., itemsize] bytes of each element."""
    x = np.ascontiguousarray(x)
    return x.view(np.uint8).reshape(x.shape + (x.dtype.itemsize,))


def first_difference(name, runs, labels=None) -> str | None:
    """Bitwise comparison of repeated results. None when all are identical bytes.

    Otherwise says which run diverged first from run 0, in how many elements,
    where the first differing element is (both values, bf16 ULP distance for
    bf16 outputs), the largest difference, and how many distinct results the
    runs produced. ``labels`` names the runs (default: "run 0", "run 1", ...).
    """
    label = (lambda i: labels[i]) if labels else (lambda i: f"run {i}")
    arrays = [np.ascontiguousarray(to_numpy(r)) for r in runs]
    first = arrays[0]
    distinct = {(first.shape, first.dtype.str, first.tobytes())}
    report = None
    for i, x in enumerate(arrays[1:], start=1):
        key = (x.shape, x.dtype.str, x.tobytes())
        if key in distinct:
            continue
        distinct.add(key)
        if report is not None:
            continue
        if x.shape != first.shape or x.dtype != first.dtype:
            report = f"{name}: {label(i)} has shape {x.shape} {x.dtype}, {label(0)} {first.shape} {first.dtype}"
            continue
        differs = (_bits(first) != _bits(x)).any(-1)
        k = int(np.flatnonzero(differs)[0])
        a64, x64 = first.astype(np.float64), x.astype(np.float64)
        with np.errstate(invalid="ignore"):
            d = np.abs(a64 - x64)
        where = tuple(int(j) for j in np.unravel_index(k, first.shape))
        ulp = ""
        if first.dtype == ml_dtypes.bfloat16:
            ulp = f" ({int(bf16_ulp_distance(a64.flat[k], x64.flat[k]))} bf16 ulp)"
        elif first.dtype == np.float32:
            ulp = f" ({int(f32_ulp_distance(first.flat[k], x.flat[k]))} fp32 ulp)"
        d = d[differs]
        finite = d[np.isfinite(d)]
        nonfinite = d.size - finite.size
        report = (
            f"{name}: {label(i)} differs from {label(0)} in {int(differs.sum())} of {differs.size} elements; "
            f"first at {where}: {float(a64.flat[k])!r} vs {float(x64.flat[k])!r}{ulp}; "
            + (f"max |diff| {finite.max():.3e}" if finite.size else "no finite difference")
            + (f"; {nonfinite} differ by NaN/inf (one side non-finite or NaN payloads)" if nonfinite else "")
        )
    if report is None:
        return None
    if len(arrays) > 2:
        report += f"; {len(distinct)} distinct results in {len(arrays)} runs"
    return report
