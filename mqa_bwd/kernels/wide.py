"""The 64-head tile: a warp-specialised main backward over 64-slot blocks, dKV added from registers.

Built from a wide ``MainConfig`` (two 32-head groups). The launch contract is main_bwd.py's (the
same tensors, a head range read in place), with Lp a multiple of WIDE_SLOTS and six more
arguments: Bound and Gate (the lanes design, below), the count of consecutive 64-head tiles from
head_base (MainConfig.tiles), the count of CTAs (launch.py: at most one an SM), Claims, a [1]
int32 counter the caller zeroes, and RowBlocks, each row's count of 64-slot blocks up to its last
valid slot (the row_blocks launch's). The kernel is persistent: each CTA takes (query row, 64-head
tile) items one after another, the next claimed from Claims when it frees (ws_claim_item).

Why this shape:
- Slot blocks of 64: every wgmma is m64n64 or wider, so each operand byte read from shared
  memory feeds twice the FLOPs of an m64n32 tile.
- No dKV staging in shared memory: a dKV chunk (64 slots x 64 columns) goes from its
  accumulator straight to the global adds. The staging's bytes are what let a 64-slot KV
  tile fit beside the 64-head Q and dO.
- The deterministic launches form a chunk transposed (columns x slots), so that the 8 lanes of
  a warp holding one slot hold 8 consecutive columns: an integer add instruction then covers 4
  kv rows x 64 contiguous bytes, where the slots-x-columns accumulator gives 8 rows x 32 bytes.
  That halves the L2's reduction requests with no exchange between lanes. The two chunks of a
  128-column block put a warp's words of a slot in one 128-byte line (config.lane_word_columns),
  so a pair of chunks added together (ws_add_pair_lanes: one shuffle of a word an add) covers
  2 kv rows x 128 bytes an instruction: half the requests again. A pair's adds need both its
  accumulators full, so warpgroup 1 forms a pair's GEMMs, then adds it (lane_pairs); warpgroup 0
  forms its first two chunks as a pair, the second in its scores' accumulator (wg0_pairs); at
  d_k = 576 it takes three chunks so that warpgroup 1's six all pair (config.default_wg0_chunks).
- The warpgroups have roles:
    warpgroup 0: gathers KV, forms S and dP, then P and dS (written to shared memory),
                 dQ[:, :dq_split] (dS from its registers, an RS wgmma issued before it waits
                 for warpgroup 1 to free P_s and dS_s), and the block's last wg0_chunks dKV
                 chunks with their adds;
    warpgroup 1: dQ[:, dq_split:] and the block's other dKV chunks, one at a time (the lanes: a
                 pair at a time, the first pair's GEMMs issued behind the dQ GEMMs, before it
                 waits for those), with their adds.
  Warpgroup 0 gathers block t + 1 and forms its scores while warpgroup 1 still forms and
  adds block t's dKV (which reads Q, dO, P and dS, never KV). One warp a scheduler issuing
  adds is latency-bound, so warpgroup 1's chunk chain set the pace while warpgroup 0 waited
  for it; its chunks in warpgroup 0 shorten that chain (docs/performance-log.md).
- One KV stage refilled in two parts: columns [0, dq_split), which only warpgroup 0's dQ GEMM
  reads, right after that GEMM; the rest once warpgroup 1's dQ GEMMs have read them
  (KV_FREE). S and dP start on the first part while the second lands: warpgroup 0's serial
  gather is otherwise the kernel's critical path. A row's first block is gathered whole, by
  warpgroup 0 before it loads the row's Q and dO, so that it lands during the row's prologue.
- Persistent CTAs whose warpgroups each run their own row: warpgroup 0 starts the next row
  (its block count, block 0's gather, Q and dO by cp.async) while warpgroup 1 still forms and
  adds the last block of the row before, so a row's fill and drain overlap where a CTA a row
  ran them one after the other. One thread prefetches the next row's Q and dO into L2 during a
  row's last block: the next row's loads wait for warpgroup 1's last GEMMs of the row, and from
  HBM they would sit on the row's critical path.

How a CTA adds dKV (config.accumulate):
  "lanes"   (deterministic) two columns a 64-bit word of two signed 32-bit lanes, lo + 2^32 hi
            (columns q and q + 8 of each 16: config.LANE_GROUP), added mod 2^64 with
            red.global.add.u64 into DKV [NKV, Dk / 2]: a lane's sum is exact whatever the
            order as long as its final value fits 32 bits, however its partial sums wrapped.
            RowScale is the plan's scale lowered, as for every deterministic launch
            (fixed_point.lanes_scale); Bound[kv row] gains, per (slot, block), a ceiling of
            the largest |scaled value| among that slot's contributions (from its upper 16 bits:
            ws_add_bounds), so Bound < 2^31 proves every lane of the row decodes exactly. The
            host (wrapper.run) reruns the launch in "fixed" where a bound failed. A slot holds
            its row's offset in the words, so an add's address is a shift-add; every slot of a
            block adds, with no branch: an invalid one adds 0 to a valid row (ws_lanes_store_slot).
            A word is rounded by FFMA (ws_magic_word), exact while every |scaled value| is below
            2^22: a query row with a larger one (or a NaN) gets bit 1 of Flag[row] and sets
            Gate[0] (ws_add_bounds, ws_flag_magic), and a second launch of the same tile with
            config.corrections, given that Gate, runs only those rows (every CTA ends at once
            where Gate[0] is 0), adding each word's exact value less the FFMA one (mod 2^64, so
            the sums are the exact words'). Neither launch has a branch on the value in its adds.
  "fixed"   int64 fixed point at the same scale, one word a column (the lanes design's redo):
            every CTA ends at once unless Gate[0] != 0, so the redo launches on every call
            without a host sync.
  "atomic"  fp32 red.global.add.v4.f32 (the control).

Each warpgroup walks a row's blocks up to the last one with a valid slot (ws_row_blocks): the
wrapper sorts a row's valid slots first, so a causal prefix row skips its empty tail.

Handoffs are mbarriers, one phase a block (named barriers are racecheck's blind spot):
PDS_READY (warpgroup 0's 128 threads arrive: P, dS, the block's slots and scales are in
shared memory), KV_FREE and PDS_FREE (warpgroup 1's 128 arrive: its last read of KV_s, of
P_s, dS_s, Q_s and dO_s), and for the lanes PEAKS_READY (warpgroup 0's 128: its chunks' slot maxima are
in; warpgroup 1 waits for it before PDS_FREE). Slots and scales (one {kv row, scale} pair a
slot, the lanes' {row offset, scale}, so that an add reads two slots' in one 16-byte load) are
double-buffered by block parity: warpgroup 1 still adds block t while warpgroup 0 lays out block t + 1.
Blocks are counted across a CTA's rows, so the phases and the parities run on from row to row; a
row's start waits for the block before's KV_FREE (block 0's gather) and PDS_FREE (Q and dO).
"""

import struct

from .config import (FLAG_MAGIC, FLAG_MASS, LANE_BLOCK, LOG2E, MAGIC_RANGE, WIDE_CHUNK, WIDE_DQ_PIECE, WIDE_SLOTS, MainConfig,
                     _tl, lane_chunk_words, require_wide_widths)
from .device_functions import GATHER_SOURCE, HANDOFF_SOURCE, ROW_BLOCKS_SOURCE, SOFTMAX_SOURCE

#: Heads of the tile.
HEADS = 64
CHUNK = WIDE_CHUNK
WARPGROUP = 128
PDS_READY, KV_FREE, PDS_FREE, PEAKS_READY = 0, 1, 2, 3
#: The row handoffs: warpgroup 0 claims the CTA's next item and posts it (ROW_READY, one arrival);
#: warpgroup 1's 128 threads arrive on ROW_FREE once each has read it. After the four block
#: handoffs and the eight words of the rows' block counts; the posted items, one int32 a parity,
#: at ITEM_WORDS in the bars' int32 words.
ROW_READY, ROW_FREE = 12, 13
ITEM_WORDS = 2 * 14
#: Named barriers of one warpgroup (128 threads): warpgroup 0's after each KV gather, warpgroup 1's
#: around the lanes' bounds.
GATHER_BARRIER, BOUNDS_BARRIER = 1, 2
#: The lanes' block maxima in shared memory: warpgroup 1's, 64 slots a warp, two a 32-bit word;
#: then warpgroup 0's, one word a slot by block parity (it stages block t + 1's while warpgroup 1
#: may still read block t's).
PEAK_WORDS = WARPGROUP // 32 * WIDE_SLOTS // 2
WG0_PEAK_WORDS = 2 * WIDE_SLOTS
#: What a kv row's Bound grows by at most for one contribution: anything larger (or NaN) fails.
BOUND_CAP = 2**40

# The row flags' bits, and the upper 16 bits of MAGIC_RANGE's float32 bits: a slot's peak half at or
# above them (WS_MAGIC_PEAK) holds a value at or past the FFMA rounding's range, or a NaN.
WS_CONSTANTS = (f"#define WS_FLAG_MASS {FLAG_MASS}\n#define WS_FLAG_MAGIC {FLAG_MAGIC}\n"
                f"#define WS_MAGIC_PEAK {struct.unpack('<I', struct.pack('<f', MAGIC_RANGE))[0] >> 16:#x}u\n")

WS_ROWS = f"#define WS_ROW_READY {ROW_READY}\n#define WS_ROW_FREE {ROW_FREE}\n#define WS_ITEM_WORDS {ITEM_WORDS}\n"

WS_SOURCE = WS_CONSTANTS + WS_ROWS + r"""
__device__ __forceinline__ void ws_bar_sync_wg(int id) { asm volatile("bar.sync %0, 128;" :: "r"(id) : "memory"); }
// cp.async and generic stores to shared memory become visible to wgmma (the async proxy).
__device__ __forceinline__ void ws_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The lanes design's int64 redo and its corrections launch run on every call and end here unless
// a row's bound failed (the redo) or a lanes launch flagged a row (the corrections: ws_flag_magic).
__device__ __forceinline__ void ws_exit_unless(const int* gate) { if (*gate == 0) asm volatile("exit;"); }
// Every cp.async group of this thread but the newest has landed.
__device__ __forceinline__ void ws_cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void ws_bars_init(void* bars) {
  mqa_handoff_init(bars, 128, 128);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_handoff_bar(bars, 2)), "r"(128) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_handoff_bar(bars, 3)), "r"(128) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_handoff_bar(bars, WS_ROW_READY)), "r"(1) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(mqa_handoff_bar(bars, WS_ROW_FREE)), "r"(128) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// An add's address is row_base + kv * row_bytes, one mad.wide. Where ok is false the add is
// skipped, and kv is never an address: ptxas puts a branch around each predicated red (three
// instructions an add), which the lanes avoid (ws_red_u64_at).
__device__ __forceinline__ void ws_red_u64_if(const void* row_base, int kv, unsigned row_bytes, unsigned long long v,
                                              bool ok) {
  asm volatile("{\n .reg .pred q;\n .reg .b64 a;\n setp.ne.u32 q, %3, 0;\n mad.wide.u32 a, %1, %2, %0;\n"
               " @q red.global.add.u64 [a], %4;\n}"
               :: "l"(row_base), "r"(kv), "r"(row_bytes), "r"(static_cast<unsigned>(ok)), "l"(v) : "memory");
}
// The lanes' add at base + 16 unit: a shift-add and its carry (LEA, LEA.HI.X), where a row index
// times the row's bytes took a multiply and a 64-bit add.
__device__ __forceinline__ void ws_red_u64_at(const void* base, unsigned unit, unsigned long long v) {
  asm volatile("{\n .reg .b64 a, o;\n cvt.u64.u32 o, %1;\n shl.b64 o, o, 4;\n add.s64 a, %0, o;\n"
               " red.global.add.u64 [a], %2;\n}" :: "l"(base), "r"(unit), "l"(v) : "memory");
}
// The lanes' slot i, as a pair {its row's offset in the words, in 16-byte units (row_units a row);
// its row scale's bits}. An invalid slot (index outside [0, nkv)) gets the valid row spread % nkv
// and the scale -0.0 (WS_LANES_INVALID), which no row has (a row scale is +0 or above, or NaN): the scale
// marks it invalid for every reader, and the lanes add its words, which are 0, to that row
// unconditionally (cvt.rni of -0.0, or of a NaN from 0 * inf, is 0: SASS F2I.NTZ). Spreading the
// rows keeps those adds of 0 off one address.
#define WS_LANES_INVALID (-2147483647 - 1)
__device__ __forceinline__ bool ws_lanes_valid(int scale_bits) { return scale_bits != WS_LANES_INVALID; }
// A valid slot's scale comes by cp.async (4 bytes), in the group of the block's gather: a load
// here would be a second round trip after the slot's index, behind the SM's reductions
// (benchmarks/load_under_reds.py), on warpgroup 0's path to its gather barrier. Every reader of
// the scale (the masked exp2, warpgroup 1's adds and bounds) comes after that group's wait.
__device__ __forceinline__ void ws_lanes_store_slot(void* info, int i, int row, int nkv, int spread, unsigned row_units,
                                                    const float* row_scale) {
  const bool ok = static_cast<unsigned>(row) < static_cast<unsigned>(nkv);
  volatile int* slot = static_cast<volatile int*>(info) + 2 * i;
  slot[0] = static_cast<int>(static_cast<unsigned>(ok ? row : spread % nkv) * row_units);
  if (ok) {
    mqa_cp_async4(const_cast<int*>(slot + 1), row_scale + row);
  } else {
    slot[1] = WS_LANES_INVALID;
  }
}
// A warpgroup's count of its row's blocks up to the last with a valid slot (the blocks after it add
// nothing, and the wrapper sorts a row's valid slots first, so a causal prefix row skips its empty
// tail). No CTA barrier: the persistent CTA's warpgroups run different rows at a time. Each
// thread's last valid slot of its stride, a warp's maximum by shuffles, the four warps' through
// words of the row's parity (a row's reads and the row after next's writes have a barrier between).
__device__ __forceinline__ int ws_row_blocks(const int* indices, int row, int lp, int nkv, void* info, int words_at, int t,
                                             int block_slots, int parity, int bar) {
  const unsigned live = mqa_warp_row_blocks(indices + static_cast<long>(row) * lp, lp, nkv, block_slots, t, 128);
  void* words = static_cast<int*>(info) + words_at;
  volatile unsigned* w = static_cast<volatile unsigned*>(words) + 4 * parity;
  if ((t & 31) == 0) w[t >> 5] = live;
  ws_bar_sync_wg(bar);
  return static_cast<int>(max(max(w[0], w[1]), max(w[2], w[3])));
}
// Warpgroup 0's count of its next row's blocks (RowBlocks, the row_blocks launch's): its thread 0
// fetches it by cp.async at the claim, into the warpgroup's word of the next row's parity, waited
// for with the block's gather (or at once where no block follows the claim), and the warpgroup
// reads it after its row-end barrier. A count loaded at the row's change would wait behind the
// SM's reductions of the row's last block, on warpgroup 0's path to the next row's first P and dS.
__device__ __forceinline__ void ws_fetch_row_blocks(void* bars, int words_at, int parity, const int* row_blocks, int row) {
  mqa_cp_async4(static_cast<int*>(bars) + words_at + 4 * parity, row_blocks + row);
}
__device__ __forceinline__ int ws_fetched_row_blocks(void* bars, int words_at, int parity) {
  return static_cast<volatile int*>(bars)[words_at + 4 * parity];
}
// A CTA's first row's count, loaded (no claim came before it).
__device__ __forceinline__ int ws_load_row_blocks(const int* row_blocks, int row) {
  int n;
  asm volatile("ld.global.u32 %0, [%1];" : "=r"(n) : "l"(row_blocks + row) : "memory");
  return n;
}
// Warpgroup 0's thread 0 claims the CTA's item after its k-th (a CTA's first is its own index: the
// first wave claims nothing) and posts it at parity (k + 1) % 2, once warpgroup 1 has read item k
// (ROW_FREE's phase k): so ROW_READY completes no phase that warpgroup 1 has not yet waited for,
// and the word it writes was read. Items go to whichever CTA is free first; no output depends on
// which CTA takes an item (a row's dQ is one CTA's, in block order; the dKV and Bound adds are
// integers).
__device__ __forceinline__ int ws_claim_item(void* bars, const int* claims, int k, int ctas) {
  mqa_handoff_wait(bars, WS_ROW_FREE, k & 1);
  const int item = ctas + atomicAdd(const_cast<int*>(claims), 1);
  static_cast<volatile int*>(bars)[WS_ITEM_WORDS + ((k + 1) & 1)] = item;
  mqa_handoff_arrive(bars, WS_ROW_READY);
  return item;
}
// The CTA's k-th item, as warpgroup 0 posted it; warpgroup 1 frees its word once read.
__device__ __forceinline__ int ws_posted_item(void* bars, int k) {
  return static_cast<volatile int*>(bars)[WS_ITEM_WORDS + (k & 1)];
}
__device__ __forceinline__ int ws_take_item(void* bars, int k) {
  mqa_handoff_wait(bars, WS_ROW_READY, k & 1);
  const int item = ws_posted_item(bars, k);
  mqa_handoff_arrive(bars, WS_ROW_FREE);
  return item;
}
__device__ __forceinline__ void ws_post_first_item(void* bars, int item) {
  static_cast<volatile int*>(bars)[WS_ITEM_WORDS] = item;
  mqa_handoff_arrive(bars, WS_ROW_READY);
}
// The persistent tile's next row of Q or dO into L2 while this row's last block runs: its loads at the
// row's start then come from L2, not HBM (one bulk prefetch of a contiguous range, by one thread).
__device__ __forceinline__ void ws_prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
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

// The caller's index in its warpgroup (tid.x mod 128), read from %tid.x by an opaque move at each
// call, not passed in: what the adds derive from it (their column's address) is then formed at
// each call, neither hoisted out of the slot loop as one 64-bit register a chunk nor kept live
// across the block loop, where ptxas spilled it and values formed from it once a block (at
// Dk = 576 this leaves no spill store in warpgroup 1's block loop; the bytes: SPILL_BUDGET in
// tests/test_kernels_compile.py).
__device__ __forceinline__ int ws_thread_again() {
  int r;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r));
  return r & 127;
}
// The slots of a block sit in shared memory as pairs {kv row (the lanes: its offset in the words),
// row scale's bits}: slots 2i, 2i + 1 are one 16-byte load.
__device__ __forceinline__ int4 ws_slot_pair(const void* info, int slot) {
  return static_cast<const int4*>(info)[slot / 2];
}
// The control adds a 64 x 64 dKV chunk (slots x columns) from a warpgroup's wgmma accumulator.
// Thread t of the warpgroup holds, in acc[2i] and acc[2i + 1], row 16 (t / 32) + 8 (i % 2) +
// (t % 32) / 4 and columns 8 (i / 2) + 2 (t % 4) + {0, 1} (TileLang's m64n64 C layout). dkv
// comes const: TileLang sees no store to it through these calls.
// red.v4.f32, four columns a lane, as cuDNN adds. Of each 16-column group a lane holds pairs A
// (8-column block 2m) and B (block 2m + 1); partners k and k ^ 1 swap one pair, so even k adds
// A_k A_k+1 (columns 16m + 2k .. + 3) and odd k adds B_k-1 B_k (columns 16m + 6 + 2k .. + 3): a
// quad covers 64 bytes a row.
__device__ __forceinline__ void ws_add_chunk_atomic(const float* acc, const void* dkv, const void* slot_info, int col0,
                                                    int ld, int nkv, int t) {
  const int lane = t & 31, warp = t >> 5, k = lane & 3;
  const bool odd = k & 1;
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + 8 * half + (lane >> 2);
    const int kv = static_cast<const int*>(slot_info)[2 * row];
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

// The deterministic launches add a transposed chunk, 64 columns x 64 slots: thread t holds, in
// acc[2i + e], column col0 + 16 (t / 32) + 8 (i % 2) + (t % 32) / 4 of slot 8 (i / 2) + 2 (t % 4)
// + e. So the 8 lanes of a warp that share t % 4 hold 8 consecutive columns of the same slots,
// and one add instruction covers 4 kv rows x 64 contiguous bytes: half the L2 requests of the
// slots-by-columns chunk, whose instruction covers 8 rows x 32 bytes, with no exchange.

// The int64 redo: one word a column, at the lanes' scale (the same integers).
__device__ __forceinline__ void ws_add_chunk_fixed(const float* acc, const void* dkv, const void* slot_info, int col0,
                                                   int ld, int nkv) {
  const int t = ws_thread_again(), lane = t & 31, warp = t >> 5, k = lane & 3;
  const unsigned long long* base = static_cast<const unsigned long long*>(dkv) + col0 + 16 * warp + (lane >> 2);
  int4 next = ws_slot_pair(slot_info, 2 * k);
  #pragma unroll
  for (int n8 = 0; n8 < 8; ++n8) {
    const int4 pair = next;
    if (n8 < 7) next = ws_slot_pair(slot_info, 8 * (n8 + 1) + 2 * k);  // a pair ahead: its latency under this one
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int kv = e ? pair.z : pair.x;
      const float scale = __int_as_float(e ? pair.w : pair.y);
      const bool ok = static_cast<unsigned>(kv) < static_cast<unsigned>(nkv);
      ws_red_u64_if(base, kv, 8 * ld, static_cast<unsigned long long>(__float2ll_rn(acc[2 * (2 * n8) + e] * scale)), ok);
      ws_red_u64_if(base + 8, kv, 8 * ld, static_cast<unsigned long long>(__float2ll_rn(acc[2 * (2 * n8 + 1) + e] * scale)), ok);
    }
    __syncwarp();  // keeps ptxas from hoisting every pair's slot load to the top of the chunk (spills)
  }
}
// The word lo + 2^32 hi mod 2^64 with lo sign-extended, built as its two halves {lo, hi + (lo >> 31)}:
// one add, where ptxas forms the 64-bit sum lo + 2^32 hi with an add and an add with carry.
__device__ __forceinline__ unsigned long long ws_lane_word(int lo, int hi) {
  unsigned long long word;
  asm("mov.b64 %0, {%1, %2};" : "=l"(word) : "r"(lo), "r"(static_cast<unsigned>(hi) + static_cast<unsigned>(lo >> 31)));
  return word;
}
// The same word from fma(x, s, 1.5 x 2^23), whose bits are 0x4b400000 + rint(x s) wherever |x s| <= 2^22
// (the binade [2^23, 2^24) has a unit step, and the fused product is rounded once, half to even, as
// cvt.rni rounds the product, s being a power of two): the two results' bits less 0x4b400000 each,
// one 64-bit subtract. No F2I (a quarter-rate pipe) and no word forming. An invalid slot's scale
// -0.0 gives 0 here too. Past 2^22 (or for a NaN) the word is not the exact one: the corrections.
#define WS_MAGIC 12582912.0f
__device__ __forceinline__ unsigned long long ws_magic_word(float lo, float hi, float scale) {
  unsigned long long word;
  asm("mov.b64 %0, {%1, %2};" : "=l"(word) : "r"(__float_as_uint(__fmaf_rn(lo, scale, WS_MAGIC))),
      "r"(__float_as_uint(__fmaf_rn(hi, scale, WS_MAGIC))));
  return word - 0x4b4000004b400000ull;
}
// The word a lanes launch adds (FFMA), or what its corrections launch adds: the exact word less
// that one (0 wherever |x s| <= 2^22).
template <bool correct>
__device__ __forceinline__ unsigned long long ws_lanes_word(float lo, float hi, float scale) {
  return correct ? ws_lane_word(__float2int_rn(lo * scale), __float2int_rn(hi * scale)) - ws_magic_word(lo, hi, scale)
                 : ws_magic_word(lo, hi, scale);
}
// The lanes: a lane's two columns c and c + 8 of one slot go as one word lo + 2^32 hi (a warp's 8 words
// of the chunk start at word0 + warp_words warp: config.lane_chunk_words), each rounded half to
// even (ws_lanes_word: by FFMA in the lanes launch, the exact word's difference from that in its
// corrections launch). peak[n8] keeps, for this thread's slots
// 8 n8 + 2 (t % 4) + {0, 1}, the upper 16 bits of the largest |value|'s float bits (unscaled) over the
// block's chunks (two slots a register; an inf or NaN gives 0x7f80 or more, never 0x8000: a NaN
// from max.NaN is 0x7fffffff); ws_add_bounds takes the maximum over both warpgroups' warps.
template <bool correct>
__device__ __forceinline__ void ws_add_chunk_lanes(const float* acc, const void* words, const void* slot_info, int word0,
                                                   int warp_words, unsigned* peak) {
  const int t = ws_thread_again(), lane = t & 31, warp = t >> 5, k = lane & 3;
  const unsigned long long* base = static_cast<const unsigned long long*>(words) + word0 + warp_words * warp + (lane >> 2);
  int4 next = ws_slot_pair(slot_info, 2 * k);
  #pragma unroll
  for (int n8 = 0; n8 < 8; ++n8) {
    const int4 pair = next;
    if (n8 < 7) next = ws_slot_pair(slot_info, 8 * (n8 + 1) + 2 * k);  // a pair ahead: its latency under this one
    const float s0 = __int_as_float(pair.y), s1 = __int_as_float(pair.w);
    const float a00 = acc[4 * n8], a01 = acc[4 * n8 + 2];      // slot e = 0: columns c, c + 8
    const float a10 = acc[4 * n8 + 1], a11 = acc[4 * n8 + 3];  // slot e = 1
    // The peaks are of |x|, unscaled: ws_add_bounds scales a slot's once a block (its scale is a
    // power of two, so the upper 16 bits scale exactly but for results below 2^-126).
    const unsigned m0 = __float_as_uint(ws_max_nan(fabsf(a00), fabsf(a01)));
    const unsigned m1 = __float_as_uint(ws_max_nan(fabsf(a10), fabsf(a11)));
    peak[n8] = __vmaxu2(peak[n8], __byte_perm(m0, m1, 0x7632));
    // A peak's halves are at most 0x7fff, so `stale` is 0: it makes this pair's first add wait for
    // the peak, where ptxas would sink the peak to the block's end and keep (spill) the scaled
    // values. Not the next pair's load: that load would then wait for this pair's whole peak chain.
    const unsigned stale = peak[n8] >> 31;
    // lo sign-extended: the words' sum is sum(lo) + 2^32 sum(hi) mod 2^64 (fixed_point.decode_lane_words).
    // Every slot adds (ws_lanes_store_slot): an invalid one 0, to a valid row.
    ws_red_u64_at(base, static_cast<unsigned>(pair.x) | stale, ws_lanes_word<correct>(a00, a01, s0));
    ws_red_u64_at(base, static_cast<unsigned>(pair.z), ws_lanes_word<correct>(a10, a11, s1));
    __syncwarp();  // keeps ptxas from hoisting every pair's slot load to the top of the chunk (spills)
  }
}
// The lanes of a chunk pair (2 P, 2 P + 1) of one config.LANE_BLOCK, a line at a time: a warp's 16
// words of a slot in the two chunks are adjacent (word0 + 16 warp: chunk 2 P's 8, then 2 P + 1's),
// so partners k and k ^ 1, which hold slots 2 k, 2 k + 1 and 2 (k ^ 1), 2 (k ^ 1) + 1 of each 8,
// swap one chunk's words: even k keeps chunk A's words of the four slots, odd k chunk B's, and an
// add instruction covers 2 kv rows x 128 bytes where ws_add_chunk_lanes' covers 4 x 64: half the
// L2's requests, for one shuffle of a word an add. Rounding, peaks (over both chunks) and slots as
// in ws_add_chunk_lanes.
template <bool correct>
__device__ __forceinline__ void ws_add_pair_lanes(const float* acc_a, const float* acc_b, const void* words,
                                                  const void* slot_info, int word0, unsigned* peak) {
  const int t = ws_thread_again(), lane = t & 31, warp = t >> 5, k0 = lane & 2;
  const bool odd = lane & 1;
  const unsigned long long* base =
      static_cast<const unsigned long long*>(words) + word0 + 16 * warp + 8 * static_cast<int>(odd) + (lane >> 2);
  int4 next_lo = ws_slot_pair(slot_info, 2 * k0), next_hi = ws_slot_pair(slot_info, 2 * k0 + 2);
  #pragma unroll
  for (int n8 = 0; n8 < 8; ++n8) {
    const int4 lo = next_lo, hi = next_hi;  // slots 8 n8 + 2 k0 + {0, 1}, then + {2, 3}
    if (n8 < 7) {  // a pair ahead: its latency under this one
      next_lo = ws_slot_pair(slot_info, 8 * (n8 + 1) + 2 * k0);
      next_hi = ws_slot_pair(slot_info, 8 * (n8 + 1) + 2 * k0 + 2);
    }
    const int4 own = odd ? hi : lo;         // this thread's: 8 n8 + 2 k + {0, 1}
    const float s0 = __int_as_float(own.y), s1 = __int_as_float(own.w);
    const float a00 = acc_a[4 * n8], a01 = acc_a[4 * n8 + 2];  // slot e = 0: columns c, c + 8
    const float a10 = acc_a[4 * n8 + 1], a11 = acc_a[4 * n8 + 3];
    const float b00 = acc_b[4 * n8], b01 = acc_b[4 * n8 + 2];
    const float b10 = acc_b[4 * n8 + 1], b11 = acc_b[4 * n8 + 3];
    const unsigned m0 = __float_as_uint(ws_max_nan(ws_max_nan(fabsf(a00), fabsf(a01)), ws_max_nan(fabsf(b00), fabsf(b01))));
    const unsigned m1 = __float_as_uint(ws_max_nan(ws_max_nan(fabsf(a10), fabsf(a11)), ws_max_nan(fabsf(b10), fabsf(b11))));
    peak[n8] = __vmaxu2(peak[n8], __byte_perm(m0, m1, 0x7632));
    const unsigned stale = peak[n8] >> 31;  // 0, as in ws_add_chunk_lanes
    const unsigned long long a0 = ws_lanes_word<correct>(a00, a01, s0), a1 = ws_lanes_word<correct>(a10, a11, s1);
    const unsigned long long b0 = ws_lanes_word<correct>(b00, b01, s0), b1 = ws_lanes_word<correct>(b10, b11, s1);
    // Even k sends chunk B's words of its slots, odd k chunk A's.
    const unsigned long long r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
    const unsigned long long r1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
    ws_red_u64_at(base, static_cast<unsigned>(lo.x) | stale, odd ? r0 : a0);  // slot 8 n8 + 2 k0
    ws_red_u64_at(base, static_cast<unsigned>(lo.z), odd ? r1 : a1);          // + 1
    ws_red_u64_at(base, static_cast<unsigned>(hi.x), odd ? b0 : r0);          // + 2
    ws_red_u64_at(base, static_cast<unsigned>(hi.z), odd ? b1 : r1);          // + 3
    __syncwarp();
  }
}
// dQ's bf16 from a warpgroup's m64nN accumulator (N a multiple of 64) at dq (row 0, the piece's
// first column; ld elements a row), 16 bytes a store. Thread t holds row 16 (t / 32) + 8 h +
// (t % 32) / 4 and columns 8 j + 2 (t % 4) + {0, 1} of each 8-column tile j (acc[4 j + 2 h] and
// + 1): one 4-byte pair a tile, so a warp's store of them covers 8 rows x 16 bytes. The quad's
// four lanes swap their pairs of 4 tiles (a butterfly on lane bit 1, then on bit 0: 4 shuffles)
// so that lane k holds tile 4 g + k's 8 columns whole (a quad: 32 columns, 64 bytes, of its row).
// Quads 2 q and 2 q + 1 then swap one of two such groups (lane bit 2: 4 shuffles), so that a
// quad pair holds 64 columns of one row, and a warp's store covers 4 rows x 128 contiguous bytes:
// whole L2 lines, half the requests of 8 rows x 64 bytes. The same bits: cvt.rn.bf16x2.f32, the
// conversion of TileLang's copy (__float22bfloat162_rn). Rows at or past `rows` (heads past HQ)
// are not stored.
__device__ __forceinline__ uint4 ws_dq_group(const float* acc, int g, int h, bool lo, bool hi) {
  unsigned w[4];
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = 4 * (4 * g + j) + 2 * h;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[j]) : "f"(acc[i + 1]), "f"(acc[i]));  // acc[i] low
  }
  // Bit 1: keep tiles 2 hi + {0, 1} (a0, a1, this lane's), take them from lane k ^ 2 (b0, b1).
  const unsigned a0 = hi ? w[2] : w[0], a1 = hi ? w[3] : w[1];
  const unsigned b0 = __shfl_xor_sync(0xffffffffu, hi ? w[0] : w[2], 2);
  const unsigned b1 = __shfl_xor_sync(0xffffffffu, hi ? w[1] : w[3], 2);
  // Bit 0: keep tile 2 hi + lo, from lanes k (s0) and k ^ 2 (s2); take it from k ^ 1 and k ^ 3.
  const unsigned s0 = lo ? a1 : a0, s2 = lo ? b1 : b0;
  const unsigned r1 = __shfl_xor_sync(0xffffffffu, lo ? a0 : a1, 1);
  const unsigned r3 = __shfl_xor_sync(0xffffffffu, lo ? b0 : b1, 1);
  // Column pair s of the tile came from lane s: the word from lane k ^ d sits at s = k ^ d.
  const unsigned v0 = lo ? r1 : s0, v1 = lo ? s0 : r1, v2 = lo ? r3 : s2, v3 = lo ? s2 : r3;
  return hi ? make_uint4(v2, v3, v0, v1) : make_uint4(v0, v1, v2, v3);
}
template <int N>
__device__ __forceinline__ void ws_store_dq(const float* acc, void* dq, int ld, int rows, int thread) {
  static_assert(N % 64 == 0, "ws_store_dq: whole 128-byte lines need N a multiple of 64");
  const int lane = thread & 31, warp = thread >> 5;
  const bool lo = lane & 1, hi = lane & 2, odd = lane & 4;
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    // The quad pair's rows: the even quad's, then the odd's. The even quad stores the first 32
    // columns of a 64 (its group 2 m), the odd quad the next 32 (group 2 m + 1).
    const int row = 16 * warp + 8 * h + ((lane >> 2) & ~1);
    unsigned short* at = static_cast<unsigned short*>(dq) + static_cast<long long>(row) * ld;
    uint4* first = reinterpret_cast<uint4*>(at) + (lane & 3) + (odd ? 4 : 0);
    uint4* second = reinterpret_cast<uint4*>(at + ld) + (lane & 3) + (odd ? 4 : 0);
    #pragma unroll
    for (int m = 0; m < N / 64; ++m) {
      const uint4 own0 = ws_dq_group(acc, 2 * m, h, lo, hi), own1 = ws_dq_group(acc, 2 * m + 1, h, lo, hi);
      // The even quad keeps its row's group 2 m and sends group 2 m + 1; the odd quad keeps its
      // row's 2 m + 1 and sends 2 m: each then holds both rows' pieces of its 32 columns.
      const uint4 send = odd ? own0 : own1;
      uint4 got;
      got.x = __shfl_xor_sync(0xffffffffu, send.x, 4);
      got.y = __shfl_xor_sync(0xffffffffu, send.y, 4);
      got.z = __shfl_xor_sync(0xffffffffu, send.z, 4);
      got.w = __shfl_xor_sync(0xffffffffu, send.w, 4);
      const uint4 upper = odd ? got : own0, lower = odd ? own1 : got;  // rows row, row + 1
      if (row < rows) first[8 * m] = upper;
      if (row + 1 < rows) second[8 * m] = lower;
    }
  }
}
// The block's bounds. The 8 lanes of a warp that share t % 4 hold the same slots: a reduce-scatter
// over them (ws_peaks_scatter) leaves lane l the warp's maxima of peak word (l / 4) % 8, so every
// lane stores one word. ws_stage_peaks stores warpgroup 1's to its peak buffer (64 slots a warp,
// two a word as in peak), between two of its barriers (BOUNDS_BARRIER; the first keeps its stores
// from the previous block's loads). ws_merge_peaks takes warpgroup 0's into one word a slot with
// shared atomicMax (the block's words zero: ws_add_bounds clears them), before it arrives on
// PEAKS_READY.
// Three exchanges, of 4, 2 and 1 words (lane bits 4, 3, 2): 7 shuffles where a full reduction
// of each of the 8 words takes 24. A lane keeps the half its bit selects and sends the other.
__device__ __forceinline__ unsigned ws_peaks_scatter(const unsigned* peak, int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  unsigned v4[4], v2[2];
  #pragma unroll
  for (int i = 0; i < 4; ++i)  // words 4 b4 + i
    v4[i] = __vmaxu2(b4 ? peak[4 + i] : peak[i], __shfl_xor_sync(0xffffffffu, b4 ? peak[i] : peak[4 + i], 16));
  #pragma unroll
  for (int i = 0; i < 2; ++i)  // words 4 b4 + 2 b3 + i
    v2[i] = __vmaxu2(b3 ? v4[2 + i] : v4[i], __shfl_xor_sync(0xffffffffu, b3 ? v4[i] : v4[2 + i], 8));
  return __vmaxu2(b2 ? v2[1] : v2[0], __shfl_xor_sync(0xffffffffu, b2 ? v2[0] : v2[1], 4));  // word 4 b4 + 2 b3 + b2
}
// Lane l's word is that of slots 8 n8 + 2 k + {0, 1}, n8 = l / 4 and k = l % 4: word 4 n8 + k = l of
// the warp's 32.
__device__ __forceinline__ void ws_stage_peaks(unsigned* peak, void* peak_buf, int t) {
  const int lane = t & 31, warp = t >> 5;
  static_cast<unsigned*>(peak_buf)[32 * warp + lane] = ws_peaks_scatter(peak, lane);
  #pragma unroll
  for (int i = 0; i < 8; ++i) peak[i] = 0u;  // the next block's peaks start here
}
__device__ __forceinline__ void ws_merge_peaks(unsigned* peak, void* slot_peaks, int t) {
  const int lane = t & 31;
  unsigned* words = static_cast<unsigned*>(slot_peaks);  // one a slot: slots 2 l and 2 l + 1
  const unsigned m = ws_peaks_scatter(peak, lane);
  atomicMax(words + 2 * lane, m & 0xffffu);
  atomicMax(words + 2 * lane + 1, m >> 16);
  #pragma unroll
  for (int i = 0; i < 8; ++i) peak[i] = 0u;
}
// Flag[row] bits (WS_CONSTANTS): WS_FLAG_MASS where a head's softmax mass is over its allowance or NaN
// (every launch's check; the host poisons the batch element), WS_FLAG_MAGIC where a lanes launch's
// FFMA rounding may be inexact (its corrections launch runs the row). Set by atomicOr: one CTA a
// tile of the row sets each, and a plain store of one would drop the other's.
__device__ __forceinline__ void ws_flag_row(const int* flag, int row, int bit) {
  atomicOr(const_cast<int*>(flag) + row, bit);
}
__device__ __forceinline__ bool ws_row_flagged(const int* flag, int row) { return flag[row] & WS_FLAG_MAGIC; }
// Warpgroup 1 at a row's end: WS_FLAG_MAGIC where one of its threads saw a slot past the FFMA's range,
// and Gate[0] set, which opens the corrections launch (it ends at once where no row is flagged).
__device__ __forceinline__ void ws_flag_magic(const int* flag, int row, unsigned* beyond, int t, const int* gate) {
  if (__any_sync(0xffffffffu, *beyond) && (t & 31) == 0) {
    ws_flag_row(flag, row, WS_FLAG_MAGIC);
    atomicOr(const_cast<int*>(gate), 1);
  }
  *beyond = 0u;
}
// ws_add_bounds: Bound[kv] += the bound of each valid slot's contribution in the block, from h, the
// upper 16 bits of its largest |scaled value| over all columns (warpgroup 1's 4 warps' maxima and
// warpgroup 0's, of |x|, times the slot's scale here): that value is below the bf16 one step above
// h, so min(ceil(bf16 h + 1), 2^40); 2^40 where h + 1 is inf or NaN; 0 where h is 0 (every value
// below 2^-133, which rounds to 0).
__device__ __forceinline__ void ws_add_bounds(const void* peak_buf, void* slot_peaks, const void* bound,
                                              const void* slot_info, unsigned row_units, unsigned* beyond, int t) {
  if (t >= 64) return;
  const unsigned* peaks_s = static_cast<const unsigned*>(peak_buf);
  const int word = t / 2;
  const unsigned m = __vmaxu2(__vmaxu2(peaks_s[word], peaks_s[32 + word]), __vmaxu2(peaks_s[64 + word], peaks_s[96 + word]));
  unsigned* slot_peak = static_cast<unsigned*>(slot_peaks) + t;
  const unsigned unscaled = max((t & 1) ? (m >> 16) : (m & 0xffffu), *slot_peak);
  *slot_peak = 0u;  // for warpgroup 0's block t + 2, which waits for this warpgroup's PDS_FREE of t + 1
  const int* slot = static_cast<const int*>(slot_info) + 2 * t;
  // The peaks are of |x|; the slot's scale (a power of two; an invalid slot's -0.0, so that an inf
  // there gives NaN, as x s did) moves the upper 16 bits as it moves x.
  const unsigned half = __float_as_uint(__uint_as_float(unscaled << 16) * fabsf(__int_as_float(slot[1]))) >> 16;
  // Any slot, valid or not (an invalid one's NaN, from 0 * inf, went to a valid row's words): the
  // row's flag goes out at its end (ws_flag_magic), where a store here kept more values live.
  *beyond |= half >= WS_MAGIC_PEAK;
  if (slot[1] != WS_LANES_INVALID && half != 0u)
    atomicAdd(const_cast<unsigned long long*>(static_cast<const unsigned long long*>(bound)) + static_cast<unsigned>(slot[0]) / row_units,
              half + 1u >= 0x7f80u ? 1099511627776ull
                                   : static_cast<unsigned long long>(fminf(ceilf(__uint_as_float((half + 1u) << 16)), 1099511627776.0f)));
}
"""


def lane_pairs(config: MainConfig) -> int:
    """The chunk pairs (2 i, 2 i + 1) whose lanes warpgroup 1 adds a line at a time
    (ws_add_pair_lanes): its chunks of whole LANE_BLOCKs, in the lanes design; it adds the rest
    of its chunks one at a time."""
    if config.accumulate != "lanes":
        return 0
    return min((config.d_k // CHUNK - config.wg0_chunks) // 2, config.d_k // LANE_BLOCK)


def wg0_pairs(config: MainConfig) -> bool:
    """Whether warpgroup 0's first two chunks are a pair of one whole LANE_BLOCK, which it adds a
    line at a time (the second in its scores' accumulator): the lanes, with an even first chunk."""
    first = config.d_k // CHUNK - config.wg0_chunks
    return (config.accumulate == "lanes" and config.wg0_chunks >= 2 and first % 2 == 0
            and (first + 2) * CHUNK <= config.d_k // LANE_BLOCK * LANE_BLOCK)


def wide_program(config: MainConfig):
    """The 64-head tile's main backward as the module docstring describes."""
    if not config.wide:
        raise ValueError(f"config: the warp-specialised tile is the wide one (heads {HEADS}), got {config}")
    accumulate, Dk, Dv = config.accumulate, config.d_k, config.d_v
    dq_split = config.dq_split  # dQ columns [0, dq_split) are warpgroup 0's, the rest warpgroup 1's
    if Dk % CHUNK or Dv % CHUNK:
        raise ValueError(f"config: d_k={Dk}, d_v={Dv}: multiples of {CHUNK}")
    try:
        require_wide_widths(config)
    except ValueError as e:
        raise ValueError(f"config: {e}") from None
    tilelang, T = _tl()
    R, HQ, NKV, Lp = T.dynamic("R"), T.dynamic("HQ"), T.dynamic("NKV"), T.dynamic("Lp")
    BS, H = WIDE_SLOTS, HEADS
    f32, bf16, i32, i64 = "float32", "bfloat16", "int32", "int64"
    dkv_dtype = f32 if accumulate == "atomic" else i64
    dkv_shape = (NKV, Dk // 2) if accumulate == "lanes" else (NKV, Dk)
    scaled = accumulate != "atomic"  # a row scale per slot, and the mass check
    corrections = config.corrections  # the rows a lanes launch flagged, their words' corrections only
    correct = "true" if corrections else "false"
    transposed = scaled  # dKV chunks as columns x slots (WS_SOURCE says why)
    chunks = Dk // CHUNK
    n1 = chunks - config.wg0_chunks  # warpgroup 1's chunks: [0, n1); warpgroup 0's: [n1, chunks)
    pairs, wg0_pair = lane_pairs(config), wg0_pairs(config)
    value_chunks = Dv // CHUNK
    # Warpgroup 1's dQ columns in two wgmma-sized pieces (N at most 256, whole 64s):
    # 192 + 128 at Dk = 576, 192 + 64 at 512.
    w1 = min(WIDE_DQ_PIECE, Dk - dq_split - CHUNK)
    w2 = Dk - dq_split - w1
    c1, c2 = dq_split, dq_split + w1
    if WG0_PEAK_WORDS != WARPGROUP:  # warpgroup 0 clears its slot maxima one word a thread
        raise ValueError(f"WG0_PEAK_WORDS: {WG0_PEAK_WORDS}, not {WARPGROUP}")

    ROW_UNITS = Dk // 4  # a kv row of the lanes' words in 16-byte units (ws_lanes_store_slot)

    def slot_valid(slot_info_s, p, j, NKV):
        """Whether slot j of the block of parity p names a kv row: the lanes mark an invalid slot
        by its scale (ws_lanes_store_slot), the others keep the row index."""
        if accumulate == "lanes":
            return T.call_extern("bool", "ws_lanes_valid", slot_info_s[2 * (p * BS + j) + 1])
        row_j = slot_info_s[2 * (p * BS + j)]
        return T.And(row_j >= 0, row_j < NKV)

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
    def load_rows(dst, src, r, h0, width):
        """cp.async of src[r, h0 : h0 + H, 0:width] into dst by one warpgroup, as gather_columns
        lays out its rows (8 threads a head row, 16 rows a pass): no registers hold the rows on
        their way, where a copy through registers held them beside the warpgroup's accumulators.
        The thread index goes through ws_thread_again, so that the addresses are formed at each
        row, not hoisted out of the row loop and spilled."""
        t = T.call_extern("int32", "ws_thread_again")
        for rows in T.unroll(H // (WARPGROUP // 8)):
            h = rows * (WARPGROUP // 8) + t // 8
            for k in T.unroll(width // 64):
                c = k * 64 + (t % 8) * 8
                T.call_extern("handle", "mqa_cp_async16", T.address_of(dst[h, c]), T.address_of(src[r, h0 + h, c]), True)

    def chunk_gemms(c):
        """The GEMMs (wgmma commit groups) dkv_chunk issues for chunk c: dO's too where c has value columns."""
        return 1 + (c < value_chunks)

    @T.macro
    def dkv_chunk(Q_s, dO_s, dS_s, P_s, acc, c):
        """dKV columns [c * CHUNK, (c + 1) * CHUNK) of the block into ``acc``, dS^T Q + P^T dO over
        the heads; issued, not waited for. The deterministic launches form it transposed
        (columns x slots: Q^T dS + dO^T P), the layout their adds want (WS_SOURCE)."""
        T.clear(acc)
        if transposed:
            T.wgmma_gemm(Q_s[0:H, c * CHUNK : (c + 1) * CHUNK], dS_s, acc, transpose_A=True, clear_accum=True)
            if c < value_chunks:
                T.wgmma_gemm(dO_s[0:H, c * CHUNK : (c + 1) * CHUNK], P_s, acc, transpose_A=True)
        else:
            T.wgmma_gemm(dS_s, Q_s[0:H, c * CHUNK : (c + 1) * CHUNK], acc, transpose_A=True, clear_accum=True)
            if c < value_chunks:
                T.wgmma_gemm(P_s, dO_s[0:H, c * CHUNK : (c + 1) * CHUNK], acc, transpose_A=True)

    @T.macro
    def add_chunk(dKV, acc, slot_info_s, c, p, NKV, peak, thread):
        """The global adds of chunk c's accumulator, for the block of parity p, by the warpgroup
        whose thread index (0..127) is ``thread`` (the deterministic adds read it from %tid.x
        themselves: ws_thread_again)."""
        info = T.address_of(slot_info_s[p * BS * 2])
        if accumulate == "lanes":
            word0, warp_words = lane_chunk_words(c, Dk, T.if_then_else)
            T.call_extern("handle", f"ws_add_chunk_lanes<{correct}>", acc.data, dKV.data, info, word0, warp_words, peak.data)
        elif accumulate == "atomic":
            T.call_extern("handle", "ws_add_chunk_atomic", acc.data, dKV.data, info, c * CHUNK, Dk, NKV, thread)
        else:
            T.call_extern("handle", "ws_add_chunk_fixed", acc.data, dKV.data, info, c * CHUNK, Dk, NKV)

    @T.macro
    def add_pair(dKV, acc_a, acc_b, slot_info_s, c, p, peak):
        """The lanes' adds of chunks c (in acc_a) and c + 1 (acc_b), a whole LANE_BLOCK, a line at a time."""
        word0, _ = lane_chunk_words(c, Dk, T.if_then_else)
        T.call_extern("handle", f"ws_add_pair_lanes<{correct}>", acc_a.data, acc_b.data, dKV.data,
                      T.address_of(slot_info_s[p * BS * 2]), word0, peak.data)

    @T.macro
    def peaks_then_pds_free(bars, p):
        """Warpgroup 1 frees P_s and dS_s; the lanes' first wait for warpgroup 0's maxima of the block.
        Warpgroup 0 arrives on PEAKS_READY for block t + 1 once P_s is free of block t: had
        warpgroup 1 not seen block t's phase complete by then, two phases would complete and its
        wait on block t's parity would never return."""
        if accumulate == "lanes":
            T.call_extern("handle", "mqa_handoff_wait", bars.data, PEAKS_READY, p)
        T.call_extern("handle", "mqa_handoff_arrive", bars.data, PDS_FREE)

    @T.macro
    def ping_pong_chunks(dKV, Q_s, dO_s, dS_s, P_s, acc, acc2, slot_info_s, bars, p, NKV, peak, thread):
        """Warpgroup 1's dKV chunks [0, n1) of the block, one at a time in two accumulators: chunk
        c + 1's GEMMs run while chunk c's adds go out."""
        dkv_chunk(Q_s, dO_s, dS_s, P_s, acc, 0)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc, num_regs=BS * CHUNK // WARPGROUP)
        for pair in T.unroll((n1 - 1) // 2):  # chunk c is in acc, c + 1 goes to acc2
            c = 2 * pair
            dkv_chunk(Q_s, dO_s, dS_s, P_s, acc2, c + 1)
            add_chunk(dKV, acc, slot_info_s, c, p, NKV, peak, thread)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc2, num_regs=BS * CHUNK // WARPGROUP)
            dkv_chunk(Q_s, dO_s, dS_s, P_s, acc, c + 2)
            add_chunk(dKV, acc2, slot_info_s, c + 1, p, NKV, peak, thread)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc, num_regs=BS * CHUNK // WARPGROUP)
        # Every GEMM of the block has been waited for once the last chunk's is: then P_s
        # and dS_s are free, and that chunk's adds go out after the handoff.
        if n1 % 2 == 0:  # chunk n1 - 2 is in acc, n1 - 1 goes to acc2
            dkv_chunk(Q_s, dO_s, dS_s, P_s, acc2, n1 - 1)
            add_chunk(dKV, acc, slot_info_s, n1 - 2, p, NKV, peak, thread)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc2, num_regs=BS * CHUNK // WARPGROUP)
            peaks_then_pds_free(bars, p)
            add_chunk(dKV, acc2, slot_info_s, n1 - 1, p, NKV, peak, thread)
        else:  # chunk n1 - 1 is in acc
            peaks_then_pds_free(bars, p)
            add_chunk(dKV, acc, slot_info_s, n1 - 1, p, NKV, peak, thread)

    @T.macro
    def paired_chunks(dKV, Q_s, dO_s, dS_s, P_s, acc, acc2, slot_info_s, bars, p, NKV, peak, thread):
        """The lanes' chunks of warpgroup 1: a pair's two GEMMs (the first pair's issued under its
        dQ GEMMs: first_pair_gemms), then its adds a line at a time (add_pair), which need both
        chunks' words, so the next pair's GEMMs wait for them; then any chunk left, one at a time."""
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc, num_regs=BS * CHUNK // WARPGROUP)
        T.warpgroup_fence_operand(acc2, num_regs=BS * CHUNK // WARPGROUP)
        for pair in T.unroll(pairs):
            if 2 * pair + 2 == n1:  # the block's last GEMM has been waited for
                peaks_then_pds_free(bars, p)
            add_pair(dKV, acc, acc2, slot_info_s, 2 * pair, p, peak)
            if pair + 1 < pairs:
                dkv_chunk(Q_s, dO_s, dS_s, P_s, acc, 2 * pair + 2)
                dkv_chunk(Q_s, dO_s, dS_s, P_s, acc2, 2 * pair + 3)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc, num_regs=BS * CHUNK // WARPGROUP)
                T.warpgroup_fence_operand(acc2, num_regs=BS * CHUNK // WARPGROUP)
        for c in T.unroll(2 * pairs, n1):
            dkv_chunk(Q_s, dO_s, dS_s, P_s, acc, c)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc, num_regs=BS * CHUNK // WARPGROUP)
            if c == n1 - 1:
                peaks_then_pds_free(bars, p)
            add_chunk(dKV, acc, slot_info_s, c, p, NKV, peak, thread)

    @T.macro
    def first_pair_gemms(Q_s, dO_s, dS_s, P_s, acc, acc2):
        """Warpgroup 1's first chunk pair's GEMMs, issued behind its dQ GEMMs and before it waits
        for those: the tensor cores go on to them while the dQ GEMMs' wait and KV_FREE arrival
        run. Leaves the dQ GEMMs' groups done and the pair's pending."""
        dkv_chunk(Q_s, dO_s, dS_s, P_s, acc, 0)
        dkv_chunk(Q_s, dO_s, dS_s, P_s, acc2, 1)
        T.wait_wgmma(chunk_gemms(0) + chunk_gemms(1))

    @T.macro
    def row_blocks(live, done, Indices, Flag, RowBlocks, r, Lp, NKV, bars, words_at, t, k, bar):
        """live[0]: the row's blocks up to its last with a valid slot: warpgroup 0's from RowBlocks,
        warpgroup 1's by ws_row_blocks; in a corrections launch, both by ws_row_blocks and 0 for a
        row its lanes launch did not flag. ``done`` counts the rows that took ws_row_blocks, whose
        words go by that count's parity (a flagged row's reads and the next flagged row but one's
        writes have a barrier between); warpgroup 0's fetched counts go by the parity of its count
        of items, k (the fetch for item k + 1 and the read of item k - 1's have its row-end
        barrier between)."""
        if corrections:
            live[0] = 0
            if T.call_extern("bool", "ws_row_flagged", Flag.data, r):
                live[0] = T.call_extern("int32", "ws_row_blocks", Indices.data, r, Lp, NKV, bars.data, words_at, t, BS,
                                        done[0] % 2, bar)
                done[0] = done[0] + 1
        elif bar == GATHER_BARRIER:  # warpgroup 0: its claim fetched the count (ws_fetch_row_blocks)
            if k == 0:
                live[0] = T.call_extern("int32", "ws_load_row_blocks", RowBlocks.data, r)
            else:
                live[0] = T.call_extern("int32", "ws_fetched_row_blocks", bars.data, words_at, k % 2)
        else:  # warpgroup 1 counts its own, under the slack of its row's change
            live[0] = T.call_extern("int32", "ws_row_blocks", Indices.data, r, Lp, NKV, bars.data, words_at, t, BS, k % 2,
                                    bar)

    def item_of(item, head_base):
        """Row and first head of an item of the launch: items run tile by tile, rows within a tile."""
        return T.truncmod(item, R), head_base + T.truncdiv(item, R) * H

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
        tiles: T.int32,
        ctas: T.int32,
        Claims: T.Tensor((1,), i32),
        RowBlocks: T.Tensor((R,), i32),
    ):
        # Persistent: ``ctas`` CTAs (at most one an SM: the tile takes its shared memory), each
        # taking item cta first, then whichever is next when it frees (ws_claim_item: Claims[0]
        # counts the items claimed), counted from the last row: a causal call's first rows, which
        # have the fewest blocks, come last. Claimed as CTAs free, the items end the launch within
        # about an item of each other, where a fixed share left the CTAs that took one item more,
        # or ran on slower SMs, to finish alone. Its warpgroups run their own
        # rows: warpgroup 0 loads the next row's Q and dO and gathers its first block while
        # warpgroup 1 still adds the last block of the row before, so a row's fill and drain
        # overlap where a CTA a row ran them one after the other. The handoffs count blocks
        # across rows (t), so their phases and the double buffers run on unchanged.
        with T.Kernel(ctas, threads=2 * WARPGROUP) as cta:
            scale_log2 = sm_scale * LOG2E
            Q_s = T.alloc_shared((H, Dk), bf16)
            dO_s = T.alloc_shared((H, Dv), bf16)
            KV_s = T.alloc_shared((BS, Dk), bf16)
            P_s = T.alloc_shared((H, BS), bf16)
            dS_s = T.alloc_shared((H, BS), bf16)
            lse_s = T.alloc_shared((H,), f32)
            delta_s = T.alloc_shared((H,), f32)
            # Slot j of the block of parity p: its kv row (the lanes: the row's offset in the words) at
            # [2 (p BS + j)], its row scale's bits next;
            # then, for the lanes, the block maxima (PEAK_WORDS of warpgroup 1's, WG0_PEAK_WORDS of
            # warpgroup 0's). One buffer: the peaks are only touched through calls, and TileLang gives
            # a buffer it sees no access to the shared memory of another (it placed them on delta_s
            # and lse_s).
            peaks1 = 2 * BS * 2
            peaks0 = peaks1 + PEAK_WORDS
            slot_info_s = T.alloc_shared((peaks1 + (PEAK_WORDS + WG0_PEAK_WORDS if accumulate == "lanes" else 0),), i32)
            # The four block mbarriers, then each warpgroup's 2 x 4 words of its rows' block counts
            # (ws_row_blocks; int32 offsets rows0 and rows1), the two row mbarriers and the posted
            # items (ROW_READY, ROW_FREE, ITEM_WORDS): in the bytes TileLang leaves before the
            # 1024-aligned tiles, where in slot_info_s they took the lanes tile past 227 KiB.
            bars = T.alloc_shared((4 + 8 + 4,), "uint64")
            rows0, rows1 = 8, 16

            acc_s = T.alloc_fragment((H, BS), f32)
            acc_dp = T.alloc_fragment((H, BS), f32)
            dS_r = T.alloc_fragment((H, BS), bf16)  # warpgroup 0's dS in registers, its dQ GEMM's A operand
            acc_dq0 = T.alloc_fragment((H, dq_split), f32)
            acc_dq1 = T.alloc_fragment((H, w1), f32)
            acc_dq2 = T.alloc_fragment((H, w2), f32)
            acc_dkv = T.alloc_fragment((BS, CHUNK), f32)
            acc_dkv2 = T.alloc_fragment((BS, CHUNK), f32)
            acc_dkv0 = T.alloc_fragment((BS, CHUNK), f32)  # warpgroup 0's chunks (the lanes' pair: its second in acc_s)
            if scaled:
                mass_row = T.alloc_fragment((H,), f32)
            peak = T.alloc_local((BS // 8,), "uint32")  # warpgroup 1's lanes bound of this thread's 16 slots
            peak0 = T.alloc_local((BS // 8,), "uint32")  # warpgroup 0's
            live0 = T.alloc_local((1,), i32)  # warpgroup 0's blocks of its row, and its blocks before the row
            base0 = T.alloc_local((1,), i32)
            live1 = T.alloc_local((1,), i32)
            base1 = T.alloc_local((1,), i32)
            done0 = T.alloc_local((1,), i32)  # the rows each warpgroup took ws_row_blocks for (row_blocks)
            done1 = T.alloc_local((1,), i32)
            beyond1 = T.alloc_local((1,), "uint32")  # warpgroup 1's: a slot of its row past the FFMA's range
            # Each warpgroup's item as {row, first head}, computed once a row: an index expression of
            # the item would divide by R at every use.
            at0 = T.alloc_local((2,), i32)
            at1 = T.alloc_local((2,), i32)
            # Each warpgroup's item and its count of items so far (the row handoffs' phases); warpgroup
            # 0's thread 0's claim of the next.
            item0 = T.alloc_local((1,), i32)
            item1 = T.alloc_local((1,), i32)
            k0 = T.alloc_local((1,), i32)
            k1 = T.alloc_local((1,), i32)
            next0 = T.alloc_local((1,), i32)
            tid = T.get_thread_binding()
            tid1 = tid - WARPGROUP  # a thread's index in warpgroup 1
            items = R * (tiles if config.tiles > 1 else 1)

            T.import_source(GATHER_SOURCE + HANDOFF_SOURCE + ROW_BLOCKS_SOURCE + SOFTMAX_SOURCE + WS_SOURCE)
            if accumulate == "fixed" or corrections:  # before any barrier: the whole CTA leaves
                T.call_extern("handle", "ws_exit_unless", Gate.data)
            if tid == 0:
                T.call_extern("handle", "ws_bars_init", bars.data)
            T.sync_threads()

            with T.ws(0):
                for i in T.serial(BS // 8):
                    peak0[i] = T.cast(0, "uint32")
                if accumulate == "lanes":  # its slot maxima start at zero (ws_merge_peaks), one word a thread
                    T.call_extern("handle", "mqa_st_shared_i32", slot_info_s.data, peaks0 + tid, 0)
                base0[0] = 0
                done0[0] = 0
                k0[0] = 0
                item0[0] = cta
                if tid == 0:
                    T.call_extern("handle", "ws_post_first_item", bars.data, cta)
                while item0[0] < items:
                    at0[0], at0[1] = item_of(items - 1 - item0[0], head_base)
                    r, h0 = at0[0], at0[1]
                    # The row-end barrier below (and, in a corrections launch, ws_row_blocks' own)
                    # keeps this row's stores of lse_s and delta_s after the last reads of the row
                    # before (the softmax of its last block).
                    row_blocks(live0, done0, Indices, Flag, RowBlocks, r, Lp, NKV, bars, rows0, tid, k0[0], GATHER_BARRIER)
                    if live0[0] > 0:  # block 0 whole, once warpgroup 1's dQ GEMMs of the block before have read KV_s
                        if base0[0] > 0:
                            T.call_extern("handle", "mqa_handoff_wait", bars.data, KV_FREE, (base0[0] - 1) % 2)
                        gather_columns(KV_s, KV, Indices, r, 0, 0, Dk, NKV, tid)
                        T.call_extern("handle", "mqa_cp_async_commit")
                        if base0[0] > 0:  # warpgroup 1 is done with Q_s and dO_s (its last GEMMs of the row before)
                            T.call_extern("handle", "mqa_handoff_wait", bars.data, PDS_FREE, (base0[0] - 1) % 2)
                        load_rows(Q_s, Q, r, h0, Dk)
                        load_rows(dO_s, dO, r, h0, Dv)
                        # lse and Delta of the row's heads by cp.async too, 4 heads a thread: no round
                        # trip to L2 before the row's first block (the heads' floats are 16-byte aligned:
                        # HQ and h0 are multiples of 32).
                        if tid < H // 4:
                            T.call_extern("handle", "mqa_cp_async16", T.address_of(lse_s[tid * 4]),
                                          T.address_of(Lse2[r, h0 + tid * 4]), True)
                        elif tid < H // 2:
                            T.call_extern("handle", "mqa_cp_async16", T.address_of(delta_s[(tid - H // 4) * 4]),
                                          T.address_of(Delta[r, h0 + (tid - H // 4) * 4]), True)
                        T.call_extern("handle", "mqa_cp_async_commit")  # waited for with block 0's gather
                    T.clear(acc_dq0)
                    if scaled:
                        T.clear(mass_row)
                    for tl_ in T.serial(live0[0]):
                        t = base0[0] + tl_
                        p = t % 2
                        if tl_ > 0:  # warpgroup 1's dQ GEMMs of block t - 1 have read KV_s
                            T.call_extern("handle", "mqa_handoff_wait", bars.data, KV_FREE, (t - 1) % 2)
                        if tl_ == live0[0] - 1 and tid == 0:
                            # The CTA's next item, claimed; its Q and dO rows (contiguous: its heads are
                            # consecutive) into L2.
                            next0[0] = T.call_extern(i32, "ws_claim_item", bars.data, Claims.data, k0[0], ctas)
                            if next0[0] < items:
                                next_r, next_h0 = item_of(items - 1 - next0[0], head_base)
                                T.call_extern("handle", "ws_prefetch_l2", T.address_of(Q[next_r, next_h0, 0]), H * Dk * 2)
                                T.call_extern("handle", "ws_prefetch_l2", T.address_of(dO[next_r, next_h0, 0]), H * Dv * 2)
                                if not corrections:  # waited for with this block's gather
                                    T.call_extern("handle", "ws_fetch_row_blocks", bars.data, rows0, (k0[0] + 1) % 2,
                                                  RowBlocks.data, next_r)
                        if tid < BS:
                            row = Indices[r, tl_ * BS + tid]
                            if accumulate == "lanes":  # its row's offset in the words; invalid: scale -0.0
                                T.call_extern("handle", "ws_lanes_store_slot", slot_info_s.data, p * BS + tid, row, NKV,
                                              (r % NKV) + tid, ROW_UNITS, RowScale.data)
                            else:
                                T.call_extern("handle", "mqa_st_shared_i32", slot_info_s.data, 2 * (p * BS + tid), row)
                            if scaled and accumulate != "lanes":
                                T.call_extern("handle", "mqa_st_shared_f32", slot_info_s.data, 2 * (p * BS + tid) + 1,
                                              T.if_then_else((row >= 0) and (row < NKV), RowScale[T.max(T.min(row, NKV - 1), 0)],
                                                             T.cast(0, f32)))
                        if tl_ == 0:  # gathered whole at the row's start
                            T.call_extern("handle", "mqa_cp_async_wait_all")
                        else:  # columns [0, dq_split) went out after the previous block's dQ GEMM
                            gather_columns(KV_s, KV, Indices, r, tl_, dq_split, Dk, NKV, tid)
                            T.call_extern("handle", "mqa_cp_async_commit")
                            T.call_extern("handle", "ws_cp_async_wait_one")
                        T.call_extern("handle", "ws_fence_proxy_async")
                        T.call_extern("handle", "ws_bar_sync_wg", GATHER_BARRIER)

                        # S = Q KV^T and dP = dO V^T, both 64 x 64 over the heads; the first
                        # columns' GEMMs while the rest of the gather lands.
                        T.clear(acc_s)
                        T.clear(acc_dp)
                        T.wgmma_gemm(Q_s[0:H, 0:dq_split], KV_s[0:BS, 0:dq_split], acc_s, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(dO_s[0:H, 0:dq_split], KV_s[0:BS, 0:dq_split], acc_dp, transpose_B=True, clear_accum=True)
                        if tl_ > 0:
                            T.call_extern("handle", "mqa_cp_async_wait_all")
                            T.call_extern("handle", "ws_fence_proxy_async")
                            T.call_extern("handle", "ws_bar_sync_wg", GATHER_BARRIER)
                        T.wgmma_gemm(Q_s[0:H, dq_split:Dk], KV_s[0:BS, dq_split:Dk], acc_s, transpose_B=True)
                        T.wgmma_gemm(dO_s[0:H, dq_split:Dv], KV_s[0:BS, dq_split:Dv], acc_dp, transpose_B=True)
                        # P from S while dP's last GEMM runs: every group but the newest is done.
                        T.wait_wgmma(1)
                        T.warpgroup_fence_operand(acc_s, num_regs=H * BS // WARPGROUP)
                        for h, j in T.Parallel(H, BS):  # parity p's slots were stored before the barrier above
                            acc_s[h, j] = T.call_extern(f32, "mqa_masked_exp2", acc_s[h, j] * scale_log2 - lse_s[h],
                                                        slot_valid(slot_info_s, p, j, NKV))
                        if scaled:
                            T.reduce_sum(acc_s, mass_row, dim=1, clear=False)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_dp, num_regs=H * BS // WARPGROUP)
                        for h, j in T.Parallel(H, BS):
                            acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_s[h]) * sm_scale
                        T.copy(acc_dp, dS_r)
                        # dQ[:, :dq_split] += dS KV (this warpgroup's columns) with dS from registers: it
                        # runs while this warpgroup waits for dS_s to be free and stores P and dS.
                        T.wgmma_gemm(dS_r, KV_s[0:BS, 0:dq_split], acc_dq0)
                        if t > 0:  # warpgroup 1 is done with block t - 1's P, dS and slots
                            T.call_extern("handle", "mqa_handoff_wait", bars.data, PDS_FREE, (t - 1) % 2)
                        T.copy(acc_s, P_s)  # stmatrix
                        T.copy(acc_dp, dS_s)  # dS_r is the pending GEMM's operand: PTX forbids touching it before the wait
                        T.call_extern("handle", "ws_fence_proxy_async")
                        T.call_extern("handle", "mqa_handoff_arrive", bars.data, PDS_READY)
                        # The first of its dKV chunks.
                        dkv_chunk(Q_s, dO_s, dS_s, P_s, acc_dkv0, n1)
                        if wg0_pair:  # its second chunk in the scores' accumulator, free once P is stored
                            dkv_chunk(Q_s, dO_s, dS_s, P_s, acc_s, n1 + 1)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(dS_r, num_regs=H * BS // WARPGROUP // 2)  # read by the dQ GEMM until here
                        T.warpgroup_fence_operand(acc_dq0, num_regs=H * dq_split // WARPGROUP)
                        T.warpgroup_fence_operand(acc_dkv0, num_regs=BS * CHUNK // WARPGROUP)
                        if wg0_pair:
                            T.warpgroup_fence_operand(acc_s, num_regs=H * BS // WARPGROUP)
                        # Only this warpgroup reads KV_s[:, :dq_split]: refill it now.
                        if tl_ + 1 < live0[0]:
                            gather_columns(KV_s, KV, Indices, r, tl_ + 1, 0, dq_split, NKV, tid)
                            T.call_extern("handle", "mqa_cp_async_commit")
                        # Its dKV chunks' adds go out while the gather lands.
                        if wg0_pair:
                            add_pair(dKV, acc_dkv0, acc_s, slot_info_s, n1, p, peak0)
                        for c in T.unroll(n1 + 2 * wg0_pair, chunks):
                            if c > n1:
                                dkv_chunk(Q_s, dO_s, dS_s, P_s, acc_dkv0, c)
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(acc_dkv0, num_regs=BS * CHUNK // WARPGROUP)
                            add_chunk(dKV, acc_dkv0, slot_info_s, c, p, NKV, peak0, tid)
                        if accumulate == "lanes":  # its maxima, for warpgroup 1's bounds of the block
                            T.call_extern("handle", "ws_merge_peaks", peak0.data, T.address_of(slot_info_s[peaks0 + p * BS]), tid)
                            T.call_extern("handle", "mqa_handoff_arrive", bars.data, PEAKS_READY)
                    if not corrections:  # a corrections launch's lanes launch checked the masses and stored dQ
                        if scaled:
                            for h in T.Parallel(H):
                                if (mass_row[h] > Allowance[r, h0 + h]) or T.isnan(mass_row[h]):
                                    T.call_extern("handle", "ws_flag_row", Flag.data, r, FLAG_MASS)
                        T.call_extern("handle", f"ws_store_dq<{dq_split}>", acc_dq0.data, T.address_of(dQ[r, h0, 0]), Dk,
                                      HQ - h0, tid)
                    if live0[0] == 0 and tid == 0:  # no block to claim the next item in
                        next0[0] = T.call_extern(i32, "ws_claim_item", bars.data, Claims.data, k0[0], ctas)
                        if not corrections and next0[0] < items:
                            next_r, next_h0 = item_of(items - 1 - next0[0], head_base)
                            T.call_extern("handle", "ws_fetch_row_blocks", bars.data, rows0, (k0[0] + 1) % 2,
                                          RowBlocks.data, next_r)
                            T.call_extern("handle", "mqa_cp_async_wait_all")
                    base0[0] = base0[0] + live0[0]
                    k0[0] = k0[0] + 1
                    T.call_extern("handle", "ws_bar_sync_wg", GATHER_BARRIER)  # thread 0's claim is posted
                    item0[0] = T.call_extern(i32, "ws_posted_item", bars.data, k0[0])

            with T.ws(1):
                for i in T.serial(BS // 8):
                    peak[i] = T.cast(0, "uint32")
                base1[0] = 0
                done1[0] = 0
                beyond1[0] = T.cast(0, "uint32")
                k1[0] = 0
                item1[0] = T.call_extern(i32, "ws_take_item", bars.data, 0)
                while item1[0] < items:
                    at1[0], at1[1] = item_of(items - 1 - item1[0], head_base)
                    r, h0 = at1[0], at1[1]
                    row_blocks(live1, done1, Indices, Flag, RowBlocks, r, Lp, NKV, bars, rows1, tid1, k1[0], BOUNDS_BARRIER)
                    T.clear(acc_dq1)
                    T.clear(acc_dq2)
                    for tl_ in T.serial(live1[0]):
                        t = base1[0] + tl_
                        p = t % 2
                        T.call_extern("handle", "mqa_handoff_wait", bars.data, PDS_READY, p)
                        T.wgmma_gemm(dS_s, KV_s[0:BS, c1 : c1 + w1], acc_dq1)
                        T.wgmma_gemm(dS_s, KV_s[0:BS, c2 : c2 + w2], acc_dq2)
                        if pairs:
                            first_pair_gemms(Q_s, dO_s, dS_s, P_s, acc_dkv, acc_dkv2)
                        else:
                            T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_dq1, num_regs=H * w1 // WARPGROUP)
                        T.warpgroup_fence_operand(acc_dq2, num_regs=H * w2 // WARPGROUP)
                        T.call_extern("handle", "mqa_handoff_arrive", bars.data, KV_FREE)
                        if pairs:
                            paired_chunks(dKV, Q_s, dO_s, dS_s, P_s, acc_dkv, acc_dkv2, slot_info_s, bars, p, NKV, peak, tid1)
                        else:
                            ping_pong_chunks(dKV, Q_s, dO_s, dS_s, P_s, acc_dkv, acc_dkv2, slot_info_s, bars, p, NKV, peak, tid1)
                        if accumulate == "lanes" and not corrections:  # the block's bounds, one add a slot
                            T.call_extern("handle", "ws_bar_sync_wg", BOUNDS_BARRIER)
                            T.call_extern("handle", "ws_stage_peaks", peak.data, T.address_of(slot_info_s[peaks1]),
                                          tid1)
                            T.call_extern("handle", "ws_bar_sync_wg", BOUNDS_BARRIER)
                            T.call_extern("handle", "ws_add_bounds", T.address_of(slot_info_s[peaks1]),
                                          T.address_of(slot_info_s[peaks0 + p * BS]), Bound.data,
                                          T.address_of(slot_info_s[p * BS * 2]), ROW_UNITS, beyond1.data, tid1)
                    if not corrections:
                        if accumulate == "lanes":
                            T.call_extern("handle", "ws_flag_magic", Flag.data, r, beyond1.data, tid1, Gate.data)
                        T.call_extern("handle", f"ws_store_dq<{w1}>", acc_dq1.data, T.address_of(dQ[r, h0, c1]), Dk,
                                      HQ - h0, tid1)
                        T.call_extern("handle", f"ws_store_dq<{w2}>", acc_dq2.data, T.address_of(dQ[r, h0, c2]), Dk,
                                      HQ - h0, tid1)
                    base1[0] = base1[0] + live1[0]
                    k1[0] = k1[0] + 1
                    item1[0] = T.call_extern(i32, "ws_take_item", bars.data, k1[0])

    return main_bwd
