"""A test case: a few numbers that build the same tensors on any machine.

A ``Case`` is frozen and round-trips through JSON. Its tensors are derived
from its seed with NumPy's PCG64 (bf16-exact values), so the same case gives
the same bits in torch, paddle or NumPy, on a CPU or a GPU. ``out`` and ``lse``
come from the float32 oracle forward (``out`` rounded to bf16, as a forward
kernel would return it).

Besides the tensors, a case carries the call configuration that a property
needs to reproduce a failure exactly: the head-group width (``block_h``), the
scratch budget (``dkv_buf_bytes``) and the framework the tensors are handed
over in. Each has a default that means "as a plain call".
"""

import dataclasses
import json
import zlib

import ml_dtypes
import numpy as np

import oracle
from mqa_bwd import edge
from mqa_bwd import contract
from mqa_bwd.contract import SPEC_ARGS

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

#: Every kind of invalid index docs/SPEC.md names (anything outside [0, S_kv)).
INVALID_KINDS = ("minus_one", "int32_min", "negative", "s_kv", "above_s_kv", "int32_max")
#: Invalid values close to the valid range: [-2*S_kv, -1] and [S_kv, 3*S_kv).
#: Under global kv addressing (b * S_kv + index) they are exactly the values
#: that land on another batch element's rows if only -1 were treated as invalid.
NEAR_INVALID_KINDS = ("near_negative", "near_above_s_kv")
ALL_INVALID_KINDS = INVALID_KINDS + NEAR_INVALID_KINDS
PATTERNS = ("random", "causal")
SINKS = ("none", "neg_inf", "neg_1e30", "random", "large")
FRAMEWORKS = ("torch", "paddle")
#: The head-group widths docs/SPEC.md allows; None lets the implementation pick.
BLOCK_H_CHOICES = (None,) + contract.BLOCK_H_CHOICES  # None: the implementation's default
#: The kernel's slot block (mqa_bwd.kernels.BLOCK_SLOTS): L is padded to it.
SLOT_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 1
    S: int = 4
    S_kv: int = 16
    H: int = 16
    L: int = 8
    d_k: int = 64
    d_v: int = 32
    pattern: str = "random"  # how valid slots are chosen: PATTERNS
    invalid: tuple = ()  # kinds of invalid index sprinkled in: ALL_INVALID_KINDS
    hole_rate: float = 0.0  # fraction of slots made invalid
    duplicates: bool = False  # copy some slots' indices onto others in the row
    empty_rows: int = 0  # rows (b, s) with no valid slot at all
    sink: str = "random"  # SINKS
    seed: int = 0
    block_h: int | None = None  # head-group width passed to the call; None: the implementation's default
    dkv_buf_bytes: int | None = None  # scratch budget passed to the call; None: the implementation's default
    framework: str = "torch"  # FRAMEWORKS: what the tensors are handed over in
    # The query rows of batch element 0 come in cancelling pairs (2k, 2k+1):
    # same q, same indices, opposite grad_out. Their dKV contributions cancel
    # exactly, so batch 0's dkv is zero up to rounding residue, whose value
    # depends on the summation order: any change of order (atomics) shows in
    # bf16 dkv even at tiny shapes. Needs S >= 2; a no-op otherwise.
    cancelling_rows: bool = False

    def __post_init__(self):
        object.__setattr__(self, "invalid", tuple(self.invalid))
        for name in ("B", "S", "S_kv", "H", "L", "d_k", "d_v"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern: one of {PATTERNS}")
        if self.sink not in SINKS:
            raise ValueError(f"sink: one of {SINKS}")
        for k in self.invalid:
            if k not in ALL_INVALID_KINDS:
                raise ValueError(f"invalid: {k!r} not in {ALL_INVALID_KINDS}")
        if self.block_h not in BLOCK_H_CHOICES:
            raise ValueError(f"block_h: one of {BLOCK_H_CHOICES}")
        if self.dkv_buf_bytes is not None and self.dkv_buf_bytes < 1:
            raise ValueError("dkv_buf_bytes: None or >= 1")
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework: one of {FRAMEWORKS}")

    # -- serialisation ---------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def to_dict(self) -> dict:
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> "Case":
        return cls(**json.loads(text))

    @classmethod
    def from_dict(cls, fields: dict) -> "Case":
        return cls(**fields)

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    @property
    def sm_scale(self) -> float:
        return float(self.d_k) ** -0.5

    @property
    def slot_row_bytes(self) -> int:
        """fp32 bytes of one query row's per-slot dKV contributions (L padded to the slot block)."""
        return -(-self.L // SLOT_BLOCK) * SLOT_BLOCK * self.d_k * 4

    @property
    def kv_bytes(self) -> int:
        """fp32 bytes of one dKV accumulator over every kv row of the batch."""
        return self.B * self.S_kv * self.d_k * 4

    def call_options(self) -> dict:
        """Keyword arguments of the SPEC call this case asks for (only the non-default ones)."""
        options = {}
        if self.block_h is not None:
            options["block_h"] = self.block_h
        if self.dkv_buf_bytes is not None:
            options["dkv_buf_bytes"] = self.dkv_buf_bytes
        return options

    def derived_rng(self, purpose: str) -> np.random.Generator:
        """A generator for choices a property makes about this case (which heads, how many pads).

        Seeded from the case's seed and the purpose's name, so a replayed case
        makes the same choices on any machine.
        """
        return self._rng(1000 + zlib.crc32(purpose.encode()))

    # -- tensors ---------------------------------------------------------
    def _rng(self, stream: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([self.seed, stream]))

    def indices(self) -> np.ndarray:
        rng = self._rng(1)
        B, S, S_kv, L = self.B, self.S, self.S_kv, self.L
        if self.pattern == "random":
            idx = rng.integers(0, S_kv, size=(B, S, L), dtype=np.int64)
        else:  # causal top-k: row s sees kv rows [0, s + S_kv - S], distinct, -1 beyond
            idx = np.full((B, S, L), -1, dtype=np.int64)
            for b in range(B):
                for s in range(S):
                    visible = max(1, s + S_kv - S + 1)
                    chosen = rng.permutation(visible)[:L]
                    idx[b, s, : len(chosen)] = chosen
        if self.duplicates and L > 1:
            src = rng.integers(0, L, size=(B, S, L))
            take = rng.random((B, S, L)) < 0.3
            idx = np.where(take, np.take_along_axis(idx, src, axis=2), idx)
        if self.invalid and self.hole_rate > 0:
            holes = rng.random((B, S, L)) < self.hole_rate
            kinds = rng.integers(0, len(self.invalid), size=(B, S, L))
            values = np.stack([self._invalid_values(k, rng, (B, S, L)) for k in self.invalid])
            idx = np.where(holes, np.take_along_axis(values, kinds[None], axis=0)[0], idx)
        if self.empty_rows:
            rows = rng.choice(B * S, size=min(self.empty_rows, B * S), replace=False)
            kind = self.invalid[0] if self.invalid else "minus_one"
            flat = idx.reshape(B * S, L)
            flat[rows] = self._invalid_values(kind, rng, (len(rows), L))
        if self.has_cancelling_pair:
            idx[0, 1 : 2 * (S // 2) : 2] = idx[0, 0 : 2 * (S // 2) : 2]
        return idx.astype(np.int32)

    @property
    def has_cancelling_pair(self) -> bool:
        return self.cancelling_rows and self.S >= 2

    def _invalid_values(self, kind, rng, shape):
        S_kv = self.S_kv
        if kind == "minus_one":
            return np.full(shape, -1, np.int64)
        if kind == "int32_min":
            return np.full(shape, INT32_MIN, np.int64)
        if kind == "negative":
            return -rng.integers(2, 1 << 20, size=shape)
        if kind == "s_kv":
            return np.full(shape, S_kv, np.int64)
        if kind == "above_s_kv":
            return S_kv + rng.integers(1, 1 << 20, size=shape)
        if kind == "near_negative":
            return -rng.integers(1, 2 * S_kv + 1, size=shape)
        if kind == "near_above_s_kv":
            return S_kv + rng.integers(0, 2 * S_kv, size=shape)
        return np.full(shape, INT32_MAX, np.int64)

    def attn_sink(self):
        if self.sink == "none":
            return None
        if self.sink == "neg_inf":
            return np.full(self.H, -np.inf, np.float32)
        if self.sink == "neg_1e30":
            return np.full(self.H, -1e30, np.float32)
        rng = self._rng(2)
        if self.sink == "random":
            return rng.normal(0.0, 1.0, self.H).astype(np.float32)
        return rng.uniform(20.0, 40.0, self.H).astype(np.float32)  # "large": the sink dominates

    def inputs(self) -> dict:
        """NumPy inputs of the SPEC signature (bf16 as ml_dtypes.bfloat16)."""
        bf16 = ml_dtypes.bfloat16
        rng = self._rng(0)
        q = rng.standard_normal((self.B, self.S, self.H, self.d_k), dtype=np.float32).astype(bf16)
        kv = rng.standard_normal((self.B, self.S_kv, self.d_k), dtype=np.float32).astype(bf16)
        grad_out = rng.standard_normal((self.B, self.S, self.H, self.d_v), dtype=np.float32).astype(bf16)
        idx = self.indices()
        if self.has_cancelling_pair:
            pairs = 2 * (self.S // 2)
            q[0, 1:pairs:2] = q[0, 0:pairs:2]
            grad_out[0, 1:pairs:2] = -grad_out[0, 0:pairs:2]
        sink = self.attn_sink()
        out, lse = oracle.forward(q, kv, idx, sink, self.sm_scale, self.d_v)
        return {
            "query": q,
            "kv": kv,
            "out": out.astype(bf16),
            "grad_out": grad_out,
            "lse": lse.astype(np.float32),
            "attn_sink": sink,
            "token_indices": idx,
            "sm_scale": self.sm_scale,
        }


def expected(inputs: dict):
    """(float64 oracle, bf16 baseline) gradients for a case's inputs."""
    args = tuple(inputs[name] for name in SPEC_ARGS)
    return oracle.backward(*args, precision="float64"), oracle.backward_bf16_baseline(*args)


def to_framework(inputs: dict, framework: str = "torch", device: str = "cpu") -> dict:
    """NumPy inputs -> torch or paddle tensors (bf16 bits preserved)."""
    if framework not in ("torch", "paddle"):
        raise ValueError(f"framework: {framework!r}")
    return {name: value if value is None or name == "sm_scale" else edge.numpy_to(value, framework, device)
            for name, value in inputs.items()}
