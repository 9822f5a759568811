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

Everything is drawn inside the ``Space``'s domain (``mqa_bwd.contract.Domain``,
the implementation's declared one or the command line's): head counts of its
range and multiple, top-k widths of its multiple and minimum, its widths,
batch, sink support, invalid-index kinds and causality. Its own edges (the
range's ends, the smallest multiples) join the edges above.

Two further families:

- Collisions (the determinism property): many query rows whose slots point
  at very few kv rows, so that every kv row's dKV is a sum of hundreds or
  thousands of contributions and an atomic accumulation cannot keep one
  order (``collision_case`` is the one such case replayed first).
- Buckets (``Space.buckets``, the JIT-friendly mode): the shape
  (B, S, S_kv, H, L, Dk, Dv) comes from a small fixed set, so a kernel that
  compiles per shape compiles once per bucket; values, index patterns,
  invalid kinds, duplicates, empty rows and sinks still vary freely. The
  call options stay at their defaults there, since a configuration is a
  compile too.

Shrinking goes towards the first alternative of each choice, so the simplest
values come first.
"""

import dataclasses

from hypothesis import strategies as st

from mqa_bwd.contract import Domain

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
#: Collision cases: (query rows, kv rows, top-k) by where they run. Every kv row
#: then takes S * L / S_kv contributions per batch element (thousands on a GPU,
#: where there are enough CTAs in flight for their atomics to contend).
COLLISION_ROWS = {"small": (32, 16), "production": (256, 128)}
COLLISION_KV_ROWS = (2, 1, 4, 8)
COLLISION_TOPK = (64, 32)
#: Collision cases among the determinism property's generated ones: one in
#: COLLISION_SHARE[widths] (cheap on a GPU; costly on the CPU model).
COLLISION_SHARE = {"small": 32, "production": 4}
#: Bucket templates (B, S, S_kv, H, L) before they are fitted into the domain: a
#: plain tile, a padded one with a batch, the wide head tile, and collisions.
BUCKET_TEMPLATES = {
    "small": ((1, 4, 16, 16, 32), (2, 5, 33, 5, 33), (1, 3, 9, 64, 65), (1, 32, 2, 24, 64)),
    "production": ((1, 4, 16, 16, 32), (2, 5, 33, 5, 33), (1, 3, 9, 64, 65), (1, 256, 4, 24, 64)),
}
#: The shape fields of a bucket, in order.
BUCKET_FIELDS = ("B", "S", "S_kv", "H", "L", "d_k", "d_v")


@dataclasses.dataclass(frozen=True)
class Space:
    """What the strategies may draw: set once per session from the plugin's options."""

    heads: tuple = (1, MAX_HEADS)  # inclusive range (--heads LO-HI)
    widths: str = "small"  # "small" (CPU) or "production" (GPU backends)
    frameworks: tuple = ("torch",)  # paddle joins when it is installed and can reach the device
    domain: Domain = Domain()  # what the implementation supports (declared, or --mqa-domain)
    buckets: tuple | None = None  # ((B, S, S_kv, H, L, d_k, d_v), ...): shapes only from these

    def __post_init__(self):
        lo, hi = self.heads
        if not 1 <= lo <= hi <= MAX_HEADS:
            raise ValueError(f"heads: need 1 <= LO <= HI <= {MAX_HEADS}, got {lo}-{hi}")
        if self.widths not in ("small", "production"):
            raise ValueError(f"widths: 'small' or 'production', got {self.widths!r}")
        if not isinstance(self.domain, Domain):
            raise ValueError(f"domain: expected a mqa_bwd.contract.Domain, got {type(self.domain).__name__}")
        if not self.head_choices():
            raise ValueError(f"heads: --heads {lo}-{hi} and the domain ({self.domain}) leave no head count")
        if not self.framework_choices():
            raise ValueError(f"frameworks: the domain allows {'+'.join(self.domain.frameworks)}, "
                             f"this machine offers {'+'.join(self.frameworks)}")
        if self.buckets is not None:
            buckets = tuple(tuple(int(n) for n in b) for b in self.buckets)
            for b in buckets:
                if len(b) != len(BUCKET_FIELDS):
                    raise ValueError(f"buckets: each is {BUCKET_FIELDS}, got {b}")
                why = self.domain.violations(**dict(zip(("batch", "heads", "topk"), (b[0], b[3], b[4]))),
                                             widths=b[5:])
                if why:
                    raise ValueError(f"buckets: {dict(zip(BUCKET_FIELDS, b))} is outside the domain: {'; '.join(why)}")
            if not buckets:
                raise ValueError("buckets: give at least one")
            object.__setattr__(self, "buckets", buckets)

    # -- what the domain leaves --------------------------------------------
    def head_choices(self) -> tuple:
        """Every head count inside both --heads and the domain."""
        return tuple(h for h in range(self.heads[0], self.heads[1] + 1) if self.domain.admits_heads(h))

    def width_choices(self) -> tuple:
        """The domain's widths, else the ones this backend builds cheaply."""
        return self.domain.widths or (SMALL_WIDTHS if self.widths == "small" else PRODUCTION_WIDTHS)

    def framework_choices(self) -> tuple:
        return tuple(f for f in self.frameworks if f in self.domain.frameworks)

    def sink_choices(self) -> tuple:
        if self.domain.sink == "required":
            return tuple(s for s in SINKS if s != "none")
        if self.domain.sink == "unsupported":
            return ("none",)
        return SINKS

    def invalid_kind_choices(self) -> tuple:
        accepted = self.domain.invalid_indices
        return ALL_INVALID_KINDS if accepted is None else tuple(k for k in ALL_INVALID_KINDS if k in accepted)

    def pattern_choices(self) -> tuple:
        return ("causal",) if self.domain.causal_indices else PATTERNS

    def fit_heads(self, target: int) -> int:
        """The admitted head count nearest ``target`` (the smaller one on a tie)."""
        return min(self.head_choices(), key=lambda h: (abs(h - target), h))

    def fit_topk(self, target: int) -> int:
        """The admitted top-k width nearest ``target`` (the smaller one on a tie)."""
        hi = max(target, 2 * SLOT_BLOCK + 1) + self.domain.topk_multiple  # the nearest may lie above target
        return min(topk_choices(self.domain, hi), key=lambda n: (abs(n - target), n))

    def fit_batch(self, target: int) -> int:
        return min(target, self.domain.batch_max or target)

    def fit_kv_rows(self, S: int, S_kv: int, L: int, pattern: str) -> int:
        """S_kv raised where the domain needs it: causal indices need S <= S_kv (else the first rows'
        window is empty); causal top-k pads with -1, so without -1 every window must hold L rows."""
        if pattern == "causal" or self.domain.causal_indices:
            S_kv = max(S_kv, S)
            if "minus_one" not in self.invalid_kind_choices():
                S_kv = max(S_kv, S + L - 1)
        return S_kv


def default_buckets(space: Space) -> tuple:
    """The bucket set of ``space``: BUCKET_TEMPLATES fitted into its domain, widths taken in turn."""
    widths = space.width_choices()
    found = []
    for i, (B, S, S_kv, H, L) in enumerate(BUCKET_TEMPLATES[space.widths]):
        H, L, B = space.fit_heads(H), space.fit_topk(L), space.fit_batch(B)
        S_kv = space.fit_kv_rows(S, S_kv, L, space.pattern_choices()[0])
        d_k, d_v = widths[1] if i == 1 and len(widths) > 1 else widths[0]  # the second width once
        bucket = (B, S, S_kv, H, L, d_k, d_v)
        if bucket not in found:
            found.append(bucket)
    return tuple(found)


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


def dimensions(case: Case) -> dict:
    """A case's dimensions as ``Domain.violations`` reads them (the invalid-index kinds it holds
    and its causality, from how the case builds its indices: see properties/case.py)."""
    kinds = set(case.invalid) if case.invalid and case.hole_rate > 0 else set()
    if case.empty_rows:
        kinds.add(case.invalid[0] if case.invalid else "minus_one")
    if case.pattern == "causal" and case.L > max(1, case.S_kv - case.S + 1):
        kinds.add("minus_one")  # causal top-k pads a short window with -1
    return dict(batch=case.B, heads=case.H, topk=case.L, widths=(case.d_k, case.d_v), sink=case.sink != "none",
                invalid_indices=kinds, causal=case.pattern == "causal" and case.S <= case.S_kv,
                framework=case.framework)


def in_domain(case: Case, domain: Domain) -> bool:
    return domain.contains(**dimensions(case))


def topk_choices(domain: Domain, hi: int) -> tuple:
    """Admitted top-k widths up to ``hi`` (at least the four smallest, whatever ``hi`` is)."""
    m = domain.topk_multiple
    first = max(domain.topk_min, m)
    first += -first % m
    return tuple(range(first, max(hi, first + 3 * m) + 1, m))


def head_counts(lo: int = 1, hi: int = MAX_HEADS, domain: Domain = Domain()):
    allowed = tuple(h for h in range(lo, hi + 1) if domain.admits_heads(h))
    if not allowed:
        raise ValueError(f"heads: {lo}-{hi} and the domain ({domain}) leave no head count")
    corners = ()
    if domain.heads is not None or domain.heads_multiple > 1:  # a declared range's own ends are edges too
        corners = (allowed[0], allowed[-1]) + allowed[1:2] + allowed[-2:-1]
    edges = sorted({h for h in EDGE_HEADS + corners if h in allowed})
    m = domain.heads_multiple
    anything = st.integers(allowed[0], allowed[-1]) if m == 1 else \
        st.integers(allowed[0] // m, allowed[-1] // m).map(lambda k: k * m)
    return st.one_of(st.sampled_from(edges), anything) if edges else anything


def slot_counts(domain: Domain = Domain()):
    if domain.topk_min == 1 and domain.topk_multiple == 1:
        return st.one_of(st.sampled_from(EDGE_SLOTS), st.integers(1, 2 * SLOT_BLOCK + 1))
    allowed = topk_choices(domain, 2 * SLOT_BLOCK + 1)
    edges = sorted({n for n in EDGE_SLOTS if domain.admits_topk(n)} | set(allowed[:2]))
    return st.one_of(st.sampled_from(edges), st.sampled_from(allowed[:4]))


def kv_row_counts():
    return st.one_of(st.integers(1, 12), st.sampled_from(EDGE_KV_ROWS))


def _free_fields(draw, space: Space, S: int, S_kv: int, L: int, block_h: bool = False) -> dict:
    """What varies inside any shape: the index pattern, invalid kinds, duplicates, sinks, values
    (and, with ``block_h``, the head-group width). Drawn in one fixed order, so that a derandomized
    run over the whole SPEC domain draws the cases it always drew."""
    kinds = space.invalid_kind_choices()
    invalid = tuple(draw(st.lists(st.sampled_from(kinds), unique=True, max_size=len(kinds)))) if kinds else ()
    hole_rate = draw(st.sampled_from(HOLE_RATES)) if invalid else 0.0
    patterns = space.pattern_choices()
    if "minus_one" not in kinds and S_kv < S + L - 1:
        patterns = tuple(p for p in patterns if p != "causal") or patterns  # causal top-k would pad with -1
    fields = dict(invalid=invalid, hole_rate=hole_rate, pattern=draw(st.sampled_from(patterns)),
                  duplicates=draw(st.booleans()))
    empty_kind = invalid[0] if invalid else "minus_one"
    fields["empty_rows"] = draw(st.integers(0, 2)) if empty_kind in kinds else 0
    fields["sink"] = draw(st.sampled_from(space.sink_choices()))
    fields["seed"] = draw(st.integers(0, 2**32 - 1))
    if block_h:
        fields["block_h"] = draw(st.sampled_from(BLOCK_H_CHOICES))
    fields["framework"] = draw(st.sampled_from(space.framework_choices()))
    fields["cancelling_rows"] = draw(st.sampled_from((False, False, True)))
    return fields


def _checked(case: Case, space: Space) -> Case:
    why = space.domain.violations(**dimensions(case))
    if why:  # the strategies' own bug: say so rather than test outside what was declared
        raise RuntimeError(f"strategies drew a case outside the domain {space.domain}: {'; '.join(why)}: {case}")
    return case


@st.composite
def bucket_cases(draw, space: Space) -> Case:
    B, S, S_kv, H, L, d_k, d_v = draw(st.sampled_from(space.buckets))
    fields = _free_fields(draw, space, S, S_kv, L)
    return _checked(Case(B=B, S=S, S_kv=S_kv, H=H, L=L, d_k=d_k, d_v=d_v, **fields), space)


def _collision_shape(draw, space: Space) -> tuple:
    S = draw(st.sampled_from(COLLISION_ROWS[space.widths]))
    L = space.fit_topk(draw(st.sampled_from(COLLISION_TOPK)))
    S_kv = space.fit_kv_rows(S, draw(st.sampled_from(COLLISION_KV_ROWS)), L, space.pattern_choices()[0])
    H = draw(head_counts(*space.heads, domain=space.domain))
    d_k, d_v = draw(st.sampled_from(space.width_choices()))
    return 1, S, S_kv, H, L, d_k, d_v


@st.composite
def collision_cases(draw, space: Space) -> Case:
    """Many query rows on few kv rows: every dKV row a long sum whose order atomics would change."""
    B, S, S_kv, H, L, d_k, d_v = _collision_shape(draw, space)
    fields = _free_fields(draw, space, S, S_kv, L)
    fields.update(duplicates=draw(st.sampled_from((True, False))),
                  cancelling_rows=draw(st.sampled_from((True, False))))
    return _checked(Case(B=B, S=S, S_kv=S_kv, H=H, L=L, d_k=d_k, d_v=d_v, **fields), space)


def collision_case(space: Space) -> Case:
    """The collision case the determinism property replays first: the most collisions per kv row
    its size allows, with a cancelling pair and duplicates, inside the domain."""
    if space.buckets:
        B, S, S_kv, H, L, d_k, d_v = max(space.buckets, key=lambda b: (b[1] * b[4] / b[2], b))
    else:
        S = COLLISION_ROWS[space.widths][0]
        L = space.fit_topk(COLLISION_TOPK[0])
        S_kv = space.fit_kv_rows(S, COLLISION_KV_ROWS[0], L, space.pattern_choices()[0])
        (d_k, d_v), B, H = space.width_choices()[0], 1, space.fit_heads(16 if space.widths == "small" else 64)
    pattern = space.pattern_choices()[0]
    return _checked(Case(B=B, S=S, S_kv=S_kv, H=H, L=L, d_k=d_k, d_v=d_v, pattern=pattern, duplicates=True,
                         sink=space.sink_choices()[-1] if space.domain.sink == "required" else "random",
                         seed=0, framework=space.framework_choices()[0], cancelling_rows=True), space)


def _draw_general(draw, space: Space) -> Case:
    """The general family, drawn with ``draw`` (no strategy of its own, so that over the whole SPEC
    domain the draws and their structure are the ones ``cases`` always made)."""
    domain = space.domain
    H = draw(head_counts(*space.heads, domain=domain))
    B = draw(st.one_of(st.just(1), st.integers(2, 3))) if domain.batch_max != 1 else 1
    B = space.fit_batch(B)
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
    L = draw(slot_counts(domain))
    S_kv = draw(kv_row_counts())
    if S >= MODEL_ROW_STEP - 1:
        # The rare tall case tests the model's row step, nothing else: keep its
        # dKV reduction chains (about B*S*L/S_kv entries per kv row) short.
        B, S_kv = 1, max(S_kv, SLOT_BLOCK - 1)
        if L > SLOT_BLOCK + 1:
            L = max([n for n in topk_choices(domain, SLOT_BLOCK + 1) if n <= SLOT_BLOCK + 1] or [space.fit_topk(L)])
    S_kv = space.fit_kv_rows(S, S_kv, L, space.pattern_choices()[0])
    d_k, d_v = draw(st.sampled_from(space.width_choices()))
    fields = _free_fields(draw, space, S, S_kv, L, block_h=True)
    case = Case(B=B, S=S, S_kv=S_kv, H=H, L=L, d_k=d_k, d_v=d_v, **fields)
    if budget_units is not None:
        unit = draw(st.sampled_from((case.slot_row_bytes, case.kv_bytes)))
        case = case.replace(dkv_buf_bytes=budget_units * unit)
    return _checked(case, space)


@st.composite
def cases(draw, space: Space = Space(), collisions: bool = False) -> Case:
    """Cases inside ``space``: from its buckets when it has them; else the general family, and, with
    ``collisions``, a share of collision cases (the first alternative, so Hypothesis' first and
    simplest case is one)."""
    if space.buckets:
        return draw(bucket_cases(space))
    if collisions and draw(st.sampled_from((True,) + (False,) * (COLLISION_SHARE[space.widths] - 1))):
        return draw(collision_cases(space))
    return _draw_general(draw, space)


#: The production-shape probe of the determinism property (one call, compared over reruns):
#: a DeepSeek-V3.2-like slice, large enough that a GPU's atomics contend on every kv row.
SCALE_SHAPE = dict(B=1, S=512, S_kv=1024, H=64, L=256, d_k=576, d_v=512)


def scale_case(space: Space) -> Case:
    """SCALE_SHAPE fitted into the domain (its head count, top-k, widths, sink and causality)."""
    shape = dict(SCALE_SHAPE)
    shape["H"], shape["L"], shape["B"] = space.fit_heads(shape["H"]), space.fit_topk(shape["L"]), space.fit_batch(1)
    widths = space.width_choices()
    shape["d_k"], shape["d_v"] = (576, 512) if (576, 512) in widths else widths[0]
    pattern = space.pattern_choices()[0]
    shape["S_kv"] = space.fit_kv_rows(shape["S"], shape["S_kv"], shape["L"], pattern)
    return _checked(Case(**shape, pattern=pattern, sink="none" if space.domain.sink == "unsupported" else "random",
                         seed=0, framework=space.framework_choices()[0]), space)
