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
  f32x4 x2 the same kernel launched twice: the control's adds at H=64
  indices  the index loads and barriers alone

Whatever the GEMMs cost, a design that issues these adds cannot be faster
than their time here (they overlap the GEMMs at best), so the 3.7 ms the
tensor cores need (issue 6) is out of reach while the floor is above it.
Measured on the H200 at dsv32 (B=1, S=4096, S_kv=8192, L=2048): u64 10.20
ms (3.8 TB/s of adds), f32x4 4.57, f32x4 x2 9.12, indices 0.06; fleet: 6.34,
2.88, 5.74, 0.04. Another run at dsv32: u64 10.24, u64pair 5.40, u32 5.17,
f32x4 4.61, f32x4 x2 9.11, indices 0.10: the L2 reduction time follows the
bytes (3.6-4.2 TB/s), not the instruction's width.
"""

import argparse
import statistics

from mqa_bwd import kernels as K

ADD_SOURCE = r"""
__device__ __forceinline__ void mqa_red4_ones(void* dst) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(dst), "f"(1.0f) : "memory");
}
"""
VARIANTS = ("u64", "u64pair", "u32", "f32x4", "indices")
DTYPES = {"f32x4": "float32", "u32": "int32"}  # the others add into int64


def adds_program(variant: str, d_k: int = 576, slots: int = 32, threads: int = 256):
    """One CTA per query row issuing ``variant``'s adds for every valid slot of the row."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} (one of {VARIANTS})")
    tilelang, T = K._tl()
    R, NKV, Lp = T.dynamic("R"), T.dynamic("NKV"), T.dynamic("Lp")
    BS, n_warps = slots, threads // 32

    @T.prim_func
    def adds(Indices: T.Tensor((R, Lp), "int32"), dKV: T.Tensor((NKV, d_k), DTYPES.get(variant, "int64"))):
        with T.Kernel(R, threads=threads) as r:
            slot = T.alloc_shared((BS,), "int32")
            kv_row = T.alloc_local((1,), "int32")
            warp = T.get_thread_binding() // 32
            lane = T.get_thread_binding() % 32
            T.import_source(ADD_SOURCE)
            for t in T.serial(Lp // BS):
                for j in T.Parallel(BS):
                    slot[j] = Indices[r, t * BS + j]
                T.sync_threads()
                for s_i in T.serial(BS // n_warps):
                    kv_row[0] = slot[warp + s_i * n_warps]
                    if (kv_row[0] >= 0) and (kv_row[0] < NKV) and (variant != "indices"):
                        if variant == "u64":
                            for c in T.unroll(d_k // 32):
                                T.atomic_add(dKV[kv_row[0], c * 32 + lane], T.cast(lane + 1, "int64"))
                        elif variant == "u64pair":  # two columns a lane: the row's first d_k / 2 words
                            for c in T.unroll(d_k // 64):
                                T.atomic_add(dKV[kv_row[0], c * 32 + lane], T.cast(lane + 1, "int64"))
                        elif variant == "u32":
                            for c in T.unroll(d_k // 32):
                                T.atomic_add(dKV[kv_row[0], c * 32 + lane], T.cast(lane + 1, "int32"))
                        else:
                            for c in T.unroll(d_k // 128):
                                T.call_extern("handle", "mqa_red4_ones", T.address_of(dKV[kv_row[0], c * 128 + lane * 4]))
                T.sync_threads()

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
    acc["indices"] = acc["u64pair"] = acc["u64"]
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
