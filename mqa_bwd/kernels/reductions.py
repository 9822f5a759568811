"""Reductions and casts: d_sink over the rows, the fixed-point accumulator (and the lanes) and fp32 to bf16."""

from .config import FLAG_MASS, LANE_BLOCK, LANE_GROUP, LANE_LIMIT, _tl, lane_word_in_block, lane_word_in_tail


#: dsink_reduce's row groups: group g sums rows g, g + DSINK_GROUPS, ... in increasing order.
DSINK_GROUPS = 64
#: Heads of one dsink_reduce CTA (of 1024 threads): a warp loads 64 bytes of each of two rows.
DSINK_HEADS = 16


def dsink_reduce_program():
    """DSink[h] = sum over g = 0, 1, ..., G-1 of part[g, h], in that order, with part[g, h] the
    sum of DSinkRows[r, h] over rows r = g, g + G, g + 2G, ... < R in increasing order (G =
    DSINK_GROUPS), all in fp32: a fixed order, with G rows in flight instead of one."""
    tilelang, T = _tl()
    R = T.dynamic("R")
    H = T.dynamic("H")
    f32 = "float32"
    G, HB = DSINK_GROUPS, DSINK_HEADS

    @T.prim_func
    def dsink_reduce(DSinkRows: T.Tensor((R, H), f32), DSink: T.Tensor((H,), f32)):
        with T.Kernel(T.ceildiv(H, HB), threads=G * HB) as bx:
            part = T.alloc_shared((G, HB), f32)
            acc = T.alloc_local((1,), f32)
            total = T.alloc_local((1,), f32)
            tx = T.get_thread_binding()
            g = tx // HB
            h = bx * HB + tx % HB
            acc[0] = 0.0
            if h < H:
                for i in T.serial(T.ceildiv(R, G)):
                    if g + i * G < R:
                        acc[0] = acc[0] + DSinkRows[g + i * G, h]
            part[g, tx % HB] = acc[0]
            T.sync_threads()
            if g == 0 and h < H:
                total[0] = 0.0
                for j in T.serial(G):
                    total[0] = total[0] + part[j, tx % HB]
                DSink[h] = total[0]

    return dsink_reduce


def _row_reciprocals(T, rows: int):
    """A macro: reciprocals[i] = 1 / RowScale[first + i] in fp64, NaN (from fp32's default NaN,
    0x7fc00000, as the host's poisoned scale held) where Poisoned[(first + i) // S_kv] is set, for
    i < rows; once a row, in shared memory, so that the element loop multiplies by a load. A row
    scale is a power of two (or 0, inf, NaN), so x * (1 / scale) is x / scale bit for bit, and a
    multiply is a few instructions where fp64 division is a subroutine."""

    @T.macro
    def row_reciprocals(RowScale, Poisoned, S_kv, reciprocals, first):
        for i in T.Parallel(rows):
            k = T.min(first + i, RowScale.shape[0] - 1)  # a tail CTA's rows past N: any row, unread
            nan = T.reinterpret(T.int32(0x7FC00000), "float32")
            scale = T.cast(T.if_then_else(Poisoned[k // S_kv] != 0, nan, RowScale[k]), "float64")
            reciprocals[i] = T.float64(1.0) / scale

    return row_reciprocals


def fixed_to_bf16_program(cols: int, block_rows: int = 16, threads: int = 128):
    """Dst[k, c] = bf16(fp32(fp64(Acc[k, c]) / RowScale[k])), RowScale[k] NaN where
    Poisoned[k // S_kv] is set (poisoned_batches_program).

    RowScale is a power of two, so the division (a multiply by its reciprocal) is exact in fp64; a NaN
    RowScale (a kv row whose range bound is not finite, or whose batch element
    a main_bwd CTA flagged) makes its row NaN.
    """
    tilelang, T = _tl()
    N, B = T.dynamic("N"), T.dynamic("B")
    C = cols
    row_reciprocals = _row_reciprocals(T, block_rows)

    @T.prim_func
    def fixed_to_bf16(
        Acc: T.Tensor((N, C), "int64"),
        RowScale: T.Tensor((N,), "float32"),
        Poisoned: T.Tensor((B,), "int32"),
        Dst: T.Tensor((N, C), "bfloat16"),
        S_kv: T.int32,
    ):
        with T.Kernel(T.ceildiv(N, block_rows), threads=threads) as bx:
            reciprocals = T.alloc_shared((block_rows,), "float64")
            row_reciprocals(RowScale, Poisoned, S_kv, reciprocals, bx * block_rows)
            for i, c in T.Parallel(block_rows, C):
                if bx * block_rows + i < N:
                    value = T.cast(Acc[bx * block_rows + i, c], "float64") * reciprocals[i]
                    Dst[bx * block_rows + i, c] = T.cast(T.cast(value, "float32"), "bfloat16")

    return fixed_to_bf16


def lanes_to_bf16_program(cols: int, block_rows: int = 16, threads: int = 128):
    """fixed_to_bf16 of Acc plus the decoded lanes: Dst[k, c] = bf16(fp32(fp64(Acc[k, c] + lane[k, c]) /
    RowScale[k])), lane[k, c] column c's lane of Words[k] (config.lane_word_of_column) where
    Failed[0] == 0, else 0 (Acc then holds the int64 redo's sums): join and cast in one pass.
    RowScale[k] is NaN where Poisoned[k // S_kv] is set, as in fixed_to_bf16.
    AccSummed == 0 is the caller's word that Acc is zero unless Failed[0] is set (every launch
    added in lanes): then Acc is read only where the redo ran, the same bits with a third of the
    bytes."""
    tilelang, T = _tl()
    N, B = T.dynamic("N"), T.dynamic("B")
    C, G = cols, LANE_GROUP
    if C % G:
        raise ValueError(f"cols: {C} (the lanes pair columns within groups of {G}: a multiple of {G})")
    whole = C // LANE_BLOCK * LANE_BLOCK
    row_reciprocals = _row_reciprocals(T, block_rows)

    def join_and_cast(with_acc: bool):
        @T.macro
        def join(Acc, Words, Failed, reciprocals, Dst, k, i, c, word_index):
            if k < N:
                word = Words[k, word_index]
                lo = T.cast(T.cast(word, "int32"), "int64")  # the low lane, sign-extended
                lane = T.if_then_else(c % G < G // 2, lo, T.shift_right(word - lo, T.int64(32)))
                total = Acc[k, c] + T.if_then_else(Failed[0] == 0, lane, T.int64(0)) if with_acc else lane
                value = T.cast(total, "float64") * reciprocals[i]
                Dst[k, c] = T.cast(T.cast(value, "float32"), "bfloat16")

        return join

    def rows(join):
        @T.macro
        def cast_rows(Acc, Words, Failed, reciprocals, Dst, bx):
            # The whole LANE_BLOCKs, then the tail: each loop's word index is arithmetic on its
            # column alone (a select between the two would keep the loop from vectorising).
            if whole:
                for i, c in T.Parallel(block_rows, whole):
                    join(Acc, Words, Failed, reciprocals, Dst, bx * block_rows + i, i, c, lane_word_in_block(c))
            if C > whole:
                for i, c in T.Parallel(block_rows, C - whole):
                    join(Acc, Words, Failed, reciprocals, Dst, bx * block_rows + i, i, whole + c, lane_word_in_tail(whole + c))

        return cast_rows

    with_acc, lanes_only = rows(join_and_cast(True)), rows(join_and_cast(False))

    @T.prim_func
    def lanes_to_bf16(
        Acc: T.Tensor((N, C), "int64"),
        Words: T.Tensor((N, C // 2), "int64"),
        Failed: T.Tensor((1,), "int32"),
        RowScale: T.Tensor((N,), "float32"),
        Poisoned: T.Tensor((B,), "int32"),
        Dst: T.Tensor((N, C), "bfloat16"),
        S_kv: T.int32,
        AccSummed: T.int32,
    ):
        with T.Kernel(T.ceildiv(N, block_rows), threads=threads) as bx:
            reciprocals = T.alloc_shared((block_rows,), "float64")
            row_reciprocals(RowScale, Poisoned, S_kv, reciprocals, bx * block_rows)
            if AccSummed != 0 or Failed[0] != 0:
                with_acc(Acc, Words, Failed, reciprocals, Dst, bx)
            else:
                lanes_only(Acc, Words, Failed, reciprocals, Dst, bx)

    return lanes_to_bf16


def lanes_failed_program(threads: int = 256):
    """Failed[0] = 1 where some kv row's Bound reached LANE_LIMIT: the lanes' sums may not decode,
    and the int64 redo runs (fixed_point.lanes_failed). Failed is zeroed by the caller and only
    ever set to 1, so it is the same on every run whichever thread stores first. One launch where
    torch's comparison, reduction and cast took three."""
    tilelang, T = _tl()
    N = T.dynamic("N")

    @T.prim_func
    def lanes_failed(Bound: T.Tensor((N,), "int64"), Failed: T.Tensor((1,), "int32")):
        with T.Kernel(T.ceildiv(N, threads), threads=threads) as bx:
            i = bx * threads + T.get_thread_binding()
            if i < N:
                if Bound[i] >= T.int64(LANE_LIMIT):
                    Failed[0] = 1

    return lanes_failed


def poisoned_batches_program(threads: int = 256):
    """Poisoned[b] = 1 where some query row r of batch element b (r // S == b) has FLAG_MASS in
    RowFlags: a head's mass over its allowance, or NaN; the casts make that element's dKV NaN
    (fixed_point.poisoned_batches). Zeroed by the caller, only ever set to 1, as lanes_failed.
    One launch where torch's four took."""
    tilelang, T = _tl()
    R, B = T.dynamic("R"), T.dynamic("B")

    @T.prim_func
    def poisoned_batches(RowFlags: T.Tensor((R,), "int32"), Poisoned: T.Tensor((B,), "int32"), S: T.int32):
        with T.Kernel(T.ceildiv(R, threads), threads=threads) as bx:
            r = bx * threads + T.get_thread_binding()
            if r < R:
                if (RowFlags[r] & FLAG_MASS) != 0:
                    Poisoned[r // S] = 1

    return poisoned_batches


def zero_gated_program(cols: int, block_rows: int = 16, threads: int = 128):
    """Acc[k, c] = 0 for every element where Gate[0] is set; nothing (every CTA ends at once)
    where it is not: the lanes' int64 accumulator, which only their redo adds to and the cast
    reads only where the redo ran, zeroed only where it runs."""
    tilelang, T = _tl()
    N = T.dynamic("N")
    C = cols

    @T.prim_func
    def zero_gated(Acc: T.Tensor((N, C), "int64"), Gate: T.Tensor((1,), "int32")):
        with T.Kernel(T.ceildiv(N, block_rows), threads=threads) as bx:
            if Gate[0] != 0:
                for i, c in T.Parallel(block_rows, C):
                    if bx * block_rows + i < N:
                        Acc[bx * block_rows + i, c] = T.int64(0)

    return zero_gated


def cast_bf16_program(cols: int, block_rows: int = 16, threads: int = 128):
    tilelang, T = _tl()
    N = T.dynamic("N")
    C = cols

    @T.prim_func
    def cast_bf16(Src: T.Tensor((N, C), "float32"), Dst: T.Tensor((N, C), "bfloat16")):
        with T.Kernel(T.ceildiv(N, block_rows), threads=threads) as bx:
            for i, c in T.Parallel(block_rows, C):
                if bx * block_rows + i < N:
                    Dst[bx * block_rows + i, c] = T.cast(Src[bx * block_rows + i, c], "bfloat16")

    return cast_bf16


# ---------------------------------------------------------------------------
# Compilation (cached per configuration).
# ---------------------------------------------------------------------------
