"""The wrapper's layout steps before the first launch, as kernels: the slot layout, its sort keys
and placement around torch's sort, or all three in one kernel where a row fits a CTA
(sorted_slots). mqa_bwd.layout holds their definitions; the TileLang launcher runs these
instead of some twenty torch ops, each of which costs the host a launch."""

from .config import SORT_ITEM_COUNTS, SORT_THREADS, WALK_BLOCK, WIDE_SLOTS, _tl
from .device_functions import ROW_BLOCKS_SOURCE
from .plan import PEAK_SOURCE

#: Threads a CTA of slot_keys and place_slots (one CTA a query row and chunk of slots).
SLOT_THREADS = 256
#: Threads a CTA of row_blocks (one CTA a query row).
ROW_BLOCKS_THREADS = 128
#: Head rows of q a warp of sorted_marks loads at once for PeakQ: half of mark_slots' four, as the
#: sort's registers come on top of the loads' (47 a thread where four took 79), which lets an SM hold
#: five CTAs streaming q while others sort, where four allowed three.
MARKS_PEAK_HEADS_AT_ONCE = 2


def slot_keys_program(index_dtype: str):
    """Keys[r, c] = Indices[r, c] + ((row0 + r) // S) * S_kv where 0 <= Indices[r, c] < S_kv,
    else NKV (layout.slot_keys), compared in the indices' own dtype (int32 or int64)."""
    tilelang, T = _tl()
    R, L = T.dynamic("R"), T.dynamic("L")
    i32 = "int32"

    @T.prim_func
    def slot_keys(Indices: T.Tensor((R, L), index_dtype), Keys: T.Tensor((R, L), i32), row0: T.int32, S: T.int32,
                  S_kv: T.int32, NKV: T.int32):
        with T.Kernel(R, T.ceildiv(L, SLOT_THREADS), threads=SLOT_THREADS) as (r, chunk):
            c = chunk * SLOT_THREADS + T.get_thread_binding()
            if c < L:
                index = Indices[r, c]
                if (index >= T.cast(0, index_dtype)) and (index < T.cast(S_kv, index_dtype)):
                    Keys[r, c] = T.cast(index, i32) + ((row0 + r) // S) * S_kv
                else:
                    Keys[r, c] = NKV

    return slot_keys


def row_blocks_program():
    """RowBlocks[r] = row r's count of WIDE_SLOTS-slot blocks up to its last valid slot
    (0 <= Slots[r, j] < NKV), 0 where it has none (layout.row_blocks): the wide tile's blocks of
    the row, which its warpgroup 0 reads in place of a scan of the row's slots at each row's change."""
    tilelang, T = _tl()
    R, Lp = T.dynamic("R"), T.dynamic("Lp")
    i32 = "int32"
    source = ROW_BLOCKS_SOURCE + r"""
__device__ __forceinline__ void mqa_row_blocks(const int* slots, int lp, int nkv, int* out) {
  __shared__ unsigned warp_blocks[%(warps)d];
  const int t = static_cast<int>(threadIdx.x);
  const unsigned live = mqa_warp_row_blocks(slots, lp, nkv, %(block)d, t, %(threads)d);
  if ((t & 31) == 0) warp_blocks[t >> 5] = live;
  __syncthreads();
  if (t == 0) {
    unsigned most = 0;
    for (int w = 0; w < %(warps)d; ++w) most = max(most, warp_blocks[w]);
    *out = static_cast<int>(most);
  }
}
""" % {"warps": ROW_BLOCKS_THREADS // 32, "block": WIDE_SLOTS, "threads": ROW_BLOCKS_THREADS}

    @T.prim_func
    def row_blocks(Slots: T.Tensor((R, Lp), i32), RowBlocks: T.Tensor((R,), i32), NKV: T.int32):
        with T.Kernel(R, threads=ROW_BLOCKS_THREADS) as r:
            T.import_source(source)
            T.call_extern("handle", "mqa_row_blocks", T.address_of(Slots[r, 0]), Lp, NKV, T.address_of(RowBlocks[r]))

    return row_blocks


def place_slots_program():
    """Slots[r, c] = Keys[r, c] for c < L, -1 where that key is NKV (an invalid slot) and for
    the padding columns c >= L (layout.place_slots)."""
    tilelang, T = _tl()
    R, L, Lp = T.dynamic("R"), T.dynamic("L"), T.dynamic("Lp")
    i32 = "int32"

    @T.prim_func
    def place_slots(Keys: T.Tensor((R, L), i32), Slots: T.Tensor((R, Lp), i32), NKV: T.int32):
        with T.Kernel(R, T.ceildiv(Lp, SLOT_THREADS), threads=SLOT_THREADS) as (r, chunk):
            c = chunk * SLOT_THREADS + T.get_thread_binding()
            if c < Lp:
                Slots[r, c] = -1
                if c < L:
                    if Keys[r, c] != NKV:
                        Slots[r, c] = Keys[r, c]

    return place_slots


# One query row's slot layout in one CTA (slot_keys, the sort and place_slots fused): keys in
# registers, striped over the threads (an input arrangement does not change a sort's output),
# CUB's block radix sort over the bits below end_bit (every key is at most NKV < 2**end_bit),
# then the sorted keys striped to the row's slots. The padding keys past L are NKV, as an
# invalid slot's: they sort last and become -1. The sorted keys also give the row's block count
# (row_blocks_program's), the wide tile's, where a separate launch would read the slots again.
# The deterministic design's build (mqa_sorted_marked_row) also does mark_slots' work for its
# row: PeakQ from the row's q (plan.PEAK_SOURCE), then the marks from the sorted keys. The sort
# waits on its barriers and shared memory, the q stream on HBM: in one launch, the CTAs of an
# SM that sort leave the memory system to those that stream.
SORT_SOURCE = r"""
#include <cub/block/block_radix_sort.cuh>
constexpr int mqa_sort_threads = %(threads)d, mqa_sort_items = %(items)d;
// keys[i] of thread t: the row's key (i * threads + t) in increasing order.
template <typename Index>
__device__ __forceinline__ void mqa_sort_row(const Index* indices, unsigned (&keys)[mqa_sort_items], int L, int base,
                                             int S_kv, int nkv, int end_bit) {
  using Sort = cub::BlockRadixSort<unsigned, mqa_sort_threads, mqa_sort_items>;
  __shared__ typename Sort::TempStorage storage;
#pragma unroll
  for (int i = 0; i < mqa_sort_items; ++i) {
    const int j = i * mqa_sort_threads + static_cast<int>(threadIdx.x);
    unsigned key = static_cast<unsigned>(nkv);
    if (j < L) {
      const Index index = indices[j];
      if (index >= 0 && index < static_cast<Index>(S_kv)) key = static_cast<unsigned>(static_cast<int>(index) + base);
    }
    keys[i] = key;
  }
  Sort(storage).SortBlockedToStriped(keys, 0, end_bit);
}
// Sorted key j goes to slot j, except within the row's first ceil(valid / %(walk)d) blocks of
// %(walk)d slots, which are rotated so that the row's walk starts at block position %% blocks
// (layout.rotate_walks): sorted block b goes to block (b - start) mod blocks.
__device__ __forceinline__ void mqa_place_row(const unsigned* keys, int* slots, int Lp, int nkv, int valid, int position) {
  const int blocks = (valid + %(walk)d - 1) / %(walk)d, span = blocks * %(walk)d;
  const int shift = blocks > 0 ? span - (position %% blocks) * %(walk)d : 0;
#pragma unroll
  for (int i = 0; i < mqa_sort_items; ++i) {
    const int j = i * mqa_sort_threads + static_cast<int>(threadIdx.x);
    const int placed = j < span ? (j + shift) %% span : j;
    if (j < Lp) slots[placed] = keys[i] == static_cast<unsigned>(nkv) ? -1 : static_cast<int>(keys[i]);
  }
}
// mark_slots' rule: every write stores 1, a kv row already marked is not stored again, and the
// marks' loads go out together before any store.
__device__ __forceinline__ void mqa_mark_row(const unsigned* keys, int* referenced, int* live_row, int nkv) {
  int marked[mqa_sort_items];
  bool live = false;
#pragma unroll
  for (int i = 0; i < mqa_sort_items; ++i) {
    const bool valid = keys[i] < static_cast<unsigned>(nkv);
    marked[i] = valid ? referenced[keys[i]] : 1;
    live = live || valid;
  }
#pragma unroll
  for (int i = 0; i < mqa_sort_items; ++i)
    if (marked[i] == 0) referenced[keys[i]] = 1;
  if (live) *live_row = 1;
}
// The row's valid keys (every thread gets the count), and row_blocks' count (layout.row_blocks):
// the valid keys fill the row's first blocks of %(walk)d slots, whatever their rotation, so its
// blocks up to its last valid slot are its valid keys' count in blocks.
__device__ __forceinline__ int mqa_count_row_blocks(const unsigned* keys, int* row_blocks, int nkv) {
  int valid = 0;
#pragma unroll
  for (int i = 0; i < mqa_sort_items; ++i) valid += __syncthreads_count(keys[i] < static_cast<unsigned>(nkv));
  if (threadIdx.x == 0) *row_blocks = (valid + %(block)d - 1) / %(block)d;
  return valid;
}
template <typename Index>
__device__ __forceinline__ void mqa_sorted_slots_row(const Index* indices, int* slots, int* row_blocks, int L, int Lp,
                                                     int base, int S_kv, int nkv, int end_bit, int position) {
  unsigned keys[mqa_sort_items];
  mqa_sort_row(indices, keys, L, base, S_kv, nkv, end_bit);
  mqa_place_row(keys, slots, Lp, nkv, mqa_count_row_blocks(keys, row_blocks, nkv), position);
}
template <typename Index>
__device__ __forceinline__ void mqa_sorted_marked_row(const Index* indices, int* slots, int* row_blocks, int L, int Lp,
                                                      int base, int S_kv, int nkv, int end_bit, int position,
                                                      const void* q_row, int* peak_q, int hq, int* referenced,
                                                      int* live_row) {
  mqa_peak_rows(q_row, peak_q, hq, static_cast<int>(threadIdx.x), mqa_sort_threads);
  unsigned keys[mqa_sort_items];
  mqa_sort_row(indices, keys, L, base, S_kv, nkv, end_bit);
  mqa_place_row(keys, slots, Lp, nkv, mqa_count_row_blocks(keys, row_blocks, nkv), position);
  mqa_mark_row(keys, referenced, live_row, nkv);
}
"""


def sorted_slots_program(index_dtype: str, items: int, d_k: int | None = None):
    """Slots[r] = place_slots(sort(slot_keys(Indices[r]))) for the query rows row0 .. row0 + R of
    at most SORT_THREADS * items slots (L <= Lp <= SORT_THREADS * items): the slot layout in the
    canonical order (layout.canonical_order) in one launch, with no keys in memory, and
    RowBlocks[r], what row_blocks_program writes for the row (the wide tile's blocks of it).
    end_bit: NKV's bit length.

    With ``d_k`` (the deterministic design's build, KernelConfig "sorted_marks"), the same CTA
    also writes what plan.mark_slots_program writes for its row, by the same rules: PeakQ[r] of
    Q[r] ([R, HQ, d_k]), LiveRow[r], and Referenced for the row's valid slots (Referenced and
    LiveRow zeroed by the caller)."""
    if items not in SORT_ITEM_COUNTS:
        raise ValueError(f"items: {items!r}, not one of {SORT_ITEM_COUNTS}")
    if d_k is not None and d_k % 8:
        raise ValueError(f"d_k: {d_k}, not a multiple of 8 (a load takes 8 bf16 of q)")
    source = SORT_SOURCE % {"threads": SORT_THREADS, "items": items, "block": WIDE_SLOTS, "walk": WALK_BLOCK}
    if d_k is not None:
        source = PEAK_SOURCE % {"vectors": d_k // 8, "at_once": MARKS_PEAK_HEADS_AT_ONCE} + source
    tilelang, T = _tl()
    R, L, Lp = T.dynamic("R"), T.dynamic("L"), T.dynamic("Lp")
    i32 = "int32"

    if d_k is not None:
        HQ, NKV_ROWS = T.dynamic("HQ"), T.dynamic("NKV_ROWS")

        @T.prim_func
        def sorted_marks(Indices: T.Tensor((R, L), index_dtype), Slots: T.Tensor((R, Lp), i32),
                         RowBlocks: T.Tensor((R,), i32), Referenced: T.Tensor((NKV_ROWS,), i32),
                         LiveRow: T.Tensor((R,), i32), Q: T.Tensor((R, HQ, d_k), "bfloat16"),
                         PeakQ: T.Tensor((R, HQ), i32), row0: T.int32, S: T.int32, S_kv: T.int32, NKV: T.int32,
                         end_bit: T.int32):
            with T.Kernel(R, threads=SORT_THREADS) as r:
                T.import_source(source)
                T.call_extern("handle", "mqa_sorted_marked_row", T.address_of(Indices[r, 0]), T.address_of(Slots[r, 0]),
                              T.address_of(RowBlocks[r]), L, Lp, ((row0 + r) // S) * S_kv, S_kv, NKV, end_bit,
                              T.truncmod(row0 + r, S), T.address_of(Q[r, 0, 0]), T.address_of(PeakQ[r, 0]), HQ, T.address_of(Referenced[0]),
                              T.address_of(LiveRow[r]))

        return sorted_marks

    @T.prim_func
    def sorted_slots(Indices: T.Tensor((R, L), index_dtype), Slots: T.Tensor((R, Lp), i32), RowBlocks: T.Tensor((R,), i32),
                     row0: T.int32, S: T.int32, S_kv: T.int32, NKV: T.int32, end_bit: T.int32):
        with T.Kernel(R, threads=SORT_THREADS) as r:
            T.import_source(source)
            T.call_extern("handle", "mqa_sorted_slots_row", T.address_of(Indices[r, 0]), T.address_of(Slots[r, 0]),
                          T.address_of(RowBlocks[r]), L, Lp, ((row0 + r) // S) * S_kv, S_kv, NKV, end_bit,
                          T.truncmod(row0 + r, S))

    return sorted_slots
