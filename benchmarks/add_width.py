"""Would fp32 adds pay in the cluster kernel? Times the deterministic cluster launch
with its 64-bit fixed-point adds replaced by fp32 adds of the same sums (GPU only).

    python benchmarks/add_width.py [--H 64] [--S 4096] [--S_kv 8192] [--L 2048] [--repeats 7]

A deterministic design with fp32 adds (per-shard buffers, one writer each,
adds in a fixed order, folded in shard order) would add the cluster-summed
contributions as fp32: half the bytes of today's int64 adds and half the control's
(which adds each 32-head group's partials). Before building it, this tool
measures what the adds' width costs in today's kernel. Variants, all copies
of ``mqa_bwd.kernels`` with only the fixed mode's adds rewritten (the cluster launch is timed):

  u64     today's kernel (scalar red.global.add.u64 per lane and column)
  u64raw  the same adds of the fp32 bits sign-extended, without the
          float -> int64 conversion (what the conversion costs)
  f32     scalar red.global.add.f32 per lane and column (same instructions, half the bytes)
  f32x4   red.global.add.v4.f32, four consecutive columns per lane from
          vector shared loads (a quarter of the instructions, half the bytes)
  none    no global adds at all (the floor)

The fp32 variants add into the int64 buffer's first half of each row: their
outputs are garbage and only the time means anything. Every variant runs the
whole wrapper call (plan, Delta, casts), interleaved with the atomic control.
"""

import argparse
import inspect
import statistics

from mqa_bwd import kernels
from mqa_bwd.bench import add_shape_arguments, kernels_module_from_source, production_inputs, time_with_kernels

# The fixed mode's value-column and tail adds in main_bwd_program's add_piece
# (one path for single CTAs and clusters; the latter add their column share).
VALUE_ADD = """                    for c in T.unroll(Cc // 32):
                        T.atomic_add(
                            dKV[kv_row[0], value_col0(rank) + c * 32 + lane],
                            T.call_extern("int64", "__float2ll_rn", dKV_s[j, c * 32 + lane] * scale_r[0]),
                        )
"""
TAIL_ADD = """                                T.atomic_add(
                                    dKV[kv_row[0], tail_col0(rank) + c * 32 + lane],
                                    T.call_extern("int64", "__float2ll_rn", dKVt_s[j, c * 32 + lane] * scale_r[0]),
                                )
"""
SCALAR_VALUE_ADD = """                    for c in T.unroll(Cc // 32):
                        T.call_extern("handle", "mqa_red_f32", T.address_of(dKV[kv_row[0], 0]), value_col0(rank) + c * 32 + lane,
                                      dKV_s[j, c * 32 + lane])
"""
VECTOR_VALUE_ADD = """                    for c in T.unroll(Cc // 128):
                        T.call_extern("handle", "mqa_red_f32x4", T.address_of(dKV[kv_row[0], 0]), value_col0(rank) + c * 128 + lane * 4,
                                      T.address_of(dKV_s[j, c * 128 + lane * 4]))
"""
SCALAR_TAIL_ADD = """                                T.call_extern("handle", "mqa_red_f32", T.address_of(dKV[kv_row[0], 0]), tail_col0(rank) + c * 32 + lane,
                                              dKVt_s[j, c * 32 + lane])
"""
# The fixed-point guard (both fixed paths): "none" never passes it.
FIXED_GUARD = "\n                if (kv_row[0] >= 0) and (kv_row[0] < NKV):\n"
IMPORT = 'T.import_source(GATHER_SOURCE + (CLUSTER_SOURCE if cluster > 1 else "") + (SHARD_SOURCE if sharded else ""))'
RED_SOURCE = r'''

RED_F32_SOURCE = r"""
// The fp32 bits as an int64, without a conversion (timing only).
__device__ __forceinline__ long long mqa_raw64(float v) { return static_cast<long long>(__float_as_int(v)); }
// fp32 adds into an int64 row viewed as floats (timing only: the bits are garbage).
__device__ __forceinline__ void mqa_red_f32(void* row, int col, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" :: "l"(static_cast<float*>(row) + col), "f"(v) : "memory");
}
__device__ __forceinline__ void mqa_red_f32x4(void* row, int col, const void* partial) {
  float4 a = *static_cast<const float4*>(partial);
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(static_cast<float*>(row) + col),
               "f"(a.x), "f"(a.y), "f"(a.z), "f"(a.w) : "memory");
}
"""
'''
VARIANTS = ("u64", "u64raw", "f32", "f32x4", "none")


def _replace_once(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"add_width: {old.strip()[:60]!r}... is not in mqa_bwd.kernels exactly once; update this tool")
    return source.replace(old, new)


def variant_source(variant: str, source: str | None = None) -> str:
    """mqa_bwd.kernels' source with the fixed mode's adds of ``variant``."""
    source = inspect.getsource(kernels) if source is None else source
    if variant == "u64":
        return source
    if variant == "none":
        if source.count(FIXED_GUARD) != 1:
            raise RuntimeError("add_width: the fixed-point add guard is not in mqa_bwd.kernels once; update this tool")
        return source.replace(FIXED_GUARD, FIXED_GUARD.replace(":\n", " and (kv_row[0] < 0):\n"))
    source = _replace_once(source, IMPORT, IMPORT[:-1] + " + RED_F32_SOURCE)")
    if variant == "u64raw":
        for add in (VALUE_ADD, TAIL_ADD):
            source = _replace_once(source, add, add.replace('"__float2ll_rn"', '"mqa_raw64"'))
        return source + RED_SOURCE
    source = _replace_once(source, VALUE_ADD, SCALAR_VALUE_ADD if variant == "f32" else VECTOR_VALUE_ADD)
    return _replace_once(source, TAIL_ADD, SCALAR_TAIL_ADD) + RED_SOURCE


def variant_module(variant: str):
    if variant == "u64":
        return kernels
    return kernels_module_from_source(variant_source(variant), f"kernels_{variant}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    variants = {v: (variant_module(v), True) for v in VARIANTS}
    variants["atomic control"] = (kernels, False)
    times = time_with_kernels(args, variants, a.repeats)
    control = statistics.median(times["atomic control"])
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}: whole calls, median of {a.repeats} (interleaved)")
    print(f"{'adds':<16} {'ms':>8} {'min':>8} {'/control':>9}")
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"{name:<16} {ms:>8.2f} {min(t):>8.2f} {ms / control:>9.3f}")


if __name__ == "__main__":
    main()
