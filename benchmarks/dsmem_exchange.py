"""What a block's exchange of fp32 partials between the two CTAs of a cluster costs, under the adds' load.

    python benchmarks/dsmem_exchange.py [--iterations 200] [--lines 24000]    # GPU
    python benchmarks/dsmem_exchange.py --compile-only                         # CPU: nvcc only

The column-split tile (docs/performance-log.md, forty-first session) has the two CTAs of a
cluster each form S and dP over half of a query row's columns and swap those fp32 partials,
2 x 16 KB each way a block, before the softmax. Whether that pays depends on how long the swap
takes while every SM also sends dKV reductions, against a block's some 6,500 cycles.

A persistent grid of clusters of two, one CTA of 256 threads an SM. Warpgroup 0 of a busy CTA
sends whole-line red.global.add.u64 (the lanes' adds) to rows spread over a 192 MiB buffer,
``lines`` per warp. Warpgroup 1 runs ``iterations`` exchanges: each thread writes 256 bytes of
the CTA's 32 KB partials into the partner's inbox, the partner's mbarrier completes once all of
them have landed, the thread waits on its own inbox's mbarrier, reads its 256 bytes of the
partner's partials and frees the inbox for the partner's next write. Three ways to write: st
(``st.shared::cluster.v4`` stores, then one release-arrive a thread on the partner's barrier),
st.async (``st.async...mbarrier::complete_tx::bytes.v4``, the barrier counting the bytes) and
bulk (the thread stages its 256 bytes in its own CTA's shared memory, then each warp's lane 0
sends the warp's 8 KB by one ``cp.async.bulk.shared::cluster.shared::cta`` completing its bytes
on the partner's barrier: the TMA's path).
Thread 0 of warpgroup 1 stamps clock64 before its first write and after its read of each
exchange: per launch the median and 90th percentile of an exchange's cycles, with and without
the adds (with them, only the exchanges that ended before the CTA's warp 0 sent its last add),
and the adds' rate.
"""

import itertools
import os
import sys

from mqa_bwd import kernels as K

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_under_reds import cycle_figures, probe_cli, timed_launch  # noqa: E402

#: fp32 words a CTA sends a block: S's and dP's 64 heads x 64 slots.
WORDS = 2 * 64 * 64
EXCHANGE_THREADS = 128
#: How a CTA writes its partials into the partner's inbox (the kernel's ``via``).
VIAS = {0: "st", 1: "st.async", 2: "bulk"}

PROBE_SOURCE = r"""
#define XCH_WORDS %(words)d
#define XCH_THREADS %(threads)d
__device__ __forceinline__ long long xch_clock() {
  long long t;
  asm volatile("mov.u64 %%0, %%%%clock64;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned xch_rank() {
  unsigned r;
  asm volatile("mov.u32 %%0, %%%%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned xch_remote(unsigned local, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %%0, %%1, %%2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ void xch_wait(unsigned bar, int parity) {
  asm volatile("{\n\t.reg .pred done;\n\twait:\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%%0], %%1;\n\t"
               "@!done bra wait;\n\t}" :: "r"(bar), "r"(parity & 1) : "memory");
}
__device__ __forceinline__ void xch_arrive_remote(unsigned remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%%0];" :: "r"(remote_bar) : "memory");
}
__device__ __forceinline__ void xch_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Warpgroup 0 of a busy CTA: `lines` whole-line reductions a warp to rows hashed from (CTA, warp,
// step). Warpgroup 1: `iterations` exchanges of XCH_WORDS fp32 with the partner CTA (rank ^ 1),
// written by st.shared::cluster (via 0), st.async (via 1) or a bulk copy a warp from the staged
// outbox (via 2). Inbox and outbox: XCH_WORDS fp32 of the CTA's shared memory each (TileLang's
// dynamic allocation: both would pass the static limit). Out[cta][k]: exchange k's cycles on
// thread 128, Out[cta][iterations + k] the clock at its end; [2 iterations]: the sum of what was
// read (keeps the reads), [2 iterations + 1]: the clock at which warp 0 sent its last add (0 idle).
__device__ __forceinline__ void xch_body(const void* words_, const void* out_, const void* inbox_, const void* outbox_,
                                         int rows, int lines, int iterations, int busy_mode, int via, int cta) {
  const float* inbox = static_cast<const float*>(inbox_);
  float4* outbox = const_cast<float4*>(static_cast<const float4*>(outbox_));
  __shared__ alignas(8) unsigned long long full, empty;
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const bool busy = busy_mode != 0;
  long long* out = const_cast<long long*>(static_cast<const long long*>(out_)) + static_cast<long long>(cta) * (2 * iterations + 2);
  const unsigned rank = xch_rank(), partner = rank ^ 1u;
  const unsigned full_bar = static_cast<unsigned>(__cvta_generic_to_shared(&full));
  const unsigned empty_bar = static_cast<unsigned>(__cvta_generic_to_shared(&empty));
  const unsigned inbox_at = static_cast<unsigned>(__cvta_generic_to_shared(inbox));
  if (t == 0) {
    // full: the partner's writes (st: 128 arrivals; st.async: one local arrival with the bytes);
    // empty: the partner's 128 threads have read what this CTA wrote into their inbox.
    asm volatile("mbarrier.init.shared::cta.b64 [%%0], %%1;" :: "r"(full_bar), "r"(via ? 1 : XCH_THREADS) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%%0], %%1;" :: "r"(empty_bar), "r"(XCH_THREADS) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  xch_cluster_sync();
  if (warp < 4) {
    if (busy) {
      unsigned long long* words = const_cast<unsigned long long*>(static_cast<const unsigned long long*>(words_));
      unsigned h = 2654435761u * (cta * 8 + warp + 1);
      for (int i = 0; i < lines; ++i) {
        h = h * 1664525u + 1013904223u;
        asm volatile("red.global.add.u64 [%%0], 1;" :: "l"(words + (h %% static_cast<unsigned>(rows)) * 288ull + lane) : "memory");
      }
      if (t == 0) out[2 * iterations + 1] = xch_clock();
    }
  } else {
    const int x = t - 128;
    const unsigned remote_inbox = xch_remote(inbox_at, partner), remote_full = xch_remote(full_bar, partner);
    const unsigned remote_empty = xch_remote(empty_bar, partner);
    float sum = 0.0f;
    long long spin_until = xch_clock() + 20000;  // the adds are under way by then
    while (xch_clock() < spin_until) {}
    for (int k = 0; k < iterations; ++k) {
      if (k > 0) xch_wait(empty_bar, k - 1);  // the partner has read this CTA's last write
      const long long t0 = xch_clock();
      if (via && x == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;" :: "r"(full_bar), "r"(XCH_WORDS * 4) : "memory");
#pragma unroll
      for (int i = 0; i < XCH_WORDS / 4 / XCH_THREADS; ++i) {
        const unsigned at = remote_inbox + 16u * static_cast<unsigned>(i * XCH_THREADS + x);
        const float a = static_cast<float>(k + i), b = a + 1.0f, c = a + 2.0f, d = a + 3.0f;
        if (via == 2)  // a warp's slice is contiguous: lane l's i-th vector at (warp, i, l)
          outbox[(x >> 5) * (XCH_WORDS / 4 / 4) + i * 32 + (x & 31)] = make_float4(a, b, c, d);
        else if (via)
          asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%%0], {%%1, %%2, %%3, %%4}, [%%5];"
                       :: "r"(at), "f"(a), "f"(b), "f"(c), "f"(d), "r"(remote_full) : "memory");
        else
          asm volatile("st.shared::cluster.v4.f32 [%%0], {%%1, %%2, %%3, %%4};" :: "r"(at), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
      }
      if (via == 2) {
        // The staged vectors reach the async proxy, then lane 0 sends the warp's 8 KB and waits
        // until the copy has read them (the outbox is rewritten next round).
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
        if ((x & 31) == 0) {
          const unsigned slice = 16u * static_cast<unsigned>((x >> 5) * (XCH_WORDS / 4 / 4));
          const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(outbox)) + slice;
          asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];\n\t"
                       "cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read 0;"
                       :: "r"(remote_inbox + slice), "r"(src), "r"(XCH_WORDS * 4 / (XCH_THREADS / 32)), "r"(remote_full) : "memory");
        }
        __syncwarp();
      }
      if (!via) xch_arrive_remote(remote_full);
      xch_wait(full_bar, k);
#pragma unroll
      for (int i = 0; i < XCH_WORDS / 4 / XCH_THREADS; ++i) {
        const float4 v = reinterpret_cast<const float4*>(inbox)[i * XCH_THREADS + x];
        sum += v.x + v.y + v.z + v.w;
      }
      xch_arrive_remote(remote_empty);  // release: the reads above come before the partner's next write
      if (x == 0) {
        const long long t1 = xch_clock();
        out[k] = t1 - t0;
        out[iterations + k] = t1;
      }
    }
    if (x == 0) out[2 * iterations] = static_cast<long long>(sum);
  }
  xch_cluster_sync();  // neither CTA leaves while the other may still write into its inbox
}
"""


def probe_program(iterations: int):
    tilelang, T = K._tl()
    CTAS, N = T.dynamic("CTAS"), T.dynamic("N")
    source = PROBE_SOURCE % {"words": WORDS, "threads": EXCHANGE_THREADS}

    @T.prim_func
    def probe(Words: T.Tensor((N,), "int64"), Out: T.Tensor((CTAS, 2 * iterations + 2), "int64"), rows: T.int32,
              lines: T.int32, busy: T.int32, via: T.int32):
        with T.Kernel(CTAS, threads=256, cluster_dims=2) as cta:
            inbox = T.alloc_shared((WORDS,), "float32")
            outbox = T.alloc_shared((WORDS,), "float32")
            T.import_source(source)
            T.call_extern("handle", "xch_body", Words.data, Out.data, T.address_of(inbox[0]), T.address_of(outbox[0]),
                          rows, lines, iterations, busy, via, cta)

    return probe


def run(iterations: int, lines: int) -> None:
    import torch

    ctas = torch.cuda.get_device_properties(0).multi_processor_count // 2 * 2
    rows = (192 << 20) // (288 * 8)
    kernel = K.compile_program(probe_program(iterations))
    words = torch.zeros((rows * 288,), dtype=torch.int64, device="cuda")
    print(f"{ctas} CTAs in clusters of two; {WORDS * 4 // 1024} KB each way an exchange; busy warps send {lines} lines each")
    for busy, via in itertools.product((0, 1), VIAS):
        out = torch.zeros((ctas, 2 * iterations + 2), dtype=torch.int64, device="cuda")
        ms = timed_launch(lambda: kernel(words, out, rows, lines, busy, via))
        result = out.cpu().numpy()
        cycles, ends, adds_end = result[:, :iterations], result[:, iterations:2 * iterations], result[:, -1:]
        # Under load: the exchanges that ended before their CTA's warp 0 sent its last add.
        kept = cycles[ends < adds_end] if busy else cycles.ravel()
        rate = ctas * 4 * lines * 256 / (ms * 1e-3) / 1e12 if busy else 0.0
        share = f", {kept.size} of {cycles.size} while adding" if busy else ""
        if kept.size == 0:
            print(f"  {'adds under way':<15} {VIAS[via]:<9} no exchange ended while adding: raise --lines")
            continue
        print(f"  {'adds under way' if busy else 'no adds':<15} {VIAS[via]:<9} exchange "
              f"{cycle_figures(kept)}{share}  ({ms:.2f} ms, reductions {rate:.2f} TB/s)")


def main():
    probe_cli(__doc__, "dsmem_exchange", lambda a: probe_program(a.iterations), lambda a: run(a.iterations, a.lines),
              iterations=(200, "exchanges a CTA"), lines=(24000, "lines each busy warp sends (enough to outlast the exchanges)"))


if __name__ == "__main__":
    main()
