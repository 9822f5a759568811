"""Timing probes of 32-bit lane pairs in the 64-head tile's fixed-point adds (wrong sums).

    python benchmarks/lanes_probe.py ab/            # writes ab/lanes_<variant>.py
    python benchmarks/kernel_ab.py --against ab/lanes_*.py --shapes dsv32,fleet    # on the GPU

Each variant rewrites this tree's mqa_bwd/kernels.py so that the wide tile's
add_chunk issues one red.global.add.u64 per column pair, the two columns'
integers as signed 32-bit lanes of one word (__float2int_rn, half of int64's
reductions and L2 bytes). Summed mod 2**64, such words decode exactly when
each final lane sum fits 32 bits (benchmarks/fixed_point_headroom.py,
``checked_lanes``), which a kernel must prove after the fact: per kv row, the
sum over its contributions of max |integer| below 2**31. The variants price
that proof; none computes right sums (the int64 accumulator is reused, the
bound words sit in its unused columns), they only issue the same work:

  nb      the pair adds alone (no bound): the floor of the format
  peaks   each lane tracks its columns' max |v| per slot, and after the slot
          loop adds it only when it reaches 2**31 (never here): the peaks
          and their per-slot code after the loop (the slot's kv row reloaded
          and clamped, its address, the test), no warp reduction, no traffic
  redux   each lane tracks its columns' max |v| per slot; after the slot
          loop, __reduce_max_sync per slot, and lane 0 adds the bound only
          when it reaches 2**31 (never here): the bound's arithmetic, no traffic
  bound   as redux, lane 0 always adds the slot's bound (one red.u64 per
          slot and add site): the full check
  lanes   as bound without the warp reduction, every lane adding its own
          max into its own word (32 reds per slot and site)
  running one max per lane over everything it adds, never reset; after
          each add site, an add only when it reaches 2**31 (never here): the
          max's arithmetic without any per-slot work
"""

import argparse
import inspect
import os

#: The pair add and the bound add, appended to the kernels' device helpers.
HELPERS = r"""
// Lanes probe: columns 2p and 2p + 1 of one slot as signed 32-bit lanes of one
// word, lo + 2**32 * hi; *peak tracks the largest |scaled value|.
__device__ __forceinline__ void mqa_pair_add(void* dst, const void* src, float scale, float* peak) {
  float2 x = *static_cast<const float2*>(src);
  float a = x.x * scale, b = x.y * scale;
  unsigned long long w = static_cast<unsigned long long>(static_cast<long long>(__float2int_rn(a)))
                       + (static_cast<unsigned long long>(static_cast<unsigned>(__float2int_rn(b))) << 32);
  asm volatile("red.global.add.u64 [%0], %1;" :: "l"(dst), "l"(w) : "memory");
  *peak = fmaxf(*peak, fmaxf(fabsf(a), fabsf(b)));
}
// A slot's bound: its max |v| (over the warp with MQA_PROBE_REDUCE, else this
// lane's), rounded up, added where MQA_PROBE_ADD_IF holds.
__device__ __forceinline__ void mqa_bound_add(void* dst, float peak, bool valid) {
#if MQA_PROBE_REDUCE
  unsigned bits = __reduce_max_sync(0xffffffffu, __float_as_uint(peak));
#else
  unsigned bits = __float_as_uint(peak);
#endif
  if (valid && (MQA_PROBE_ADD_IF)) {
    unsigned long long u = static_cast<unsigned long long>(fminf(ceilf(__uint_as_float(bits)), 4294967296.f));
    asm volatile("red.global.add.u64 [%0], %1;" :: "l"(dst), "l"(u) : "memory");
  }
}
"""
HELPERS_AT = "__device__ __forceinline__ void mqa_cp_async_commit()"

#: add_chunk's fixed-point body: one int64 red per column.
INT64_ADDS = """                if (0 <= kv_row[0]) and (kv_row[0] < NKV):
                    for c in T.unroll(width // 32):
                        T.atomic_add(dKV[kv_row[0], col0 + c * 32 + lane],
                                     T.call_extern("int64", "__float2ll_rn", buf[j, b0 + c * 32 + lane] * scale_r[0]))
"""
#: The pair adds; scale_r[1 + s_i]: slot s_i's peak.
PAIR_ADDS = """                scale_r[1 + s_i] = 0.0
                if (0 <= kv_row[0]) and (kv_row[0] < NKV):
                    for c in T.unroll(width // 64):
                        T.call_extern("handle", "mqa_pair_add", T.address_of(dKV[kv_row[0], col0 // 2 + c * 32 + lane]),
                                      T.address_of(buf[j, b0 + c * 64 + 2 * lane]), scale_r[0], T.address_of(scale_r[1 + s_i]))
"""
#: After the slot loop: each slot's bound into word BOUND_WORD of its kv row (a column the pairs leave alone).
BOUND_ADDS = """            for s_i in T.serial(BS // n_warps):
                j = warp + s_i * n_warps
                T.call_extern("handle", "mqa_bound_add", T.address_of(dKV[T.max(T.min(slots[j], NKV - 1), 0), {word}]),
                              scale_r[1 + s_i], (0 <= slots[j]) and (slots[j] < NKV))
"""
#: The "running" variant instead: one peak per lane over everything it adds (scale_r[1]), and
#: after each add site's slot loop one bound add at a fixed word (no per-slot work).
RUNNING_PAIR_ADDS = PAIR_ADDS.replace("                scale_r[1 + s_i] = 0.0\n", "").replace("scale_r[1 + s_i]", "scale_r[1]")
RUNNING_BOUND_ADD = """            T.call_extern("handle", "mqa_bound_add", T.address_of(dKV[0, Dk // 2]), scale_r[1], True)
"""
SCALE_ALLOC = "                scale_r = T.alloc_local((1,), f32)\n"
#: scale_r grows by a peak per slot a warp takes in add_chunk (BS // n_warps = 4).
SCALE_ALLOC_PEAKS = "                scale_r = T.alloc_local((5,), f32)\n"
SCALE_ALLOC_RUNNING = SCALE_ALLOC_PEAKS + "                scale_r[1] = 0.0\n"

LANE0 = "(threadIdx.x & 31u) == 0u"
NEVER = "__uint_as_float(bits) >= 2147483648.f"  # no bound reaches 2**31 in production data
# (bound adds, MQA_PROBE_REDUCE, MQA_PROBE_ADD_IF, bound word)
VARIANTS = {
    "nb": (False, 0, "false", None),
    "peaks": (True, 0, NEVER, "Dk // 2 + col0 // 128"),
    "redux": (True, 1, f"{LANE0} && {NEVER}", "Dk // 2 + col0 // 128"),
    "bound": (True, 1, LANE0, "Dk // 2 + col0 // 128"),
    "lanes": (True, 0, "true", "Dk // 2 + lane"),
    "running": (True, 0, NEVER, None),
}


def _replace_once(source: str, old: str, new: str, what: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"lanes probe: {what} not found once in kernels.py (found {source.count(old)}); update the probe")
    return source.replace(old, new)


def variant_source(name: str, source: str | None = None) -> str:
    """kernels.py (``source``, default this tree's) with the wide tile's fixed adds as variant ``name``."""
    if source is None:
        from mqa_bwd import kernels

        source = inspect.getsource(kernels)
    bounds, reduce, add_if, word = VARIANTS[name]
    defines = f"#define MQA_PROBE_REDUCE {reduce}\n#define MQA_PROBE_ADD_IF {add_if}\n"
    source = _replace_once(source, HELPERS_AT, defines + HELPERS + HELPERS_AT, "the device helpers' anchor")
    if name == "running":
        body, alloc = RUNNING_PAIR_ADDS + RUNNING_BOUND_ADD, SCALE_ALLOC_RUNNING
    else:
        body, alloc = PAIR_ADDS + (BOUND_ADDS.format(word=word) if bounds else ""), SCALE_ALLOC_PEAKS
    source = _replace_once(source, INT64_ADDS, body, "add_chunk's int64 adds")
    return _replace_once(source, SCALE_ALLOC, alloc, "the scale register")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where to write lanes_<variant>.py")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    a = parser.parse_args()
    os.makedirs(a.directory, exist_ok=True)
    for name in a.variants.split(","):
        path = os.path.join(a.directory, f"lanes_{name}.py")
        with open(path, "w") as f:
            f.write(variant_source(name))
        print(path)


if __name__ == "__main__":
    main()
