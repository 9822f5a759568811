"""The kernels' configurations as data, their constants, and the launch policy.

A configuration is a frozen value: the argument of its program builder and the
key of the compile cache (``toolchain.compiled``). The wrapper never flips a
switch: it asks ``main_launches`` which configurations cover its head groups
and launches those. An A/B of two variants passes two configurations.

Standard library only (no torch, no TileLang), so that the CPU model, the
fixed-point plan and the wrapper can import it cheaply.
"""

import dataclasses
import functools

LOG2E = 1.4426950408889634

# Slots gathered per main-loop step of the 16- and 32-head tiles: their slot block.
BLOCK_SLOTS = 32
# The wide tile's slot block (wide.py). A call with a wide launch pads L to it,
# every other call to BLOCK_SLOTS (MainConfig.slot_block).
WIDE_SLOTS = 64
#: The slot layout rotates each row's walk by blocks of this many slots (layout.rotate_walks):
#: every tile's block is a whole number of them, so every tile walks a row in the same order.
WALK_BLOCK = BLOCK_SLOTS
#: Columns of dKV the wide tile forms and adds at once (one m64n64 accumulator).
WIDE_CHUNK = 64
#: The wide tile's dKV chunks of a block that warpgroup 0 forms and adds, after its dQ GEMM
#: (MainConfig.wg0_chunks; default_wg0_chunks): warpgroup 1's chunk chain is the kernel's
#: critical path, and warpgroup 0 would otherwise wait for it. Two balance the control's
#: warpgroups at Dk = 576 (docs/performance-log.md).
WIDE_WG0_CHUNKS = 2


#: The wide tile's dQ columns [0, WIDE_DQ_SPLIT) are warpgroup 0's, the rest warpgroup 1's
#: (MainConfig.dq_split): their fp32 accumulators are most of each warpgroup's registers.
WIDE_DQ_SPLIT = 256
#: Warpgroup 1 forms its dQ columns in two GEMMs of at most this many columns each
#: (kernels/wide.py; wgmma's N is at most 256).
WIDE_DQ_PIECE = 192


def dq_split_bounds(d_k: int, d_v: int) -> tuple:
    """The least and the most dq_split the wide tile builds at these widths: warpgroup 1's
    columns go in two GEMMs (up to WIDE_DQ_PIECE, then at most 256, neither empty), and dO has
    columns on both sides of the split (the scores' GEMMs start on the first part while the rest
    of the gather lands)."""
    return max(WIDE_CHUNK, d_k - WIDE_DQ_PIECE - 256), min(d_v, d_k - WIDE_CHUNK) - WIDE_CHUNK


def require_wide_widths(config: "MainConfig") -> None:
    """A ValueError naming the field unless the wide tile builds ``config`` at its widths:
    warpgroup 1 keeps a dKV chunk, and dq_split lies within dq_split_bounds."""
    chunks = config.d_k // WIDE_CHUNK
    if not config.wg0_chunks < chunks:
        raise ValueError(f"wg0_chunks={config.wg0_chunks} leaves warpgroup 1 none of the {chunks} dKV chunks at d_k={config.d_k}")
    low, high = dq_split_bounds(config.d_k, config.d_v)
    if not low <= config.dq_split <= high:
        raise ValueError(f"dq_split={config.dq_split} at d_k={config.d_k}, d_v={config.d_v}: from {low} to {high}")


def default_wg0_chunks(accumulate: str, d_k: int) -> int:
    """MainConfig.wg0_chunks where none is given: WIDE_WG0_CHUNKS, and for the deterministic
    launches (the lanes and their int64 redo) one more where the chunk count is odd, so that
    warpgroup 1's chunks all go in pairs and warpgroup 0 starts with a pair (kernels/wide.py,
    lane_pairs, wg0_pairs; docs/performance-log.md, seventeenth session)."""
    if accumulate == "atomic":
        return WIDE_WG0_CHUNKS
    return WIDE_WG0_CHUNKS + d_k // WIDE_CHUNK % 2


# (Dk, Dv) the kernels are built and tested for on Hopper.
GPU_WIDTHS = ((576, 512), (512, 512))
# The softmax mass sum_j P of a head is at most 1 with the forward's lse; the
# fixed-point range proof (mqa_bwd.fixed_point) allows up to this.
MASS_LIMIT = 1.0 + 2.0**-6
#: The fixed-point range proof's constants (mqa_bwd.fixed_point says why), which
#: the plan kernels compile in: every partial sum of a kv row's column stays at or
#: below 2**(PARTIAL_SUM_BITS + 1); 2**k must be a normal float32 in the kernel,
#: and 2**-k in the final division.
PARTIAL_SUM_BITS = 61
FP32_MAX_EXPONENT = 126

#: How a main_bwd CTA adds its dKV contributions: "fixed" (int64 fixed-point
#: red.global.add.u64, deterministic: integer adds commute), "lanes" (the wide
#: tile's deterministic design: two signed 32-bit lanes a 64-bit word, exact by
#: a per-row bound, redone in "fixed" where a bound fails; mqa_bwd.fixed_point)
#: or "atomic" (fp32 atomics, the control).
ACCUMULATE = ("fixed", "lanes", "atomic")
#: The deterministic design's resolution: every launch, lanes or int64, rounds a
#: contribution at the plan's scale times 2^(LANES_GAIN - 30) (fixed_point.lanes_scale).
#: At 16, dKV's error against float64 is the fp32 atomics' within 1.01x at the
#: bench shapes, where no lane bound failed (docs/performance-log.md).
LANES_GAIN = 16
#: A lane decodes exactly when its column's final sum fits 32 signed bits; a kv row's Bound (the
#: sum, over its contributions, of a ceiling of the largest |scaled value|: kernels/wide.py,
#: ws_add_bounds) proves it below this.
LANE_LIMIT = 2**31
#: The lanes' rounding by FFMA (kernels/wide.py, ws_magic_word) is exact for |scaled value| <= this;
#: a query row with a value at or past it is run again by the lanes' corrections launch.
MAGIC_RANGE = 2.0**22
#: Bits of the main kernels' per-row flags: a head's softmax mass over its allowance (or NaN: the
#: host poisons the batch element), and a value of the wide tile's lanes at or past MAGIC_RANGE.
FLAG_MASS = 1
FLAG_MAGIC = 2
#: The lanes address a slot's kv row by its offset in 16-byte units, an unsigned 32-bit value
#: (kernels/wide.py, ws_lanes_store_slot): a row is d_k / 4 units, so B * S_kv * d_k stays within this.
LANES_ADDRESSABLE = 2**34
#: The lanes' word layout (lane_word_columns): a word holds column q of a LANE_GROUP-column group
#: in its low lane and column q + LANE_GROUP / 2 in its high lane (0 <= q < LANE_GROUP / 2), the
#: two columns one thread of the wide tile's transposed dKV chunk holds for one slot; a group is
#: one warp's columns of a WIDE_CHUNK-column chunk.
LANE_GROUP = 16
#: Within each whole LANE_BLOCK columns of a kv row (two chunks), a warp's groups of the two
#: chunks are 16 adjacent words: one 128-byte line, which warpgroup 1 adds from a chunk pair at
#: once (kernels/wide.py, ws_add_pair_lanes). Columns past the last whole block keep their
#: group's 8 words in place.
LANE_BLOCK = 128


@functools.lru_cache(maxsize=None)
def lane_word_columns(d_k: int) -> tuple:
    """[(lo, hi)] of each of a kv row's d_k / 2 words: the columns of its low and high lane
    (lane_word_of_column's map, turned round). In a whole LANE_BLOCK P, word 64 P + 16 w + 8 b + q
    holds chunk b's (2 P + b) columns 16 w + q and 16 w + 8 + q; past the last whole block, word
    8 g + q holds group g's q, q + 8."""
    columns = [[None, None] for _ in range(d_k // 2)]
    for c in range(d_k):
        columns[lane_word_of_column(c, d_k)][c % LANE_GROUP >= LANE_GROUP // 2] = c
    return tuple(map(tuple, columns))


def lane_word_of_column(c, d_k: int, select=None):
    """The word whose lane holds column ``c`` (lane_word_columns inverted; the high lane where
    c % LANE_GROUP >= LANE_GROUP / 2). ``c`` may be a TileLang expression or a torch tensor, with
    ``select`` (cond, then, else) its if_then_else or torch.where."""
    whole = d_k // LANE_BLOCK * LANE_BLOCK
    if select is None:
        return lane_word_in_block(c) if c < whole else lane_word_in_tail(c)
    return select(c < whole, lane_word_in_block(c), lane_word_in_tail(c))


def lane_word_in_block(c):
    """lane_word_of_column of a column of a whole LANE_BLOCK."""
    half = LANE_GROUP // 2
    return ((c // LANE_BLOCK) * (LANE_BLOCK // 2) + (c % WIDE_CHUNK) // LANE_GROUP * LANE_GROUP
            + (c % LANE_BLOCK) // WIDE_CHUNK * half + c % half)


def lane_word_in_tail(c):
    """lane_word_of_column of a column past the last whole LANE_BLOCK."""
    half = LANE_GROUP // 2
    return (c // LANE_GROUP) * half + c % half


def lane_chunk_words(chunk, d_k: int, select=None) -> tuple:
    """(word of warp 0's first column, words from one warp's to the next's) of the wide tile's
    dKV chunk ``chunk`` in lane_word_columns' layout; ``chunk`` may be a TileLang expression, with
    ``select`` as in lane_word_of_column."""
    in_block = (LANE_BLOCK // 2 * (chunk // 2) + LANE_GROUP // 2 * (chunk % 2), LANE_GROUP)
    in_tail = (WIDE_CHUNK // 2 * chunk, LANE_GROUP // 2)
    whole = (chunk + 1) * WIDE_CHUNK <= d_k // LANE_BLOCK * LANE_BLOCK
    if select is None:
        return in_block if whole else in_tail
    return tuple(select(whole, a, b) for a, b in zip(in_block, in_tail))


#: The head tile of the one-CTA design that runs two 32-head groups as one.
WIDE_HEADS = 64
#: Head tiles main_bwd builds: 16 and 32 (one group each), 64 (the wide tile).
TILE_HEADS = (16, 32, WIDE_HEADS)
#: Head groups of one launch: 1, or a thread block cluster of two 16-head
#: groups (fixed only) whose CTAs swap P and dS tiles and sum dKV over both.
CLUSTER_SIZES = (1, 2)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def main_tile_heads(heads: int) -> int:
    """The head tile the main backward derives from the H it is handed."""
    return min(64, max(next_power_of_2(heads), 16))


def _tl():
    import tilelang
    import tilelang.language as T

    return tilelang, T


def _pass_configs(tilelang):
    key = tilelang.PassConfigKey
    return {
        key.TL_DISABLE_WARP_SPECIALIZED: True,
        key.TL_DISABLE_TMA_LOWER: True,
    }


def _require(field: str, ok: bool, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {value!r} ({expected})")


#: The tile count of the wide tile's kernel for a launch of two or more 64-head tiles: one kernel
#: serves every such count (MainConfig.kernel). A launch of one tile runs a kernel without the
#: tile index.
MULTI_TILE = 2


@dataclasses.dataclass(frozen=True)
class MainConfig:
    """One main backward kernel (main_bwd.main_bwd_program).

    heads: the CTA's head tile (TILE_HEADS); 64 is the wide tile, two 32-head
    groups in one warp-specialised CTA over 64-slot blocks (wide.py), whose
    deterministic launches add in "lanes" (and "fixed" as their redo). cluster:
    2 runs two consecutive 16-head groups as one thread block cluster (fixed only).
    corrections: a lanes launch that adds, for the rows a lanes launch flagged (a value past the
    FFMA rounding's range: kernels/wide.py, ws_magic_word), each word's exact value less the one
    that launch added (lanes_corrections).
    tiles: the wide tile's consecutive 64-head tiles one launch covers, its persistent
    CTAs walking the (query row, tile) items (a launch argument of the kernel that
    every count above one shares: MainConfig.kernel). wg0_chunks and dq_split: how
    the wide tile shares its dKV chunks and its dQ columns between its warpgroups
    (default_wg0_chunks, WIDE_DQ_SPLIT).
    """

    heads: int
    d_k: int
    d_v: int
    accumulate: str = "fixed"
    cluster: int = 1
    wg0_chunks: int | None = None
    tiles: int = 1
    dq_split: int | None = None
    corrections: bool = False

    def __post_init__(self):
        _require("heads", self.heads in TILE_HEADS, self.heads, f"one of {TILE_HEADS}")
        for field in ("d_k", "d_v"):
            value = getattr(self, field)
            _require(field, isinstance(value, int) and value > 0 and value % 16 == 0, value, "a positive multiple of 16")
        _require("d_v", self.d_v <= self.d_k, self.d_v, f"at most d_k={self.d_k}")
        _require("accumulate", self.accumulate in ACCUMULATE, self.accumulate, f"one of {ACCUMULATE}")
        _require("accumulate", self.accumulate != "lanes" or self.heads == WIDE_HEADS, self.accumulate,
                 f"the lanes are built for the wide tile ({WIDE_HEADS} heads) only")
        _require("cluster", self.cluster in CLUSTER_SIZES, self.cluster, f"one of {CLUSTER_SIZES}")
        _require("cluster", self.cluster == 1 or (self.accumulate == "fixed" and self.heads == 16), self.cluster,
                 "a cluster of 2 is built for 16-head groups of the fixed accumulation; two 32-head groups run as one wide tile")
        _require("tiles", isinstance(self.tiles, int) and self.tiles > 0, self.tiles, "a positive int")
        _require("corrections", self.corrections in (False, True) and (not self.corrections or self.accumulate == "lanes"),
                 self.corrections, "a bool, True for a lanes launch only")
        if not self.wide:
            _require("wg0_chunks", self.wg0_chunks is None, self.wg0_chunks, "the wide tile's only")
            _require("dq_split", self.dq_split is None, self.dq_split, "the wide tile's only")
            _require("tiles", self.tiles == 1, self.tiles, "more than one is the wide tile's only")
            return
        if self.wg0_chunks is None:  # one value, one compile-cache key
            object.__setattr__(self, "wg0_chunks", default_wg0_chunks(self.accumulate, self.d_k))
        # (below d_k / WIDE_CHUNK too: require_wide_widths, where a kernel is built or a launcher made)
        _require("wg0_chunks", isinstance(self.wg0_chunks, int) and self.wg0_chunks > 0, self.wg0_chunks, "a positive int")
        if self.dq_split is None:
            object.__setattr__(self, "dq_split", WIDE_DQ_SPLIT)
        # (within dq_split_bounds too: require_wide_widths)
        _require("dq_split", isinstance(self.dq_split, int) and self.dq_split > 0 and self.dq_split % WIDE_CHUNK == 0,
                 self.dq_split, f"a positive multiple of {WIDE_CHUNK}")

    @property
    def wide(self) -> bool:
        return self.heads == WIDE_HEADS

    @property
    def slot_block(self) -> int:
        """The slots of one main-loop step: the padded top-k must be a multiple of it."""
        return WIDE_SLOTS if self.wide else BLOCK_SLOTS

    @property
    def groups(self) -> int:
        """The head groups (of the wrapper's group width) one launch covers."""
        if self.wide:
            return 2 * self.tiles
        return 2 if self.cluster == 2 else 1

    @property
    def kernel(self) -> "MainConfig":
        """The configuration whose kernel runs this launch: one tile's, or the kernel of two or more
        tiles (MULTI_TILE), whose count is the launch's argument."""
        return dataclasses.replace(self, tiles=MULTI_TILE) if self.tiles > MULTI_TILE else self

    @property
    def threads(self) -> int:
        # 8 warps need a tile of at least 32 head rows to partition the GEMMs.
        return 256 if self.heads >= 32 else 128


def main_config(heads: int, d_k: int, d_v: int, deterministic: bool = True, cluster: int = 1) -> MainConfig:
    """The kernel that runs ``cluster`` (1 or 2) consecutive groups of ``heads`` heads:
    the tile is main_tile_heads(heads); a pair of 32-head groups runs as one wide tile
    (deterministic: in lanes)."""
    tile = main_tile_heads(heads)
    accumulate = "fixed" if deterministic else "atomic"
    if cluster == 2 and tile == 32:
        return MainConfig(WIDE_HEADS, d_k, d_v, "lanes" if deterministic else "atomic")
    return MainConfig(tile, d_k, d_v, accumulate, cluster)


@functools.lru_cache(maxsize=256)
def main_launches(groups: int, heads: int, d_k: int, d_v: int, deterministic: bool = True) -> tuple:
    """((first group, MainConfig), ...) covering ``groups`` head groups of ``heads`` heads:
    pairs where a pair has a kernel (the fixed cluster of two 16-head groups, the wide
    tile for 32-head groups of either accumulation), a single group for the rest. The
    wide tile's pairs all go in one launch (MainConfig.tiles), one persistent grid over
    all their (row, tile) items, where a launch a pair would fill and drain the GPU each.
    Memoised: the wrapper asks for it several times a call, on the host's critical path."""
    pairs = main_tile_heads(heads) == 32 or (deterministic and main_tile_heads(heads) == 16)
    launches, g = [], 0
    while g < groups:
        size = 2 if pairs and groups - g >= 2 else 1
        config = main_config(heads, d_k, d_v, deterministic, size)
        if config.wide:
            config = dataclasses.replace(config, tiles=(groups - g) // 2)
        launches.append((g, config))
        g += config.groups
    return tuple(launches)


@functools.lru_cache(maxsize=64)
def lanes_redo(config: MainConfig) -> MainConfig:
    """The int64 launch that redoes a lanes launch where a bound failed (the same tile)."""
    _require("config", config.accumulate == "lanes" and not config.corrections, config, "a lanes launch")
    return dataclasses.replace(config, accumulate="fixed")


@functools.lru_cache(maxsize=64)
def lanes_corrections(config: MainConfig) -> MainConfig:
    """The launch that corrects a lanes launch's words on the rows it flagged (the same tile).
    Memoised as lanes_redo: the wrapper asks for it on every call."""
    _require("config", config.accumulate == "lanes" and not config.corrections, config, "a lanes launch")
    return dataclasses.replace(config, corrections=True)


#: Threads of prologue.sorted_slots and the keys a thread can take: one CTA sorts a row of up to
#: SORT_CAPACITY slots, built for each count of SORT_ITEM_COUNTS. A row's sort takes the fewest
#: that hold it (sort_items): a radix sort's work grows with the keys it holds, padding included.
SORT_THREADS = 256
SORT_ITEM_COUNTS = (2, 4, 8)
SORT_CAPACITY = SORT_THREADS * SORT_ITEM_COUNTS[-1]


def sort_items(padded_slots: int) -> int:
    """The keys a thread of sorted_slots takes for rows of ``padded_slots`` (at most SORT_CAPACITY)."""
    if not 0 < padded_slots <= SORT_CAPACITY:
        raise ValueError(f"padded_slots: {padded_slots}, not in [1, {SORT_CAPACITY}]")
    return next(items for items in SORT_ITEM_COUNTS if SORT_THREADS * items >= padded_slots)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One of the small kernels: ``kind`` and the builder's arguments.

    kinds: "delta" (d_v), "delta_max" (d_v), "mark_slots" (d_k), "plan" (stage),
    "dsink_reduce" (), "cast_bf16" (cols), "fixed_to_bf16" (cols), "lanes_to_bf16" (cols),
    "lanes_failed" (), "poisoned_batches" (), "zero_gated" (cols),
    "slot_keys" (index dtype: "int32" or "int64"), "place_slots" (), "row_blocks" (),
    "sorted_slots" (index dtype, keys a thread: sort_items), "sorted_marks" (the same and d_k:
    sorted_slots with mark_slots' work for its rows).
    """

    kind: str
    args: tuple = ()

    def __post_init__(self):
        _require("kind", self.kind in SMALL_KINDS, self.kind, f"one of {tuple(SMALL_KINDS)}")
        _require("args", isinstance(self.args, tuple) and len(self.args) == SMALL_KINDS[self.kind], self.args,
                 f"{SMALL_KINDS[self.kind]} values for {self.kind}")


SMALL_KINDS = {"delta": 1, "delta_max": 1, "mark_slots": 1, "plan": 1, "dsink_reduce": 0, "cast_bf16": 1,
               "fixed_to_bf16": 1, "lanes_to_bf16": 1, "lanes_failed": 0, "poisoned_batches": 0, "zero_gated": 1,
               "slot_keys": 1, "place_slots": 0, "row_blocks": 0, "sorted_slots": 2, "sorted_marks": 3}
#: The index dtypes slot_keys is built for; the wrapper converts any other to int64.
SLOT_INDEX_DTYPES = ("int32", "int64")


#: The head group sizes the wrapper launches (SPEC: 16, or 32 where H is a multiple of 32).
GROUP_WIDTHS = (16, 32)


def gpu_configs(widths=GPU_WIDTHS, group_widths=GROUP_WIDTHS):
    """Every kernel configuration the wrapper can launch for these widths, each once."""
    configs = [KernelConfig("dsink_reduce"), *(KernelConfig("plan", (stage,)) for stage in ("terms", "peaks", "scales")),
               KernelConfig("lanes_failed"), KernelConfig("poisoned_batches"),
               KernelConfig("place_slots"), KernelConfig("row_blocks"),
               *(KernelConfig("slot_keys", (dtype,)) for dtype in SLOT_INDEX_DTYPES),
               *(KernelConfig("sorted_slots", (dtype, items)) for dtype in SLOT_INDEX_DTYPES for items in SORT_ITEM_COUNTS)]
    for d_k, d_v in widths:
        configs += [KernelConfig("delta", (d_v,)), KernelConfig("delta_max", (d_v,)), KernelConfig("mark_slots", (d_k,)),
                    *(KernelConfig("sorted_marks", (dtype, items, d_k)) for dtype in SLOT_INDEX_DTYPES
                      for items in SORT_ITEM_COUNTS),
                    KernelConfig("cast_bf16", (d_k,)),
                    KernelConfig("fixed_to_bf16", (d_k,)), KernelConfig("lanes_to_bf16", (d_k,)),
                    KernelConfig("zero_gated", (d_k,))]
        for heads in group_widths:
            for deterministic in (True, False):
                for groups in (1, 2, 2 * MULTI_TILE):  # a lone group, a pair, pairs in one grid
                    for _, config in main_launches(groups, heads, d_k, d_v, deterministic):
                        configs += ([config, lanes_corrections(config), lanes_redo(config)] if config.accumulate == "lanes"
                                    else [config])
    return list(dict.fromkeys(configs))
