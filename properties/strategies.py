"""Hypothesis strategies that draw ``Case``s where this operator breaks.

Every dimension is weighted towards its edges, because that is where the
kernel's tiles and the wrapper's padding change behaviour:

- H: 1..17 (below, at and just above the 16-wide tile: the #1784 range), the
  group widths' multiples and their neighbours (24, 31-33, 40, 48, 57, 63-65,
  96, 127, 128), else anything in range.
- L: 1, odd and even, the kernel's slot block (32) +-1 and two blocks +-1.
- S: around the chunk size the case's scratch budget asks for (+-1), tiny
  sizes, and the CPU model's 64-row step +-1.
- dkv_buf_bytes: None (the default) or a few units of what one chunk needs.
  An implementation that needs more refuses it naming dkv_buf_bytes, and the
  properties' Caller doubles it until accepted, so every property runs at the
  least budget the implementation takes, to within a factor of two (ours
  needs its whole scratch: mqa_bwd.scratch_bytes).
- S_kv: small, 1 included, and the slot block +-1.
- Indices: random or causal top-k, holes of every invalid kind (including
  values just outside [0, S_kv), which alias other batch elements' rows under
  global addressing), duplicates,
  rows with no valid slot; sinks of every kind.
- A cancelling pair of query rows (large, opposite grad_out) in a third of
  the cases: it makes any change of dKV summation order visible in bf16.
- Widths: small multiples of 16 (Dv <= Dk) on the CPU model, where they are
  cheap; the production widths on a GPU backend, the only ones it builds.

Shrinking goes towards the first alternative of each choice, so the simplest
values come first.
"""

import dataclasses

from hypothesis import strategies as st

from .case import ALL_INVALID_KINDS, BLOCK_H_CHOICES, PATTERNS, SINKS, SLOT_BLOCK, Case

MAX_HEADS = 128
EDGE_HEADS = tuple(range(1, 18)) + (24, 31, 32, 33, 40, 48, 57, 63, 64, 65, 96, 127, 128)
EDGE_SLOTS = (1, 2, 3, SLOT_BLOCK - 1, SLOT_BLOCK, SLOT_BLOCK + 1, 2 * SLOT_BLOCK - 1, 2 * SLOT_BLOCK, 2 * SLOT_BLOCK + 1)
EDGE_KV_ROWS = (SLOT_BLOCK - 1, SLOT_BLOCK, SLOT_BLOCK + 1)
#: Query rows the CPU model processes per step (mqa_bwd.model.ModelLauncher.rows_per_step).
MODEL_ROW_STEP = 64
SMALL_WIDTHS = tuple((d_k, d_v) for d_k in (16, 32, 48, 64) for d_v in (16, 32) if d_v <= d_k)
PRODUCTION_WIDTHS = ((576, 512), (512, 512))
HOLE_RATES = (0.1, 0.3, 0.6, 1.0)


@dataclasses.dataclass(frozen=True)
class Space:
    """What the strategies may draw: set once per session from the plugin's options."""

    heads: tuple = (1, MAX_HEADS)  # inclusive range (--heads LO-HI)
    widths: str = "small"  # "small" (CPU) or "production" (GPU backends)
    frameworks: tuple = ("torch",)  # paddle joins when it is installed and can reach the device

    def __post_init__(self):
        lo, hi = self.heads
        if not 1 <= lo <= hi <= MAX_HEADS:
            raise ValueError(f"heads: need 1 <= LO <= HI <= {MAX_HEADS}, got {lo}-{hi}")
        if self.widths not in ("small", "production"):
            raise ValueError(f"widths: 'small' or 'production', got {self.widths!r}")


def parse_heads(text: str) -> tuple:
    """'LO-HI' or 'N' -> (lo, hi)."""
    try:
        if "-" in text:
            lo, hi = (int(part) for part in text.split("-", 1))
        else:
            lo = hi = int(text)
    except ValueError:
        raise ValueError(f"--heads: expected LO-HI or N, got {text!r}") from None
    Space(heads=(lo, hi))  # validates
    return lo, hi


def head_counts(lo: int = 1, hi: int = MAX_HEADS):
    edges = [h for h in EDGE_HEADS if lo <= h <= hi]
    anything = st.integers(lo, hi)
    return st.one_of(st.sampled_from(edges), anything) if edges else anything


def slot_counts():
    return st.one_of(st.sampled_from(EDGE_SLOTS), st.integers(1, 2 * SLOT_BLOCK + 1))


def kv_row_counts():
    return st.one_of(st.integers(1, 12), st.sampled_from(EDGE_KV_ROWS))


@st.composite
def cases(draw, space: Space = Space()) -> Case:
    H = draw(head_counts(*space.heads))
    B = draw(st.one_of(st.just(1), st.integers(2, 3)))
    # A scratch budget of k units, where a unit is what one chunk of work needs
    # in either dKV design: one query row's slot scratch, or one fp32 dKV
    # buffer over every kv row. Query rows then straddle k (S = k-1, k, k+1).
    budget_units = draw(st.one_of(st.none(), st.integers(1, 4)))
    if budget_units is None:
        tall = draw(st.sampled_from((False,) * 7 + (True,)))  # one case in eight: tall ones are slow
        if tall:
            S = draw(st.sampled_from((MODEL_ROW_STEP - 1, MODEL_ROW_STEP, MODEL_ROW_STEP + 1)))
        else:
            S = draw(st.integers(1, 6))
    else:
        S = draw(st.integers(max(1, budget_units - 1), budget_units + 1))
    L = draw(slot_counts())
    S_kv = draw(kv_row_counts())
    if S >= MODEL_ROW_STEP - 1:
        # The rare tall case tests the model's row step, nothing else: keep its
        # dKV reduction chains (about B*S*L/S_kv entries per kv row) short.
        B, L, S_kv = 1, min(L, SLOT_BLOCK + 1), max(S_kv, SLOT_BLOCK - 1)
    widths = SMALL_WIDTHS if space.widths == "small" else PRODUCTION_WIDTHS
    d_k, d_v = draw(st.sampled_from(widths))
    invalid = tuple(draw(st.lists(st.sampled_from(ALL_INVALID_KINDS), unique=True, max_size=len(ALL_INVALID_KINDS))))
    hole_rate = draw(st.sampled_from(HOLE_RATES)) if invalid else 0.0
    case = Case(
        B=B,
        S=S,
        S_kv=S_kv,
        H=H,
        L=L,
        d_k=d_k,
        d_v=d_v,
        pattern=draw(st.sampled_from(PATTERNS)),
        invalid=invalid,
        hole_rate=hole_rate,
        duplicates=draw(st.booleans()),
        empty_rows=draw(st.integers(0, 2)),
        sink=draw(st.sampled_from(SINKS)),
        seed=draw(st.integers(0, 2**32 - 1)),
        block_h=draw(st.sampled_from(BLOCK_H_CHOICES)),
        framework=draw(st.sampled_from(space.frameworks)),
        cancelling_rows=draw(st.sampled_from((False, False, True))),
    )
    if budget_units is not None:
        unit = draw(st.sampled_from((case.slot_row_bytes, case.kv_bytes)))
        case = case.replace(dkv_buf_bytes=budget_units * unit)
    return case
