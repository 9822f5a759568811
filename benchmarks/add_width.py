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
  u64last the same adds with an L2 evict_last cache hint (createpolicy), so
          that the int64 accumulator (twice the control's fp32 one) outlasts
          the streamed Q and dO rows in L2; the same bits as u64
  f32     scalar red.global.add.f32 per lane and column (same instructions, half the bytes)
  f32x4   red.global.add.v4.f32, four consecutive columns per lane from
          vector shared loads (a quarter of the instructions, half the bytes)
  f32x4x2 f32x4 issued twice (the same addresses): the control's adds in
          bytes, and in instructions but for the tail (scalar here, two
          columns a lane in the control), in the deterministic kernel's
          structure (what the cluster's structure costs at the control's adds)
  bulk    the same int64 adds through the bulk-copy (TMA) unit: each warp
          converts its slot's row into an int64 staging row in shared memory
          and one lane issues cp.reduce.async.bulk .add.u64 per contiguous
          part (a few instructions a slot instead of one red per column and
          lane, and the adds drain asynchronously); the same bits as u64
  none    no global adds at all (the floor)

On the H200 at dsv32 H=64 (whole calls, --repeats 5, one process; before
the adds moved after the GEMMs, 81dbb54): u64
25.92 ms, u64raw 25.58, u64last 25.78 (min 25.57 against u64's 25.61: no
gain), f32 23.22, f32x4 22.54, f32x4x2 25.14, bulk 30.48, none 20.25; the
atomic control 23.91. So at the control's adds the deterministic structure
costs 1.23 ms (0.42 of it the plan), and the int64 adds 0.78 ms more, 0.34
of it the conversion. The bulk variant gave u64's bits at the default clusters (C <= 2) but
failed the GPU oracle tests with clusters of four (not investigated, as it
is slower anyway).

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
IMPORT = "T.import_source(device_source)"
RED_SOURCE = r'''

RED_F32_SOURCE = r"""
// The fp32 bits as an int64, without a conversion (timing only).
__device__ __forceinline__ long long mqa_raw64(float v) { return static_cast<long long>(__float_as_int(v)); }
// The int64 add with an L2 evict_last hint.
__device__ __forceinline__ void mqa_red_u64_last(void* dst, long long v) {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("red.global.add.L2::cache_hint.u64 [%0], %1, %2;" :: "l"(dst), "l"(v), "l"(policy) : "memory");
}
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
# bulk: the guard's body (value and tail adds) becomes one warp-wide call; add_piece
# takes each warp's staging row, allocated next to the cluster barriers.
FIXED_BODY = VALUE_ADD + """                    if has_tail:
                        if owns_tail(rank):
                            for c in T.unroll(Ct // 32):
""" + TAIL_ADD
BULK_BODY = """                    T.call_extern(
                        "handle", f"mqa_fixed_bulk_add<{Cc}>",
                        T.address_of(dKV[kv_row[0], value_col0(rank)]),
                        T.address_of(dKV[kv_row[0], tail_col0(rank) if has_tail else 0]),
                        T.address_of(dKV_s[j, 0]), T.address_of(dKVt_s[j, 0]),
                        tail_cols(rank),
                        T.address_of(stage[warp, 0]), scale_r[0], lane,
                    )
"""
BARS = """                bars = T.alloc_shared((2,), "uint64")
"""
STAGE = """            stage = None
            if mode == "fixed":
                stage = T.alloc_shared((n_warps, Cc + (Ct if has_tail else 0)), "int64")
"""
OWNS_TAIL = """        return (not colsplit) or tail_ranks == cluster or rank < tail_ranks
"""
TAIL_COLS = """
    def tail_cols(rank):
        if not has_tail:
            return 0
        return Ct if owns_tail(rank) is True else T.if_then_else(owns_tail(rank), Ct, 0)
"""
LAST_ADDS = """                        if colsplit:
                            # Every peer's last arrival"""
BULK_SOURCE = r'''

BULK_ADD_SOURCE = r"""
__device__ __forceinline__ unsigned mqa_bulk_smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
// Warp-wide: value[0, VALUE) and tail[0, tail_cols) (fp32, shared) times scale, rounded
// to nearest even, into the warp's int64 staging row, then one bulk reduction per part
// into dst_value / dst_tail (int64, global). Lane 0 issues, so it owns the bulk groups;
// it waits until its previous ones have read the staging row before the warp rewrites it.
template <int VALUE>
__device__ __forceinline__ void mqa_fixed_bulk_add(int64_t* dst_value, int64_t* dst_tail, const float* value,
                                                   const float* tail, int tail_cols, int64_t* stage, float scale, int lane) {
  if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  __syncwarp();
#pragma unroll
  for (int c = 0; c < VALUE; c += 32) stage[c + lane] = __float2ll_rn(value[c + lane] * scale);
  for (int c = 0; c < tail_cols; c += 32) stage[VALUE + c + lane] = __float2ll_rn(tail[c + lane] * scale);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores above, before the bulk unit reads them
  __syncwarp();
  if (lane == 0) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;"
                 :: "l"(dst_value), "r"(mqa_bulk_smem(stage)), "n"(VALUE * 8) : "memory");
    if (tail_cols > 0)
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;"
                   :: "l"(dst_tail), "r"(mqa_bulk_smem(stage + VALUE)), "r"(tail_cols * 8) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
}
// Every bulk reduction this thread issued is complete (before the CTA exits).
__device__ __forceinline__ void mqa_bulk_drain() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
"""
'''
VARIANTS = ("u64", "u64raw", "u64last", "f32", "f32x4", "f32x4x2", "bulk", "none")


def _replace_once(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"add_width: {old.strip()[:60]!r}... is not in mqa_bwd.kernels exactly once; update this tool")
    return source.replace(old, new)


#: This tool studies the cluster kernel: every variant, and the control, run
#: without the 64-head tile (kernels.WIDE_PAIRS), as when it was measured.
NOT_WIDE = ("\nWIDE_PAIRS = True\n", "\nWIDE_PAIRS = False\n")


def variant_source(variant: str, source: str | None = None) -> str:
    """mqa_bwd.kernels' source with the fixed mode's adds of ``variant`` (and no 64-head tile)."""
    source = _replace_once(inspect.getsource(kernels) if source is None else source, *NOT_WIDE)
    if variant == "u64":
        return source
    if variant == "none":
        return _replace_once(source, FIXED_GUARD, FIXED_GUARD.replace(":\n", " and (kv_row[0] < 0):\n"))
    if variant == "bulk":
        source = _replace_once(source, IMPORT, IMPORT[:-1] + " + (BULK_ADD_SOURCE if mode == \"fixed\" else \"\"))")
        source = _replace_once(source, FIXED_BODY, BULK_BODY)
        source = _replace_once(source, BARS, BARS + STAGE)
        source = _replace_once(source, OWNS_TAIL, OWNS_TAIL + TAIL_COLS)
        source = _replace_once(source, LAST_ADDS, LAST_ADDS.replace("if colsplit:", "if mode == \"fixed\":\n"
                               "                            T.call_extern(\"handle\", \"mqa_bulk_drain\")\n"
                               "                        if colsplit:", 1))
        calls = source.count("add_piece(dKV, dKV_s, dKVt_s, ")
        source = source.replace("add_piece(dKV, dKV_s, dKVt_s, ", "add_piece(dKV, dKV_s, dKVt_s, stage, ")
        if calls < 2:
            raise RuntimeError("add_width: add_piece's definition and calls are not in mqa_bwd.kernels; update this tool")
        return source + BULK_SOURCE
    source = _replace_once(source, IMPORT, IMPORT[:-1] + " + RED_F32_SOURCE)")
    if variant == "u64raw":
        for add in (VALUE_ADD, TAIL_ADD):
            source = _replace_once(source, add, add.replace('"__float2ll_rn"', '"mqa_raw64"'))
        return source + RED_SOURCE
    if variant == "u64last":
        for add in (VALUE_ADD, TAIL_ADD):
            hinted = add.replace("T.atomic_add(\n", 'T.call_extern(\n').replace("dKV[kv_row[0]", '"handle", "mqa_red_u64_last", T.address_of(dKV[kv_row[0]')
            source = _replace_once(source, add, hinted.replace(" + lane],\n", " + lane]),\n"))
        return source + RED_SOURCE
    if variant == "f32x4x2":
        source = _replace_once(source, VALUE_ADD, _twice(VECTOR_VALUE_ADD, 1))
        return _replace_once(source, TAIL_ADD, _twice(SCALAR_TAIL_ADD, 0)) + RED_SOURCE
    source = _replace_once(source, VALUE_ADD, SCALAR_VALUE_ADD if variant == "f32" else VECTOR_VALUE_ADD)
    return _replace_once(source, TAIL_ADD, SCALAR_TAIL_ADD) + RED_SOURCE


def _twice(add: str, loop_lines: int) -> str:
    """``add`` with its body (the lines after its first ``loop_lines``) issued twice."""
    lines = add.splitlines(keepends=True)
    return "".join(lines[:loop_lines] + lines[loop_lines:] * 2)


def variant_module(variant: str):
    return kernels_module_from_source(variant_source(variant), f"kernels_{variant}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    variants = {v: (variant_module(v), True) for v in VARIANTS}
    variants["atomic control"] = (variants["u64"][0], False)
    times = time_with_kernels(args, variants, a.repeats)
    control = statistics.median(times["atomic control"])
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}: whole calls, median of {a.repeats} (interleaved)")
    print(f"{'adds':<16} {'ms':>8} {'min':>8} {'/control':>9}")
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"{name:<16} {ms:>8.2f} {min(t):>8.2f} {ms / control:>9.3f}")


if __name__ == "__main__":
    main()
