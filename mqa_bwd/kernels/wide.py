"""The 64-head tile: a warp-specialised main backward over 64-slot blocks, dKV added from registers.

Built from a wide ``MainConfig`` (two 32-head groups, one CTA a query row). The launch contract
is main_bwd.py's (the same tensors, a head range read in place), with Lp a multiple of
WIDE_SLOTS and two more arguments: Bound and Gate (the lanes design, below).

Why this shape:
- Slot blocks of 64: every wgmma is m64n64 or wider, so each operand byte read from shared
  memory feeds twice the FLOPs of an m64n32 tile.
- No dKV staging in shared memory: a dKV chunk (64 slots x 64 columns) goes from its
  accumulator straight to the global adds. The staging's bytes are what let a 64-slot KV
  tile fit beside the 64-head Q and dO.
- The warpgroups have roles:
    warpgroup 0: gathers KV, forms S and dP, then P and dS (written to shared memory), and
                 dQ[:, :DQ_SPLIT];
    warpgroup 1: dQ[:, DQ_SPLIT:] and the block's dKV, chunk by chunk, with its adds.
  Warpgroup 0 gathers block t + 1 and forms its scores while warpgroup 1 still forms and
  adds block t's dKV (which reads Q, dO, P and dS, never KV).
- One KV stage refilled in two parts: columns [0, DQ_SPLIT), which only warpgroup 0's dQ GEMM
  reads, right after that GEMM; the rest once warpgroup 1's dQ GEMMs have read them
  (KV_FREE). S and dP start on the first part while the second lands: warpgroup 0's serial
  gather is otherwise the kernel's critical path.

How a CTA adds dKV (config.accumulate):
  "lanes"   (deterministic) two consecutive columns a 64-bit word of two signed 32-bit lanes,
            lo + 2^32 hi, added mod 2^64 with red.global.add.u64 into DKV [NKV, Dk / 2]: a
            lane's sum is exact whatever the order as long as its final value fits 32 bits,
            however its partial sums wrapped. RowScale is the plan's scale lowered, as for
            every deterministic launch (fixed_point.lanes_scale); Bound[kv row] gains, per (slot, block), the ceiling
            of the largest |scaled value| among that slot's contributions, so Bound < 2^31
            proves every lane of the row decodes exactly. The host (wrapper.run) reruns the
            launch in "fixed" where a bound failed.
  "fixed"   int64 fixed point at the same scale, one word a column (the lanes design's redo):
            every CTA ends at once unless Gate[0] != 0, so the redo launches on every call
            without a host sync.
  "atomic"  fp32 red.global.add.v4.f32 (the control).

Handoffs are mbarriers, one phase a block (named barriers are racecheck's blind spot):
PDS_READY (warpgroup 0's 128 threads arrive: P, dS, the block's slots and scales are in
shared memory), KV_FREE and PDS_FREE (warpgroup 1's 128 arrive: its last read of KV_s, of
P_s and dS_s). Slots and scales are double-buffered by block parity: warpgroup 1 still adds
block t while warpgroup 0 lays out block t + 1.
"""

from .config import LOG2E, WIDE_SLOTS, MainConfig, _tl
from .device_functions import GATHER_SOURCE, HANDOFF_SOURCE

#: Heads of the tile.
HEADS = 64
#: Columns of dKV a chunk (one m64n64 accumulator).
CHUNK = 64
#: dQ columns [0, DQ_SPLIT) belong to warpgroup 0, the rest to warpgroup 1.
DQ_SPLIT = 256
WARPGROUP = 128
PDS_READY, KV_FREE, PDS_FREE = 0, 1, 2
#: What a kv row's Bound grows by at most for one contribution: anything larger (or NaN) fails.
BOUND_CAP = 2**40

WS_SOURCE = r"""
__device__ __forceinline__ void ws_bar_sync_wg(int id) { asm volatile("bar.sync %0, 128;" :: "r"(id) : "memory"); }
// cp.async and generic stores to shared memory become visible to wgmma (the async proxy).
__device__ __forceinline__ void ws_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The lanes design's int64 redo launches on every call and ends here unless a row's bound failed.
__device__ __forceinline__ void ws_exit_unless(const int* gate) { if (*gate == 0) asm volatile("exit;"); }
// Every cp.async group of this thread but the newest has landed.
__device__ __forceinline__ void ws_cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void ws_bars_init(void* bars) {
  mqa_handoff_init(bars, 128, 128);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_handoff_bar(bars, 2)), "r"(128) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Predicated adds, not a branch around each: with no branch between them, ptxas interleaves a
// chunk's independent convert-and-add chains (one warp a scheduler has nothing else to run).
__device__ __forceinline__ void ws_red_u64_if(unsigned long long* p, unsigned long long v, bool ok) {
  asm volatile("{\n .reg .pred q;\n setp.ne.u32 q, %2, 0;\n @q red.global.add.u64 [%0], %1;\n}"
               :: "l"(p), "l"(v), "r"(static_cast<unsigned>(ok)) : "memory");
}
__device__ __forceinline__ void ws_red_f32x4_if(float* p, float a, float b, float c, float d, bool ok) {
  asm volatile("{\n .reg .pred q;\n setp.ne.u32 q, %5, 0;\n @q red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n}"
               :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d), "r"(static_cast<unsigned>(ok)) : "memory");
}
// max that keeps a NaN (fmaxf drops it): a NaN contribution must fail its row's bound.
__device__ __forceinline__ float ws_max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The adds of one 64 x 64 dKV chunk from a warpgroup's wgmma accumulator. Thread t of the
// warpgroup holds, in acc[2i] and acc[2i + 1], row 16 (t / 32) + 8 (i % 2) + (t % 32) / 4 and
// columns 8 (i / 2) + 2 (t % 4) + {0, 1} (TileLang's m64n64 C layout). dkv comes const:
// TileLang sees no store to it through these calls.

// The control: red.v4.f32, four columns a lane, as cuDNN adds. Of each 16-column group a lane
// holds pairs A (8-column block 2m) and B (block 2m + 1); partners k and k ^ 1 swap one pair,
// so even k adds A_k A_k+1 (columns 16m + 2k .. + 3) and odd k adds B_k-1 B_k (columns
// 16m + 6 + 2k .. + 3): a quad covers 64 bytes a row.
__device__ __forceinline__ void ws_add_chunk_atomic(const float* acc, const void* dkv, const int* slots, int col0,
                                                    int ld, int nkv, int t) {
  const int lane = t & 31, warp = t >> 5, k = lane & 3;
  const bool odd = k & 1;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + 8 * half + (lane >> 2);
    const int kv = slots[row];
    const bool ok = kv >= 0 && kv < nkv;
    float* base = const_cast<float*>(static_cast<const float*>(dkv)) + (long long)(ok ? kv : 0) * ld + col0;
    #pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float a0 = acc[2 * (2 * (2 * m) + half)], a1 = acc[2 * (2 * (2 * m) + half) + 1];
      const float b0 = acc[2 * (2 * (2 * m + 1) + half)], b1 = acc[2 * (2 * (2 * m + 1) + half) + 1];
      const float r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
      const float r1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
      ws_red_f32x4_if(base + 16 * m + 2 * k + (odd ? 6 : 0), odd ? r0 : a0, odd ? r1 : a1, odd ? b0 : r0,
                      odd ? b1 : r1, ok);
    }
  }
}
// The int64 redo: by four shuffles a lane of a quad gets columns k and 4 + k of each 8-column
// block (k = t % 4), so each red.u64 instruction adds 32 contiguous bytes a row, whole sectors.
__device__ __forceinline__ void ws_add_chunk_fixed(const float* acc, const void* dkv, const int* slots,
                                                   const float* scales, int col0, int ld, int nkv, int t) {
  const int lane = t & 31, warp = t >> 5, k = lane & 3, quad = lane & ~3;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + 8 * half + (lane >> 2);
    const int kv = slots[row];
    const float scale = scales[row];
    const bool ok = kv >= 0 && kv < nkv;
    unsigned long long* base = const_cast<unsigned long long*>(static_cast<const unsigned long long*>(dkv))
                               + (long long)(ok ? kv : 0) * ld + col0;
    #pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
      const float v0 = acc[2 * (2 * n8 + half)], v1 = acc[2 * (2 * n8 + half) + 1];
      const float a = __shfl_sync(0xffffffffu, v0, quad + (k >> 1)), b = __shfl_sync(0xffffffffu, v1, quad + (k >> 1));
      const float c = __shfl_sync(0xffffffffu, v0, quad + 2 + (k >> 1)), d = __shfl_sync(0xffffffffu, v1, quad + 2 + (k >> 1));
      const float lo = (k & 1) ? b : a, hi = (k & 1) ? d : c;
      ws_red_u64_if(base + 8 * n8 + k, static_cast<unsigned long long>(__float2ll_rn(lo * scale)), ok);
      ws_red_u64_if(base + 8 * n8 + 4 + k, static_cast<unsigned long long>(__float2ll_rn(hi * scale)), ok);
    }
  }
}
// The lanes design: a lane's two consecutive columns go as one word lo + 2^32 hi, cvt.rni.s32 of
// each (round half to even, saturating, NaN -> 0); a quad's four words are one whole sector a
// row. peak[h] keeps the largest |scaled value| of this thread's row h over the block's chunks
// (NaN if any is); ws_add_bounds adds each row's quad maximum to its kv row's Bound.
__device__ __forceinline__ void ws_add_chunk_lanes(const float* acc, const void* words, const int* slots,
                                                   const float* scales, int col0, int ld, int nkv, int t,
                                                   float* peak) {
  const int lane = t & 31, warp = t >> 5, k = lane & 3;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + 8 * half + (lane >> 2);
    const int kv = slots[row];
    const float scale = scales[row];
    const bool ok = kv >= 0 && kv < nkv;
    unsigned long long* base = const_cast<unsigned long long*>(static_cast<const unsigned long long*>(words))
                               + (long long)(ok ? kv : 0) * (ld / 2) + col0 / 2;
    #pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
      const float x0 = acc[2 * (2 * n8 + half)] * scale, x1 = acc[2 * (2 * n8 + half) + 1] * scale;
      peak[half] = ws_max_nan(peak[half], ws_max_nan(fabsf(x0), fabsf(x1)));
      // lo sign-extended: the words' sum is sum(lo) + 2^32 sum(hi) mod 2^64 (fixed_point.decode_lane_words).
      const long long lo = __float2int_rn(x0), hi = __float2int_rn(x1);
      ws_red_u64_if(base + 4 * n8 + k, static_cast<unsigned long long>(lo) + (static_cast<unsigned long long>(hi) << 32), ok);
    }
  }
}
// Bound[kv] += min(ceil(peak), 2^40) for each of the thread's two rows (the quad's maximum; fminf
// maps a NaN peak to 2^40), then the peaks restart for the next block.
__device__ __forceinline__ void ws_add_bounds(float* peak, const void* bound, const int* slots, int nkv, int t) {
  const int lane = t & 31, warp = t >> 5;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m = peak[half];
    m = ws_max_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = ws_max_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const int kv = slots[16 * warp + 8 * half + (lane >> 2)];
    if ((lane & 3) == 0 && kv >= 0 && kv < nkv)
      atomicAdd(const_cast<unsigned long long*>(static_cast<const unsigned long long*>(bound)) + kv,
                static_cast<unsigned long long>(fminf(ceilf(m), 1099511627776.0f)));
    peak[half] = 0.0f;
  }
}
"""


def wide_program(config: MainConfig):
    """The 64-head tile's main backward as the module docstring describes."""
    if not config.wide:
        raise ValueError(f"config: the warp-specialised tile is the wide one (heads {HEADS}), got {config}")
    accumulate, Dk, Dv = config.accumulate, config.d_k, config.d_v
    if Dk % CHUNK or Dv % CHUNK or Dk <= DQ_SPLIT or Dv <= DQ_SPLIT:
        raise ValueError(f"config: d_k={Dk}, d_v={Dv}: multiples of {CHUNK}, both above {DQ_SPLIT}")
    tilelang, T = _tl()
    R, HQ, NKV, Lp = T.dynamic("R"), T.dynamic("HQ"), T.dynamic("NKV"), T.dynamic("Lp")
    BS, H = WIDE_SLOTS, HEADS
    NB = Lp // BS
    f32, bf16, i32, i64 = "float32", "bfloat16", "int32", "int64"
    dkv_dtype = f32 if accumulate == "atomic" else i64
    dkv_shape = (NKV, Dk // 2) if accumulate == "lanes" else (NKV, Dk)
    scaled = accumulate != "atomic"  # a row scale per slot, and the mass check
    n1 = Dk // CHUNK  # warpgroup 1's chunks
    value_chunks = Dv // CHUNK
    # Warpgroup 1's dQ columns in two wgmma-sized pieces (N at most 256, whole 64s):
    # 192 + 128 at Dk = 576, 192 + 64 at 512.
    w1 = min(192, Dk - DQ_SPLIT - CHUNK)
    w2 = Dk - DQ_SPLIT - w1
    c1, c2 = DQ_SPLIT, DQ_SPLIT + w1
    if w1 % CHUNK or not 0 < w2 <= 256:
        raise ValueError(f"config: d_k={Dk}: warpgroup 1's dQ columns do not split in two wgmma tiles")

    @T.macro
    def gather_columns(KV_s, KV, Indices, r, t, col0, col1, NKV, tid):
        """cp.async of KV columns [col0, col1) of block t's rows into KV_s: 8 threads a row, each
        thread 16 bytes of every 128-byte run (no division for an address), 16 rows a pass."""
        for rows in T.serial(BS // (WARPGROUP // 8)):
            j = rows * (WARPGROUP // 8) + tid // 8
            row_j = Indices[r, t * BS + j]
            for k in T.unroll((col1 - col0) // 64):
                c = col0 + k * 64 + (tid % 8) * 8
                T.call_extern("handle", "mqa_cp_async16", T.address_of(KV_s[j, c]),
                              T.address_of(KV[T.max(T.min(row_j, NKV - 1), 0), c]), (row_j >= 0) and (row_j < NKV))

    @T.macro
    def dkv_chunk(Q_s, dO_s, dS_s, P_s, acc, c):
        """dKV columns [c * CHUNK, (c + 1) * CHUNK) of the block into ``acc`` (slots x columns),
        dS^T Q + P^T dO over the heads; issued, not waited for."""
        T.clear(acc)
        T.wgmma_gemm(dS_s, Q_s[0:H, c * CHUNK : (c + 1) * CHUNK], acc, transpose_A=True, clear_accum=True)
        if c < value_chunks:
            T.wgmma_gemm(P_s, dO_s[0:H, c * CHUNK : (c + 1) * CHUNK], acc, transpose_A=True)

    @T.macro
    def add_chunk(dKV, acc, slots_s, scales_s, c, p, NKV, peak, thread):
        """The global adds of chunk c's accumulator, for the block of parity p, by the warpgroup
        whose thread index (0..127) is ``thread``."""
        if accumulate == "lanes":
            T.call_extern("handle", "ws_add_chunk_lanes", acc.data, dKV.data,
                          T.address_of(slots_s[p * BS]), T.address_of(scales_s[p * BS]), c * CHUNK, Dk, NKV, thread,
                          peak.data)
        elif accumulate == "atomic":
            T.call_extern("handle", "ws_add_chunk_atomic", acc.data, dKV.data, T.address_of(slots_s[p * BS]), c * CHUNK,
                          Dk, NKV, thread)
        else:
            T.call_extern("handle", "ws_add_chunk_fixed", acc.data, dKV.data, T.address_of(slots_s[p * BS]),
                          T.address_of(scales_s[p * BS]), c * CHUNK, Dk, NKV, thread)

    @T.prim_func
    def main_bwd(
        Q: T.Tensor((R, HQ, Dk), bf16),
        KV: T.Tensor((NKV, Dk), bf16),
        dO: T.Tensor((R, HQ, Dv), bf16),
        Indices: T.Tensor((R, Lp), i32),
        Lse2: T.Tensor((R, HQ), f32),
        Delta: T.Tensor((R, HQ), f32),
        dQ: T.Tensor((R, HQ, Dk), bf16),
        dKV: T.Tensor(dkv_shape, dkv_dtype),
        RowScale: T.Tensor((NKV,), f32),
        Allowance: T.Tensor((R, HQ), f32),
        Flag: T.Tensor((R,), i32),
        sm_scale: T.float32,
        head_base: T.int32,
        Bound: T.Tensor((NKV,), i64),
        Gate: T.Tensor((1,), i32),
    ):
        with T.Kernel(R, threads=2 * WARPGROUP) as r:
            scale_log2 = sm_scale * LOG2E
            Q_s = T.alloc_shared((H, Dk), bf16)
            dO_s = T.alloc_shared((H, Dv), bf16)
            KV_s = T.alloc_shared((BS, Dk), bf16)
            P_s = T.alloc_shared((H, BS), bf16)
            dS_s = T.alloc_shared((H, BS), bf16)
            lse_s = T.alloc_shared((H,), f32)
            delta_s = T.alloc_shared((H,), f32)
            slots_s = T.alloc_shared((2 * BS,), i32)  # block parity p at [p * BS, (p + 1) * BS)
            scales_s = T.alloc_shared((2 * BS,), f32)
            bars = T.alloc_shared((3,), "uint64")

            acc_s = T.alloc_fragment((H, BS), f32)
            acc_dp = T.alloc_fragment((H, BS), f32)
            acc_dq0 = T.alloc_fragment((H, DQ_SPLIT), f32)
            acc_dq1 = T.alloc_fragment((H, w1), f32)
            acc_dq2 = T.alloc_fragment((H, w2), f32)
            acc_dkv = T.alloc_fragment((BS, CHUNK), f32)
            acc_dkv2 = T.alloc_fragment((BS, CHUNK), f32)
            if scaled:
                mass_row = T.alloc_fragment((H,), f32)
            peak = T.alloc_local((2,), f32)  # warpgroup 1's lanes bound of this thread's two rows
            tid = T.get_thread_binding()
            h0 = head_base

            T.import_source(GATHER_SOURCE + HANDOFF_SOURCE + WS_SOURCE)
            if accumulate == "fixed":  # before any barrier: the whole CTA leaves
                T.call_extern("handle", "ws_exit_unless", Gate.data)
            T.copy(Q[r, h0 : h0 + H, 0:Dk], Q_s)
            T.copy(dO[r, h0 : h0 + H, 0:Dv], dO_s)
            for h in T.Parallel(H):
                lse_s[h] = Lse2[r, h0 + h]
                delta_s[h] = Delta[r, h0 + h]
            if tid == 0:
                T.call_extern("handle", "ws_bars_init", bars.data)
            T.sync_threads()

            with T.ws(0):
                T.clear(acc_dq0)
                if scaled:
                    T.clear(mass_row)
                for t in T.serial(NB):
                    p = t % 2
                    if t > 0:  # warpgroup 1's dQ GEMMs of block t - 1 have read KV_s
                        T.call_extern("handle", "mqa_handoff_wait", bars.data, KV_FREE, (t - 1) % 2)
                    # The block's slots (and their row scales) for both warpgroups; warpgroup 1
                    # reads parity p only after PDS_READY of this block.
                    if tid < BS:
                        row = Indices[r, t * BS + tid]
                        T.call_extern("handle", "mqa_st_shared_i32", slots_s.data, p * BS + tid, row)
                        if scaled:
                            T.call_extern("handle", "mqa_st_shared_f32", scales_s.data, p * BS + tid,
                                          T.if_then_else((row >= 0) and (row < NKV), RowScale[T.max(T.min(row, NKV - 1), 0)],
                                                         T.cast(0, f32)))
                    if t == 0:
                        gather_columns(KV_s, KV, Indices, r, 0, 0, Dk, NKV, tid)
                        T.call_extern("handle", "mqa_cp_async_commit")
                        T.call_extern("handle", "mqa_cp_async_wait_all")
                    else:  # columns [0, DQ_SPLIT) went out after the previous block's dQ GEMM
                        gather_columns(KV_s, KV, Indices, r, t, DQ_SPLIT, Dk, NKV, tid)
                        T.call_extern("handle", "mqa_cp_async_commit")
                        T.call_extern("handle", "ws_cp_async_wait_one")
                    T.call_extern("handle", "ws_fence_proxy_async")
                    T.call_extern("handle", "ws_bar_sync_wg", 1)

                    # S = Q KV^T and dP = dO V^T, both 64 x 64 over the heads; the first
                    # columns' GEMMs while the rest of the gather lands.
                    T.clear(acc_s)
                    T.clear(acc_dp)
                    T.wgmma_gemm(Q_s[0:H, 0:DQ_SPLIT], KV_s[0:BS, 0:DQ_SPLIT], acc_s, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(dO_s[0:H, 0:DQ_SPLIT], KV_s[0:BS, 0:DQ_SPLIT], acc_dp, transpose_B=True, clear_accum=True)
                    if t > 0:
                        T.call_extern("handle", "mqa_cp_async_wait_all")
                        T.call_extern("handle", "ws_fence_proxy_async")
                        T.call_extern("handle", "ws_bar_sync_wg", 1)
                    T.wgmma_gemm(Q_s[0:H, DQ_SPLIT:Dk], KV_s[0:BS, DQ_SPLIT:Dk], acc_s, transpose_B=True)
                    T.wgmma_gemm(dO_s[0:H, DQ_SPLIT:Dv], KV_s[0:BS, DQ_SPLIT:Dv], acc_dp, transpose_B=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_s, num_regs=H * BS // WARPGROUP)
                    T.warpgroup_fence_operand(acc_dp, num_regs=H * BS // WARPGROUP)
                    for h, j in T.Parallel(H, BS):  # slots_s[p] was stored before the barrier above
                        row_j = slots_s[p * BS + j]
                        acc_s[h, j] = T.if_then_else((row_j >= 0) and (row_j < NKV),
                                                     T.exp2(acc_s[h, j] * scale_log2 - lse_s[h]), T.cast(0, f32))
                    if scaled:
                        T.reduce_sum(acc_s, mass_row, dim=1, clear=False)
                    for h, j in T.Parallel(H, BS):
                        acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_s[h]) * sm_scale
                    if t > 0:  # warpgroup 1 is done with block t - 1's P, dS and slots
                        T.call_extern("handle", "mqa_handoff_wait", bars.data, PDS_FREE, (t - 1) % 2)
                    T.copy(acc_s, P_s)  # stmatrix
                    T.copy(acc_dp, dS_s)
                    T.call_extern("handle", "ws_fence_proxy_async")
                    T.call_extern("handle", "mqa_handoff_arrive", bars.data, PDS_READY)
                    # dQ[:, :DQ_SPLIT] += dS KV (this warpgroup's columns).
                    T.wgmma_gemm(dS_s, KV_s[0:BS, 0:DQ_SPLIT], acc_dq0)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_dq0, num_regs=H * DQ_SPLIT // WARPGROUP)
                    # Only this warpgroup reads KV_s[:, :DQ_SPLIT]: refill it now.
                    if t + 1 < NB:
                        gather_columns(KV_s, KV, Indices, r, t + 1, 0, DQ_SPLIT, NKV, tid)
                        T.call_extern("handle", "mqa_cp_async_commit")
                if scaled:
                    for h in T.Parallel(H):
                        if (mass_row[h] > Allowance[r, h0 + h]) or T.isnan(mass_row[h]):
                            Flag[r] = 1
                T.copy(acc_dq0, dQ[r, h0 : h0 + H, 0:DQ_SPLIT])

            with T.ws(1):
                T.clear(acc_dq1)
                T.clear(acc_dq2)
                for i in T.serial(2):
                    peak[i] = T.cast(0, f32)
                for t in T.serial(NB):
                    p = t % 2
                    T.call_extern("handle", "mqa_handoff_wait", bars.data, PDS_READY, p)
                    T.wgmma_gemm(dS_s, KV_s[0:BS, c1 : c1 + w1], acc_dq1)
                    T.wgmma_gemm(dS_s, KV_s[0:BS, c2 : c2 + w2], acc_dq2)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_dq1, num_regs=H * w1 // WARPGROUP)
                    T.warpgroup_fence_operand(acc_dq2, num_regs=H * w2 // WARPGROUP)
                    T.call_extern("handle", "mqa_handoff_arrive", bars.data, KV_FREE)
                    # dKV of the block, a chunk at a time, in two accumulators: chunk c + 1's
                    # GEMMs run while chunk c's adds go out.
                    dkv_chunk(Q_s, dO_s, dS_s, P_s, acc_dkv, 0)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_dkv, num_regs=BS * CHUNK // WARPGROUP)
                    for pair in T.unroll(n1 // 2):  # chunk c is in acc_dkv, c + 1 goes to acc_dkv2
                        c = 2 * pair
                        dkv_chunk(Q_s, dO_s, dS_s, P_s, acc_dkv2, c + 1)
                        add_chunk(dKV, acc_dkv, slots_s, scales_s, c, p, NKV, peak, T.get_thread_binding() - WARPGROUP)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_dkv2, num_regs=BS * CHUNK // WARPGROUP)
                        if c + 2 < n1:
                            dkv_chunk(Q_s, dO_s, dS_s, P_s, acc_dkv, c + 2)
                        add_chunk(dKV, acc_dkv2, slots_s, scales_s, c + 1, p, NKV, peak, T.get_thread_binding() - WARPGROUP)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_dkv, num_regs=BS * CHUNK // WARPGROUP)
                    # Every GEMM of the block has been waited for: P_s and dS_s are free.
                    T.call_extern("handle", "mqa_handoff_arrive", bars.data, PDS_FREE)
                    if n1 % 2:
                        add_chunk(dKV, acc_dkv, slots_s, scales_s, n1 - 1, p, NKV, peak, T.get_thread_binding() - WARPGROUP)
                    if accumulate == "lanes":  # the block's bounds, one add a (slot, row)
                        T.call_extern("handle", "ws_add_bounds", peak.data, Bound.data, T.address_of(slots_s[p * BS]),
                                      NKV, T.get_thread_binding() - WARPGROUP)
                T.copy(acc_dq1, dQ[r, h0 : h0 + H, c1 : c1 + w1])
                T.copy(acc_dq2, dQ[r, h0 : h0 + H, c2 : c2 + w2])

    return main_bwd
