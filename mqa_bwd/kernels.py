"""TileLang kernels of the sparse absorbed-MQA backward (Hopper, sm_90a).

Every kernel here has a CPU twin in ``mqa_bwd.model`` with the same launch
contract: the same arguments, the same tile derived from the shapes it is
handed, the same rows read and written, the same bf16 rounding points and the
same explicit reduction orders. The host wrapper (``mqa_bwd.wrapper``) drives
either through ``mqa_bwd.launch``.

Layouts (the wrapper prepares them): query rows of every batch element are
flattened into R = B*S rows, kv rows into NKV = B*S_kv rows, and a slot index
is either a global kv row in [0, NKV) or -1. The main backward reads one
head group in place: heads [head_base, head_base + tile) of [R, HQ, ...]
tensors that hold every (padded) head, so no per-group copies exist.

Kernels
  delta        Delta = rowsum(O * dO); DSinkRows = -exp2(Sink2 - Lse2) * Delta
               (fixed design: also max |Q|, max |dO| per row and head, as bf16 bits)
  main_bwd     one CTA per query row, KV rows gathered with cp.async one slot
               block ahead: dQ of the group, and the per-slot dKV
               contributions added into an int64 fixed-point accumulator
               (deterministic: integer adds commute), written to per-slot or
               per-shard scratch (the older deterministic designs), or added
               into DKVAcc with fp32 atomics (the control)
  fixed_to_bf16 the fixed-point accumulator -> bf16 dKV, NaN when poisoned
  dkv_reduce   DKVAcc[k] += DKVSlot[e] for the entries e of kv row k in CSR
               order (the order is fixed by the indices alone)
  dsink_reduce DSink[h] = sum over rows r, in increasing r, of DSinkRows[r, h]
  mark_slots   Referenced[k] = 1 for every kv row a valid slot names, LiveRow[r] = 1
               for every row with a valid slot (the fixed-point plan's inputs)
  plan         the fixed-point plan's row scales and mass allowances from the
               maxima and marks (fixed_point.plan's float64 operations), in
               three stages that reduce through integer max and add atomics
  cast_bf16    fp32 -> bf16, round to nearest even
"""


import functools

LOG2E = 1.4426950408889634

# Slots gathered per main-loop step: the kernel's slot block. L is padded to it.
BLOCK_SLOTS = 32

# (Dk, Dv) the kernels are built and tested for on Hopper.
GPU_WIDTHS = ((576, 512), (512, 512))
MAIN_MODES = ("fixed", "write", "accumulate", "atomic", "shard")
# The softmax mass sum_j P of a head is at most 1 with the forward's lse; the
# fixed-point range proof (mqa_bwd.fixed_point) allows up to this.
MASS_LIMIT = 1.0 + 2.0**-6


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


# ---------------------------------------------------------------------------
# Program builders (pure: shapes in, prim_func out). Compilation is separate so
# that CI can lower and compile them for sm_90a on a machine without a GPU.
# ---------------------------------------------------------------------------


DELTA_HEADS = 16
PEAK_COLS = 32  # columns per step of the maxima: one warp per head row


def delta_program(d_v: int, threads: int = 128, d_k: int = 0):
    """Delta[r, h] = <O[r, h], dO[r, h]>; DSinkRows[r, h] = -exp2(Sink2[h] - Lse2[r, h]) * Delta[r, h].

    With d_k (the fixed-point design's variant) it also takes Q [R, H, d_k]
    and writes the maxima its plan needs as bf16 bit patterns in int32:
    PeakQ[r, h] = max_d bits(|Q[r, h, d]|), PeakDO[r, h] likewise for dO
    (exact; a NaN pattern when an element is NaN): one launch instead of
    separate reductions of Q and dO.

    Grid (R, ceil(H / 16)); heads past H are masked, so any H is safe here.
    """
    tilelang, T = _tl()
    R = T.dynamic("R")
    H = T.dynamic("H")
    Dv, Dk = d_v, d_k
    bh = DELTA_HEADS
    block_d = 64 if Dv % 64 == 0 else 16
    f32, bf16, i32 = "float32", "bfloat16", "int32"
    if Dk and (Dk % PEAK_COLS or Dv % PEAK_COLS):
        raise ValueError(f"delta with maxima: Dk={Dk} and Dv={Dv} must be multiples of {PEAK_COLS}")

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

    if Dk:
        @T.prim_func
        def delta_max(
            O: T.Tensor((R, H, Dv), bf16),
            dO: T.Tensor((R, H, Dv), bf16),
            Lse2: T.Tensor((R, H), f32),
            Sink2: T.Tensor((H,), f32),
            Delta: T.Tensor((R, H), f32),
            DSinkRows: T.Tensor((R, H), f32),
            Q: T.Tensor((R, H, Dk), bf16),
            PeakQ: T.Tensor((R, H), i32),
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
                magnitude_peak(Q, Dk, PeakQ, peak, peak_row, r, hb)

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


# The main kernel's KV gather: cp.async of 16 bytes; src-size 0 (an invalid
# slot) reads nothing and zero-fills.
GATHER_SOURCE = r"""
__device__ __forceinline__ void mqa_cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void mqa_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void mqa_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// base[i] = v for a shared int32 array. Through a call, TileLang's barrier
// planner does not see the store: it would fence it from every later
// shared-memory read (it cannot tell the merged buffers apart at a
// thread-dependent index); the kernel orders it with its own barriers.
__device__ __forceinline__ void mqa_st_shared_i32(void* base, int i, int v) { static_cast<int*>(base)[i] = v; }
"""

# The split wide tile (WIDE_SPLIT): P goes from one warpgroup to the other in
# fp32 through shared memory. Through calls, TileLang's barrier planner sees
# neither these stores and loads nor the mbarriers that order them (it would
# put a __syncthreads between the warpgroups' branches: a deadlock); volatile
# keeps them in order with those mbarriers. mqa_st_shared_at: a store at an
# address TileLang computed (the layout of a GEMM operand), unseen too.
# A handoff is arrivals on an mbarrier (release) and a wait on the block's
# phase (acquire), one phase a slot block. bars[0] takes all 256 threads'
# arrivals: warpgroup 0 overwrites the staging only once every thread's adds
# have read it, its own too (with warpgroup 1's arrivals alone, its fast
# warps would overwrite words its slow ones have yet to add). bars[1] takes
# warpgroup 0's 128, P's writers. Not named barriers (bar.arrive / bar.sync,
# or barrier.cta): racecheck does not take an arrival as ordering the
# producer's stores before the consumer's loads, and reports such a handoff
# as a hazard (benchmarks/racecheck_handoff.py). The kernel ends without
# reusing the mbarriers' memory, so they are not invalidated.
SPLIT_SOURCE = r"""
__device__ __forceinline__ void mqa_st_shared_f32(void* base, int i, float v) { static_cast<volatile float*>(base)[i] = v; }
__device__ __forceinline__ float mqa_ld_shared_f32(void* base, int i) { return static_cast<volatile float*>(base)[i]; }
template <typename V> __device__ __forceinline__ void mqa_st_shared_at(void* p, V v) { *static_cast<V*>(p) = v; }
__device__ __forceinline__ unsigned mqa_handoff_bar(void* bars, int i) {
  return static_cast<unsigned>(__cvta_generic_to_shared(static_cast<unsigned long long*>(bars) + i));
}
__device__ __forceinline__ void mqa_handoff_init(void* bars, int arrivals0, int arrivals1) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_handoff_bar(bars, 0)), "r"(arrivals0) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_handoff_bar(bars, 1)), "r"(arrivals1) : "memory");
}
__device__ __forceinline__ void mqa_handoff_arrive(void* bars, int i) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(mqa_handoff_bar(bars, i)) : "memory");
}
__device__ __forceinline__ void mqa_handoff_wait(void* bars, int i, int parity) {
  asm volatile("{\n\t.reg .pred done;\n\tMQA_HANDOFF_%=:\n\t"
               "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra MQA_HANDOFF_%=;\n\t}" :: "r"(mqa_handoff_bar(bars, i)), "r"(parity) : "memory");
}
"""

# A cluster of CTAs (the head groups of one query row) exchanges tiles through
# distributed shared memory: every CTA's buffers sit at the same offsets.
CLUSTER_SOURCE = r"""
__device__ __forceinline__ unsigned mqa_smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ unsigned mqa_peer(unsigned addr, int rank) {
  unsigned r;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void mqa_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// mbarriers bars[0] (``full`` arrivals a phase) and bars[1] (``empty``), visible to the
// cluster after a cluster sync.
__device__ __forceinline__ void mqa_mbar_init(void* bars, int full, int empty) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_smem(bars)), "r"(full) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"
               :: "r"(mqa_smem(static_cast<unsigned long long*>(bars) + 1)), "r"(empty) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// bars[0 .. n) invalidated: PTX asks it before their memory is initialised again (the
// sharded cluster's row loop), after every arrival on them (a cluster sync).
__device__ __forceinline__ void mqa_mbar_inval(void* bars, int n) {
  for (int i = 0; i < n; ++i)
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(mqa_smem(static_cast<unsigned long long*>(bars) + i)) : "memory");
}
// The one arrival of bars[i]'s current phase, which also expects ``bytes`` of bulk-copied data.
__device__ __forceinline__ void mqa_mbar_expect(void* bars, int i, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(mqa_smem(static_cast<unsigned long long*>(bars) + i)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mqa_mbar_wait(void* bars, int i, int parity) {
  unsigned a = mqa_smem(static_cast<unsigned long long*>(bars) + i);
  asm volatile("{\n\t.reg .pred done;\n\tMQA_WAIT_%=:\n\t"
               "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra MQA_WAIT_%=;\n\t}" :: "r"(a), "r"(parity) : "memory");
}
// This CTA's arrival on bars[i] of CTA ``rank`` of the cluster. Default semantics
// (release at CTA scope), as CUTLASS's cluster barriers: ``.release.cluster``
// compiles to a GPU-wide MEMBAR on every call. What it orders, this CTA's
// reads of its inbox, are done: their values were in registers (the adds' or
// the GEMMs' operands) before the __syncthreads that precedes the arrival.
__device__ __forceinline__ void mqa_mbar_arrive_peer(void* bars, int i, int rank) {
  unsigned a = mqa_peer(mqa_smem(static_cast<unsigned long long*>(bars) + i), rank);
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(a) : "memory");
}
// Thread i copies 16 bytes: dst[i] = src[i] (shared memory, raw bits; the column-split
// cluster stages its P and dS tiles for the peer this way, layout and all).
__device__ __forceinline__ void mqa_copy16(void* dst, const void* src, int i) {
  static_cast<uint4*>(dst)[i] = static_cast<const uint4*>(src)[i];
}
// Bulk copy of ``bytes`` from this CTA's src to the same address as dst + offset (bytes)
// in CTA ``rank``, completing on that CTA's bars[i].
__device__ __forceinline__ void mqa_bulk_ptr_to_peer(void* dst, int offset, const void* src, int bytes, void* bars, int i, int rank) {
  unsigned d = mqa_peer(mqa_smem(dst) + offset, rank), m = mqa_peer(mqa_smem(static_cast<unsigned long long*>(bars) + i), rank);
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(d), "r"(mqa_smem(src)), "r"(bytes), "r"(m) : "memory");
}
// Generic-proxy stores to shared memory become visible to the bulk copies issued after a barrier.
__device__ __forceinline__ void mqa_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Bulk copy of ``bytes`` from this CTA's base + src to CTA ``rank``'s base + dst (byte offsets),
// completing on that CTA's bars[i]: one instruction, and the issuing thread never waits.
__device__ __forceinline__ void mqa_bulk_to_peer(void* base, int src, int dst, int bytes, void* bars, int i, int rank) {
  unsigned b = mqa_smem(base);
  unsigned d = mqa_peer(b + dst, rank), m = mqa_peer(mqa_smem(static_cast<unsigned long long*>(bars) + i), rank);
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(d), "r"(b + src), "r"(bytes), "r"(m) : "memory");
}
"""
# Sharded cluster mode: duplicate kv rows of a slot block and the fp32 adds.
SHARD_SOURCE = r"""
// Called by the 32 lanes of one warp, lane j holding slot j's kv row: the
// next lane with the same row (32: none), plus 64 when an earlier lane has it
// (then j only follows that lane's chain).
__device__ __forceinline__ int mqa_dup_link(int row) {
  unsigned same = __match_any_sync(0xffffffffu, row), lane = threadIdx.x & 31u;
  unsigned later = lane == 31u ? 0u : same & ~((2u << lane) - 1u);
  return (later ? __ffs(later) - 1 : 32) | ((same & ((1u << lane) - 1u)) ? 64 : 0);
}
// One lane's four columns of slot j's add into a shard: own partial plus the
// peer's (the inbox), then each later slot of its chain likewise, in slot
// order; one red.global.add.v4.f32. own and inbox point at slot 0's row.
__device__ __forceinline__ void mqa_shard_add4(void* dst, const void* own, const void* inbox, int stride, int j, const void* chain) {
  const float* o = static_cast<const float*>(own);
  const float* n = static_cast<const float*>(inbox);
  const int* link = static_cast<const int*>(chain);
  float4 a = *reinterpret_cast<const float4*>(o + j * stride), b = *reinterpret_cast<const float4*>(n + j * stride);
  float4 v = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
  for (int i = link[j] & 63; i < 32; i = link[i] & 63) {
    a = *reinterpret_cast<const float4*>(o + i * stride);
    b = *reinterpret_cast<const float4*>(n + i * stride);
    v.x = v.x + (a.x + b.x); v.y = v.y + (a.y + b.y); v.z = v.z + (a.z + b.z); v.w = v.w + (a.w + b.w);
  }
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
"""
#: Words of padding per fp32 row of dKV_s (row stride Dv + 8, 8 mod 32 banks).
#: A warp stores an mma accumulator fragment as float2 per lane: rows
#: lane // 4, columns 2 * (lane % 4). With a stride of 8 mod 32 those 8 rows
#: cover the 32 banks exactly twice (two wavefronts, the minimum); with the
#: former 4 words, neighbouring rows overlapped (2-way conflicts; ncu on the
#: H200: 1141 M shared-store wavefronts for 285 M ideal per dsv32 H=64 launch
#: of the former cluster layout, with 4-way conflicts there).
F32_ROW_PAD = 8
#: The 64-head tile's padding instead (row stride 4 mod 32 banks): its dKV
#: fragments are transposed (wgmma's, rows are columns of dKV), so a warp's
#: stores go to rows 2 * (lane % 4) + {0, 1}, eight consecutive columns each;
#: with a stride of 4 mod 32, rows 0, 2, 4 and 6 land on disjoint banks (with
#: 8 they met two by two: 2-way conflicts).
WIDE_ROW_PAD = 4


#: Head groups one deterministic launch may sum on chip (a thread block cluster).
CLUSTER_SIZES = (1, 2, 4)
#: Modes main_bwd builds as clusters of head groups, and their largest cluster:
#: the fixed cluster swaps P and dS tiles (a few KB a peer), the sharded one
#: keeps a staging copy and an inbox of dKV partials (room for one peer).
MODE_MAX_CLUSTER = {"fixed": 4, "shard": 2}
#: The largest cluster the wrapper launches (a cap over MODE_MAX_CLUSTER; benchmarks
#: change it). Two: on the H200 at dsv32 H=128, one cluster of four groups
#: (half the adds of two clusters of two) took 53.40 ms against 51.63 ms
#: (benchmarks/cluster_ab.py, one process), as clusters of four keep only 120
#: of its 132 SMs busy (benchmarks/cluster_occupancy.py).
MAX_CLUSTER = 2
#: The head tile of the one-CTA design that runs two 32-head groups as one
#: (main_bwd_program's ``wide``), in the modes that build it; WIDE_PAIRS:
#: whether launches use it (benchmarks turn it off to time the alternative).
WIDE_HEADS = 64
WIDE_MODES = ("fixed", "atomic")
WIDE_PAIRS = True
#: Whether the wide tile splits its score and dP GEMMs between its warpgroups
#: (main_bwd_program's ``split_tile``): on the H200 it takes 3-5 % off the
#: deterministic call and 10-11 % off the control, with the same bits (README,
#: Speed). Off: the unsplit wide tile, kept to time against.
WIDE_SPLIT = True
#: Whether the wide tile adds a block's earlier dKV chunks while the GEMMs of
#: the next chunk run (issued asynchronously, waited for after the adds)
#: rather than between two barriers before them. Off: the former order, kept
#: to time against.
EARLY_CHUNK_UNDER_GEMM = True
#: Threads of a warpgroup (wgmma's unit).
WARPGROUP = 128
#: The split tile's two mbarriers: both warpgroups' late adds have read the
#: staging that P's exchange overlays (all threads arrive); P is there
#: (warpgroup 0's threads arrive).
HANDOFF_STAGING_READ, HANDOFF_P_WRITTEN = 0, 1


def runs_wide(heads: int, mode: str, cluster: int) -> bool:
    """Whether a launch of ``cluster`` groups of ``heads`` heads runs as one WIDE_HEADS-head CTA."""
    # "none" (no dKV, a benchmark probe) runs in the launches of the design it replaces.
    return WIDE_PAIRS and mode in WIDE_MODES + ("none",) and cluster == 2 and 2 * heads == WIDE_HEADS


def check_cluster(cluster, mode: str, heads: int | None = None) -> None:
    """ValueError unless ``cluster`` is a size main_bwd builds for ``mode`` (clusters: MODE_MAX_CLUSTER's modes only),
    or, given the group width ``heads``, a pair that runs as one wide CTA (runs_wide)."""
    if heads is not None and runs_wide(heads, mode, cluster):
        return
    if cluster not in CLUSTER_SIZES or cluster > MODE_MAX_CLUSTER.get(mode, 1):
        raise ValueError(f"cluster: {cluster!r} (one of {CLUSTER_SIZES}, at most {MODE_MAX_CLUSTER} by mode, 1 otherwise)")


def cluster_launches(groups: int, largest: int | None = None, mode: str = "fixed", heads: int | None = None) -> list:
    """[(first group, cluster size)] covering ``groups`` head groups, largest clusters first
    (at most ``largest``, default MAX_CLUSTER, and what ``mode`` builds; the atomic mode
    pairs groups of ``heads`` heads only where the pair runs wide, runs_wide)."""
    if mode not in MODE_MAX_CLUSTER:
        most = 2 if heads is not None and runs_wide(heads, mode, 2) else 1
        return [(g, min(most, groups - g)) for g in range(0, groups, most)]
    largest = min(MAX_CLUSTER if largest is None else largest, MODE_MAX_CLUSTER[mode])
    launches, g = [], 0
    while g < groups:
        size = max(c for c in CLUSTER_SIZES if c <= min(largest, groups - g))
        launches.append((g, size))
        g += size
    return launches


def main_kernel_key(heads: int, d_k: int, d_v: int, mode: str, cluster: int = 1) -> tuple:
    """The main_bwd configuration (compiled's key after "main_bwd") that runs a launch of
    ``cluster`` consecutive groups of ``heads`` heads: two 32-head groups of the fixed or
    atomic mode run as one 64-head CTA (runs_wide), with the fixed cluster's sums."""
    if runs_wide(heads, mode, cluster):
        return (WIDE_HEADS, d_k, d_v, mode)
    return (heads, d_k, d_v, mode) + ((cluster,) if cluster > 1 else ())


def main_bwd_program(heads: int, d_k: int, d_v: int, *, mode: str, cluster: int = 1, threads: int = 0):
    """The main backward for one head group of ``heads`` heads.

    Q, dO, Lse2, Delta, Allowance and dQ hold all HQ heads; the CTA moves the
    tile's head rows [head_base, head_base + main_tile_heads(heads)) of each,
    whatever HQ is (the caller keeps that range inside HQ). Lp is a multiple of
    BLOCK_SLOTS, at least one block (the first block's gather is issued before
    the loop; the fixed and atomic modes add the last block after it).

    mode (how the per-slot dKV contributions leave the CTA):
      "write"       DKVSlot[r, j] = contribution           grid R, one CTA per row
      "accumulate"  DKVSlot[r, j] += contribution          grid R
      "fixed"       DKVAcc[kv row] += rint(contribution * RowScale[kv row]) as int64
                    (red.global.add.u64): integer addition is associative, so
                    the sum has the same bits in any order. RowScale is a power
                    of two per kv row chosen by mqa_bwd.fixed_point so that no
                    partial sum can overflow, provided every head's softmax mass
                    sum_j P is <= Allowance[r, h]; the CTA of row r sets
                    Flag[r] = 1 when one of its heads has more, or a NaN
                    mass (the caller then poisons that batch element's dKV:
                    NaN, never wrong).
      "atomic"      DKVAcc[kv row] += contribution, fp32 atomics (the control)
      "shard"       DKVShard[b, kv row] += contribution, plain read-modify-write:
                    CTA b owns shard shard_base + b and walks its query rows
                    r = shard, shard + n_shards, ... in increasing order, so each
                    shard buffer has one writer and a fixed order. Duplicate kv
                    rows inside a slot block are first summed onto their first
                    slot (in slot order), so the block's writes never collide.
      "none"        no dKV at all (a benchmark probe: the cost of everything else)

    cluster (fixed mode, 2 or 4): the launch covers that many consecutive head
    groups [head_base + g * tile, ...) as one thread block cluster per query
    row (grid R x cluster). CTA g computes P, dS and dQ of its group, as
    alone, and sends its P and dS tiles of each block to every other CTA (bulk
    copies into their inboxes, mbarrier handshakes, see the loop). It then
    computes dKV columns [g * Dv / cluster, (g + 1) * Dv / cluster) of the
    value part (and, for g < (Dk - Dv) / 32, 32 columns of the tail) over
    every head of the cluster, as one GEMM chain in a fixed order, and adds
    them: each (row, slot, column) is added once per cluster, not once per
    group, and no dKV partial leaves the CTA.

    heads = 64 (WIDE_HEADS; fixed and atomic modes, no cluster): the wide tile,
    two 32-head groups in one CTA. Every GEMM lowers to wgmma: the score, dP
    and dQ GEMMs as they are, the dKV GEMMs because they are formed
    transposed (dKV^T = Q^T dS + dO^T P, M = columns). dKV is formed over
    all 64 heads in two 256-column chunks and the tail.
    The first chunk is added from dKV_s while the second chunk's and the
    tail's GEMMs run (EARLY_CHUNK_UNDER_GEMM); the second and the tail stay
    staged and are added while the next block's score, dP and dQ GEMMs run
    (shared memory holds no whole block of fp32 dKV next to the 64-head Q
    and dO tiles). WIDE_SPLIT (on): the score and dP GEMMs split
    between the two warpgroups, which hand P over in fp32 (off: both
    warpgroups run both, each for half of the slots).

    cluster (shard mode, 2): cluster b (grid NSL x 2) walks shard b's rows as
    above, and each slot's contribution (the two groups' fp32 partials
    summed) is added with fp32 red.global.add.v4 into the shard, a
    block's adds issued during the next block. CTA g adds column half g of
    every slot (of the value columns and of the tail), so each shard element
    has one writer thread block, whose adds of it are ordered by its barriers:
    the same sums in the same order on every run. Duplicate kv rows within a
    block are summed onto their first slot, in slot order, before the add.
    Half the fixed mode's L2 reduction sectors, but the shards (fp32, one per
    cluster) outgrow L2 where fixed mode's one int64 accumulator does not: on
    the H200 at dsv32 H=64, 57 % L2 hit rate against 98 % and 39 GB of DRAM
    traffic against 5, so no faster (README, Speed).
    """
    tilelang, T = _tl()
    if mode not in MAIN_MODES + ("none",):
        raise ValueError(f"mode: {mode!r}")
    check_cluster(cluster, mode)
    R = T.dynamic("R")
    HQ = T.dynamic("HQ")  # every head of the call; the group starts at head_base
    NKV = T.dynamic("NKV")
    NSL = T.dynamic("NSL")  # shards in this launch
    Lp = T.dynamic("Lp")  # padded slots, a multiple of BLOCK_SLOTS
    Hg, Dk, Dv = heads, d_k, d_v
    Dt = Dk - Dv
    BS = BLOCK_SLOTS
    NB = Lp // BS
    block_H = main_tile_heads(Hg)
    # 8 warps need a tile of at least 32 head rows to partition the GEMMs.
    threads = threads or (256 if block_H >= 32 else 128)
    n_warps = threads // 32
    # dKV of a slot block is produced in DKV_SPLIT column chunks of Dc, so that
    # its accumulator fragment holds at most 32 fp32 per thread (16 in the
    # scratch-writing modes, whose stores hold more): the whole width would
    # keep 64 more registers live and spill at 255 (tests/test_kernels_compile).
    sharded = mode == "shard" and cluster > 1
    # Fixed mode in a cluster: CTA g of the cluster owns dKV columns [g * Cc,
    # (g + 1) * Cc) of the value part, and the first tail_ranks CTAs 32 columns
    # [Dv + g * 32, Dv + (g + 1) * 32) of the tail each (a 16-column tile would
    # not partition over 8 warps), for every slot and every head of the
    # cluster. The CTAs swap their P and dS tiles (a few KB a block) instead of
    # dKV partials.
    colsplit = mode == "fixed" and cluster > 1
    Cc, Ct = (Dv // cluster, 32) if colsplit else (Dv, Dk - Dv)
    tail_ranks = (Dk - Dv) // 32

    def value_col0(rank):
        """The first dKV column of CTA ``rank``'s value-part share."""
        return rank * Cc if colsplit else 0

    def tail_col0(rank):
        """The first dKV column of CTA ``rank``'s tail share."""
        return Dv + rank * Ct if colsplit else Dv

    def owns_tail(rank):
        """Whether CTA ``rank`` has tail columns (a runtime test only where the cluster splits fewer chunks than CTAs)."""
        return (not colsplit) or tail_ranks == cluster or rank < tail_ranks
    per_thread = 16 if mode in ("write", "accumulate") or (mode == "shard" and not sharded) else 32
    split = max(1, BS * Cc // (threads * per_thread))
    while Cc % (split * 16):  # chunks must be whole 16-column GEMM tiles
        split -= 1
    DKV_SPLIT = split
    Dc = Cc // DKV_SPLIT
    if mode == "fixed" and (Dv % 32 or (Dk - Dv) % 32):
        raise ValueError(f"fixed mode needs Dv and Dk - Dv multiples of 32, got Dk={Dk}, Dv={Dv}")
    f32, bf16, i32 = "float32", "bfloat16", "int32"
    # Read-modify-writes of dKV scratch go in groups of RMW_SLOTS slots: all
    # loads of a group are issued before any store, so they overlap in flight.
    RMW_SLOTS = 8
    dkv_shape = {"atomic": (NKV, Dk), "fixed": (NKV, Dk), "shard": (NSL, NKV, Dk), "none": (1,)}.get(mode, (R, Lp, Dk))
    # fixed and atomic: the global adds of slot block t are issued during block
    # t + 1, a quarter at a time (dKV_s is rewritten only at the end of a
    # block), so the load-store queue drains while the tensor cores work
    # instead of stalling every warp in one burst after the dKV GEMMs: on the
    # H200 10 % (fixed) and 8 % (atomic) faster at dsv32 H=64. The first three
    # quarters go right after the score, dP and dQ GEMMs, not before them: a
    # GEMM's first ldmatrix waited behind the quarter's 64-bit reductions in
    # the memory pipe and on their source registers, which it reuses (ncu at
    # S=1024: 9 % of the fixed launch's warp samples on long_sb, 2 % in the
    # control's).
    # Moved, the deterministic call took 24.85 against 25.58 ms at dsv32 H=64,
    # 49.44 against 50.84 at H=128 and 17.01 against 17.45 at fleet on the
    # H200; the control's, 23.60 against 23.67 (benchmarks/kernel_ab.py).
    # A 64-head tile (TileLang lowers all its GEMMs to wgmma) is the cluster
    # of two 32-head groups done by one CTA: every dKV element summed over
    # all 64 heads on chip, no tile exchange. Its Q and
    # dO tiles take 136 KB of shared memory, so a whole block's fp32 dKV
    # (74 KB) cannot wait in it for the next block: its first column chunk is
    # added from a one-chunk staging buffer under the next chunk's GEMMs, and
    # only the last chunk and the tail wait (``wide_late``).
    wide = block_H == WIDE_HEADS
    if wide and (cluster > 1 or mode not in WIDE_MODES + ("none",)):
        raise ValueError(f"a {WIDE_HEADS}-head tile is built for the fixed and atomic modes without clusters: "
                         f"mode={mode!r}, cluster={cluster}")
    # The wide tile's score and dP GEMMs split between its warpgroups (WIDE_SPLIT).
    split_tile = wide and WIDE_SPLIT
    # The split tile hands P over in fp32 over the value chunk's staging (dKV_s),
    # rows X_STRIDE words apart (8 mod 32 banks, as F32_ROW_PAD).
    X_STRIDE = BS + F32_ROW_PAD
    if split_tile and block_H * X_STRIDE > BS * (Dc + WIDE_ROW_PAD):
        raise ValueError(f"split tile: P ({block_H} x {BS} fp32, padded) does not fit the staging of a {Dc}-column chunk")
    # The device functions the kernel calls (benchmarks/add_width.py appends its own).
    device_source = (GATHER_SOURCE + (CLUSTER_SOURCE if cluster > 1 else "") + (SHARD_SOURCE if sharded else "")
                     + (SPLIT_SOURCE if split_tile else ""))
    deferred = (mode in ("fixed", "atomic") and not wide) or sharded
    # Wide tile: its last value chunk and its tail wait in their staging for
    # the next block, which adds them while its score, dP and dQ GEMMs run
    # (gemm_async below); the first chunk's go out under the second chunk's
    # GEMMs: every add overlaps some GEMM.
    wide_late = wide and mode != "none"
    PIECES = 4  # four call sites below
    piece = BS // PIECES
    if deferred and piece % n_warps:
        raise ValueError(f"{n_warps} warps must divide the {piece} slots of a piece of global adds")
    if colsplit and (Cc % 32 or (Dk - Dv) % 32 or tail_ranks > cluster):
        raise ValueError(f"cluster {cluster}: each CTA's share of the Dv columns must be whole 32-column adds, "
                         f"and the Dk - Dv tail at most one 32-column chunk per CTA: Dk={Dk}, Dv={Dv}")
    # dKV_s rows: the block's partials (one row per slot), of this CTA's
    # columns (a cluster of the fixed mode: Cc of the value part in dKV_s, 32
    # of the tail in dKVt_s). The sharded cluster: rows [0, BS) this CTA's
    # partials of its column half (dKV_s: of the Dv columns, dKVt_s: of the
    # tail), [BS, 2BS) its partials of the peer's half (staging), [2BS, 3BS)
    # the peer's of this half (inbox).
    dkv_w, dkvt_w, dkv_rows = (Dc if wide else Cc), Ct, BS
    peers = cluster - 1
    tile_bytes = block_H * BS * 2  # one bf16 P or dS tile
    inbox_bytes = peers * 2 * tile_bytes  # the fixed cluster's P and dS of a block, from every peer
    if colsplit and 2 * tile_bytes != 16 * threads:
        raise ValueError(f"cluster {cluster}: {threads} threads must stage the P and dS tiles 16 bytes each")
    if sharded:
        dkv_w, dkvt_w, dkv_rows = Dv // cluster, Dt // cluster, 3 * BS
        if BS != 32 or dkv_w % Dc or dkv_w % 128 or dkvt_w % 4 or dkvt_w > 128:
            raise ValueError(f"sharded cluster: needs 32-slot blocks (one warp's lanes) and column halves of whole "
                             f"128- and 4-column adds: Dv={Dv}, Dt={Dt}")
        inbox_bytes = BS * ((dkv_w + F32_ROW_PAD) + (dkvt_w + F32_ROW_PAD if Dt > 0 else 0)) * 4  # its bulk copies
    # Global adds of this CTA's own partials only (no peer's partials in an inbox).
    local_adds = deferred and (cluster == 1 or colsplit)
    dkv_dtype = "int64" if mode == "fixed" else "float32"
    grid = NSL if mode == "shard" else R
    has_tail = Dt > 0

    # The wide tile's score, dP and dQ GEMMs are wgmma: issued without waiting,
    # so that the previous block's late adds go out while the tensor cores work
    # (the wait follows them); elsewhere T.gemm, which waits.
    gemm_async = T.wgmma_gemm if wide else T.gemm
    # After the wait, each accumulator is pinned (an empty asm that reads and
    # writes its registers, as T.gemm's own wait does), so that the compiler
    # reads none of it before the wait; num_regs: this thread's share of it.

    @T.macro
    def gather_async(KV, KV_s, KVt_s, rows, NKV):
        """cp.async of the kv rows named by ``rows`` into KV_s / KVt_s, 16 bytes a copy;
        an invalid slot reads nothing (source size 0) and gets zeros."""
        for j, c in T.Parallel(BS, Dv // 8):
            T.call_extern(
                "handle", "mqa_cp_async16", T.address_of(KV_s[j, c * 8]),
                T.address_of(KV[T.max(T.min(rows[j], NKV - 1), 0), c * 8]), (rows[j] >= 0) and (rows[j] < NKV),
            )
        if has_tail:
            for j, c in T.Parallel(BS, Dt // 8):
                T.call_extern(
                    "handle", "mqa_cp_async16", T.address_of(KVt_s[j, c * 8]),
                    T.address_of(KV[T.max(T.min(rows[j], NKV - 1), 0), Dv + c * 8]), (rows[j] >= 0) and (rows[j] < NKV),
                )
        T.call_extern("handle", "mqa_cp_async_commit")

    @T.macro
    def store_halves(acc, buf, col0, width, half, rank):
        """Sharded cluster: the fragment's columns [col0, col0 + width) of this CTA's
        half (of ``half`` columns) into its own rows of buf, the peer's half's into the staging rows."""
        for j, d in T.Parallel(BS, width):
            buf[j + BS * (((col0 + d) // half + rank) % cluster), (col0 + d) % half] = acc[j, d]

    @T.macro
    def add_piece(dKV, dKV_s, dKVt_s, slots, scales, k, warp, lane, kv_row, scale_r, NKV, rank, inbox, b, chains):
        """The global adds of slots [k * piece, (k + 1) * piece) of the block held in dKV_s."""
        if sharded:
            # Warp w adds slot k * piece + w of the block if it leads its
            # chain of equal kv rows (chains: mqa_dup_link), four columns a
            # lane: 128 columns per red.v4 of the warp, 512 bytes of one row.
            for s_i in T.serial(piece // n_warps):
                j = k * piece + warp + s_i * n_warps
                kv_row[0] = slots[j]
                if (kv_row[0] >= 0) and (kv_row[0] < NKV) and (chains[j] < 64):
                    for c in T.unroll(dkv_w // 128):
                        T.call_extern("handle", "mqa_shard_add4",
                                      T.address_of(dKV[b, kv_row[0], rank * dkv_w + c * 128 + lane * 4]),
                                      T.address_of(dKV_s[0, c * 128 + lane * 4]),
                                      T.address_of(dKV_s[inbox, c * 128 + lane * 4]), dkv_w + F32_ROW_PAD, j, chains.data)
                    if has_tail:
                        if lane * 4 < dkvt_w:
                            T.call_extern("handle", "mqa_shard_add4",
                                          T.address_of(dKV[b, kv_row[0], Dv + rank * dkvt_w + lane * 4]),
                                          T.address_of(dKVt_s[0, lane * 4]),
                                          T.address_of(dKVt_s[inbox, lane * 4]), dkvt_w + F32_ROW_PAD, j, chains.data)
        elif mode == "fixed":
            # SIMT: warp w takes slots w, w + n_warps, ... of the piece; its
            # lanes walk the row 32 columns at a time, so every red.u64 is one
            # coalesced 256-byte row segment, and the slot's kv row and scale
            # are loaded once. x * 2^k is exact; __float2ll_rn rounds to
            # nearest even. In a cluster, the CTA adds its column share, whose
            # sum over the cluster's heads its dKV GEMMs formed. (Lanes that
            # add 2 or 4 consecutive columns each, from one vector shared
            # load, measured 19 % and 78 % slower at dsv32 H=64 on the H200:
            # a warp's red.u64 then touches 2x or 4x the 32-byte L2 sectors.)
            for s_i in T.serial(piece // n_warps):
                j = k * piece + warp + s_i * n_warps
                kv_row[0] = slots[j]
                scale_r[0] = scales[j]
                if (kv_row[0] >= 0) and (kv_row[0] < NKV):
                    for c in T.unroll(Cc // 32):
                        T.atomic_add(
                            dKV[kv_row[0], value_col0(rank) + c * 32 + lane],
                            T.call_extern("int64", "__float2ll_rn", dKV_s[j, c * 32 + lane] * scale_r[0]),
                        )
                    if has_tail:
                        if owns_tail(rank):
                            for c in T.unroll(Ct // 32):
                                T.atomic_add(
                                    dKV[kv_row[0], tail_col0(rank) + c * 32 + lane],
                                    T.call_extern("int64", "__float2ll_rn", dKVt_s[j, c * 32 + lane] * scale_r[0]),
                                )
        else:
            for j, d in T.Parallel(piece, Dv):
                if (slots[k * piece + j] >= 0) and (slots[k * piece + j] < NKV):
                    T.atomic_add(dKV[slots[k * piece + j], d], dKV_s[k * piece + j, d])
            if has_tail:
                for j, d in T.Parallel(piece, Dt):
                    if (slots[k * piece + j] >= 0) and (slots[k * piece + j] < NKV):
                        T.atomic_add(dKV[slots[k * piece + j], Dv + d], dKVt_s[k * piece + j, d])

    @T.macro
    def add_chunk(dKV, buf, b0, col0, width, slots, scales, warp, lane, kv_row, scale_r, NKV, part):
        """Wide tile: the global adds of dKV columns [col0, col0 + width) of every slot of
        a block, staged in buf[:, b0:b0 + width]; as add_piece, a warp per slot. In
        warpgroup ``part``'s branch (T.ws; None: outside any), that warpgroup's share of the slots."""
        if mode == "fixed":  # warp w takes slots w, w + n_warps, ...: in a branch, its warpgroup's share
            for s_i in T.serial(BS // n_warps):
                j = warp + s_i * n_warps
                kv_row[0] = slots[j]
                scale_r[0] = scales[j]
                if (0 <= kv_row[0]) and (kv_row[0] < NKV):
                    for c in T.unroll(width // 32):
                        T.atomic_add(dKV[kv_row[0], col0 + c * 32 + lane],
                                     T.call_extern("int64", "__float2ll_rn", buf[j, b0 + c * 32 + lane] * scale_r[0]))
        elif part is None:
            for j, d in T.Parallel(BS, width):
                if (slots[j] >= 0) and (slots[j] < NKV):
                    T.atomic_add(dKV[slots[j], col0 + d], buf[j, b0 + d])
        else:
            # A parallel loop in a warpgroup's branch spans that warpgroup's
            # threads only: each branch takes half of the slots.
            for i, d in T.Parallel(BS // 2, width):
                if (slots[part * (BS // 2) + i] >= 0) and (slots[part * (BS // 2) + i] < NKV):
                    T.atomic_add(dKV[slots[part * (BS // 2) + i], col0 + d], buf[part * (BS // 2) + i, b0 + d])

    @T.macro
    def wide_late_adds(dKV, dKV_s, dKVt_s, slots, scales, k, warp, lane, kv_row, scale_r, NKV, part=None):
        """Wide tile, site k of the next block: the previous block's last value chunk
        (dKV_s, two halves: k = 0, 1) and tail (dKVt_s, k = 2); ``part``: as add_chunk's."""
        if k < 2:
            add_chunk(dKV, dKV_s, k * (Dc // 2), (DKV_SPLIT - 1) * Dc + k * (Dc // 2), Dc // 2, slots, scales,
                      warp, lane, kv_row, scale_r, NKV, part)
        elif has_tail:
            add_chunk(dKV, dKVt_s, 0, Dv, Dt, slots, scales, warp, lane, kv_row, scale_r, NKV, part)

    @T.macro
    def dkv_chunk_gemms(gemm, Q_s, dO_s, dS_s, P_s, acc_dkv, c):
        """Wide tile: dKV^T of value chunk c, Q^T dS + dO^T P over the 64 heads, by ``gemm``
        (T.wgmma_gemm: issued, not waited for; T.gemm: waited for). Each warpgroup takes
        whole rows (FullRow: 64 x 32 wgmma tiles; the default split of the 32 slots gave
        64 x 16 ones and was slower)."""
        gemm(Q_s[0:block_H, c * Dc : (c + 1) * Dc], dS_s, acc_dkv, transpose_A=True, clear_accum=True,
             policy=T.GemmWarpPolicy.FullRow)
        gemm(dO_s[0:block_H, c * Dc : (c + 1) * Dc], P_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def probabilities(acc_s, slot, lse_s, scale_log2, NKV):
        """The scores in acc_s become P = exp2(score * scale * log2e - Lse2), 0 on invalid slots."""
        for h, j in T.Parallel(block_H, BS):
            acc_s[h, j] = T.if_then_else(
                (slot[j] >= 0) and (slot[j] < NKV),
                T.exp2(acc_s[h, j] * scale_log2 - lse_s[h]),
                T.cast(0, f32),
            )

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
        shard_base: T.int32,
        n_shards: T.int32,
    ):
        with T.Kernel(grid, cluster, threads=threads, cluster_dims=(1, cluster, 1) if cluster > 1 else None) as (b, rank):
            scale_log2 = sm_scale * LOG2E
            Q_s = T.alloc_shared((block_H, Dv), bf16)
            dO_s = T.alloc_shared((block_H, Dv), bf16)
            KV_s = T.alloc_shared((BS, Dv), bf16)
            P_s = T.alloc_shared((block_H, BS), bf16)
            dS_s = T.alloc_shared((block_H, BS), bf16)
            row_pad = WIDE_ROW_PAD if wide else F32_ROW_PAD
            dKV_s = T.alloc_shared((dkv_rows, dkv_w + row_pad), f32)
            slot = T.alloc_shared((BS,), i32)
            slot_next = T.alloc_shared((BS,), i32)  # the rows of the block in flight
            lse_s = T.alloc_shared((block_H,), f32)
            delta_s = T.alloc_shared((block_H,), f32)
            leader = T.alloc_shared((BS,), i32)
            tid = T.get_thread_binding()
            # Thread j < BS holds slot j's global loads in flight in registers,
            # so that no warp waits on their latency at a barrier: the next
            # block's index (stored before the gather) and, fixed mode, this
            # block's row scale (stored for its deferred adds). On the H200 the
            # barriers behind these loads, read into shared memory at the top of
            # each block, held 10 % of the stall samples at dsv32 H=64 (ncu).
            idx_next = T.alloc_local((1,), i32)
            if cluster > 1:
                # mbarriers: 0 full (every peer's block is in the inbox), 1 empty
                # (every peer has read ours: cluster - 1 arrivals a phase)
                bars = T.alloc_shared((2,), "uint64")
            if colsplit:
                # The peers' P and dS tiles of the block (bulk-copied into the
                # same offsets as this CTA's P_in and dS_in), this CTA's tiles
                # staged for those copies, and the peers' heads of Q and dO at
                # this CTA's columns. Rows [i * block_H, (i + 1) * block_H) of
                # each hold rank (rank + 1 + i) % cluster's, its P_s and dS_s
                # byte for byte (the same layout: tile_bytes per tile;
                # tests/test_kernels_compile checks the generated indexing).
                P_in = T.alloc_shared((peers * block_H, BS), bf16)
                dS_in = T.alloc_shared((peers * block_H, BS), bf16)
                send_P = T.alloc_shared((block_H, BS), bf16)
                send_dS = T.alloc_shared((block_H, BS), bf16)
                Qp_s = T.alloc_shared((peers * block_H, Cc), bf16)
                dOp_s = T.alloc_shared((peers * block_H, Cc), bf16)
            dKVt_s = dKV_s  # without a tail, add_piece never reads it
            KVt_s = None  # nor gather_async this one
            if has_tail:
                Qt_s = T.alloc_shared((block_H, Dt), bf16)
                KVt_s = T.alloc_shared((BS, Dt), bf16)
                dKVt_s = T.alloc_shared((dkv_rows, dkvt_w + row_pad), f32)
                acc_dqt = T.alloc_fragment((block_H, Dt), f32)
                acc_dkvt = T.alloc_fragment((Ct, BS) if wide else (BS, Ct), f32)
                if colsplit:
                    Qpt_s = T.alloc_shared((peers * block_H, Ct), bf16)

            acc_s = T.alloc_fragment((block_H, BS), f32)
            acc_dp = T.alloc_fragment((block_H, BS), f32)
            acc_dq = T.alloc_fragment((block_H, Dv), f32)
            # The wide tile forms dKV transposed, dKV^T = Q^T dS + dO^T P: M is
            # then the chunk's columns, not the 32 slots, so TileLang lowers
            # these GEMMs to wgmma as well (M = 32 keeps them on mma.sync).
            acc_dkv = T.alloc_fragment((Dc, BS) if wide else (BS, Dc), f32)
            if mode == "fixed":
                mass_row = T.alloc_fragment((block_H,), f32)
                if not split_tile:  # summed per element, reduced once per row (the split tile: per block)
                    mass = T.alloc_fragment((block_H, BS), f32)
                scale_next = T.alloc_local((1,), f32)
            if deferred or wide:
                slot_prev = T.alloc_shared((BS,), i32)  # the block whose dKV_s awaits its adds
                scale_prev = T.alloc_shared((BS,), f32)
                kv_row = T.alloc_local((1,), i32)
                scale_r = T.alloc_local((1,), f32)
                warp = T.get_thread_binding() // 32
                lane = T.get_thread_binding() % 32
            if wide:
                scale_cur = T.alloc_shared((BS,), f32)  # this block's row scales
            if split_tile:
                hand_bars = T.alloc_shared((2,), "uint64")  # HANDOFF_STAGING_READ, HANDOFF_P_WRITTEN
            chain_prev = None
            if sharded:  # mqa_dup_link of each slot: of the block in flight, this block, the previous one
                chain_next = T.alloc_shared((BS,), i32)
                chain = T.alloc_shared((BS,), i32)
                chain_prev = T.alloc_shared((BS,), i32)
            if mode == "accumulate" or (mode == "shard" and not sharded):
                old = T.alloc_fragment((RMW_SLOTS, Dv), f32)
                if has_tail:
                    old_t = T.alloc_fragment((RMW_SLOTS, Dt), f32)

            if mode == "shard":
                first_row = shard_base + b
                row_stride = n_shards
                rows = T.max(0, T.ceildiv(R - first_row, row_stride))
            else:
                first_row = b
                row_stride = 1
                rows = 1
            for it in T.serial(rows):
                r = first_row + it * row_stride
                # The tile is block_H head rows, whatever Hg is: the wrapper must hand
                # a group of exactly block_H heads (SPEC, "the kernel's own tile").
                h0 = head_base if cluster == 1 else head_base + rank * block_H
                T.copy(Q[r, h0 : h0 + block_H, 0:Dv], Q_s)
                if has_tail:
                    T.copy(Q[r, h0 : h0 + block_H, Dv:Dk], Qt_s)
                T.copy(dO[r, h0 : h0 + block_H, 0:Dv], dO_s)
                if colsplit:
                    for i in T.unroll(peers):
                        ph0 = head_base + (rank + 1 + i) % cluster * block_H
                        col0 = value_col0(rank)
                        T.copy(Q[r, ph0 : ph0 + block_H, col0 : col0 + Cc], Qp_s[i * block_H : (i + 1) * block_H, 0:Cc])
                        T.copy(dO[r, ph0 : ph0 + block_H, col0 : col0 + Cc], dOp_s[i * block_H : (i + 1) * block_H, 0:Cc])
                        if has_tail:
                            if owns_tail(rank):
                                T.copy(Q[r, ph0 : ph0 + block_H, tail_col0(rank) : tail_col0(rank) + Ct],
                                       Qpt_s[i * block_H : (i + 1) * block_H, 0:Ct])
                # Staged once per row: the slot loop then indexes shared memory,
                # not [R, HQ] tensors (their 64-bit addressing costs registers).
                for h in T.Parallel(block_H):
                    lse_s[h] = Lse2[r, h0 + h]
                    delta_s[h] = Delta[r, h0 + h]
                T.clear(acc_dq)
                if has_tail:
                    T.clear(acc_dqt)
                if mode == "fixed":
                    if split_tile:
                        T.clear(mass_row)
                    else:
                        T.clear(mass)

                # The KV gather of slot block t + 1 is issued asynchronously
                # right after block t's last read of KV_s (the dQ GEMM), so it
                # lands while the dKV GEMMs and adds run (on the H200, 14 %
                # (fixed) and 18 % (atomic) faster than gathering each block
                # at its top, commit 679c2e6). Invalid slots are never read:
                # their rows of KV_s are zero.
                T.import_source(device_source)
                for j in T.Parallel(BS):
                    slot_next[j] = Indices[r, j]
                if sharded and tid < BS:
                    T.call_extern("handle", "mqa_st_shared_i32", chain_next.data, tid,
                                  T.call_extern("int32", "mqa_dup_link", Indices[r, tid]))
                gather_async(KV, KV_s, KVt_s, slot_next, NKV)
                # Once per CTA: a wide tile's CTA has one row (rows = 1; another
                # row would need the mbarriers invalidated first, and t restarts).
                if split_tile and tid == 0:  # before the slot loop's first __syncthreads
                    T.call_extern("handle", "mqa_handoff_init", hand_bars.data, threads, WARPGROUP)
                # Sharded cluster (the fixed one's handshake is at its exchange
                # below): block t's partials of the peer's half are staged,
                # then bulk-copied to the peer's inbox, completing on its full
                # barrier. The peer waits on it one GEMM stage into block t + 1,
                # adds, and arrives on this CTA's empty barrier, which this CTA
                # waits on one GEMM into block t + 1 before it restages (and so
                # before it refills the peer's inbox). Only the barrier of the
                # data a thread is about to read or overwrite is ever waited on.
                if cluster > 1:
                    if tid == 0:
                        T.call_extern("handle", "mqa_mbar_init", bars.data, 1, peers if colsplit else 1)
                    T.call_extern("handle", "mqa_cluster_sync")  # the peer's barriers exist
                    if tid == 0:
                        T.call_extern("handle", "mqa_mbar_expect", bars.data, 0, inbox_bytes)
                for t in T.Pipelined(NB, num_stages=0):
                    # Block t's rows are in flight since block t - 1; the next
                    # block's indices are read now, stored after the dQ GEMM.
                    for j in T.Parallel(BS):
                        slot[j] = slot_next[j]
                    if sharded:
                        for j in T.Parallel(BS):
                            chain[j] = chain_next[j]
                    if (tid < BS) and (t + 1 < NB):
                        idx_next[0] = Indices[r, (t + 1) * BS + tid]
                    T.call_extern("handle", "mqa_cp_async_wait_all")
                    T.sync_threads()
                    if mode == "fixed":
                        if tid < BS:
                            scale_next[0] = T.if_then_else(
                                (slot[tid] >= 0) and (slot[tid] < NKV), RowScale[slot[tid]], T.cast(0, f32)
                            )

                    if split_tile:
                        # The warpgroups split the score and dP GEMMs: warpgroup 0
                        # forms the scores and P, warpgroup 1 dP and dS, each GEMM
                        # one 64 x 32 wgmma tile over the 64 heads (split by slots
                        # instead, both read all of Q and dO and ran 64 x 16
                        # tiles). P goes to warpgroup 1 in fp32 through shared
                        # memory, over the value chunk's staging (X_STRIDE), which
                        # both add first while their GEMMs run; warpgroup 0 also
                        # stores P_s (bf16) and sums the block's softmax mass.
                        # Each warpgroup keeps its accumulator within its own
                        # branch, cleared before its GEMM, so that the two share
                        # registers (neither is live in the other's branch or
                        # between blocks); they meet only at two mbarriers
                        # (SPLIT_SOURCE).
                        with T.ws(0):
                            T.clear(acc_s)
                            T.wgmma_gemm(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True)
                            if has_tail:
                                T.wgmma_gemm(Qt_s, KVt_s, acc_s, transpose_B=True)
                            if wide_late and t > 0:
                                for k in T.unroll(2):
                                    wide_late_adds(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, k, warp, lane, kv_row, scale_r, NKV, 0)
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc_s, num_regs=block_H * BS // WARPGROUP)
                            T.call_extern("handle", "mqa_handoff_arrive", hand_bars.data, HANDOFF_STAGING_READ)
                            T.call_extern("handle", "mqa_handoff_wait", hand_bars.data, HANDOFF_STAGING_READ, t % 2)
                            probabilities(acc_s, slot, lse_s, scale_log2, NKV)
                            for h, j in T.Parallel(block_H, BS):
                                T.call_extern("handle", "mqa_st_shared_f32", dKV_s.data, h * X_STRIDE + j, acc_s[h, j])
                            T.call_extern("handle", "mqa_handoff_arrive", hand_bars.data, HANDOFF_P_WRITTEN)
                            for h, j in T.Parallel(block_H, BS):
                                T.call_extern("handle", "mqa_st_shared_at", T.address_of(P_s[h, j]), T.cast(acc_s[h, j], bf16))
                            if mode == "fixed":
                                T.reduce_sum(acc_s, mass_row, dim=1, clear=False)
                        with T.ws(1):
                            T.clear(acc_dp)
                            T.wgmma_gemm(dO_s, KV_s, acc_dp, transpose_B=True, clear_accum=True)
                            if wide_late and t > 0:
                                for k in T.unroll(2):
                                    wide_late_adds(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, k, warp, lane, kv_row, scale_r, NKV, 1)
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc_dp, num_regs=block_H * BS // WARPGROUP)
                            T.call_extern("handle", "mqa_handoff_arrive", hand_bars.data, HANDOFF_STAGING_READ)
                            T.call_extern("handle", "mqa_handoff_wait", hand_bars.data, HANDOFF_P_WRITTEN, t % 2)
                            for h, j in T.Parallel(block_H, BS):
                                acc_dp[h, j] = (T.call_extern("float32", "mqa_ld_shared_f32", dKV_s.data, h * X_STRIDE + j)
                                                * (acc_dp[h, j] - delta_s[h]) * sm_scale)
                            T.copy(acc_dp, dS_s)
                    else:
                        # Scores, then P.
                        gemm_async(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True)
                        if has_tail:
                            gemm_async(Qt_s, KVt_s, acc_s, transpose_B=True)
                        if local_adds and t > 0:  # after the GEMM: see ``deferred``
                            add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 0, warp, lane, kv_row, scale_r, NKV, rank, 0, b, chain_prev)
                        if wide_late and t > 0:
                            wide_late_adds(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 0, warp, lane, kv_row, scale_r, NKV)
                        if wide:
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc_s, num_regs=block_H * BS // threads)
                        probabilities(acc_s, slot, lse_s, scale_log2, NKV)
                        T.copy(acc_s, P_s)
                        if mode == "fixed":
                            for h, j in T.Parallel(block_H, BS):
                                mass[h, j] += acc_s[h, j]

                        if sharded and t > 0:
                            # The peer's partials of block t - 1 are in; expect those of block t.
                            T.call_extern("handle", "mqa_mbar_wait", bars.data, 0, (t - 1) % 2)
                            if tid == 0:
                                T.call_extern("handle", "mqa_mbar_expect", bars.data, 0, inbox_bytes)
                            add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 0, warp, lane, kv_row, scale_r, NKV, rank,
                                      2 * BS, b, chain_prev)
                        # dP = dO KV_v^T; dS = P * (dP - Delta) * sm_scale.
                        gemm_async(dO_s, KV_s, acc_dp, transpose_B=True, clear_accum=True)
                        if local_adds and t > 0:
                            add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 1, warp, lane, kv_row, scale_r, NKV, rank, 0, b, chain_prev)
                        if wide_late and t > 0:
                            wide_late_adds(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 1, warp, lane, kv_row, scale_r, NKV)
                        if wide:
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc_dp, num_regs=block_H * BS // threads)
                        for h, j in T.Parallel(block_H, BS):
                            acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_s[h]) * sm_scale
                        T.copy(acc_dp, dS_s)

                    if sharded and t > 0:
                        add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 1, warp, lane, kv_row, scale_r, NKV, rank,
                                  2 * BS, b, chain_prev)
                    # dQ += dS KV.
                    gemm_async(dS_s, KV_s, acc_dq)
                    if has_tail:
                        gemm_async(dS_s, KVt_s, acc_dqt)
                    if local_adds and t > 0:
                        add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 2, warp, lane, kv_row, scale_r, NKV, rank, 0, b, chain_prev)
                    if wide_late and t > 0:
                        wide_late_adds(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 2, warp, lane, kv_row, scale_r, NKV)
                    if wide:
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_dq, num_regs=block_H * Dv // threads)
                        if has_tail:
                            T.warpgroup_fence_operand(acc_dqt, num_regs=block_H * Dt // threads)
                    if colsplit:
                        # Stage this block's P and dS tiles for the peers (their
                        # stores were ordered by the barrier before this GEMM);
                        # every peer has consumed block t - 1, so the staging and
                        # their inboxes are free. The barrier below orders the
                        # staging before the bulk copies that read it.
                        if t > 0:
                            T.call_extern("handle", "mqa_mbar_wait", bars.data, 1, (t - 1) % 2)
                        if tid < threads // 2:
                            T.call_extern("handle", "mqa_copy16", send_P.data, P_s.data, tid)
                        else:
                            T.call_extern("handle", "mqa_copy16", send_dS.data, dS_s.data, tid - threads // 2)
                        T.call_extern("handle", "mqa_fence_proxy_async")
                    # The next block's indices, for its gather. TileLang's planner does
                    # not see this store: the barrier below also orders it before the
                    # gather's reads.
                    if (tid < BS) and (t + 1 < NB):
                        T.call_extern("handle", "mqa_st_shared_i32", slot_next.data, tid, idx_next[0])
                        if sharded:
                            T.call_extern("handle", "mqa_st_shared_i32", chain_next.data, tid,
                                          T.call_extern("int32", "mqa_dup_link", idx_next[0]))
                    if wide and mode == "fixed" and tid < BS:
                        scale_cur[tid] = scale_next[0]
                    T.sync_threads()  # every warp is done with KV_s
                    if t + 1 < NB:
                        gather_async(KV, KV_s, KVt_s, slot_next, NKV)
                    if colsplit:
                        # Send this block's P and dS tiles to every peer: staged
                        # raw above, then one bulk copy each, completing on the
                        # peer's full barrier.
                        if tid == 0:
                            # Peer (rank + 1 + i) % cluster keeps this CTA's tiles in its inbox peers - 1 - i.
                            for i in T.unroll(peers):
                                T.call_extern("handle", "mqa_bulk_ptr_to_peer", P_in.data, (peers - 1 - i) * tile_bytes, send_P.data,
                                              tile_bytes, bars.data, 0, (rank + 1 + i) % cluster)
                                T.call_extern("handle", "mqa_bulk_ptr_to_peer", dS_in.data, (peers - 1 - i) * tile_bytes, send_dS.data,
                                              tile_bytes, bars.data, 0, (rank + 1 + i) % cluster)

                    if local_adds and t > 0:
                        add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 3, warp, lane, kv_row, scale_r, NKV, rank, 0, b, chain_prev)
                    if sharded and t > 0:
                        for k in T.unroll(2, PIECES):
                            add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, k, warp, lane, kv_row, scale_r, NKV, rank,
                                      2 * BS, b, chain_prev)
                        T.sync_threads()  # every thread is done with the inbox
                        # The arrival publishes no data (release at CTA scope is
                        # enough for the reads above, whose values are consumed);
                        # one that followed writes into the peer would need
                        # .release.cluster.
                        if tid == 0:
                            T.call_extern("handle", "mqa_mbar_arrive_peer", bars.data, 1, 1 - rank)
                    if colsplit:
                        # This CTA's columns of dKV for the block, over every CTA's
                        # heads: its own tiles, then its inboxes in order.
                        T.call_extern("handle", "mqa_mbar_wait", bars.data, 0, t % 2)
                        if (tid == 0) and (t + 1 < NB):
                            T.call_extern("handle", "mqa_mbar_expect", bars.data, 0, inbox_bytes)
                        for c in T.unroll(DKV_SPLIT):
                            T.gemm(dS_s, Q_s[0:block_H, rank * Cc + c * Dc : rank * Cc + (c + 1) * Dc], acc_dkv,
                                   transpose_A=True, clear_accum=True)
                            T.gemm(P_s, dO_s[0:block_H, rank * Cc + c * Dc : rank * Cc + (c + 1) * Dc], acc_dkv, transpose_A=True)
                            T.gemm(dS_in, Qp_s[0 : peers * block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True)
                            T.gemm(P_in, dOp_s[0 : peers * block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True)
                            T.copy(acc_dkv, dKV_s[0:BS, c * Dc : (c + 1) * Dc])
                        if has_tail:
                            if owns_tail(rank):
                                T.gemm(dS_s, Qt_s[0:block_H, rank * Ct : rank * Ct + Ct], acc_dkvt, transpose_A=True,
                                       clear_accum=True)
                                T.gemm(dS_in, Qpt_s, acc_dkvt, transpose_A=True)
                                T.copy(acc_dkvt, dKVt_s[0:BS, 0:Ct])
                        T.sync_threads()  # every warp is done with the inboxes
                        if tid == 0:
                            for i in T.unroll(peers):
                                T.call_extern("handle", "mqa_mbar_arrive_peer", bars.data, 1, (rank + 1 + i) % cluster)
                    elif wide and mode != "none":
                        # dKV of this slot block, a column chunk at a time, staged in
                        # dKV_s. All chunks but the last are added at once (the
                        # barriers keep a chunk's adds before the next chunk
                        # overwrites the staging); the last and the tail wait
                        # in dKV_s and dKVt_s for the next block, which adds them
                        # while its GEMMs run (``wide_late``).
                        # The GEMMs give dKV^T (acc_dkv, dkv_chunk_gemms). Chunk c > 0's
                        # GEMMs (and the tail's, with the last) are issued
                        # asynchronously and chunk c - 1's adds go out while they run
                        # (EARLY_CHUNK_UNDER_GEMM); the wait and a barrier follow, and
                        # only then is chunk c staged over chunk c - 1.
                        for c in T.unroll(DKV_SPLIT):
                            if EARLY_CHUNK_UNDER_GEMM and c > 0:
                                dkv_chunk_gemms(T.wgmma_gemm, Q_s, dO_s, dS_s, P_s, acc_dkv, c)
                                if has_tail and c + 1 == DKV_SPLIT:
                                    T.wgmma_gemm(Qt_s, dS_s, acc_dkvt, transpose_A=True, clear_accum=True,
                                                 policy=T.GemmWarpPolicy.FullRow)
                                add_chunk(dKV, dKV_s, 0, (c - 1) * Dc, Dc, slot, scale_cur, warp, lane, kv_row, scale_r, NKV, None)
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(acc_dkv, num_regs=Dc * BS // threads)
                                if has_tail and c + 1 == DKV_SPLIT:
                                    T.warpgroup_fence_operand(acc_dkvt, num_regs=Dt * BS // threads)
                                T.sync_threads()  # every warp has read chunk c - 1's staging
                            else:
                                dkv_chunk_gemms(T.gemm, Q_s, dO_s, dS_s, P_s, acc_dkv, c)
                            for d, j in T.Parallel(Dc, BS):
                                dKV_s[j, d] = acc_dkv[d, j]
                            if c + 1 < DKV_SPLIT:
                                T.sync_threads()
                                if not EARLY_CHUNK_UNDER_GEMM:
                                    add_chunk(dKV, dKV_s, 0, c * Dc, Dc, slot, scale_cur, warp, lane, kv_row, scale_r, NKV, None)
                                    T.sync_threads()
                        if has_tail:
                            if not EARLY_CHUNK_UNDER_GEMM or DKV_SPLIT == 1:
                                T.gemm(Qt_s, dS_s, acc_dkvt, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                            for d, j in T.Parallel(Dt, BS):
                                dKVt_s[j, d] = acc_dkvt[d, j]
                        for j in T.Parallel(BS):
                            slot_prev[j] = slot[j]
                        if mode == "fixed":
                            for j in T.Parallel(BS):
                                scale_prev[j] = scale_cur[j]
                    elif mode != "none":
                        # dKV of this slot block = dS^T Q (all columns) + P^T dO (first Dv).
                        for c in T.unroll(DKV_SPLIT):
                            T.gemm(dS_s, Q_s[0:block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True, clear_accum=True)
                            T.gemm(P_s, dO_s[0:block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True)
                            if sharded:
                                if c == 0 and t > 0:  # the peer has our block t - 1: staging and its inbox are free
                                    T.call_extern("handle", "mqa_mbar_wait", bars.data, 1, (t - 1) % 2)
                                store_halves(acc_dkv, dKV_s, c * Dc, Dc, dkv_w, rank)
                            else:
                                T.copy(acc_dkv, dKV_s[0:BS, c * Dc : (c + 1) * Dc])
                        if has_tail:
                            T.gemm(dS_s, Qt_s, acc_dkvt, transpose_A=True, clear_accum=True)
                            if sharded:
                                store_halves(acc_dkvt, dKVt_s, 0, Dt, dkvt_w, rank)
                            else:
                                T.copy(acc_dkvt, dKVt_s[0:BS, 0:Dt])
                        if sharded:  # send the staged partials to the peer's inbox
                            T.call_extern("handle", "mqa_fence_proxy_async")
                            T.sync_threads()
                            if tid == 0:
                                stage = BS * (dkv_w + F32_ROW_PAD) * 4
                                T.call_extern("handle", "mqa_bulk_to_peer", dKV_s.data, stage, 2 * stage, stage, bars.data, 0, 1 - rank)
                                if has_tail:
                                    stage_t = BS * (dkvt_w + F32_ROW_PAD) * 4
                                    T.call_extern("handle", "mqa_bulk_to_peer", dKVt_s.data, stage_t, 2 * stage_t, stage_t, bars.data, 0,
                                                  1 - rank)

                    if mode == "write":
                        T.copy(dKV_s[0:BS, 0:Dv], dKV[r, t * BS : (t + 1) * BS, 0:Dv])
                        if has_tail:
                            T.copy(dKVt_s[0:BS, 0:Dt], dKV[r, t * BS : (t + 1) * BS, Dv:Dk])
                    elif mode == "accumulate":
                        for g8 in T.serial(BS // RMW_SLOTS):
                            for j, d in T.Parallel(RMW_SLOTS, Dv):
                                old[j, d] = dKV[r, t * BS + g8 * RMW_SLOTS + j, d]
                            for j, d in T.Parallel(RMW_SLOTS, Dv):
                                dKV[r, t * BS + g8 * RMW_SLOTS + j, d] = old[j, d] + dKV_s[g8 * RMW_SLOTS + j, d]
                            if has_tail:
                                for j, d in T.Parallel(RMW_SLOTS, Dt):
                                    old_t[j, d] = dKV[r, t * BS + g8 * RMW_SLOTS + j, Dv + d]
                                for j, d in T.Parallel(RMW_SLOTS, Dt):
                                    dKV[r, t * BS + g8 * RMW_SLOTS + j, Dv + d] = old_t[j, d] + dKVt_s[g8 * RMW_SLOTS + j, d]
                    elif deferred:
                        # This block's adds are issued during the next one.
                        for j in T.Parallel(BS):
                            slot_prev[j] = slot[j]
                        if sharded:
                            for j in T.Parallel(BS):
                                chain_prev[j] = chain[j]
                        if mode == "fixed":
                            if tid < BS:
                                scale_prev[tid] = scale_next[0]
                    elif mode == "shard":
                        # leader[j]: the first slot of this block with the same kv row.
                        for j in T.Parallel(BS):
                            leader[j] = j
                            for i in T.serial(BS):
                                if (BS - 1 - i < j) and (slot[BS - 1 - i] == slot[j]):
                                    leader[j] = BS - 1 - i
                        # Fold duplicates onto their leader, in slot order.
                        for j in T.serial(BS):
                            if (leader[j] != j) and (slot[j] >= 0) and (slot[j] < NKV):
                                for d in T.Parallel(Dv):
                                    dKV_s[leader[j], d] = dKV_s[leader[j], d] + dKV_s[j, d]
                                if has_tail:
                                    for d in T.Parallel(Dt):
                                        dKVt_s[leader[j], d] = dKVt_s[leader[j], d] + dKVt_s[j, d]
                        # Now every written kv row is distinct: one plain RMW each,
                        # all loads of a group of slots in flight before its stores.
                        for g8 in T.serial(BS // RMW_SLOTS):
                            for j, d in T.Parallel(RMW_SLOTS, Dv):
                                old[j, d] = T.if_then_else(
                                    (leader[g8 * RMW_SLOTS + j] == g8 * RMW_SLOTS + j) and (slot[g8 * RMW_SLOTS + j] >= 0) and (slot[g8 * RMW_SLOTS + j] < NKV),
                                    dKV[b, slot[g8 * RMW_SLOTS + j], d], T.cast(0, f32),
                                )
                            for j, d in T.Parallel(RMW_SLOTS, Dv):
                                if (leader[g8 * RMW_SLOTS + j] == g8 * RMW_SLOTS + j) and (slot[g8 * RMW_SLOTS + j] >= 0) and (slot[g8 * RMW_SLOTS + j] < NKV):
                                    dKV[b, slot[g8 * RMW_SLOTS + j], d] = old[j, d] + dKV_s[g8 * RMW_SLOTS + j, d]
                            if has_tail:
                                for j, d in T.Parallel(RMW_SLOTS, Dt):
                                    old_t[j, d] = T.if_then_else(
                                        (leader[g8 * RMW_SLOTS + j] == g8 * RMW_SLOTS + j) and (slot[g8 * RMW_SLOTS + j] >= 0) and (slot[g8 * RMW_SLOTS + j] < NKV),
                                        dKV[b, slot[g8 * RMW_SLOTS + j], Dv + d], T.cast(0, f32),
                                    )
                                for j, d in T.Parallel(RMW_SLOTS, Dt):
                                    if (leader[g8 * RMW_SLOTS + j] == g8 * RMW_SLOTS + j) and (slot[g8 * RMW_SLOTS + j] >= 0) and (slot[g8 * RMW_SLOTS + j] < NKV):
                                        dKV[b, slot[g8 * RMW_SLOTS + j], Dv + d] = old_t[j, d] + dKVt_s[g8 * RMW_SLOTS + j, d]
                        # The next block's writes (other threads) must see these.
                        T.sync_threads()

                if wide_late:  # the last block's late adds
                    T.sync_threads()
                    for k in T.unroll(3):
                        wide_late_adds(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, k, warp, lane, kv_row, scale_r, NKV)
                if deferred:  # the last block's adds
                    if local_adds:
                        for k in T.unroll(PIECES):
                            add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, k, warp, lane, kv_row, scale_r, NKV, rank, 0, b, chain_prev)
                        if colsplit:
                            # Every peer's last arrival on this CTA's barrier is in, and
                            # its last bulk copies from this CTA's staging are done.
                            T.call_extern("handle", "mqa_cluster_sync")
                    else:
                        T.call_extern("handle", "mqa_mbar_wait", bars.data, 0, (NB - 1) % 2)
                        for k in T.unroll(PIECES):
                            add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, k, warp, lane, kv_row, scale_r, NKV, rank,
                                      2 * BS, b, chain_prev)
                        # A CTA's shared memory must outlive the peer's remote arrivals on it.
                        T.call_extern("handle", "mqa_cluster_sync")
                        if sharded and tid == 0:  # the next row initialises them again
                            T.call_extern("handle", "mqa_mbar_inval", bars.data, 2)
                if mode == "fixed":
                    if not split_tile:
                        T.reduce_sum(mass, mass_row, dim=1)
                    for h in T.Parallel(block_H):
                        # A NaN mass (a NaN lse or score) flags too: its
                        # contributions would otherwise convert to garbage.
                        if (mass_row[h] > Allowance[r, h0 + h]) or T.isnan(mass_row[h]):
                            Flag[r] = 1
                if sharded:
                    # Straight from the fragments: a staging tile would not fit
                    # next to the cluster's dKV rows (in a row loop, TileLang
                    # keeps every shared buffer live across iterations).
                    T.copy(acc_dq, dQ[r, h0 : h0 + block_H, 0:Dv])
                    if has_tail:
                        T.copy(acc_dqt, dQ[r, h0 : h0 + block_H, Dv:Dk])
                else:
                    dQ_s = T.alloc_shared((block_H, Dv), bf16)
                    T.copy(acc_dq, dQ_s)
                    T.copy(dQ_s, dQ[r, h0 : h0 + block_H, 0:Dv])
                    if has_tail:
                        dQt_s = T.alloc_shared((block_H, Dt), bf16)
                        T.copy(acc_dqt, dQt_s)
                        T.copy(dQt_s, dQ[r, h0 : h0 + block_H, Dv:Dk])

    return main_bwd


def shard_fold_program(d_k: int, threads: int = 128):
    """DKVAcc[k, :] += DKVShard[0, k, :] + ... in shard order, one fp32 chain per element."""
    tilelang, T = _tl()
    NKV = T.dynamic("NKV")
    NSL = T.dynamic("NSL")
    Dk = d_k
    f32 = "float32"
    per_thread = (Dk + threads - 1) // threads

    @T.prim_func
    def shard_fold(DKVShard: T.Tensor((NSL, NKV, Dk), f32), DKVAcc: T.Tensor((NKV, Dk), f32)):
        with T.Kernel(NKV, threads=threads) as k:
            acc = T.alloc_local((per_thread,), f32)
            tx = T.get_thread_binding()
            for c in T.unroll(per_thread):
                if c * threads + tx < Dk:
                    acc[c] = DKVAcc[k, c * threads + tx]
            for sh in T.serial(NSL):
                for c in T.unroll(per_thread):
                    if c * threads + tx < Dk:
                        acc[c] = acc[c] + DKVShard[sh, k, c * threads + tx]
            for c in T.unroll(per_thread):
                if c * threads + tx < Dk:
                    DKVAcc[k, c * threads + tx] = acc[c]

    return shard_fold


def dkv_reduce_program(d_k: int, threads: int = 128):
    """DKVAcc[k, :] += DKVSlot[SlotOfEntry[e] - slot_base, :] for e in [EntryLo[k], EntryHi[k]), in e order."""
    tilelang, T = _tl()
    NKV = T.dynamic("NKV")
    NS = T.dynamic("NS")
    E = T.dynamic("E")
    Dk = d_k
    f32, i32 = "float32", "int32"

    per_thread = (Dk + threads - 1) // threads

    @T.prim_func
    def dkv_reduce(
        DKVSlot: T.Tensor((NS, Dk), f32),
        SlotOfEntry: T.Tensor((E,), i32),
        EntryLo: T.Tensor((NKV,), i32),
        EntryHi: T.Tensor((NKV,), i32),
        DKVAcc: T.Tensor((NKV, Dk), f32),
        slot_base: T.int32,
    ):
        with T.Kernel(NKV, threads=threads) as k:
            # Column c*threads + tx of kv row k belongs to thread tx: one fp32 chain
            # per element, added in entry order.
            acc = T.alloc_local((per_thread,), f32)
            tx = T.get_thread_binding()
            for c in T.unroll(per_thread):
                if c * threads + tx < Dk:
                    acc[c] = DKVAcc[k, c * threads + tx]
            for e in T.serial(EntryLo[k], EntryHi[k]):
                src = SlotOfEntry[e] - slot_base
                for c in T.unroll(per_thread):
                    if c * threads + tx < Dk:
                        acc[c] = acc[c] + DKVSlot[src, c * threads + tx]
            for c in T.unroll(per_thread):
                if c * threads + tx < Dk:
                    DKVAcc[k, c * threads + tx] = acc[c]

    return dkv_reduce


#: mark_slots' threads a CTA; its grid runs one CTA per query row and chunk of
#: that many slots, and CUDA caps the chunks (grid y) at 65535: the longest
#: padded top-k row the kernels take (the wrapper rejects longer ones).
MARK_THREADS = 128
MAX_SLOTS_PER_ROW = 65535 * MARK_THREADS


def mark_slots_program(threads: int = MARK_THREADS):
    """Referenced[k] = 1 for every kv row k a valid slot names; LiveRow[r] = 1 when row r has a valid slot.

    Both are zeroed by the caller. Every write stores 1, so writes of the same
    element by different threads agree: the result is the same on every run.
    One launch with plain stores: no host sync and no int64 index temporaries.
    One thread per slot (grid R x ceil(Lp / threads)), so that every slot's
    two dependent loads (its index, then its kv row's mark) are in flight at
    once: a thread that looped over its row's slots waited on each pair in
    turn: 0.119 ms against 0.166 at dsv32 H=64 on the H200
    (benchmarks/call_trace.py). A kv row already marked is not stored again
    (stores to one address from many threads serialize); LiveRow[r] is
    stored by every thread with a valid slot, one transaction per warp.
    """
    tilelang, T = _tl()
    R = T.dynamic("R")
    Lp = T.dynamic("Lp")
    NKV = T.dynamic("NKV")
    i32 = "int32"

    @T.prim_func
    def mark_slots(Slots: T.Tensor((R, Lp), i32), Referenced: T.Tensor((NKV,), i32), LiveRow: T.Tensor((R,), i32)):
        with T.Kernel(R, T.ceildiv(Lp, threads), threads=threads) as (r, chunk):
            k = T.alloc_local((1,), i32)
            tx = T.get_thread_binding()
            if chunk * threads + tx < Lp:
                k[0] = Slots[r, chunk * threads + tx]
                if (k[0] >= 0) and (k[0] < NKV):
                    LiveRow[r] = 1
                    if Referenced[k[0]] == 0:
                        Referenced[k[0]] = 1

    return mark_slots


# The fixed-point plan (mqa_bwd.fixed_point's _plan_small) as three launches,
# the same float64 operations in the same order (the __d*_rn intrinsics keep
# nvcc from contracting a product and a sum into an FMA), so the same bits
# (NaN payloads aside). On the H200 the call took 0.14-0.30 ms less than with
# the torch ops, some 80 kernels replayed as a CUDA graph with their inputs
# copied in and outputs out (two runs of benchmarks/package_ab.py: dsv32 H=64
# 16.14 and 16.18 against 16.36 ms, H=128 32.16 and 31.63 against 32.30 and
# 31.93, fleet 11.44 and 11.07 against 11.65 and 11.32).
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
                               const void* mv_, const int* referenced, const void* peaks_,
                               int S, int H, int S_kv, int hq, double c_a, double scale, int b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned short* mv = static_cast<const unsigned short*>(mv_);
  unsigned long long* mine = static_cast<unsigned long long*>(const_cast<void*>(peaks_)) + b * %(slots)d;
  MqaTerm t = {0.0, 0.0, 0.0, 0.0, 0.0};
  if (i < S * H) t = mqa_term(peak_q, peak_do, delta, live_row, hq, static_cast<long>(b) * S + i / H, i %% H, c_a, scale);
  double v = 0.0;
  if (i < S_kv && referenced[static_cast<long>(b) * S_kv + i] != 0) v = mqa_bf16_bits(mv[static_cast<long>(b) * S_kv + i]);
  mqa_block_flush(mqa_key(t.a), mine + %(A)d, 0);
  mqa_block_flush(mqa_key(t.b), mine + %(B)d, 0);
  mqa_block_flush((t.a > 0 || t.b > 0) ? 1ull : 0ull, mine + %(LIVE)d, 1);
  mqa_block_flush(mqa_key(t.mdo), mine + %(DO)d, 0);
  mqa_block_flush(mqa_key(v), mine + %(MV)d, 0);
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
                                int S_kv, int d_v, double limit, double fp32_safe, int b) {
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
  static_cast<float*>(const_cast<void*>(row_scale_))[j] = scale;
}
"""


def plan_program(stage: str, threads: int = PLAN_THREADS):
    """One stage of the fixed-point plan (mqa_bwd.fixed_point.plan, the same bits):

      terms   PlanPeaks[b] gets max a, max b, the live-term count N_b, max mdo (of
              live rows) and max mv (of referenced kv rows) of batch element b
      peaks   Allowance [R, H], and PlanPeaks[b] gets the peaks of dS and of bound_j
      scales  RowScale [NKV]: 2**k_j, NaN where the batch element is unsafe or a
              bound unrepresentable, 1 for kv rows no slot names

    PeakQ, PeakDO [R, HQ] int32 (bf16 magnitude bits) and Delta [R, HQ] hold
    the call's heads; H <= HQ are the real ones. MV [NKV] bf16 is max |kv| of
    each row's value part. PlanPeaks [B, PLAN_SLOTS] int64 is zeroed by the
    caller. Grid (ceil(max(S * H, S_kv) / threads), B).
    """
    from mqa_bwd import fixed_point as F  # the plan's constants; absolute: kernel_ab loads copies of this file alone

    tilelang, T = _tl()
    R, HQ, NKV, B = T.dynamic("R"), T.dynamic("HQ"), T.dynamic("NKV"), T.dynamic("B")
    i32, i64, f32, bf16 = "int32", "int64", "float32", "bfloat16"
    source = PLAN_SOURCE % dict(slots=PLAN_SLOTS, A=PLAN_A, B=PLAN_B, LIVE=PLAN_LIVE, DO=PLAN_DO, MV=PLAN_MV, DS=PLAN_DS,
                                BOUND=PLAN_BOUND, fp32_max=F.FP32_MAX_EXPONENT, sum_bits=F.PARTIAL_SUM_BITS)
    if stage == "terms":
        @T.prim_func
        def plan_terms(PeakQ: T.Tensor((R, HQ), i32), PeakDO: T.Tensor((R, HQ), i32), Delta: T.Tensor((R, HQ), f32),
                       LiveRow: T.Tensor((R,), i32), MV: T.Tensor((NKV,), bf16), Referenced: T.Tensor((NKV,), i32),
                       PlanPeaks: T.Tensor((B, PLAN_SLOTS), i64), S: T.int32, H: T.int32, S_kv: T.int32, c_a: T.float64,
                       scale: T.float64):
            with T.Kernel(T.ceildiv(T.max(S * H, S_kv), threads), B, threads=threads) as (bx, b):
                T.import_source(source)
                T.call_extern("handle", "mqa_plan_terms", PeakQ.data, PeakDO.data, Delta.data, LiveRow.data, MV.data,
                              Referenced.data, PlanPeaks.data, S, H, S_kv, HQ, c_a, scale, b)

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
                        RowScale: T.Tensor((NKV,), f32), S_kv: T.int32, d_v: T.int32, limit: T.float64, fp32_safe: T.float64):
            with T.Kernel(T.ceildiv(S_kv, threads), B, threads=threads) as (bx, b):
                T.import_source(source)
                T.call_extern("handle", "mqa_plan_scales", MV.data, Referenced.data, PlanPeaks.data, RowScale.data, S_kv, d_v,
                              limit, fp32_safe, b)

        return plan_scales
    raise ValueError(f"stage: {stage!r} (terms, peaks or scales)")


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

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def compile_program(program, target=None):
    tilelang, _ = _tl()
    return tilelang.compile(program, target=target or SM90A, pass_configs=_pass_configs(tilelang))


@functools.lru_cache(maxsize=None)
def compiled(kind: str, *key):
    builders = {
        "delta": delta_program,
        "delta_max": lambda d_k, d_v: delta_program(d_v, d_k=d_k),
        "main_bwd": lambda h, dk, dv, mode, cluster=1: main_bwd_program(h, dk, dv, mode=mode, cluster=cluster),
        "shard_fold": shard_fold_program,
        "dkv_reduce": dkv_reduce_program,
        "dsink_reduce": dsink_reduce_program,
        "mark_slots": mark_slots_program,
        "cast_bf16": cast_bf16_program,
        "fixed_to_bf16": fixed_to_bf16_program,
        "plan": plan_program,
    }
    return compile_program(builders[kind](*key))


def gpu_configs(widths=GPU_WIDTHS, group_widths=(16, 32)):
    """Every kernel configuration the wrapper can launch for these widths."""
    yield ("dsink_reduce",)
    for stage in ("terms", "peaks", "scales"):
        yield ("plan", stage)
    yield ("mark_slots",)
    for d_k, d_v in widths:
        yield ("delta", d_v)
        yield ("delta_max", d_k, d_v)
        yield ("dkv_reduce", d_k)
        yield ("shard_fold", d_k)
        yield ("cast_bf16", d_k)
        yield ("fixed_to_bf16", d_k)
        for heads in group_widths:
            for mode in MAIN_MODES:
                yield ("main_bwd", heads, d_k, d_v, mode)
            for mode, largest in MODE_MAX_CLUSTER.items():
                for cluster in (c for c in CLUSTER_SIZES[1:] if c <= largest):
                    yield ("main_bwd", heads, d_k, d_v, mode, cluster)
        for mode in WIDE_MODES:
            yield ("main_bwd", WIDE_HEADS, d_k, d_v, mode)


def _nvcc(config, output: str, code: str, extra=()):
    """Compile a configuration's CUDA source with the machine's nvcc (no GPU needed):
    (the output file's text, nvcc's stderr)."""
    return _nvcc_source(compiled(*config).get_kernel_source(), output, code, extra)


def cuda_tool(name: str) -> str | None:
    """A CUDA toolkit executable: CUDA_HOME's (default /usr/local/cuda) bin, else the one on
    PATH; None where there is neither. Every tool is looked up this way (nvcc_path,
    bench.compute_sanitizer), so they come from one toolkit where both are set."""
    import os
    import shutil

    tool = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)
    return tool if os.path.exists(tool) else shutil.which(name)


def nvcc_path() -> str | None:
    """The nvcc that builds for sm_90a here (cuda_tool); None where there is none (tests that
    compile then skip)."""
    return cuda_tool("nvcc")


def require_nvcc() -> str:
    """nvcc_path for a compile that cannot skip: RuntimeError where there is no nvcc."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    return nvcc


def _nvcc_source(source: str, output: str, code: str, extra=()):
    import os
    import subprocess
    import tempfile

    from tilelang import env

    nvcc = require_nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.out")
        with open(cu, "w") as f:
            f.write(source)
        done = subprocess.run(
            [nvcc, output, "-std=c++17", f"-gencode=arch=compute_90a,code={code}", "-DENABLE_BF16",
             "-I" + env.TILELANG_TEMPLATE_PATH, "-I" + env.CUTLASS_INCLUDE_DIR, "-w", *extra, cu, "-o", out],
            check=True, capture_output=True, text=True,
        )
        with open(out, errors="replace") as f:
            return f.read(), done.stderr


def ptx_of(config) -> str:
    """PTX of a compiled configuration.

    PTX shows every atomic the kernel can issue (atom.*, red.*), whether it came
    from the kernel body or from a library template it includes.
    """
    return _nvcc(config, "-ptx", "compute_90a")[0]


def ptxas_info(config) -> dict:
    """ptxas's resource report for sm_90a: registers, spill_stores, spill_loads (bytes), stack (bytes)."""
    return ptxas_info_of_source(compiled(*config).get_kernel_source(), config)


def ptxas_info_of_source(source: str, name="kernel") -> dict:
    """ptxas_info of generated CUDA source (any TileLang program, not only the configurations here)."""
    import re

    report = _nvcc_source(source, "-cubin", "sm_90a", ("-Xptxas", "-v"))[1]
    numbers = {
        "registers": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack": r"(\d+) bytes stack frame",
    }
    found = {key: re.findall(pattern, report) for key, pattern in numbers.items()}
    if not all(found.values()):
        raise RuntimeError(f"unexpected ptxas report for {name}:\n{report}")
    return {key: max(int(v) for v in values) for key, values in found.items()}


def dynamic_shared_bytes(kernel, name: str = "main_bwd"):
    """The dynamic shared memory a compiled kernel's host code launches ``name``_kernel
    with (the last integer it packs before looking the kernel up), or None if not found."""
    import re

    host = kernel.get_host_source()
    lookup = host.find(f"if ({name}_kernel_packed == NULL)")
    found = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);", host[:lookup]) if lookup >= 0 else []
    return int(found[-1]) if found else None


def _compile_source(config):
    return config, compiled(*config).get_kernel_source()


def precompile(configs, workers: int = 1):
    """Compile configurations in parallel processes; TileLang's disk cache keeps them.

    Returns {config: CUDA source}.
    """
    configs = list(configs)
    if workers <= 1:
        return dict(map(_compile_source, configs))
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return dict(pool.map(_compile_source, configs))


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Compile every kernel configuration for sm_90a (fills the cache).")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    start = time.time()
    sources = precompile(gpu_configs(), args.workers)
    print(f"compiled {len(sources)} kernels in {time.time() - start:.1f} s")
