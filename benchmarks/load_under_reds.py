"""How long one global load waits while reductions are under way: on its own SM, elsewhere, nowhere.

    python benchmarks/load_under_reds.py [--iterations 4000] [--probes 48]     # GPU
    python benchmarks/load_under_reds.py --compile-only                       # CPU: nvcc only

A question from the block timeline (docs/performance-log.md, thirty-sixth session): every step of
the wide tile's row change that waits on a global memory instruction takes thousands of cycles,
whatever the instruction's count, and L2 prefetches did not shorten them. Either the L2 is slow to
answer under the adds' load, or the load waits in its own SM's queue behind that SM's reductions.

One CTA of 256 threads an SM. Warps 0-6 of a "busy" CTA send red.global.add.u64, a whole line a
warp instruction (the lanes' adds), to rows spread over a 192 MiB buffer; warp 7's lane 0 times
dependent loads (ld.global.cg, so from the L2) of a small table that stays in the L2, one every
few hundred cycles, in clock64 cycles from issue to use; or the same words by a 16-byte bulk copy
(cp.async.bulk, the TMA's path) waited for on an mbarrier. Launches: nobody busy (the latency on an
idle GPU), every other CTA busy and three in four (an idle CTA's probe sees the L2 loaded by the
busy ones, without reductions of its own SM ahead of it), every CTA busy (the main kernel's case).
Per launch, the medians and 90th percentiles over every CTA's probes, the busy CTAs' and the idle
CTAs' apart, and the launch's rate of reductions (the busy warps' lines over its time; the probes
end well before the reductions do).
"""

import argparse
import itertools

import numpy as np

from mqa_bwd import kernels as K

PROBE_SOURCE = r"""
// A warp's line of reductions: 32 lanes x 8 bytes, two 128-byte lines of one row.
__device__ __forceinline__ void probe_red_line(unsigned long long* words, unsigned long long row, int lane) {
  asm volatile("red.global.add.u64 [%0], 1;" :: "l"(words + row * 288 + (lane & 31)) : "memory");
}
__device__ __forceinline__ long long probe_clock() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}
// One 16-byte bulk copy (the TMA's, cp.async.bulk) of table + at into shared memory, waited for on
// an mbarrier of phase `phase`: the loaded word.
__device__ __forceinline__ int probe_bulk_load(const int* table, int at, int phase) {
  __shared__ alignas(16) int landed[4];
  __shared__ alignas(8) unsigned long long bar;
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(landed));
  if (phase < 0) {  // first use
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n\tfence.mbarrier_init.release.cluster;" :: "r"(b) : "memory");
    return 0;
  }
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 16;" :: "r"(b) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 16, [%2];"
               :: "r"(dst), "l"(table + (at & ~3)), "r"(b) : "memory");
  asm volatile("{\n\t.reg .pred done;\n\twait:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra wait;\n\t}" :: "r"(b), "r"(phase & 1) : "memory");
  return landed[at & 3];
}
// Warps 0-6 of a busy CTA: `iterations` lines each, to rows from a hash of (CTA, warp, step).
// Warp 7's lane 0: `probes` timed dependent loads of `table` (ld.global.cg, or with bulk a 16-byte
// bulk copy waited for on an mbarrier), spaced by a spin. Busy: every CTA (mode 1), every other
// (2), three in four (3), none (0).
__device__ __forceinline__ void probe_body(const void* words_, const void* table_, const void* out_, int rows,
                                           int iterations, int probes, int mode, int cta, int bulk) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const bool busy = mode == 1 || (mode == 2 && (cta & 1) == 0) || (mode == 3 && (cta & 3) != 0);
  unsigned long long* words = const_cast<unsigned long long*>(static_cast<const unsigned long long*>(words_));
  const int* table = static_cast<const int*>(table_);
  long long* out = const_cast<long long*>(static_cast<const long long*>(out_)) + static_cast<long long>(cta) * (probes + 1);
  if (warp < 7) {
    if (!busy) return;
    unsigned h = 2654435761u * (cta * 8 + warp + 1);
    for (int i = 0; i < iterations; ++i) {
      h = h * 1664525u + 1013904223u;
      probe_red_line(words, h % static_cast<unsigned>(rows), lane);
    }
    return;
  }
  if (lane != 0) return;
  int at = cta & 1023;
  if (bulk) probe_bulk_load(table, at, -1);
  long long spin_until = probe_clock() + 20000;  // the busy warps' reductions are under way by then
  while (probe_clock() < spin_until) {}
  for (int k = 0; k < probes; ++k) {
    const long long t0 = probe_clock();
    int v;
    if (bulk) {
      v = probe_bulk_load(table, at, k);
    } else {
      asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(table + at) : "memory");
    }
    at = (v + k) & 1023;  // the next address depends on this load
    // The clock is read under a predicate formed from the loaded value: after the load returns.
    long long t1;
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ge.s32 p, %1, 0;\n\t@p mov.u64 %0, %%clock64;\n\t@!p mov.u64 %0, 0;\n\t}"
                 : "=l"(t1) : "r"(v) : "memory");
    out[k] = t1 - t0;
    spin_until = t1 + 400;
    while (probe_clock() < spin_until) {}
  }
  out[probes] = busy;
}
"""
MODES = {0: "nobody busy", 2: "every other CTA busy", 3: "three CTAs in four busy", 1: "every CTA busy"}


def cycle_figures(cycles) -> str:
    """A probe's timed cycles as this tool prints them: median, 90th percentile and maximum."""
    return f"{np.median(cycles):6.0f} cycles median, p90 {np.percentile(cycles, 90):7.0f}, max {cycles.max():7.0f}"


def timed_launch(launch) -> float:
    """Milliseconds of one call of ``launch`` (a probe's launch), after a warm-up call, by CUDA events."""
    import torch

    launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def probe_cli(doc: str, label: str, build, run, **counts) -> None:
    """A probe's command line: an int option a ``counts`` entry (name: (default, help)) and
    --compile-only, which builds ``build(args)``'s program for sm_90a and prints what ptxas gave
    it (no GPU); otherwise ``run(args)``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (default, text) in counts.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=text)
    parser.add_argument("--compile-only", action="store_true", help="build the kernel for sm_90a and stop (CPU)")
    args = parser.parse_args()
    if args.compile_only:
        print(K.ptxas_info_of_source(K.compile_program(build(args)).get_kernel_source(), label))
    else:
        run(args)


def probe_program(probes: int):
    tilelang, T = K._tl()
    CTAS, ROWS, N = T.dynamic("CTAS"), T.dynamic("ROWS"), T.dynamic("N")

    @T.prim_func
    def probe(Words: T.Tensor((N,), "int64"), Table: T.Tensor((1024,), "int32"), Out: T.Tensor((CTAS, probes + 1), "int64"),
              rows: T.int32, iterations: T.int32, mode: T.int32, bulk: T.int32):
        with T.Kernel(CTAS, threads=256) as cta:
            T.import_source(PROBE_SOURCE)
            T.call_extern("handle", "probe_body", Words.data, Table.data, Out.data, rows, iterations, probes, mode, cta,
                          bulk)

    return probe


def run(iterations: int, probes: int) -> None:
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = (192 << 20) // (288 * 8)
    kernel = K.compile_program(probe_program(probes))
    words = torch.zeros((rows * 288,), dtype=torch.int64, device="cuda")
    table = torch.randint(0, 1024, (1024,), dtype=torch.int32, device="cuda")
    print(f"{sms} CTAs of 256 threads; busy warps send {iterations} lines each; {probes} probes a CTA")
    for (mode, name), bulk in itertools.product(MODES.items(), (0, 1)):
        out = torch.zeros((sms, probes + 1), dtype=torch.int64, device="cuda")
        ms = timed_launch(lambda: kernel(words, table, out, rows, iterations, mode, bulk))
        result = out.cpu().numpy()
        busy = result[:, probes].astype(bool)
        # The L2's rate of reductions: the busy warps' lines over the launch (probes end first).
        rate = int(busy.sum()) * 7 * iterations * 256 / (ms * 1e-3) / 1e12
        for label, sel in (("busy CTAs", busy), ("idle CTAs", ~busy)):
            if sel.any():
                cycles = result[sel, :probes].ravel()
                print(f"  {name:<24} {label:<10} {'bulk copy' if bulk else 'load':<9} {cycle_figures(cycles)}  "
                      f"({ms:.2f} ms, reductions {rate:.2f} TB/s)")


def main():
    probe_cli(__doc__, "load_under_reds", lambda a: probe_program(a.probes), lambda a: run(a.iterations, a.probes),
              iterations=(4000, "lines each busy warp sends"), probes=(48, "timed loads a CTA"))


if __name__ == "__main__":
    main()
