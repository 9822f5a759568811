"""CUDA device functions the main backward imports as source (T.import_source)."""

# The main kernel's KV gather: cp.async of 16 bytes; src-size 0 (an invalid
# slot) reads nothing and zero-fills. The 4-byte copy (a slot's row scale, in
# the gather's group) goes through L1 (.cg takes 16 bytes only) and states its
# source size, as every copy of the kernel states what it reads.
GATHER_SOURCE = r"""
__device__ __forceinline__ void mqa_cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void mqa_cp_async4(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, 4;" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void mqa_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void mqa_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// base[i] = v for a shared int32 array. Through a call, TileLang's barrier
// planner does not see the store: it would fence it from every later
// shared-memory read (it cannot tell the merged buffers apart at a
// thread-dependent index); the kernel orders it with its own barriers.
__device__ __forceinline__ void mqa_st_shared_i32(void* base, int i, int v) { static_cast<int*>(base)[i] = v; }
"""

# A row's count of slot blocks up to its last valid slot (0 <= slot < nkv), the wide tile's blocks a
# row: each thread's last valid slot of its stride (valid slots sort first, but a caller's order
# may interleave them), then the warp's maximum by shuffles. The row_blocks launch forms every
# row's before the main one; the wide tile's warpgroup 1 counts its row's again at each row's
# change, by the same rule, and the two counts must agree (a block one warpgroup walks and the
# other skips leaves a handoff unmatched).
ROW_BLOCKS_SOURCE = r"""
__device__ __forceinline__ unsigned mqa_warp_row_blocks(const int* slots, int lp, int nkv, int block, int t, int stride) {
  unsigned live = 0;
  for (int j = t; j < lp; j += stride)
    if (static_cast<unsigned>(slots[j]) < static_cast<unsigned>(nkv)) live = j / block + 1;
  #pragma unroll
  for (int o = 16; o; o >>= 1) live = max(live, __shfl_xor_sync(0xffffffffu, live, o));
  return live;
}
"""

# P of a score with no branch, for every main kernel: exp2 of x, or 0 for an invalid slot.
# ex2.approx.ftz is the MUFU.EX2 that exp2f issues, without exp2f's rescaling of arguments below
# -126 (a compare and two predicated multiplies a score, which the slot's validity predicated
# too): those results, below 2^-126, flush to 0. One function, so that every head tile forms the
# same P (pad heads inert compares the 32-head tile with the wide one bit for bit).
SOFTMAX_SOURCE = r"""
__device__ __forceinline__ float mqa_masked_exp2(float x, bool valid) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x));
  return valid ? e : 0.0f;
}
"""

# Max |x| of bf16 rows as bf16 bits, for the fixed-point plan (PeakDO in the Delta kernel, PeakQ in
# the slot marks). bf16 is sign and magnitude: |x| orders as its low 15 bits do, and every NaN's
# bits lie above inf's, so an integer max is exact and keeps a NaN. mqa_magnitudes: the two 16-bit
# maxima of 8 bf16 (a 16-byte load); mqa_warp_peak: a warp's maximum of those, in every lane.
MAGNITUDE_SOURCE = r"""
__device__ __forceinline__ unsigned mqa_magnitudes(uint4 x) {
  return __vmaxu2(__vmaxu2(x.x & 0x7fff7fffu, x.y & 0x7fff7fffu), __vmaxu2(x.z & 0x7fff7fffu, x.w & 0x7fff7fffu));
}
__device__ __forceinline__ unsigned mqa_warp_peak(unsigned m) {
  return __reduce_max_sync(0xffffffffu, max(m & 0xffffu, m >> 16));
}
"""

# The wide tile's warpgroups (kernels/wide.py) hand a slot block's buffers to
# each other on mbarriers. Through calls, TileLang's barrier planner sees
# neither these stores nor the mbarriers that order them (it would put a
# __syncthreads between the warpgroups' branches: a deadlock); volatile keeps
# the stores in order with those mbarriers. A handoff is arrivals on an
# mbarrier (release) and a wait on the block's phase (acquire), one phase a
# slot block. Not named barriers (bar.arrive / bar.sync, or barrier.cta):
# racecheck does not take an arrival as ordering the producer's stores before
# the consumer's loads, and reports such a handoff as a hazard
# (benchmarks/racecheck_handoff.py). The kernel ends without reusing the
# mbarriers' memory, so they are not invalidated.
HANDOFF_SOURCE = r"""
__device__ __forceinline__ void mqa_st_shared_f32(void* base, int i, float v) { static_cast<volatile float*>(base)[i] = v; }
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
