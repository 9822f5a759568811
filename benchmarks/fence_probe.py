"""What a fence costs a thread with its 64-bit reductions still in flight (GPU).

    python benchmarks/fence_probe.py                 # GPU
    python benchmarks/fence_probe.py --compile-only  # CPU: nvcc only

The main kernel's adds are fire-and-forget `red.global.add.u64`: nothing
waits for them, unless an instruction after them must. This probe issues N
reductions per thread (132 CTAs of 256 threads, each thread its own words),
then times, with clock64, one of:

  nothing            the two clock reads alone
  fence.proxy.async  what TileLang emits before every wgmma whose operands
                     generic stores may have written (MEMBAR.ALL.CTA in SASS)
  threadfence_block  __threadfence_block (MEMBAR.SC.CTA)
  syncthreads        a CTA barrier
  threadfence        __threadfence (MEMBAR.SC.GPU): what a release at cluster
                     or GPU scope compiles to, `barrier.cluster.arrive.release`
                     included (MEMBAR.ALL.GPU)

On the H200 (median thread, cycles; 0 / 4 / 16 / 48 reductions in flight):
nothing 131 / 133 / 131 / 131; fence.proxy.async 151 / 175 / 313 / 414;
threadfence_block 150 / 206 / 516 / 479; syncthreads 78 throughout;
threadfence 352 / 981 / 1789 / 3198. A GPU-scope release waits for the
reductions, a CTA-scope fence only partly, a barrier not at all.
"""

import argparse

from mqa_bwd import kernels as K

PROBE_SOURCE = r"""
__device__ void mqa_fence_probe(void* acc, void* out, int mode, int n_red) {
  unsigned long long* base = static_cast<unsigned long long*>(acc) + (blockIdx.x * blockDim.x + threadIdx.x);
  long long total = 0;
  for (int it = 0; it < 64; ++it) {
    for (int i = 0; i < n_red; ++i)
      asm volatile("red.global.add.u64 [%0], %1;" :: "l"(base + (size_t)i * gridDim.x * blockDim.x), "l"(1ull) : "memory");
    long long t1 = clock64();
    if (mode == 1) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    else if (mode == 2) __threadfence_block();
    else if (mode == 3) __syncthreads();
    else if (mode == 4) __threadfence();
    long long t2 = clock64();
    total += t2 - t1;
  }
  static_cast<long long*>(out)[blockIdx.x * blockDim.x + threadIdx.x] = total / 64;
}
"""
MODES = ("nothing", "fence.proxy.async", "threadfence_block", "syncthreads", "threadfence")
IN_FLIGHT = (0, 4, 16, 48)
CTAS, THREADS = 132, 256


def probe_program():
    """One thread per output word: the mean cycles across ``mode``'s instruction after ``n_red`` reductions."""
    tilelang, T = K._tl()
    words = CTAS * THREADS

    @T.prim_func
    def fence_probe(Acc: T.Tensor((words * max(IN_FLIGHT),), "int64"), Out: T.Tensor((words,), "int64"),
                    mode: T.int32, n_red: T.int32):
        with T.Kernel(CTAS, threads=THREADS):
            T.import_source(PROBE_SOURCE)
            T.call_extern("handle", "mqa_fence_probe", T.address_of(Acc[0]), T.address_of(Out[0]), mode, n_red)

    return fence_probe


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true", help="build the probe (nvcc) and stop: no GPU needed")
    a = parser.parse_args()
    kernel = K.compile_program(probe_program())
    if a.compile_only:
        print(f"compiled fence_probe ({len(kernel.get_kernel_source())} characters of CUDA)")
        return
    import torch

    acc = torch.zeros(CTAS * THREADS * max(IN_FLIGHT), dtype=torch.int64, device="cuda")
    out = torch.zeros(CTAS * THREADS, dtype=torch.int64, device="cuda")
    for mode, name in enumerate(MODES):
        cycles = []
        for n_red in IN_FLIGHT:
            for _ in range(2):  # the first launch warms up
                kernel(acc, out, mode, n_red)
            torch.cuda.synchronize()
            cycles.append(f"{out.float().median().item():6.0f}")
        print(f"{name:<18} cycles across it, median thread, {'/'.join(map(str, IN_FLIGHT))} reductions in flight: "
              + " / ".join(cycles))


if __name__ == "__main__":
    main()
