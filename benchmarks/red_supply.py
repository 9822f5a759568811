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
each the same bytes (--mib), to rows of 2304 bytes (a d_k = 576 row of 4-byte columns) spread
over --kv-rows rows (each lane's row steps by a fixed stride from a start of its warp's own):
8192 by default, the bench shapes' dKV (18 MiB), which stays in the L2 as the kernels' does (a
buffer past the L2's 50 MB would time the DRAM's write-backs instead), whole or half 128-byte
lines as the kernels send them:

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
import os
import sys

from mqa_bwd import kernels as K

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_under_reds import timed_launch  # noqa: E402

#: name -> (id the kernel switches on, bytes an instruction)
FORMS = {"u64 2x128": (0, 256), "u64 4x64": (1, 256), "f32x4 4x128": (2, 512), "f32x4 8x64": (3, 512),
         "u32 1x128": (4, 128)}
ROW_BYTES = 2304
LINES_A_ROW = ROW_BYTES // 128

SUPPLY_SOURCE = r"""
// One warp instruction of `form` to this lane's piece at row `row`, line `line` (`half` of it for the
// half-line forms); `piece` is the lane's byte offset inside its row's piece.
template <int form>
__device__ __forceinline__ void supply_send(char* buf, unsigned row, unsigned line, int half, int piece) {
  char* p = buf + static_cast<unsigned long long>(row) * ROW_BYTES + line * 128 + piece;
  if (form == 0) {         // u64, 2 rows x 128 bytes
    asm volatile("red.global.add.u64 [%0], 1;" :: "l"(p) : "memory");
  } else if (form == 1) {  // u64, 4 rows x 64 bytes
    asm volatile("red.global.add.u64 [%0], 1;" :: "l"(p + half * 64) : "memory");
  } else if (form == 2) {  // f32x4, 4 rows x 128 bytes
    asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(p), "f"(1.0f) : "memory");
  } else if (form == 3) {  // f32x4, 8 rows x 64 bytes
    asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" :: "l"(p + half * 64), "f"(1.0f) : "memory");
  } else {                 // u32, 1 row x 128 bytes
    asm volatile("red.global.add.u32 [%0], 1;" :: "l"(p) : "memory");
  }
}
// A sender's loop. Each lane's row walks the rows by a fixed stride from its group's own start,
// and the line steps through the row's lines: no division inside the loop, so that a sender is
// held back by the L2 or by its instructions, not by its address arithmetic (a hash and two
// remainders an instruction held one warp to some 300 cycles an add).
template <int form>
__device__ __forceinline__ void supply_loop(char* buf, int rows, int steps, int burst, int gap, int cta, int warp,
                                            int lane) {
  constexpr int group_shift = form == 0 ? 4 : form == 1 || form == 2 ? 3 : form == 3 ? 2 : 5;
  constexpr int lane_bytes = form == 2 || form == 3 ? 16 : form == 4 ? 4 : 8;
  const int group = lane >> group_shift, piece = (lane & ((1 << group_shift) - 1)) * lane_bytes;
  const unsigned n_rows = static_cast<unsigned>(rows);
  const unsigned base = (2654435761u * static_cast<unsigned>(cta * 8 + warp + 1)) % n_rows;
  unsigned row = (base + static_cast<unsigned>(group) * (n_rows / 8u + 1u)) % n_rows;
  const unsigned stride = 1031u % n_rows == 0u ? 1u : 1031u % n_rows;
  unsigned line = 0u;
  for (int done = 0; done < steps;) {
    const int n = burst > 0 && burst < steps - done ? burst : steps - done;
#pragma unroll 4
    for (int i = 0; i < n; ++i) {
      supply_send<form>(buf, row, line, i & 1, piece);
      row += stride;
      row = row >= n_rows ? row - n_rows : row;
      line = line == LINES_A_ROW - 1 ? 0u : line + 1u;
    }
    done += n;
    if (burst > 0) {
      const long long until = clock64() + gap;
      while (clock64() < until) {}
    }
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
  switch (form) {
    case 0: supply_loop<0>(buf, rows, steps, burst, gap, cta, warp, lane); break;
    case 1: supply_loop<1>(buf, rows, steps, burst, gap, cta, warp, lane); break;
    case 2: supply_loop<2>(buf, rows, steps, burst, gap, cta, warp, lane); break;
    case 3: supply_loop<3>(buf, rows, steps, burst, gap, cta, warp, lane); break;
    default: supply_loop<4>(buf, rows, steps, burst, gap, cta, warp, lane);
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
            ms = timed_launch(lambda: kernel(buf, ran, rows, form, n, steps, burst, gap))
            if int(ran.sum()) != sms:
                raise RuntimeError(f"{int(ran.sum())} of {sms} CTAs ran")
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
    if a.kv_rows < 64:
        raise ValueError(f"--kv-rows {a.kv_rows}: at least 64 (an instruction's 8 rows start an eighth of them apart)")
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
