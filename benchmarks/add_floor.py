"""How long the dKV adds alone take: a floor under any design that adds per (query row, slot).

    python benchmarks/add_floor.py [--shapes dsv32,fleet] [--repeats 10]     # GPU
    python benchmarks/add_floor.py --compile-only                            # CPU: nvcc only

Kernels that do nothing but the main kernel's global dKV adds, on the
production slots (bench.production_inputs): one CTA per query row, the slots
a block of 32 at a time, a warp per slot and 576 columns a slot, every add a
constant (no GEMM, no shared-memory partials). Variants:

  u64      one red.global.add.u64 per lane and column: the fixed design's
           adds (one per (row, slot, column): the cluster has summed the heads)
  u64pair  one red.global.add.u64 per lane and two columns (two 32-bit lanes
           a word, as the experiment on branch exp/fixed-lanes adds them)
  u32      one red.global.add.u32 per lane and column
  f32x4    red.global.add.v4.f32, four columns a lane: the control's add
           instruction; the control issues it once per head group
  u64pair64  u64pair's words as the lanes kernel sends them: a warp instruction covers 4
           rows x 64 bytes (8 lanes a row), where u64pair's covers 256 bytes of one row
  f32x4_64 f32x4 as the wide control sends it: 8 rows x 64 bytes a warp instruction (a
           quad a row), where f32x4's covers 512 bytes of one row
  bulk256  u64pair's words from shared memory by TMA bulk reductions
           (cp.reduce.async.bulk .add.u64), 256 bytes of a row each: the lanes' chunk
           row, whole lines, no add instruction a lane
  f32x4 x2 the same kernel launched twice: the control's adds at H=64
  indices  the index loads and barriers alone

Whatever the GEMMs cost, a design that issues these adds cannot be faster
than their time here (they overlap the GEMMs at best), so the 3.7 ms the
tensor cores need (issue 6) is out of reach while the floor is above it.
The 64-byte variants and bulk256 ask what whole 128-byte lines would save the lanes
(docs/performance-log.md, eleventh session). Measured on the H200 at dsv32 (B=1, S=4096, S_kv=8192, L=2048): u64 10.20
ms (3.8 TB/s of adds), f32x4 4.57, f32x4 x2 9.12, indices 0.06; fleet: 6.34,
2.88, 5.74, 0.04. Another run at dsv32: u64 10.24, u64pair 5.40, u32 5.17,
f32x4 4.61, f32x4 x2 9.11, indices 0.10: the L2 reduction time follows the
bytes (3.6-4.2 TB/s), not the instruction's width. Until 2026-12-04 f32x4 added
only the first 512 of 576 columns (four 128-column instructions a row), so
those f32x4 figures are of 8/9 of the bytes; it now adds them all.
"""

import argparse
import statistics

from mqa_bwd import kernels as K

ADD_SOURCE = r"""
__device__ __forceinline__ void mqa_red4_ones(void* dst) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(dst), "f"(1.0f) : "memory");
}
__device__ __forceinline__ void mqa_red4_ones_if(void* dst, bool ok) {
  if (ok) mqa_red4_ones(dst);
}
// Every word of a shared buffer of `words` 64-bit words set to `value` (before a barrier).
__device__ __forceinline__ void mqa_fill_words(void* buf, int words, long long value, int t, int threads) {
  for (int i = t; i < words; i += threads) static_cast<long long*>(buf)[i] = value;
}
// A TMA bulk reduction of `bytes` from shared src into global dst (.add.u64), in this thread's bulk group.
__device__ __forceinline__ void mqa_bulk_add_u64(void* dst, const void* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;"
               :: "l"(dst), "r"(static_cast<unsigned>(__cvta_generic_to_shared(src))), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mqa_bulk_commit_and_wait() {
  asm volatile("cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group 0;" ::: "memory");
}
// Shared stores become visible to the bulk copies (the async proxy).
__device__ __forceinline__ void mqa_fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
"""
VARIANTS = ("u64", "u64pair", "u32", "f32x4", "u64pair64", "f32x4_64", "bulk256", "indices")
#: Bytes of one bulk256 reduction: 32 words, the lanes' row of a 64-column chunk.
BULK_BYTES = 256
DTYPES = {"f32x4": "float32", "f32x4_64": "float32", "u32": "int32"}  # the others add into int64


def adds_program(variant: str, d_k: int = 576, slots: int = 32, threads: int = 256):
    """One CTA per query row issuing ``variant``'s adds for every valid slot of the row."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} (one of {VARIANTS})")
    if variant in ("u64pair64", "f32x4_64") and (slots, threads) != (32, 256):
        raise ValueError(f"slots, threads: {variant} lays out 32 slots over 8 warps, got {slots}, {threads}")
    tilelang, T = K._tl()
    R, NKV, Lp = T.dynamic("R"), T.dynamic("NKV"), T.dynamic("Lp")
    BS, n_warps = slots, threads // 32
    chunks = d_k // 64  # bulk256: a row's 64-column chunks, 256 bytes of words each

    @T.prim_func
    def adds(Indices: T.Tensor((R, Lp), "int32"), dKV: T.Tensor((NKV, d_k), DTYPES.get(variant, "int64"))):
        with T.Kernel(R, threads=threads) as r:
            slot = T.alloc_shared((BS,), "int32")
            kv_row = T.alloc_local((1,), "int32")
            tid = T.get_thread_binding()
            warp = tid // 32
            lane = tid % 32
            T.import_source(ADD_SOURCE)
            if variant == "bulk256":  # the words one bulk reduction sends, the same for every row
                staged = T.alloc_shared((BULK_BYTES // 8,), "int64")
                T.call_extern("handle", "mqa_fill_words", staged.data, BULK_BYTES // 8, 1, tid, threads)
                T.call_extern("handle", "mqa_fence_async_shared")
            for t in T.serial(Lp // BS):
                for j in T.Parallel(BS):
                    slot[j] = Indices[r, t * BS + j]
                T.sync_threads()
                if variant == "u64pair64":  # a warp 4 slots at a time, 8 lanes a slot
                    for s_i in T.serial(BS // (n_warps * 4)):
                        kv_row[0] = slot[(s_i * n_warps + warp) * 4 + lane // 8]
                        if (kv_row[0] >= 0) and (kv_row[0] < NKV):
                            for c in T.unroll(d_k // 16):
                                T.atomic_add(dKV[kv_row[0], c * 8 + lane % 8], T.cast(lane + 1, "int64"))
                elif variant == "f32x4_64":  # warp w: 8 slots, a quad a slot, the columns' half w // 4
                    kv_row[0] = slot[(warp % 4) * 8 + lane // 4]
                    if (kv_row[0] >= 0) and (kv_row[0] < NKV):
                        for c in T.unroll(d_k // 32):
                            T.call_extern("handle", "mqa_red4_ones",
                                          T.address_of(dKV[kv_row[0], (warp // 4) * (d_k // 2) + c * 16 + (lane % 4) * 4]))
                elif variant == "bulk256":  # the block's (slot, chunk) reductions spread over every thread
                    for i in T.serial(T.ceildiv(BS * chunks, threads)):
                        if i * threads + tid < BS * chunks:
                            kv_row[0] = slot[(i * threads + tid) // chunks]
                            if (kv_row[0] >= 0) and (kv_row[0] < NKV):
                                T.call_extern("handle", "mqa_bulk_add_u64",
                                              T.address_of(dKV[kv_row[0], ((i * threads + tid) % chunks) * (BULK_BYTES // 8)]),
                                              staged.data, BULK_BYTES)
                elif variant != "indices":  # a warp a slot
                    for s_i in T.serial(BS // n_warps):
                        kv_row[0] = slot[warp + s_i * n_warps]
                        if (kv_row[0] >= 0) and (kv_row[0] < NKV):
                            if variant == "u64":
                                for c in T.unroll(d_k // 32):
                                    T.atomic_add(dKV[kv_row[0], c * 32 + lane], T.cast(lane + 1, "int64"))
                            elif variant == "u64pair":  # two columns a lane: the row's first d_k / 2 words
                                for c in T.unroll(d_k // 64):
                                    T.atomic_add(dKV[kv_row[0], c * 32 + lane], T.cast(lane + 1, "int64"))
                            elif variant == "u32":
                                for c in T.unroll(d_k // 32):
                                    T.atomic_add(dKV[kv_row[0], c * 32 + lane], T.cast(lane + 1, "int32"))
                            else:  # 128 columns an instruction: the last one's lanes past d_k add nothing
                                for c in T.unroll(T.ceildiv(d_k, 128)):
                                    T.call_extern("handle", "mqa_red4_ones_if", T.address_of(dKV[kv_row[0], c * 128 + lane * 4]),
                                                  c * 128 + lane * 4 < d_k)
                T.sync_threads()
            if variant == "bulk256":  # the reductions have read shared memory before the CTA ends
                T.call_extern("handle", "mqa_bulk_commit_and_wait")

    return adds


def time_floor(shape: dict, repeats: int) -> None:
    import functools

    import torch

    from mqa_bwd import launch, wrapper
    from mqa_bwd.bench import production_inputs, time_interleaved

    args = production_inputs(**shape)
    launcher = launch.TileLangLauncher(True)
    problem = wrapper.validate(*args, None, None, launcher, design=True)
    slots = wrapper.global_slots(args[6], problem, launcher)  # as the main kernel reads them
    nkv, d_k = problem.B * problem.S_kv, problem.d_k
    kernels = {v: K.compile_program(adds_program(v, d_k)) for v in VARIANTS}
    acc = {"u64": torch.zeros((nkv, d_k), dtype=torch.int64, device="cuda"),
           "u32": torch.zeros((nkv, d_k), dtype=torch.int32, device="cuda"),
           "f32x4": torch.zeros((nkv, d_k), dtype=torch.float32, device="cuda")}
    acc["indices"] = acc["u64pair"] = acc["u64pair64"] = acc["bulk256"] = acc["u64"]
    acc["f32x4_64"] = acc["f32x4"]
    calls = {v: functools.partial(kernels[v], slots, acc[v]) for v in VARIANTS}
    calls["f32x4 x2"] = lambda: (calls["f32x4"](), calls["f32x4"]())
    medians = {name: statistics.median(t) for name, t in time_interleaved(calls, warmup=2, repeats=repeats).items()}
    elements = problem.B * problem.S * problem.L * d_k
    print(shape)
    for name, ms in medians.items():
        payload = elements * (8 if name == "u64" else 0 if name == "indices" else 4) * (2 if name.endswith("x2") else 1)
        rate = f"{payload / (ms * 1e-3) / 1e12:6.2f} TB/s of adds" if payload else ""
        print(f"  {name:<10} {ms:8.2f} ms  {rate}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv32,fleet")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile-only", action="store_true", help="build every variant for sm_90a and stop (CPU)")
    a = parser.parse_args()
    if a.compile_only:
        for v in VARIANTS:
            source = K.compile_program(adds_program(v)).get_kernel_source()
            print(v, K.ptxas_info_of_source(source, v))
        return
    from mqa_bwd.bench import SHAPES

    seen = set()  # the adds do not depend on H: one run per (B, S, S_kv, L)
    for name in a.shapes.split(","):
        for shape in SHAPES[name]:
            key = tuple(shape[k] for k in ("B", "S", "S_kv", "L"))
            if key not in seen:
                seen.add(key)
                time_floor(shape, a.repeats)


if __name__ == "__main__":
    main()
