"""How fast a few warps an SM feed the L2's reductions, by the form of their add instructions (GPU).

    python benchmarks/red_supply.py [--senders 1,2,4,8] [--mib 2] [--kv-rows 8192] [--burst 16 --gap 2000]   # GPU
    python benchmarks/red_supply.py --compile-only                     # CPU: nvcc only

A question from benchmarks/l2_timeline.py (docs/performance-log.md, thirty-seventh session): the
deterministic kernel holds the L2 at 89 % of its throughput all launch long where the atomic
control and cuDNN hold 93-95 %, and cutting its traffic (whole lines for the unpaired chunk, no
Bound adds) makes it faster without raising that level. In the main kernels only a few warps of
an SM add at a time, and their add instructions carry 8 bytes a lane (the lanes' red.u64) where
cuDNN's and the control's carry 16 (red.v4.f32). If what an SM can have in flight towards the L2
is counted in instructions rather than bytes, 8-byte lanes feed the L2 half as much.

One CTA of 256 threads an SM; ``senders`` of its 8 warps send reductions as fast as they issue,
each the same bytes (--mib), to rows of 2304 bytes (a d_k = 576 row of 4-byte columns) hashed over
--kv-rows rows: 8192 by default, the bench shapes' dKV (18 MiB), which stays in the L2 as the
kernels' does (a buffer past the L2's 50 MB would time the DRAM's write-backs instead), whole or
half 128-byte lines as the kernels send them:

  u64 2x128    red.global.add.u64, 2 rows x 128 bytes an instruction (the lanes' chunk pairs)
  u64 4x64     red.global.add.u64, 4 rows x 64 bytes (the lanes' unpaired chunk)
  f32x4 4x128  red.global.add.v4.f32, 4 rows x 128 bytes (cuDNN's adds)
  f32x4 8x64   red.global.add.v4.f32, 8 rows x 64 bytes (the atomic control's)
  u32 1x128    red.global.add.u32, 1 row x 128 bytes

With --burst and --gap, each sender stops for ``gap`` clock cycles after every ``burst``
instructions, as the kernels' warps stop to run their GEMMs between a chunk pair's adds.

Printed: the L2's rate of reductions (TB/s) for each form and count of senders.
"""

import argparse

from mqa_bwd import kernels as K

#: name -> (id the kernel switches on, bytes an instruction)
FORMS = {"u64 2x128": (0, 256), "u64 4x64": (1, 256), "f32x4 4x128": (2, 512), "f32x4 8x64": (3, 512),
         "u32 1x128": (4, 128)}
ROW_BYTES = 2304
LINES_A_ROW = ROW_BYTES // 128

SUPPLY_SOURCE = r"""
// Row g of an instruction's rows, from the step's hash h.
__device__ __forceinline__ unsigned long long supply_row(unsigned h, int g, int rows) {
  return static_cast<unsigned long long>(((h ^ (0x9e3779b9u * (g + 1))) * 2654435761u) % static_cast<unsigned>(rows));
}
// One warp instruction of `form` at step hash h: the byte offset of this lane's piece.
__device__ __forceinline__ void supply_send(char* buf, int form, unsigned h, int rows, int lane) {
  const unsigned line = (h >> 7) % LINES_A_ROWu;
  if (form == 0) {         // u64, 2 rows x 128 bytes
    char* p = buf + supply_row(h, lane >> 4, rows) * ROW_BYTES + line * 128 + (lane & 15) * 8;
    asm volatile("red.global.add.u64 [%0], 1;" :: "l"(p) : "memory");
  } else if (form == 1) {  // u64, 4 rows x 64 bytes
    char* p = buf + supply_row(h, lane >> 3, rows) * ROW_BYTES + line * 128 + ((h >> 3) & 1) * 64 + (lane & 7) * 8;
    asm volatile("red.global.add.u64 [%0], 1;" :: "l"(p) : "memory");
  } else if (form == 2) {  // f32x4, 4 rows x 128 bytes
    char* p = buf + supply_row(h, lane >> 3, rows) * ROW_BYTES + line * 128 + (lane & 7) * 16;
    asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(p), "f"(1.0f) : "memory");
  } else if (form == 3) {  // f32x4, 8 rows x 64 bytes
    char* p = buf + supply_row(h, lane >> 2, rows) * ROW_BYTES + line * 128 + ((h >> 3) & 1) * 64 + (lane & 3) * 16;
    asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(p), "f"(1.0f) : "memory");
  } else {                 // u32, 1 row x 128 bytes
    char* p = buf + supply_row(h, 0, rows) * ROW_BYTES + line * 128 + lane * 4;
    asm volatile("red.global.add.u32 [%0], 1;" :: "l"(p) : "memory");
  }
}
// Warps [0, senders) of the CTA send `steps` instructions of `form` each, pausing `gap` cycles after
// every `burst` (burst 0: no pause); thread 0 marks the CTA in `ran` (the grid's size comes from
// that tensor's).
__device__ __forceinline__ void supply_body(const void* buf_, const void* ran, int rows, int form, int senders, int steps,
                                            int burst, int gap, int cta) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  if (t == 0) const_cast<int*>(static_cast<const int*>(ran))[cta] = 1;
  if (warp >= senders) return;
  char* buf = const_cast<char*>(static_cast<const char*>(buf_));
  unsigned h = 2654435761u * (cta * 8 + warp + 1);
  for (int i = 0; i < steps; ++i) {
    h = h * 1664525u + 1013904223u;
    supply_send(buf, form, h, rows, lane);
    if (burst > 0 && (i + 1) % burst == 0) {
      const long long until = clock64() + gap;
      while (clock64() < until) {}
    }
  }
}
""".replace("ROW_BYTES", str(ROW_BYTES)).replace("LINES_A_ROW", str(LINES_A_ROW))


def supply_program():
    tilelang, T = K._tl()
    CTAS, N = T.dynamic("CTAS"), T.dynamic("N")

    @T.prim_func
    def supply(Buf: T.Tensor((N,), "int64"), Ran: T.Tensor((CTAS,), "int32"), rows: T.int32, form: T.int32,
               senders: T.int32, steps: T.int32, burst: T.int32, gap: T.int32):
        with T.Kernel(CTAS, threads=256) as cta:
            T.import_source(SUPPLY_SOURCE)
            T.call_extern("handle", "supply_body", Buf.data, Ran.data, rows, form, senders, steps, burst, gap, cta)

    return supply


def run(senders: list, mib: float, rows: int, burst: int, gap: int) -> None:
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = K.compile_program(supply_program())
    buf = torch.zeros((rows * ROW_BYTES // 8,), dtype=torch.int64, device="cuda")
    pause = f", pausing {gap} cycles every {burst} instructions" if burst else ""
    print(f"{sms} CTAs of 8 warps; each sender sends {mib:g} MiB{pause} to {rows} rows "
          f"({rows * ROW_BYTES / 2**20:.0f} MiB); L2 reductions in TB/s")
    print(f"{'form':<12}" + "".join(f"{n:>4} warp{'s' if n > 1 else ' '}" for n in senders))
    for name, (form, per_instruction) in FORMS.items():
        steps = int(mib * (1 << 20)) // per_instruction
        rates = []
        for n in senders:
            ran = torch.zeros((sms,), dtype=torch.int32, device="cuda")
            kernel(buf, ran, rows, form, n, steps, burst, gap)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernel(buf, ran, rows, form, n, steps, burst, gap)
            end.record()
            torch.cuda.synchronize()
            if int(ran.sum()) != sms:
                raise RuntimeError(f"{int(ran.sum())} of {sms} CTAs ran")
            ms = start.elapsed_time(end)
            rates.append(sms * n * steps * per_instruction / (ms * 1e-3) / 1e12)
        print(f"{name:<12}" + "".join(f"{r:>10.2f}" for r in rates))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--senders", default="1,2,4,8", help="warps of each CTA that send, a run each")
    parser.add_argument("--mib", type=float, default=2.0, help="MiB each sending warp adds")
    parser.add_argument("--kv-rows", type=int, default=8192, help="rows of 2304 bytes the adds spread over")
    parser.add_argument("--burst", type=int, default=0, help="instructions a sender sends between pauses (0: none)")
    parser.add_argument("--gap", type=int, default=2000, help="clock cycles of each pause")
    parser.add_argument("--compile-only", action="store_true", help="build the kernel for sm_90a and stop (CPU)")
    a = parser.parse_args()
    if a.burst < 0 or a.gap < 0:
        raise ValueError(f"--burst {a.burst}, --gap {a.gap}: neither may be negative")
    if a.kv_rows < 8:
        raise ValueError(f"--kv-rows {a.kv_rows}: at least 8 (an instruction's rows)")
    if a.compile_only:
        source = K.compile_program(supply_program()).get_kernel_source()
        print(K.ptxas_info_of_source(source, "red_supply"))
        return
    senders = [int(n) for n in a.senders.split(",")]
    if not senders or any(n < 1 or n > 8 for n in senders):
        raise ValueError(f"--senders: {a.senders!r}: each between 1 and 8")
    run(senders, a.mib, a.kv_rows, a.burst, a.gap)


if __name__ == "__main__":
    main()
