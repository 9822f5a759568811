"""How many SMs a cluster launch of the main kernel can keep busy (GPU only).

    python benchmarks/cluster_occupancy.py [--threads 256]

A thread block cluster is placed on SMs of one GPC, so when the kernel's
shared memory allows one CTA per SM, a GPC whose SM count is not a multiple
of the cluster size leaves SMs idle that a launch without clusters would use.
For every main_bwd configuration of the wrapper's widths and head tiles, this
prints the CTA's dynamic shared memory and, for clusters of 1, 2 and 4 CTAs of
that size, ``cudaOccupancyMaxActiveClusters`` times the cluster size: the SMs
such a launch keeps busy, against the device's SM count. It compiles a probe
kernel with the same launch shape (threads, shared memory, cluster) with nvcc
and runs it; the probe does no work, only the occupancy query matters.

On the H200 (132 SMs), for every configuration (118 to 228 KB, one CTA per
SM): clusters of 1 and 2 keep 132 SMs busy, clusters of 4 only 120. That is
why one cluster of four head groups at dsv32 H=128 (half the adds of two
clusters of two) is slower: 53.40 against 51.63 ms (cluster_ab.py).
"""

import argparse
import subprocess
import tempfile

PROBE = r"""
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__global__ void probe(int* out) { extern __shared__ int smem[]; if (out) out[0] = smem[0]; }

int main(int argc, char** argv) {
  int threads = atoi(argv[1]), device = 0, sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  printf("SMs %d\n", sms);
  for (int a = 2; a < argc; ++a) {
    int smem = atoi(argv[a]);
    cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    printf("smem %d", smem);
    for (int size = 1; size <= 4; size *= 2) {
      cudaLaunchConfig_t config = {};
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = size; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
      config.gridDim = dim3(size * 1024, 1, 1);
      config.blockDim = dim3(threads, 1, 1);
      config.dynamicSmemBytes = smem;
      config.attrs = &attr;
      config.numAttrs = 1;
      int clusters = 0;
      cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, probe, &config);
      if (err != cudaSuccess) { printf(" cluster %d: %s", size, cudaGetErrorString(err)); continue; }
      printf(" cluster%d %d", size, clusters * size);
    }
    printf("\n");
  }
  return 0;
}
"""


def main_kernel_shared_bytes() -> dict:
    """config -> dynamic shared memory bytes of every main_bwd configuration (compiles them)."""
    from mqa_bwd import kernels as K

    return {c: K.dynamic_shared_bytes(K.compiled(*c)) for c in K.gpu_configs() if c[0] == "main_bwd"}


def build_probe(directory: str) -> str:
    """The probe program, built for sm_90a in ``directory``: its path."""
    from mqa_bwd.bench import build_cuda_program

    return build_cuda_program(PROBE, directory, "probe")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=256)
    a = parser.parse_args()
    sizes = main_kernel_shared_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_probe(tmp)
        distinct = sorted(set(sizes.values()))
        report = subprocess.run([exe, str(a.threads)] + [str(s) for s in distinct], check=True, capture_output=True,
                                text=True).stdout
    print(report.strip())
    print("configurations per shared-memory size:")
    for smem in distinct:
        names = ["-".join(map(str, c[1:])) for c, s in sizes.items() if s == smem]
        print(f"  {smem:>7} bytes: {', '.join(names)}")


if __name__ == "__main__":
    main()
