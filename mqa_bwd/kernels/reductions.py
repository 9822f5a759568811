"""Reductions and casts: d_sink over the rows, the fixed-point accumulator and fp32 to bf16."""

from .config import _tl


def dsink_reduce_program(threads: int = 128):
    """DSink[h] = sum of DSinkRows[r, h] over r = 0, 1, ..., R-1, in that order, in fp32."""
    tilelang, T = _tl()
    R = T.dynamic("R")
    H = T.dynamic("H")
    f32 = "float32"

    @T.prim_func
    def dsink_reduce(DSinkRows: T.Tensor((R, H), f32), DSink: T.Tensor((H,), f32)):
        with T.Kernel(T.ceildiv(H, threads), threads=threads) as bx:
            acc = T.alloc_local((1,), f32)
            tx = T.get_thread_binding()
            h = bx * threads + tx
            if h < H:
                acc[0] = 0.0
                for r in T.serial(R):
                    acc[0] = acc[0] + DSinkRows[r, h]
                DSink[h] = acc[0]

    return dsink_reduce


def fixed_to_bf16_program(cols: int, block_rows: int = 16, threads: int = 128):
    """Dst[k, c] = bf16(fp32(fp64(Acc[k, c]) / RowScale[k])).

    RowScale is a power of two, so the division is exact in fp64; a NaN
    RowScale (a kv row whose range bound is not finite, or whose batch element
    a main_bwd CTA flagged) makes its row NaN.
    """
    tilelang, T = _tl()
    N = T.dynamic("N")
    C = cols

    @T.prim_func
    def fixed_to_bf16(
        Acc: T.Tensor((N, C), "int64"),
        RowScale: T.Tensor((N,), "float32"),
        Dst: T.Tensor((N, C), "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(N, block_rows), threads=threads) as bx:
            for i, c in T.Parallel(block_rows, C):
                if bx * block_rows + i < N:
                    value = T.cast(Acc[bx * block_rows + i, c], "float64") / T.cast(RowScale[bx * block_rows + i], "float64")
                    Dst[bx * block_rows + i, c] = T.cast(T.cast(value, "float32"), "bfloat16")

    return fixed_to_bf16


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
