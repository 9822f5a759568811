"""Which warpgroup handoffs compute-sanitizer's racecheck can check (GPU only).

    python benchmarks/racecheck_handoff.py

The split wide tile (kernels.main_bwd's 64-head tile before kernels/wide.py) handed P from one
warpgroup to the other through shared memory. Built first under named barriers (the
producer's bar.arrive, the consumer's bar.sync), racecheck reported the
handoffs as hazards, while synccheck passed and the outputs had the same
bits as the unsplit kernel. This probe tells a racecheck blind spot from a
real race: one 256-thread CTA whose warpgroups hand a shared buffer over
(each thread reads another thread's word), ordered by

  sync         one __syncthreads that both warpgroups reach (the reference)
  arrive       the producer's bar.arrive, the consumer's bar.sync (PTX's
               .aligned forms)
  barrier_cta  the same with the non-aligned barrier.cta.arrive / .sync
  mbarrier     mbarrier.arrive (release) and try_wait.parity (acquire)
  none         nothing (racecheck must report this one)
  sync_wgmma   sync, with a group of wgmmas (reading other shared memory)
               issued before the reads and waited for after them, before
               the barrier: the overlap variant's dKV GEMMs and adds (README)
  sync_wgmma_waited  the same wgmmas waited for before the reads

both ways, as the tile's handoffs between its warpgroups: warpgroup 1
reads, then lets warpgroup 0 overwrite; warpgroup 0 writes, then lets
warpgroup 1 read. Only the cross-warpgroup ordering is modelled: each thread
here writes words no thread of its own warpgroup reads, so the probe's
mbarriers take the other warpgroup's arrivals alone, where the tile's first
takes all 256 threads' (its warpgroup 0 overwrites words its own warps add). It prints, for
each, racecheck's hazard count and how many reads missed their value.

On the H200 (compute-sanitizer of CUDA 13.0): sync 0 hazards, arrive 1,
barrier_cta 1, mbarrier 0, none 1 (64 wrong reads; 96 in a later run); no
wrong read but for none. Racecheck does not take a barrier arrival as
ordering the producer's stores, so the split tile hands over on mbarriers,
which the gate checks. sync_wgmma and sync_wgmma_waited: 0 and 0, with one
wgmma or a chain of 64 in the group: a wgmma in flight across the reads
does not by itself make racecheck report the barrier's ordering.
"""

import re
import subprocess
import tempfile

from mqa_bwd.bench import RACECHECK_HAZARDS, build_cuda_program, compute_sanitizer

PROBE = r"""
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <cuda_runtime.h>

enum Handoff { SYNC, ARRIVE, BARRIER_CTA, MBARRIER, NONE, SYNC_WGMMA, SYNC_WGMMA_WAITED, KINDS };

__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// A wgmma descriptor of a no-swizzle tile at ``p``: core matrices of 8 rows x 16
// bytes, 128 bytes apart along K (LBO) and 256 along M or N (SBO).
__device__ __forceinline__ uint64_t tile_desc(const void* p) {
  return ((smem_addr(p) & 0x3FFFFu) >> 4) | (uint64_t(128 >> 4) << 16) | (uint64_t(256 >> 4) << 32);
}

// Each warpgroup issues WGMMA_CHAIN asynchronous m64n8k16 bf16 wgmmas reading ``tiles`` (A: 2 KB,
// then B) as one group, still in flight while the reads that follow run, as the overlap variant's
// dKV GEMMs are (fence.proxy.async first: the tiles were written by generic stores).
#define WGMMA_CHAIN 64
__device__ __forceinline__ void wgmma_issue(const void* tiles, float* acc) {
  uint64_t a = tile_desc(tiles), b = tile_desc(static_cast<const char*>(tiles) + 2048);
  asm volatile("fence.proxy.async.shared::cta;\nwgmma.fence.sync.aligned;" ::: "memory");
  for (int i = 0; i < WGMMA_CHAIN; ++i)
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %6, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0; }"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]) : "l"(a), "l"(b), "r"(0) : "memory");
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait(float* acc) {
  asm volatile("wgmma.wait_group.sync.aligned 0;" : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]) :: "memory");
}

// One handoff from the producer warpgroup to the other, on barrier ``id``
// (named barrier id + 1, or mbarrier bars[id]); every thread calls it.
__device__ __forceinline__ void handoff(int kind, bool producer, int id, uint64_t* bars) {
  if (kind == SYNC || kind == SYNC_WGMMA || kind == SYNC_WGMMA_WAITED) {
    __syncthreads();
  } else if (kind == ARRIVE) {  // the .aligned forms (the split tile's first version)
    if (producer) asm volatile("bar.arrive %0, 256;" :: "r"(id + 1) : "memory");
    else asm volatile("bar.sync %0, 256;" :: "r"(id + 1) : "memory");
  } else if (kind == BARRIER_CTA) {  // the non-aligned forms
    if (producer) asm volatile("barrier.cta.arrive %0, 256;" :: "r"(id + 1) : "memory");
    else asm volatile("barrier.cta.sync %0, 256;" :: "r"(id + 1) : "memory");
  } else if (kind == MBARRIER) {  // 128 arrivals (release), then a wait on phase 0 (acquire)
    if (producer) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bars + id)) : "memory");
    } else {
      unsigned done = 0;
      while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(bars + id)) : "memory");
      }
    }
  }
}

// The split tile's two handoffs: warpgroup 1 reads the buffer, then lets
// warpgroup 0 overwrite it (write after read); warpgroup 0 writes it, then
// lets warpgroup 1 read (read after write). Each reads another thread's word.
__global__ void probe(int kind, float* out) {
  __shared__ float buf[128];
  __shared__ uint64_t bars[2];
  __shared__ __align__(128) unsigned short tiles[1152];  // wgmma's A (64 x 16) and B (16 x 8), bf16 zeros
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int t = threadIdx.x;
  for (int i = t; i < 1152; i += 256) tiles[i] = 0;
  if (t < 128) buf[t] = -1.0f - t;
  if (kind == MBARRIER && t == 0) {
    for (int i = 0; i < 2; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;" :: "r"(smem_addr(bars + i)) : "memory");
  }
  __syncthreads();
  // The wgmma kinds: a wgmma in flight while the reads below run and waited
  // for before the barrier (the overlap variant's dKV chunk GEMM and adds),
  // or waited for before the reads.
  if (kind == SYNC_WGMMA || kind == SYNC_WGMMA_WAITED) wgmma_issue(tiles, acc);
  if (kind == SYNC_WGMMA_WAITED) wgmma_wait(acc);
  float old = 0.0f;
  if (t >= 128) old = buf[255 - t];
  if (kind == SYNC_WGMMA) wgmma_wait(acc);
  handoff(kind, t >= 128, 0, bars);
  if (t < 128) buf[t] = 1.0f + t;
  handoff(kind, t < 128, 1, bars);
  if (t >= 128) {
    out[2 * (t - 128)] = old + (acc[0] + acc[1] + acc[2] + acc[3]);  // the zero tiles add 0
    out[2 * (t - 128) + 1] = buf[255 - t];
  }
}

int main(int argc, char** argv) {
  const char* names[KINDS] = {"sync", "arrive", "barrier_cta", "mbarrier", "none", "sync_wgmma", "sync_wgmma_waited"};
  int kind = -1;
  for (int k = 0; k < KINDS; ++k) if (argc > 1 && !strcmp(argv[1], names[k])) kind = k;
  if (kind < 0) { fprintf(stderr, "usage: %s sync|arrive|barrier_cta|mbarrier|none|sync_wgmma|sync_wgmma_waited\n", argv[0]); return 2; }
  float* out;
  float host[256];
  if (cudaMalloc(&out, sizeof(host)) != cudaSuccess) return 3;
  probe<<<1, 256>>>(kind, out);
  if (cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost) != cudaSuccess) return 3;
  int wrong = 0;  // reader i = t - 128 reads word 127 - i: first its old value, then the new one
  for (int i = 0; i < 128; ++i) wrong += (host[2 * i] != -128.0f + i) + (host[2 * i + 1] != 128.0f - i);
  printf("%s wrong %d\n", names[kind], wrong);
  return 0;
}
"""

HANDOFFS = ("sync", "arrive", "barrier_cta", "mbarrier", "none", "sync_wgmma", "sync_wgmma_waited")


def build_probe(directory: str) -> str:
    """The probe program, built for sm_90a in ``directory``: its path."""
    return build_cuda_program(PROBE, directory, "handoff")


def racecheck(exe: str, handoff: str) -> tuple:
    """(racecheck's hazard count, the probe's count of reads that missed their write) for one handoff."""
    tool = compute_sanitizer()
    if tool is None:
        raise RuntimeError("racecheck_handoff needs compute-sanitizer (CUDA toolkit)")
    done = subprocess.run([tool, "--tool", "racecheck", exe, handoff], capture_output=True, text=True, timeout=300)
    found, wrong = re.search(RACECHECK_HAZARDS, done.stdout), re.search(rf"{handoff} wrong (\d+)", done.stdout)
    if not (found and wrong) or done.returncode:
        raise RuntimeError(f"no racecheck summary or probe output for {handoff}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return int(found.group(1)), int(wrong.group(1))


def main():
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_probe(tmp)
        print(f"{'handoff':<12} {'racecheck hazards':>18} {'wrong reads':>12}")
        results = {handoff: racecheck(exe, handoff) for handoff in HANDOFFS}
        for handoff, (hazards, wrong) in results.items():
            print(f"{handoff:<12} {hazards:>18} {wrong:>12}")
    if results["none"][0] == 0 or results["sync"][0] != 0:
        print("racecheck missed the race in 'none' or saw one in 'sync': its other counts say nothing here")


if __name__ == "__main__":
    main()
