"""The wrapper's layout steps before the first launch, as kernels: Lse2 and Sink2, and the slot
layout: its sort keys and placement around torch's sort, or all three in one kernel where a row
fits a CTA (sorted_slots). mqa_bwd.layout holds their definitions; the TileLang launcher runs these
instead of some twenty torch ops, each of which costs the host a launch."""

import math

from .config import LOG2E, SORT_ITEM_COUNTS, SORT_THREADS, _tl

#: Threads a CTA of slot_keys and place_slots (one CTA a query row and chunk of slots).
SLOT_THREADS = 256
#: Threads a CTA of kernel_lse (one CTA a query row and chunk of heads).
LSE_THREADS = 64


def kernel_lse_program():
    """Lse2[r, h] = logaddexp(Lse[r, h], Sink[h]) * log2(e), +inf where Lse is -inf, NaN where
    Lse[r, h] or Sink[h] is NaN or +inf; Sink2[h] = Sink[h] * log2(e) (layout.lse_base2)."""
    tilelang, T = _tl()
    R, H = T.dynamic("R"), T.dynamic("H")
    f32 = "float32"

    @T.prim_func
    def kernel_lse(Lse: T.Tensor((R, H), f32), Sink: T.Tensor((H,), f32), Lse2: T.Tensor((R, H), f32),
                   Sink2: T.Tensor((H,), f32)):
        with T.Kernel(R, T.ceildiv(H, LSE_THREADS), threads=LSE_THREADS) as (r, chunk):
            h = chunk * LSE_THREADS + T.get_thread_binding()
            if h < H:
                a, b = Lse[r, h], Sink[h]
                # logaddexp as max + log1p(exp(-|a - b|)): no overflow, and exactly max where one is -inf.
                summed = (T.max(a, b) + T.log1p(T.exp(-T.abs(a - b)))) * T.float32(LOG2E)
                value = T.if_then_else(a == T.float32(-math.inf), T.float32(math.inf), summed)
                sound = (a < T.float32(math.inf)) and (b < T.float32(math.inf))
                Lse2[r, h] = T.if_then_else(sound, value, T.float32(math.nan))
                if r == 0:
                    Sink2[h] = b * T.float32(LOG2E)

    return kernel_lse


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
# invalid slot's: they sort last and become -1.
SORT_SOURCE = r"""
#include <cub/block/block_radix_sort.cuh>
template <typename Index>
__device__ __forceinline__ void mqa_sorted_slots_row(const Index* indices, int* slots, int L, int Lp, int base,
                                                     int S_kv, int nkv, int end_bit) {
  using Sort = cub::BlockRadixSort<unsigned, %(threads)d, %(items)d>;
  __shared__ typename Sort::TempStorage storage;
  unsigned keys[%(items)d];
#pragma unroll
  for (int i = 0; i < %(items)d; ++i) {
    const int j = i * %(threads)d + static_cast<int>(threadIdx.x);
    unsigned key = static_cast<unsigned>(nkv);
    if (j < L) {
      const Index index = indices[j];
      if (index >= 0 && index < static_cast<Index>(S_kv)) key = static_cast<unsigned>(static_cast<int>(index) + base);
    }
    keys[i] = key;
  }
  Sort(storage).SortBlockedToStriped(keys, 0, end_bit);
#pragma unroll
  for (int i = 0; i < %(items)d; ++i) {
    const int j = i * %(threads)d + static_cast<int>(threadIdx.x);
    if (j < Lp) slots[j] = keys[i] == static_cast<unsigned>(nkv) ? -1 : static_cast<int>(keys[i]);
  }
}
"""


def sorted_slots_program(index_dtype: str, items: int):
    """Slots[r] = place_slots(sort(slot_keys(Indices[r]))) for the query rows row0 .. row0 + R of
    at most SORT_THREADS * items slots (L <= Lp <= SORT_THREADS * items): the slot layout in the
    canonical order (layout.canonical_order) in one launch, with no keys in memory. end_bit:
    NKV's bit length."""
    if items not in SORT_ITEM_COUNTS:
        raise ValueError(f"items: {items!r}, not one of {SORT_ITEM_COUNTS}")
    source = SORT_SOURCE % {"threads": SORT_THREADS, "items": items}
    tilelang, T = _tl()
    R, L, Lp = T.dynamic("R"), T.dynamic("L"), T.dynamic("Lp")
    i32 = "int32"

    @T.prim_func
    def sorted_slots(Indices: T.Tensor((R, L), index_dtype), Slots: T.Tensor((R, Lp), i32), row0: T.int32, S: T.int32,
                     S_kv: T.int32, NKV: T.int32, end_bit: T.int32):
        with T.Kernel(R, threads=SORT_THREADS) as r:
            T.import_source(source)
            T.call_extern("handle", "mqa_sorted_slots_row", T.address_of(Indices[r, 0]), T.address_of(Slots[r, 0]), L, Lp,
                          ((row0 + r) // S) * S_kv, S_kv, NKV, end_bit)

    return sorted_slots
