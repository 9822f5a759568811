"""The fixed-point plan's kernels: the slot marks and the three plan stages."""

from .config import FP32_MAX_EXPONENT, PARTIAL_SUM_BITS, _tl
from .device_functions import MAGNITUDE_SOURCE


#: mark_slots' threads a CTA and slots a thread; its grid runs one CTA per query
#: row and chunk of MARK_THREADS * MARK_ITEMS slots. CUDA caps the chunks (grid y)
#: at 65535: the longest padded top-k row the kernels take (the wrapper rejects
#: longer ones) stays the one-slot-a-thread kernel's limit, 65535 * MARK_THREADS.
MARK_THREADS = 128
MARK_ITEMS = 8
MAX_SLOTS_PER_ROW = 65535 * MARK_THREADS


#: Head rows of q a warp of mark_slots loads at once for PeakQ (each 16 bytes a lane a load).
PEAK_HEADS_AT_ONCE = 4

# PeakQ of one query row: max |q| of each head row as its bf16 bits (MAGNITUDE_SOURCE's rule). A
# warp takes PEAK_HEADS_AT_ONCE head rows at a time and issues all their loads before it reduces any.
PEAK_SOURCE = MAGNITUDE_SOURCE + r"""
__device__ __forceinline__ void mqa_peak_rows(const void* q_row, int* peak, int hq, int t, int threads) {
  constexpr int vectors = %(vectors)d, per_lane = (vectors + 31) / 32, at_once = %(at_once)d;
  const int lane = t & 31, warps = threads >> 5;
  for (int h0 = (t >> 5) * at_once; h0 < hq; h0 += warps * at_once) {
    uint4 x[at_once][per_lane];
#pragma unroll
    for (int i = 0; i < at_once; ++i)
#pragma unroll
      for (int v = 0; v < per_lane; ++v) {
        const int vector = v * 32 + lane;
        x[i][v] = make_uint4(0u, 0u, 0u, 0u);
        if (h0 + i < hq && vector < vectors)
          x[i][v] = __ldg(static_cast<const uint4*>(q_row) + static_cast<long>(h0 + i) * vectors + vector);
      }
#pragma unroll
    for (int i = 0; i < at_once; ++i) {
      unsigned m = 0u;
#pragma unroll
      for (int v = 0; v < per_lane; ++v) m = __vmaxu2(m, mqa_magnitudes(x[i][v]));
      m = mqa_warp_peak(m);
      if (lane == 0 && h0 + i < hq) peak[h0 + i] = static_cast<int>(m);
    }
  }
}
"""


def mark_slots_program(d_k: int, threads: int = MARK_THREADS, items: int = MARK_ITEMS):
    """Referenced[k] = 1 for every kv row k a valid slot names; LiveRow[r] = 1 when row r has a valid
    slot; PeakQ[r, h] = max_d bits(|Q[r, h, d]|), the fixed-point plan's maxima of q (exact; a NaN
    pattern where an element is NaN).

    Referenced and LiveRow are zeroed by the caller. Every write stores 1, so writes of the same
    element by different threads agree: the result is the same on every run.
    One launch with plain stores: no host sync and no int64 index temporaries.
    A thread takes ``items`` slots of its row, strided by the CTA (coalesced),
    and issues their loads together: the slots, then their kv rows' marks
    (predicated, independent), then the stores. A thread that looped over its
    row's slots waited on each dependent pair in turn, and one thread a slot
    left the GPU scheduling tiny CTAs (docs/performance-log.md). A kv row
    already marked is not stored again (stores to one address from many
    threads serialize); LiveRow[r] is stored once by every thread with a valid
    slot.
    A row's first CTA also reduces PeakQ (PEAK_SOURCE), before its marks: CTAs whose
    marks wait on dependent loads share the SMs with CTAs streaming q, so one launch
    overlaps the two (q's loads issued first, not between the marks' loads and stores,
    were faster: docs/performance-log.md).
    """
    if d_k % 8:
        raise ValueError(f"d_k: {d_k}, not a multiple of 8 (a load takes 8 bf16 of q)")
    if threads % 32:
        raise ValueError(f"threads: {threads}, not whole warps (a head row's maximum is a warp's reduction)")
    tilelang, T = _tl()
    R = T.dynamic("R")
    HQ = T.dynamic("HQ")
    Lp = T.dynamic("Lp")
    NKV = T.dynamic("NKV")
    i32 = "int32"
    source = PEAK_SOURCE % {"vectors": d_k // 8, "at_once": PEAK_HEADS_AT_ONCE}

    @T.prim_func
    def mark_slots(Slots: T.Tensor((R, Lp), i32), Referenced: T.Tensor((NKV,), i32), LiveRow: T.Tensor((R,), i32),
                   Q: T.Tensor((R, HQ, d_k), "bfloat16"), PeakQ: T.Tensor((R, HQ), i32)):
        with T.Kernel(R, T.ceildiv(Lp, threads * items), threads=threads) as (r, chunk):
            k = T.alloc_local((items,), i32)
            marked = T.alloc_local((items,), i32)
            live = T.alloc_local((1,), i32)
            tx = T.get_thread_binding()
            T.import_source(source)
            if chunk == 0:
                T.call_extern("handle", "mqa_peak_rows", T.address_of(Q[r, 0, 0]), T.address_of(PeakQ[r, 0]), HQ, tx, threads)
            for i in T.unroll(items):
                c = (chunk * items + i) * threads + tx
                k[i] = T.if_then_else(c < Lp, Slots[r, c], -1)
            live[0] = 0
            for i in T.unroll(items):
                valid = (k[i] >= 0) and (k[i] < NKV)
                marked[i] = T.if_then_else(valid, Referenced[k[i]], 1)
                if valid:
                    live[0] = 1
            for i in T.unroll(items):
                if marked[i] == 0:
                    Referenced[k[i]] = 1
            if live[0] != 0:
                LiveRow[r] = 1

    return mark_slots


# The fixed-point plan (mqa_bwd.fixed_point's _plan_small) as three launches,
# the same float64 operations in the same order (the __d*_rn intrinsics keep
# nvcc from contracting a product and a sum into an FMA), so the same bits
# (NaN payloads aside), in place of the torch ops: some 80 kernels replayed
# as a CUDA graph with their inputs copied in and outputs out. The last stage
# also takes the lanes' gain, a power of two (launch.Launcher.plan's scales).
# Per batch element, its maxima and the live-term count go through PlanPeaks
# [B, PLAN_SLOTS] as 64-bit integers: non-negative doubles order as their
# bits do, and a NaN of either sign lies above inf, so an unsigned max of the
# bits is torch.amax (a NaN wins), and the integer atomics make every result
# independent of the order the blocks finish in.
PLAN_THREADS = 256
PLAN_A, PLAN_B, PLAN_LIVE, PLAN_DO, PLAN_MV, PLAN_DS, PLAN_BOUND = range(7)
PLAN_SLOTS = 8
PLAN_SOURCE = r"""
#define MQA_NAN __longlong_as_double(0x7FF8000000000000LL)
#define MQA_INF __longlong_as_double(0x7FF0000000000000LL)
#define MQA_NAN_F __int_as_float(0x7FC00000)
__device__ __forceinline__ double mqa_bf16_bits(int bits) { return static_cast<double>(__int_as_float(bits << 16)); }
__device__ __forceinline__ unsigned long long mqa_key(double x) { return static_cast<unsigned long long>(__double_as_longlong(x)); }
__device__ __forceinline__ double mqa_value(unsigned long long k) { return __longlong_as_double(static_cast<long long>(k)); }
// torch.maximum and torch.minimum: a NaN operand gives NaN.
__device__ __forceinline__ double mqa_nan_max(double x, double y) { return (isnan(x) || isnan(y)) ? MQA_NAN : (x > y ? x : y); }
__device__ __forceinline__ double mqa_nan_min(double x, double y) { return (isnan(x) || isnan(y)) ? MQA_NAN : (x < y ? x : y); }

// Max (op 0) or sum (op 1) of v over the block, then one atomic into dst by thread 0.
__device__ __forceinline__ void mqa_block_flush(unsigned long long v, unsigned long long* dst, int op) {
  __shared__ unsigned long long part[32];
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = op ? v + w : (w > v ? w : v);
  }
  __syncthreads();  // part[] of a previous flush is read
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < blockDim.x / 32; ++w) v = op ? v + part[w] : (part[w] > v ? part[w] : v);
    if (op) atomicAdd(dst, v); else atomicMax(dst, v);
  }
}

// One (row, head) term of batch element b: a, b of fixed_point.term_coefficients, 0 for a dead row.
struct MqaTerm { double mq, mdo, ad, a, b; };
__device__ __forceinline__ MqaTerm mqa_term(const int* peak_q, const int* peak_do, const float* delta, const int* live_row,
                                            int hq, long r, int h, double c_a, double scale) {
  MqaTerm t = {0.0, 0.0, 0.0, 0.0, 0.0};
  if (live_row[r] != 0) {
    t.mq = mqa_bf16_bits(peak_q[r * hq + h]);
    t.mdo = mqa_bf16_bits(peak_do[r * hq + h]);
    t.ad = fabs(static_cast<double>(delta[r * hq + h]));
    t.a = __dmul_rn(__dmul_rn(c_a, t.mdo), t.mq);
    t.b = __dadd_rn(__dmul_rn(__dmul_rn(scale, t.ad), t.mq), t.mdo);
  }
  return t;
}

// bound_j of kv row j (0 when no slot names it).
__device__ __forceinline__ double mqa_bound(const void* mv_, const int* referenced, long j, double live, double limit,
                                            double a_max, double b_max) {
  const unsigned short* mv = static_cast<const unsigned short*>(mv_);
  double v = referenced[j] != 0 ? mqa_bf16_bits(mv[j]) : 0.0;
  return __dmul_rn(__dmul_rn(live, limit), __dadd_rn(__dmul_rn(v, a_max), b_max));
}

__device__ void mqa_plan_terms(const int* peak_q, const int* peak_do, const float* delta, const int* live_row,
                               const void* kv_, const void* mv_, const int* referenced, const void* peaks_,
                               int S, int H, int S_kv, int hq, int kv_width, int d_v, double c_a, double scale, int b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long* mine = static_cast<unsigned long long*>(const_cast<void*>(peaks_)) + b * %(slots)d;
  MqaTerm t = {0.0, 0.0, 0.0, 0.0, 0.0};
  if (i < S * H) t = mqa_term(peak_q, peak_do, delta, live_row, hq, static_cast<long>(b) * S + i / H, i %% H, c_a, scale);
  // MV of every kv row a slot names, a warp a row (16 bytes a lane a load), the grid's warps taking
  // the rows in turn: max |kv| of the row's value part as its bf16 bits (MAGNITUDE_SOURCE's rule).
  // The later stages read MV only where Referenced is set, so the other rows are never written.
  unsigned long long mv_key = 0ull;
  const int lane = threadIdx.x & 31, warps = (gridDim.x * blockDim.x) >> 5;
  for (int w = i >> 5; w < S_kv; w += warps) {
    const long j = static_cast<long>(b) * S_kv + w;
    if (referenced[j] == 0) continue;  // the same j across the warp: its shuffles stay whole
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(kv_) + j * kv_width);
    unsigned m = 0u;
    for (int x = lane; x < d_v / 8; x += 32) m = __vmaxu2(m, mqa_magnitudes(__ldg(row + x)));
    m = mqa_warp_peak(m);
    if (lane == 0) {
      static_cast<unsigned short*>(const_cast<void*>(mv_))[j] = static_cast<unsigned short>(m);
      const unsigned long long k = mqa_key(mqa_bf16_bits(static_cast<int>(m)));
      mv_key = k > mv_key ? k : mv_key;
    }
  }
  mqa_block_flush(mqa_key(t.a), mine + %(A)d, 0);
  mqa_block_flush(mqa_key(t.b), mine + %(B)d, 0);
  mqa_block_flush((t.a > 0 || t.b > 0) ? 1ull : 0ull, mine + %(LIVE)d, 1);
  mqa_block_flush(mqa_key(t.mdo), mine + %(DO)d, 0);
  mqa_block_flush(mv_key, mine + %(MV)d, 0);
}

__device__ void mqa_plan_peaks(const int* peak_q, const int* peak_do, const float* delta, const int* live_row,
                               const void* mv_, const int* referenced, const void* peaks_, const void* allowance_,
                               int S, int H, int S_kv, int hq, int d_v, double c_a, double scale, double limit, int b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long* mine = static_cast<unsigned long long*>(const_cast<void*>(peaks_)) + b * %(slots)d;
  double a_max = mqa_value(mine[%(A)d]), b_max = mqa_value(mine[%(B)d]), mv_max = mqa_value(mine[%(MV)d]);
  double live = static_cast<double>(mine[%(LIVE)d]);
  double ds = 0.0, bound = 0.0;
  if (i < S * H) {
    long r = static_cast<long>(b) * S + i / H;
    MqaTerm t = mqa_term(peak_q, peak_do, delta, live_row, hq, r, i %% H, c_a, scale);
    double m = mqa_nan_min(t.a > 0 ? __ddiv_rn(a_max, t.a) : MQA_INF, t.b > 0 ? __ddiv_rn(b_max, t.b) : MQA_INF);
    double allow = __dmul_rn(limit, m);
    static_cast<float*>(const_cast<void*>(allowance_))[r * H + i %% H] = __double2float_rn(allow);
    ds = __dmul_rn(__dmul_rn(allow, scale), __dadd_rn(__dmul_rn(__dmul_rn(static_cast<double>(d_v), t.mdo), mv_max), t.ad));
    if (isinf(allow)) ds = 0.0;
  }
  if (i < S_kv) bound = mqa_bound(mv_, referenced, static_cast<long>(b) * S_kv + i, live, limit, a_max, b_max);
  mqa_block_flush(mqa_key(ds), mine + %(DS)d, 0);
  mqa_block_flush(mqa_key(bound), mine + %(BOUND)d, 0);
}

// fixed_point.row_scales of one bound.
__device__ __forceinline__ float mqa_row_scale(double bound) {
  int k = %(fp32_max)d;
  if (bound != 0.0) {
    int e;
    double m = frexp(bound, &e);
    k = %(sum_bits)d - (e - (m == 0.5 ? 1 : 0));
    if (k > %(fp32_max)d) k = %(fp32_max)d;
  }
  if (!isfinite(bound) || k < -%(fp32_max)d) return MQA_NAN_F;
  return ldexpf(1.0f, k);
}

__device__ void mqa_plan_scales(const void* mv_, const int* referenced, const void* peaks_, const void* row_scale_,
                                int S_kv, int d_v, double limit, double fp32_safe, float gain, int b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= S_kv) return;
  const unsigned long long* mine = static_cast<const unsigned long long*>(peaks_) + b * %(slots)d;
  double a_max = mqa_value(mine[%(A)d]), b_max = mqa_value(mine[%(B)d]), mv_max = mqa_value(mine[%(MV)d]);
  double live = static_cast<double>(mine[%(LIVE)d]);
  double dp = __dmul_rn(__dmul_rn(static_cast<double>(d_v), mqa_value(mine[%(DO)d])), mv_max);
  double peak = mqa_nan_max(mqa_nan_max(dp, mqa_value(mine[%(DS)d])), mqa_value(mine[%(BOUND)d]));
  long j = static_cast<long>(b) * S_kv + i;
  float scale = 1.0f;
  if (referenced[j] != 0)
    scale = !(peak < fp32_safe) ? MQA_NAN_F : mqa_row_scale(mqa_bound(mv_, referenced, j, live, limit, a_max, b_max));
  static_cast<float*>(const_cast<void*>(row_scale_))[j] = scale * gain;  // fixed_point.lanes_scale's fp32 product
}
"""


def plan_program(stage: str, threads: int = PLAN_THREADS):
    """One stage of the fixed-point plan (launch.Launcher.plan: mqa_bwd.fixed_point.plan with the
    lanes' gain, the same bits):

      terms   MV [NKV] bf16 (max |kv| of each referenced kv row's first d_v columns
              of KV [NKV, KW]; other rows left unwritten, never read), and
              PlanPeaks[b] gets max a, max b, the live-term count N_b, max mdo (of
              live rows) and max mv (of referenced kv rows) of batch element b
      peaks   Allowance [R, H], and PlanPeaks[b] gets the peaks of dS and of bound_j
      scales  RowScale [NKV]: 2**k_j times ``gain`` (the lanes' power of two,
              fixed_point.lanes_scale), NaN where the batch element is unsafe or a
              bound unrepresentable, ``gain`` for kv rows no slot names

    PeakQ, PeakDO [R, HQ] int32 (bf16 magnitude bits) and Delta [R, HQ] hold
    the call's heads; H <= HQ are the real ones. PlanPeaks [B, PLAN_SLOTS]
    int64 is zeroed by the caller. Grid (ceil(max(S * H, S_kv) / threads), B).
    """
    tilelang, T = _tl()
    R, HQ, NKV, B = T.dynamic("R"), T.dynamic("HQ"), T.dynamic("NKV"), T.dynamic("B")
    i32, i64, f32, bf16 = "int32", "int64", "float32", "bfloat16"
    source = MAGNITUDE_SOURCE + PLAN_SOURCE % dict(slots=PLAN_SLOTS, A=PLAN_A, B=PLAN_B, LIVE=PLAN_LIVE, DO=PLAN_DO,
                                                   MV=PLAN_MV, DS=PLAN_DS, BOUND=PLAN_BOUND, fp32_max=FP32_MAX_EXPONENT,
                                                   sum_bits=PARTIAL_SUM_BITS)
    if stage == "terms":
        KW = T.dynamic("KW")

        @T.prim_func
        def plan_terms(PeakQ: T.Tensor((R, HQ), i32), PeakDO: T.Tensor((R, HQ), i32), Delta: T.Tensor((R, HQ), f32),
                       LiveRow: T.Tensor((R,), i32), KV: T.Tensor((NKV, KW), bf16), MV: T.Tensor((NKV,), bf16),
                       Referenced: T.Tensor((NKV,), i32), PlanPeaks: T.Tensor((B, PLAN_SLOTS), i64), S: T.int32, H: T.int32,
                       S_kv: T.int32, d_v: T.int32, c_a: T.float64, scale: T.float64):
            with T.Kernel(T.ceildiv(T.max(S * H, S_kv), threads), B, threads=threads) as (bx, b):
                T.import_source(source)
                T.call_extern("handle", "mqa_plan_terms", PeakQ.data, PeakDO.data, Delta.data, LiveRow.data, KV.data, MV.data,
                              Referenced.data, PlanPeaks.data, S, H, S_kv, HQ, KW, d_v, c_a, scale, b)

        return plan_terms
    if stage == "peaks":
        @T.prim_func
        def plan_peaks(PeakQ: T.Tensor((R, HQ), i32), PeakDO: T.Tensor((R, HQ), i32), Delta: T.Tensor((R, HQ), f32),
                       LiveRow: T.Tensor((R,), i32), MV: T.Tensor((NKV,), bf16), Referenced: T.Tensor((NKV,), i32),
                       PlanPeaks: T.Tensor((B, PLAN_SLOTS), i64), Allowance: T.Tensor((R, T.dynamic("H_out")), f32),
                       S: T.int32, H: T.int32, S_kv: T.int32, d_v: T.int32, c_a: T.float64, scale: T.float64,
                       limit: T.float64):
            with T.Kernel(T.ceildiv(T.max(S * H, S_kv), threads), B, threads=threads) as (bx, b):
                T.import_source(source)
                T.call_extern("handle", "mqa_plan_peaks", PeakQ.data, PeakDO.data, Delta.data, LiveRow.data, MV.data,
                              Referenced.data, PlanPeaks.data, Allowance.data, S, H, S_kv, HQ, d_v, c_a, scale, limit, b)

        return plan_peaks
    if stage == "scales":
        @T.prim_func
        def plan_scales(MV: T.Tensor((NKV,), bf16), Referenced: T.Tensor((NKV,), i32), PlanPeaks: T.Tensor((B, PLAN_SLOTS), i64),
                        RowScale: T.Tensor((NKV,), f32), S_kv: T.int32, d_v: T.int32, limit: T.float64, fp32_safe: T.float64,
                        gain: T.float32):
            with T.Kernel(T.ceildiv(S_kv, threads), B, threads=threads) as (bx, b):
                T.import_source(source)
                T.call_extern("handle", "mqa_plan_scales", MV.data, Referenced.data, PlanPeaks.data, RowScale.data, S_kv, d_v,
                              limit, fp32_safe, gain, b)

        return plan_scales
    raise ValueError(f"stage: {stage!r} (terms, peaks or scales)")

