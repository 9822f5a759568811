"""Would S and dP as one GEMM pay? Warpgroup 0's score chain alone, timed in SM clocks.

    python benchmarks/score_chain.py [--blocks 2000] [--repeats 5]     # GPU
    python benchmarks/score_chain.py --compile-only                     # CPU: nvcc only

Every block, the wide tile's warpgroup 0 forms S = Q KV^T and dP = dO V^T: 36 + 32 m64n64k16
GEMMs from shared memory, each of which reads 4 KB, 32 clocks at the SM's 128 bytes a clock,
while its FLOPs take the tensor cores about as long: the chain runs at par with the shared pipe.
Stacked, S^T = KV Q^T and dP^T = V dO^T share their A operand (KV's first 512 columns): 32
m64n128k16 GEMMs (6 KB in 64 clocks each) and 4 m64n64k16 for S^T's last 64 columns, in an
accumulator of their own (a tile without room to pad dO to 576 columns would do that). The
same FLOPs, 24 % fewer bytes, 36 HGMMAs for 68 (docs/performance-log.md, twenty-third session).

Forms (FORMS):
  separate  today's: S, then dP, each into its own 64 x 64 accumulator
  stacked   S^T and dP^T into one 64 x 128 accumulator, S^T's last columns into a third
each with warpgroup 1 idle or contending: forming, back to back, the six 64 x 64 dKV chunks a
block that it forms in the wide tile (8 m64n64k16 GEMMs each from shared memory, Q^T times a
64 x 64 operand), for twice warpgroup 0's trips, so that it contends until warpgroup 0 is done:
GEMMs back to back without the tile's adds between them, an upper bound on the pressure it puts
on the shared pipe. One persistent CTA an SM; every chain waits for its GEMMs, as warpgroup 0 does
before P. The operands are constants in shared memory (no gather, no softmax: the chain alone),
and every chain adds into the accumulators, which the kernel stores at its end: ptxas drops a
wgmma whose result nobody reads. Per form and contention it prints the
median over CTAs of warpgroup 0's clocks a chain (clock64 around its loop), warpgroup 1's
clocks a block where it contends, the launch's median time, and the stacked form's ratio to the
separate one: below 1 under contention says the shared pipe holds today's chain back. That is
necessary, not sufficient, for the rebuilt tile to pay: its scores come transposed (slots x
heads), which changes the softmax, the mass check, the stores and warpgroup 0's dQ GEMM
(docs/performance-log.md), and takes 32 more accumulator registers a thread.
"""

import argparse
import statistics

from mqa_bwd import kernels as K

FORMS = ("separate", "stacked")
HEADS, SLOTS, D_K, D_V, CHUNK = 64, 64, 576, 512, 64
#: Warpgroup 1's dKV chunks a block in the wide tile at d_k = 576 (config.default_wg0_chunks).
CONTENDER_CHUNKS = 6
#: Every operand element: small enough that thousands of chains' sums stay finite.
OPERAND = 1.0 / 64
#: The accumulators' rows in Sink, a CTA's: the scores' two (or three) and warpgroup 1's.
SINK_ROWS = 2 * SLOTS + CHUNK
#: A chain's FLOPs, either form: S over d_k and dP over d_v, 64 heads x 64 slots.
CHAIN_FLOPS = 2 * HEADS * SLOTS * (D_K + D_V)

CLOCK_SOURCE = r"""
__device__ __forceinline__ long long sc_clock() {
  long long c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory");
  return c;
}
"""


def chain_program(form: str, contended: bool):
    """The kernel of one form (FORMS), warpgroup 1 contending or idle: grid (ctas,), 256 threads;
    Clocks[cta, 0] gets warpgroup 0's clocks over its ``blocks`` chains, Clocks[cta, 1]
    warpgroup 1's over its first ``blocks`` blocks of chunks (not written where it is idle)."""
    if form not in FORMS:
        raise ValueError(f"form: {form!r} (one of {FORMS})")
    tilelang, T = K._tl()
    CTAS = T.dynamic("CTAS")
    f32, bf16, i64 = "float32", "bfloat16", "int64"
    stacked = form == "stacked"

    @T.prim_func
    def chain(Clocks: T.Tensor((CTAS, 2), i64), Sink: T.Tensor((CTAS, SINK_ROWS, 2 * HEADS), f32), blocks: T.int32):
        with T.Kernel(CTAS, threads=256) as cta:
            # Stacked: Q in rows [0, 64), dO in [64, 128) (its columns past D_V unused).
            QdO_s = T.alloc_shared((2 * HEADS if stacked else HEADS, D_K), bf16)
            dO_s = T.alloc_shared((HEADS, D_V), bf16) if not stacked else None
            KV_s = T.alloc_shared((SLOTS, D_K), bf16)
            if stacked:
                acc_sdp = T.alloc_fragment((SLOTS, 2 * HEADS), f32)
                acc_tail = T.alloc_fragment((SLOTS, HEADS), f32)
            else:
                acc_s = T.alloc_fragment((HEADS, SLOTS), f32)
                acc_dp = T.alloc_fragment((HEADS, SLOTS), f32)
            acc_kv = T.alloc_fragment((CHUNK, SLOTS), f32)
            start = T.alloc_local((1,), i64)
            T.import_source(CLOCK_SOURCE)
            for buffer in (QdO_s, KV_s) + ((dO_s,) if not stacked else ()):
                T.fill(buffer, OPERAND)
            if stacked:
                T.clear(acc_sdp)
                T.clear(acc_tail)
            else:
                T.clear(acc_s)
                T.clear(acc_dp)
            T.clear(acc_kv)
            T.sync_threads()
            with T.ws(0):
                start[0] = T.call_extern(i64, "sc_clock")
                for _ in T.unroll(blocks, unroll_factor=1):  # one chain a trip, as in the kernel
                    if stacked:
                        T.wgmma_gemm(KV_s[0:SLOTS, 0:D_V], QdO_s[0:2 * HEADS, 0:D_V], acc_sdp, transpose_B=True)
                        T.wgmma_gemm(KV_s[0:SLOTS, D_V:D_K], QdO_s[0:HEADS, D_V:D_K], acc_tail, transpose_B=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_sdp, num_regs=SLOTS * 2 * HEADS // 128)
                        T.warpgroup_fence_operand(acc_tail, num_regs=SLOTS * HEADS // 128)
                    else:
                        T.wgmma_gemm(QdO_s, KV_s, acc_s, transpose_B=True)
                        T.wgmma_gemm(dO_s, KV_s[0:SLOTS, 0:D_V], acc_dp, transpose_B=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_s, num_regs=HEADS * SLOTS // 128)
                        T.warpgroup_fence_operand(acc_dp, num_regs=HEADS * SLOTS // 128)
                if T.get_thread_binding() == 0:
                    Clocks[cta, 0] = T.call_extern(i64, "sc_clock") - start[0]
                if stacked:
                    T.copy(acc_sdp, Sink[cta, 0:SLOTS, 0:2 * HEADS])
                    T.copy(acc_tail, Sink[cta, SLOTS:2 * SLOTS, 0:HEADS])
                else:
                    T.copy(acc_s, Sink[cta, 0:HEADS, 0:SLOTS])
                    T.copy(acc_dp, Sink[cta, HEADS:2 * HEADS, 0:SLOTS])
            with T.ws(1):
                start[0] = T.call_extern(i64, "sc_clock")
                if contended:
                    # Twice warpgroup 0's trips, so that it contends until warpgroup 0 is done; its
                    # clocks over the first half, which run beside warpgroup 0's chains.
                    for trip in T.unroll(2 * blocks, unroll_factor=1):  # one block's chunks a trip
                        if trip == blocks and T.get_thread_binding() == 128:
                            Clocks[cta, 1] = T.call_extern(i64, "sc_clock") - start[0]
                        for c in T.unroll(CONTENDER_CHUNKS):
                            # A transposed dKV chunk's two GEMMs: Q^T times a heads x slots operand.
                            T.wgmma_gemm(QdO_s[0:HEADS, c * CHUNK:(c + 1) * CHUNK], KV_s[0:HEADS, 0:SLOTS], acc_kv,
                                         transpose_A=True)
                            T.wgmma_gemm(QdO_s[0:HEADS, (c + 1) * CHUNK:(c + 2) * CHUNK], KV_s[0:HEADS, CHUNK:2 * CHUNK],
                                         acc_kv, transpose_A=True)
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc_kv, num_regs=CHUNK * SLOTS // 128)
                T.copy(acc_kv, Sink[cta, 2 * SLOTS:2 * SLOTS + CHUNK, 0:SLOTS])

    return chain


def variants():
    """(form, contended) of every kernel the tool times, in its table's order."""
    return [(form, contended) for contended in (False, True) for form in FORMS]


def time_chains(blocks: int, repeats: int) -> None:
    import torch

    from mqa_bwd import bench

    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    clocks = torch.zeros((ctas, 2), dtype=torch.int64, device="cuda")
    sink = torch.empty((ctas, SINK_ROWS, 2 * HEADS), dtype=torch.float32, device="cuda")
    per_chain = {}
    print(f"{ctas} CTAs, {blocks} chains a CTA, medians of {repeats} launches")
    for form, contended in variants():
        kernel = K.compile_program(chain_program(form, contended))
        launch = lambda: kernel(clocks, sink, blocks)  # noqa: E731
        launch()
        ms = statistics.median(bench.event_time(launch) for _ in range(repeats))
        wg0 = statistics.median(clocks[:, 0].tolist()) / blocks
        wg1 = statistics.median(clocks[:, 1].tolist()) / blocks
        per_chain[form, contended] = wg0
        busy = f", warpgroup 1 {wg1:8.0f} clocks a block" if contended else ""
        print(f"{form:9s} {'contended' if contended else 'alone':9s}: {ms:8.3f} ms, warpgroup 0 {wg0:7.0f} clocks a chain "
              f"({CHAIN_FLOPS / wg0:5.0f} FLOP a clock; the tensor cores' dense bf16 peak is about 4096){busy}")
    for contended in (False, True):
        ratio = per_chain["stacked", contended] / per_chain["separate", contended]
        print(f"stacked / separate, {'contended' if contended else 'alone'}: {ratio:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2000, help="chains (blocks) a CTA")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile-only", action="store_true", help="build every variant for sm_90a and stop (CPU)")
    a = parser.parse_args()
    if a.blocks < 1:
        raise ValueError(f"--blocks: {a.blocks} (at least 1)")
    if a.compile_only:
        for form, contended in variants():
            source = K.compile_program(chain_program(form, contended)).get_kernel_source()
            print(form, "contended" if contended else "alone", K.ptxas_info_of_source(source, form))
        return
    time_chains(a.blocks, a.repeats)


if __name__ == "__main__":
    main()
