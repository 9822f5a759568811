"""The Delta kernel: the kernels' base-2 lse (Lse2), Delta = rowsum(O * dO), the sink rows,
and the fixed-point plan's maxima of dO."""

import numpy

from .config import LOG2E, _tl
from .device_functions import MAGNITUDE_SOURCE

DELTA_HEADS = 16
#: Head rows a warp of the Delta kernel takes at once (DELTA_HEADS over the CTA's 4 warps).
DELTA_HEADS_AT_ONCE = 4
DELTA_THREADS = 32 * DELTA_HEADS // DELTA_HEADS_AT_ONCE

# A warp per DELTA_HEADS_AT_ONCE head rows of one query row, 16 bytes a lane a load: every load
# of those rows goes out before any product, so that a warp keeps 8 KB of O and dO in flight (a
# TileLang loop of one element a thread a load kept far less). A lane sums its own elements in a
# fixed order, then the warp's lanes by a butterfly: the same order on every run, and no block
# barrier. The maxima of dO: MAGNITUDE_SOURCE. Lane 0 of each warp also turns its heads' lse and
# sink into the kernels' base 2 (layout.lse_base2), loaded before the rows so that they arrive
# with them: one launch fewer on the host's path to the main kernel.
DELTA_SOURCE = MAGNITUDE_SOURCE + r"""
// Lse2 from the natural-log lse a and sink b: logaddexp as max + log1p(exp(-|a - b|)) (no
// overflow, exactly max where one is -inf), +inf where a is -inf (a row with no valid slot), NaN
// where a or b is NaN or +inf (x < inf fails for those two only). The multiply by log2(e) is
// __fmul_rn: contracted into the sink rows' subtraction below, it would round differently.
__device__ __forceinline__ float mqa_lse_base2(float a, float b) {
  const float inf = __int_as_float(0x7f800000);  // math_constants.h comes after imported source
  if (!(a < inf && b < inf)) return __int_as_float(0x7fffffff);  // CUDART_NAN_F
  if (a == -inf) return inf;
  return __fmul_rn(max(a, b) + log1pf(expf(fabsf(a - b) * -1.0f)), %(log2e)s);
}
__device__ __forceinline__ float mqa_dot_bf16x8(uint4 a, uint4 b, float sum) {
  const unsigned x[4] = {a.x, a.y, a.z, a.w}, y[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    sum = fmaf(__uint_as_float(x[k] << 16), __uint_as_float(y[k] << 16), sum);
    sum = fmaf(__uint_as_float(x[k] & 0xffff0000u), __uint_as_float(y[k] & 0xffff0000u), sum);
  }
  return sum;
}
template <bool with_peak>
__device__ __forceinline__ void mqa_delta_heads(const void* o_row, const void* do_row, const float* lse_row,
                                                const float* sink, const void* lse2_row, const void* delta_row,
                                                const void* dsink_row, const void* peak_row, int h_first, int hq) {
  constexpr int vectors = %(vectors)d, per_lane = (vectors + 31) / 32, at_once = %(at_once)d;
  const int lane = threadIdx.x & 31, h0 = h_first + (threadIdx.x >> 5) * at_once;
  const uint4* o = static_cast<const uint4*>(o_row);
  const uint4* g = static_cast<const uint4*>(do_row);
  float lse[at_once], sink_h[at_once];
#pragma unroll
  for (int i = 0; i < at_once; ++i) {
    lse[i] = sink_h[i] = 0.0f;
    if (lane == 0 && h0 + i < hq) {
      lse[i] = __ldg(lse_row + h0 + i);
      sink_h[i] = __ldg(sink + h0 + i);
    }
  }
  uint4 a[at_once][per_lane], b[at_once][per_lane];
#pragma unroll
  for (int i = 0; i < at_once; ++i)
#pragma unroll
    for (int v = 0; v < per_lane; ++v) {
      const int vector = v * 32 + lane;
      a[i][v] = b[i][v] = make_uint4(0u, 0u, 0u, 0u);
      if (h0 + i < hq && vector < vectors) {
        a[i][v] = __ldg(o + static_cast<long>(h0 + i) * vectors + vector);
        b[i][v] = __ldg(g + static_cast<long>(h0 + i) * vectors + vector);
      }
    }
#pragma unroll
  for (int i = 0; i < at_once; ++i) {
    float sum = 0.0f;
    unsigned m = 0u;
#pragma unroll
    for (int v = 0; v < per_lane; ++v) {
      sum = mqa_dot_bf16x8(a[i][v], b[i][v], sum);
      if (with_peak) m = __vmaxu2(m, mqa_magnitudes(b[i][v]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (with_peak) m = mqa_warp_peak(m);
    const int h = h0 + i;
    if (lane == 0 && h < hq) {
      const float lse2 = mqa_lse_base2(lse[i], sink_h[i]), sink2_h = __fmul_rn(sink_h[i], %(log2e)s);
      const_cast<float*>(static_cast<const float*>(lse2_row))[h] = lse2;
      const_cast<float*>(static_cast<const float*>(delta_row))[h] = sum;
      const_cast<float*>(static_cast<const float*>(dsink_row))[h] = -exp2f(sink2_h - lse2) * sum;
      if (with_peak) const_cast<int*>(static_cast<const int*>(peak_row))[h] = static_cast<int>(m);
    }
  }
}
"""


def delta_program(d_v: int, threads: int = DELTA_THREADS, peak_do: bool = False):
    """Lse2[r, h] from Lse and Sink, the kernels' base-2 sink-inclusive lse, poisoned where the
    input is bad (layout.lse_base2); Delta[r, h] = <O[r, h], dO[r, h]>; DSinkRows[r, h] =
    -exp2(Sink[h] * log2(e) - Lse2[r, h]) * Delta[r, h] (layout.sink_rows).

    With peak_do (the fixed-point design's variant) it also writes the maximum
    its plan needs of dO, which it reads anyway, as bf16 bit patterns in int32:
    PeakDO[r, h] = max_d bits(|dO[r, h, d]|) (exact; a NaN pattern when an
    element is NaN). The plan's maxima of q come with the slot layout
    (prologue.sorted_slots_program's sorted_marks build, or plan.mark_slots_program).

    Grid (R, ceil(H / 16)); heads past H are masked, so any H is safe here.
    """
    if d_v % 8:
        raise ValueError(f"d_v: {d_v}, not a multiple of 8 (a load takes 8 bf16)")
    if threads != DELTA_THREADS:
        raise ValueError(f"threads: {threads}, not {DELTA_THREADS} (a warp per {DELTA_HEADS_AT_ONCE} of {DELTA_HEADS} heads)")
    tilelang, T = _tl()
    R = T.dynamic("R")
    H = T.dynamic("H")
    Dv = d_v
    bh = DELTA_HEADS
    f32, bf16, i32 = "float32", "bfloat16", "int32"
    log2e = float(numpy.float32(LOG2E)).hex() + "f"  # log2(e) rounded to fp32, as a C hex literal
    source = DELTA_SOURCE % {"vectors": Dv // 8, "at_once": DELTA_HEADS_AT_ONCE, "log2e": log2e}

    @T.macro
    def heads(r, hb, O, dO, Lse, Sink, Lse2, Delta, DSinkRows, PeakDO):
        T.import_source(source)
        T.call_extern("handle", f"mqa_delta_heads<{'true' if peak_do else 'false'}>", T.address_of(O[r, 0, 0]),
                      T.address_of(dO[r, 0, 0]), T.address_of(Lse[r, 0]), T.address_of(Sink[0]),
                      T.address_of(Lse2[r, 0]), T.address_of(Delta[r, 0]), T.address_of(DSinkRows[r, 0]),
                      T.address_of(PeakDO[r, 0]), hb * bh, H)

    if peak_do:
        @T.prim_func
        def delta_max(
            O: T.Tensor((R, H, Dv), bf16),
            dO: T.Tensor((R, H, Dv), bf16),
            Lse: T.Tensor((R, H), f32),
            Sink: T.Tensor((H,), f32),
            Lse2: T.Tensor((R, H), f32),
            Delta: T.Tensor((R, H), f32),
            DSinkRows: T.Tensor((R, H), f32),
            PeakDO: T.Tensor((R, H), i32),
        ):
            with T.Kernel(R, T.ceildiv(H, bh), threads=threads) as (r, hb):
                heads(r, hb, O, dO, Lse, Sink, Lse2, Delta, DSinkRows, PeakDO)

        return delta_max

    @T.prim_func
    def delta(
        O: T.Tensor((R, H, Dv), bf16),
        dO: T.Tensor((R, H, Dv), bf16),
        Lse: T.Tensor((R, H), f32),
        Sink: T.Tensor((H,), f32),
        Lse2: T.Tensor((R, H), f32),
        Delta: T.Tensor((R, H), f32),
        DSinkRows: T.Tensor((R, H), f32),
    ):
        with T.Kernel(R, T.ceildiv(H, bh), threads=threads) as (r, hb):
            # <false> writes no maxima: Delta stands in for the peak pointer it never uses.
            heads(r, hb, O, dO, Lse, Sink, Lse2, Delta, DSinkRows, Delta)

    return delta
