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

from mqa_bwd.edge import to_numpy

FLOOR_REL = 1e-5  # float32 accumulation floor, relative to max |reference|
FACTOR = 2.0


def ulp_distance(a, b) -> np.ndarray:
    """Number of representable values between a and b in their own floating dtype (bf16, fp16, fp32,
    fp64; both the same), as int64; -0 and +0 are one value. Integer arrays: the plain difference."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype:
        raise ValueError(f"ulp_distance: dtypes differ ({a.dtype} vs {b.dtype})")
    if a.dtype.kind in "iu":
        return np.abs(a.astype(np.int64) - b.astype(np.int64))
    width = a.dtype.itemsize * 8
    unsigned = {16: np.uint16, 32: np.uint32, 64: np.uint64}[width]
    sign = 1 << (width - 1)

    def ordered(x):
        u = np.ascontiguousarray(x).view(unsigned)
        if width == 64:  # int64 arithmetic cannot hold 2**64: fold on the sign bit as signed values
            signed = u.view(np.int64)
            return np.where(signed < 0, -(signed & np.int64(sign - 1)), signed)
        u = u.astype(np.int64)
        return np.where(u >= sign, sign - u, u)  # monotone in the value

    return np.abs(ordered(a) - ordered(b))


def bf16_ulp_distance(a, b) -> np.ndarray:
    """Number of bf16 values between a and b, both rounded to bf16 first."""
    as_bf16 = lambda x: np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    return ulp_distance(as_bf16(a), as_bf16(b))


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


@dataclasses.dataclass(frozen=True)
class Difference:
    """Where and how much two arrays of one shape and dtype differ, byte for byte."""

    count: int  # elements whose bytes differ
    total: int
    first_index: tuple
    first_values: tuple  # (a's value, b's value) as floats
    max_abs: float  # over the differing elements; inf where one side is non-finite
    max_ulp: int  # in the arrays' own dtype
    nonfinite: int  # differing elements with a NaN or inf on one side
    first_ulp: int = 0  # at first_index, in the arrays' own dtype
    max_abs_finite: float | None = None  # over the differing elements with finite values on both sides

    def describe(self, dtype) -> str:
        unit = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float64": "fp64"}.get(str(dtype))
        first_ulp = f" ({self.first_ulp} {unit} ulp)" if unit else ""
        return (f"{self.count} of {self.total} elements; first at {self.first_index}: "
                f"{self.first_values[0]!r} vs {self.first_values[1]!r}{first_ulp}; "
                + (f"max |diff| {self.max_abs_finite:.3e}" if self.max_abs_finite is not None else "no finite difference")
                + (f"; {self.nonfinite} differ by NaN/inf (one side non-finite or NaN payloads)" if self.nonfinite else ""))


def difference(a, b) -> Difference | None:
    """None when a and b are the same bytes; else where and how much they differ.
    Both must have one shape and dtype (a ValueError otherwise)."""
    a, b = np.ascontiguousarray(to_numpy(a)), np.ascontiguousarray(to_numpy(b))
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"difference: shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
    differs = (_bits(a) != _bits(b)).any(-1)
    count = int(differs.sum())
    if not count:
        return None
    k = int(np.flatnonzero(differs)[0])
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.abs(a64 - b64)[differs]
    finite = d[np.isfinite(d)]
    ulps = ulp_distance(a[differs], b[differs]) if a.dtype.kind in "fiu" or a.dtype == ml_dtypes.bfloat16 else None
    return Difference(
        count=count, total=differs.size, first_index=tuple(int(j) for j in np.unravel_index(k, a.shape)),
        first_values=(float(a64.flat[k]), float(b64.flat[k])),
        max_abs=float(d.max()) if finite.size == d.size else float("inf"),
        max_ulp=int(ulps.max()) if ulps is not None else 0, nonfinite=int(d.size - finite.size),
        first_ulp=int(ulp_distance(a.flat[k:k + 1], b.flat[k:k + 1])[0]) if ulps is not None else 0,
        max_abs_finite=float(finite.max()) if finite.size else None)


def first_difference(name, runs, labels=None) -> str | None:
    """Bitwise comparison of repeated results. None when all are identical bytes.

    Otherwise says which run diverged first from run 0, in how many elements,
    where the first differing element is (both values, ULP distance in the
    output's dtype), the largest difference, and how many distinct results the
    runs produced. ``labels`` names the runs (default: "run 0", "run 1", ...).
    """
    tally = RunTally(name)
    for x in runs:
        tally.add(to_numpy(x))
    return tally.report(labels)


@dataclasses.dataclass
class RunTally:
    """N runs of one output against run 0, byte for byte: distinct results, the first run that
    diverges and where, the largest distance from run 0 over all runs. Runs are host arrays;
    ``add_same`` counts a run its caller already found equal to run 0 (on the device, say)."""

    name: str
    shape: tuple = ()
    dtype: str = ""
    runs: int = 0
    distinct: int = 0
    first_diverging_run: int | None = None
    first_element: tuple | None = None  # index in the output
    first_values: tuple | None = None  # (run 0's value, the diverging run's value)
    differing_elements: int = 0  # in the first diverging run
    max_abs_diff: float = 0.0  # over all runs, against run 0
    max_ulp: int = 0

    def __post_init__(self):
        self._reference = None
        self._reference_key = None
        self._seen = set()
        self._first = None  # (run, Difference or a shape/dtype text)

    @property
    def bitwise(self) -> bool:
        return self.runs > 0 and self.distinct == 1

    def add_same(self) -> None:
        self.runs += 1

    def add(self, x) -> None:
        x = np.ascontiguousarray(x)
        run, self.runs = self.runs, self.runs + 1
        key = (x.shape, x.dtype.str, x.tobytes())
        if self._reference is None:
            self._reference, self._reference_key = x, key
            self._seen.add(key)
            self.shape, self.dtype, self.distinct = tuple(x.shape), str(x.dtype), 1
            return
        if key == self._reference_key:
            return
        if key not in self._seen:
            self._seen.add(key)
            self.distinct = len(self._seen)
        ref = self._reference
        if x.shape != ref.shape or x.dtype != ref.dtype:
            self.max_abs_diff = float("inf")
            if self.first_diverging_run is None:
                self.first_diverging_run = run
                self.first_values = (f"shape {ref.shape} {ref.dtype}", f"shape {x.shape} {x.dtype}")
                self._first = (run, f"has shape {x.shape} {x.dtype}, run 0 {ref.shape} {ref.dtype}")
            return
        d = difference(ref, x)
        self.max_abs_diff = max(self.max_abs_diff, d.max_abs)
        self.max_ulp = max(self.max_ulp, d.max_ulp)
        if self.first_diverging_run is None:
            self.first_diverging_run, self.first_element, self.first_values = run, d.first_index, d.first_values
            self.differing_elements = d.count
            self._first = (run, d)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["bitwise"] = self.bitwise
        return d

    def report(self, labels=None) -> str | None:
        """One line on how the runs differ (None when all are identical bytes)."""
        if self._first is None:
            return None
        label = (lambda i: labels[i]) if labels else (lambda i: f"run {i}")
        run, d = self._first
        if isinstance(d, str):
            text = f"{self.name}: {label(run)} {d.replace('run 0', label(0))}"
        else:
            text = f"{self.name}: {label(run)} differs from {label(0)} in {d.describe(self.dtype)}"
        if self.runs > 2:
            text += f"; {self.distinct} distinct results in {self.runs} runs"
        return text


class OutputChecksums:
    """Checksums of a call's outputs, computed where the outputs are (on the GPU: no copy, no sync).

    An output's checksum is sum_i w_i * x_i mod 2**64, where x_i is its i-th
    16-bit word (the raw bits, sign-extended to int64) and w_i a fixed
    random odd 64-bit weight. torch's int64 arithmetic wraps mod 2**64 and
    wrapping addition is associative, so the checksum has the same bits in
    whatever order the device sums it. It sees any change of bits: a change
    of one word by d (0 < |d| < 2**16) changes the checksum by w_i * d mod
    2**64, which is not 0 because w_i is odd and d has fewer than 64 factors
    of 2; changes of several words cancel only if sum_i w_i * d_i = 0 mod
    2**64, about 2**-48 likely for weights drawn independently of the
    changes. (A plain sum of the words would miss +1 in one and -1 in
    another.)
    """

    def __init__(self, outputs, seed: int = 0):
        import torch

        g = torch.Generator(device=outputs[0].device).manual_seed(seed)
        self.weights = [torch.randint(-(2**62), 2**62, (self.words(x).numel(),), generator=g, dtype=torch.int64,
                                      device=x.device) | 1 for x in outputs]

    @staticmethod
    def words(x):
        import torch

        return x.contiguous().view(-1).view(torch.int16)

    def __call__(self, outputs):
        """[len(outputs)] int64 on the outputs' device."""
        import torch

        return torch.stack([(w * self.words(x)).sum() for w, x in zip(self.weights, outputs)])
