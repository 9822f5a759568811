"""The Delta kernel: Delta = rowsum(O * dO), the sink rows, and the fixed-point plan's maxima of dO."""

from .config import LOG2E, _tl

DELTA_HEADS = 16
PEAK_COLS = 32  # columns per step of the maxima: one warp per head row


def delta_program(d_v: int, threads: int = 128, peak_do: bool = False):
    """Delta[r, h] = <O[r, h], dO[r, h]>; DSinkRows[r, h] = -exp2(Sink2[h] - Lse2[r, h]) * Delta[r, h].

    With peak_do (the fixed-point design's variant) it also writes the maximum
    its plan needs of dO, which it reads anyway, as bf16 bit patterns in int32:
    PeakDO[r, h] = max_d bits(|dO[r, h, d]|) (exact; a NaN pattern when an
    element is NaN). The plan's maxima of q come with the slot marks
    (plan.mark_slots_program), whose dependent loads hide q's stream.

    Grid (R, ceil(H / 16)); heads past H are masked, so any H is safe here.
    """
    tilelang, T = _tl()
    R = T.dynamic("R")
    H = T.dynamic("H")
    Dv = d_v
    bh = DELTA_HEADS
    block_d = 64 if Dv % 64 == 0 else 16
    f32, bf16, i32 = "float32", "bfloat16", "int32"
    if peak_do and Dv % PEAK_COLS:
        raise ValueError(f"d_v: {Dv}, not a multiple of {PEAK_COLS} (the maxima's columns a step)")

    @T.macro
    def row_products(O, dO, acc, r, hb):
        T.clear(acc)
        for kd in T.serial(Dv // block_d):
            for h, d in T.Parallel(bh, block_d):
                if hb * bh + h < H:
                    acc[h, d] += T.cast(O[r, hb * bh + h, kd * block_d + d], f32) * T.cast(
                        dO[r, hb * bh + h, kd * block_d + d], f32
                    )

    @T.macro
    def write_delta(Lse2, Sink2, Delta, DSinkRows, acc, row, r, hb):
        T.reduce_sum(acc, row, dim=1)
        for h in T.Parallel(bh):
            if hb * bh + h < H:
                Delta[r, hb * bh + h] = row[h]
                DSinkRows[r, hb * bh + h] = -T.exp2(Sink2[hb * bh + h] - Lse2[r, hb * bh + h]) * row[h]

    @T.macro
    def magnitude_peak(X, width, Peak, peak, peak_row, r, hb):
        # bf16 is sign-magnitude: |x| orders as its low 15 bits do, and every
        # NaN's bits lie above inf's, so an integer max is exact and keeps NaN.
        # Rows of 32 columns reduce within a warp (no block barrier).
        T.clear(peak)
        for kd in T.serial(width // PEAK_COLS):
            for h, d in T.Parallel(bh, PEAK_COLS):
                if hb * bh + h < H:
                    peak[h, d] = T.max(peak[h, d], T.bitwise_and(
                        T.cast(T.reinterpret(X[r, hb * bh + h, kd * PEAK_COLS + d], "int16"), i32), 0x7FFF))
        T.reduce_max(peak, peak_row, dim=1)
        for h in T.Parallel(bh):
            if hb * bh + h < H:
                Peak[r, hb * bh + h] = peak_row[h]

    if peak_do:
        @T.prim_func
        def delta_max(
            O: T.Tensor((R, H, Dv), bf16),
            dO: T.Tensor((R, H, Dv), bf16),
            Lse2: T.Tensor((R, H), f32),
            Sink2: T.Tensor((H,), f32),
            Delta: T.Tensor((R, H), f32),
            DSinkRows: T.Tensor((R, H), f32),
            PeakDO: T.Tensor((R, H), i32),
        ):
            with T.Kernel(R, T.ceildiv(H, bh), threads=threads) as (r, hb):
                acc = T.alloc_fragment((bh, block_d), f32)
                row = T.alloc_fragment((bh,), f32)
                peak = T.alloc_fragment((bh, PEAK_COLS), i32)
                peak_row = T.alloc_fragment((bh,), i32)
                row_products(O, dO, acc, r, hb)
                write_delta(Lse2, Sink2, Delta, DSinkRows, acc, row, r, hb)
                magnitude_peak(dO, Dv, PeakDO, peak, peak_row, r, hb)

        return delta_max

    @T.prim_func
    def delta(
        O: T.Tensor((R, H, Dv), bf16),
        dO: T.Tensor((R, H, Dv), bf16),
        Lse2: T.Tensor((R, H), f32),
        Sink2: T.Tensor((H,), f32),
        Delta: T.Tensor((R, H), f32),
        DSinkRows: T.Tensor((R, H), f32),
    ):
        with T.Kernel(R, T.ceildiv(H, bh), threads=threads) as (r, hb):
            acc = T.alloc_fragment((bh, block_d), f32)
            row = T.alloc_fragment((bh,), f32)
            row_products(O, dO, acc, r, hb)
            write_delta(Lse2, Sink2, Delta, DSinkRows, acc, row, r, hb)

    return delta

