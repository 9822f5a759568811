"""The wrapper's steps before the main launch as kernels: an experiment (GPU), not the product.

    python -m experiments.host_steps [--shapes dsv32,fleet] [--repeats 12]

Before its first launcher method, wrapper.run spends most of its host time in two
steps, ``kernel_lse`` (9 torch ops) and ``global_slots`` (7 torch ops and a sort at
int32 indices, B = 1, no padding), and the GPU waits for the host meanwhile
(benchmarks/host_overhead.py). Here both are replaced through the wrapper's
replaceable ``Steps``, not by editing the product:

- ``kernel_lse``: one TileLang launch for Lse2 and Sink2, the same formula
  (logaddexp, the -inf rows, the poisoned rows) in fp32;
- ``global_slots``: one launch for the sort's keys (global kv row, or B * S_kv for
  an invalid slot), torch's sort, and one launch that places the sorted keys in the
  padded layout (invalid and padding slots -1).

``main`` times the default steps against these in one process
(bench.time_interleaved), for the deterministic call and the control, and says
whether the slot layouts and the outputs have the same bits. Lse2 comes from
TileLang's exp and log1p rather than torch's, so its last bits may differ.
"""

import argparse
import dataclasses
import math
import statistics

from mqa_bwd import bench, launch, wrapper
from mqa_bwd.kernels.config import LOG2E, _tl
from mqa_bwd.kernels.toolchain import compile_program

THREADS = 256
I32 = "int32"


def kernel_lse_program():
    """Lse2[r, h] = logaddexp(Lse[r, h], Sink[h]) * log2(e), +inf where Lse is -inf, NaN where
    Lse or Sink is NaN or +inf; Sink2[h] = Sink[h] * log2(e) (wrapper.kernel_lse)."""
    tilelang, T = _tl()
    R, H = T.dynamic("R"), T.dynamic("H")
    f32 = "float32"

    @T.prim_func
    def kernel_lse(Lse: T.Tensor((R, H), f32), Sink: T.Tensor((H,), f32), Lse2: T.Tensor((R, H), f32),
                   Sink2: T.Tensor((H,), f32)):
        with T.Kernel(T.ceildiv(R * H, THREADS), threads=THREADS) as bx:
            n = bx * THREADS + T.get_thread_binding()
            if n < R * H:
                r, h = n // H, n % H
                a, b = Lse[r, h], Sink[h]
                summed = (T.max(a, b) + T.log1p(T.exp(-T.abs(a - b)))) * T.float32(LOG2E)
                value = T.if_then_else(a == T.float32(-math.inf), T.float32(math.inf), summed)
                sound = (a < T.float32(math.inf)) and (b < T.float32(math.inf))
                Lse2[r, h] = T.if_then_else(sound, value, T.float32(math.nan))
                if r == 0:
                    Sink2[h] = b * T.float32(LOG2E)

    return kernel_lse


def slot_keys_program(index_dtype: str):
    """Keys[r, c] = Indices[r, c] + (r // S) * S_kv where 0 <= Indices[r, c] < S_kv, else NKV =
    B * S_kv (int32: every key fits, validated), compared in the indices' own dtype."""
    tilelang, T = _tl()
    R, L = T.dynamic("R"), T.dynamic("L")

    @T.prim_func
    def slot_keys(Indices: T.Tensor((R, L), index_dtype), Keys: T.Tensor((R, L), I32), S: T.int32,
                  S_kv: T.int32, NKV: T.int32):
        with T.Kernel(R, T.ceildiv(L, THREADS), threads=THREADS) as (r, chunk):
            c = chunk * THREADS + T.get_thread_binding()
            if c < L:
                index = Indices[r, c]
                if (index >= T.cast(0, index_dtype)) and (index < T.cast(S_kv, index_dtype)):
                    Keys[r, c] = T.cast(index, I32) + (r // S) * S_kv
                else:
                    Keys[r, c] = NKV

    return slot_keys


def place_slots_program():
    """Slots[r, c] = Keys[r, c] for c < L unless it is NKV (an invalid slot), else -1."""
    tilelang, T = _tl()
    R, L, Lp = T.dynamic("R"), T.dynamic("L"), T.dynamic("Lp")

    @T.prim_func
    def place_slots(Keys: T.Tensor((R, L), I32), Slots: T.Tensor((R, Lp), I32), NKV: T.int32):
        with T.Kernel(R, T.ceildiv(Lp, THREADS), threads=THREADS) as (r, chunk):
            c = chunk * THREADS + T.get_thread_binding()
            if c < Lp:
                Slots[r, c] = -1
                if c < L:
                    if Keys[r, c] != NKV:
                        Slots[r, c] = Keys[r, c]

    return place_slots


_COMPILED = {}


def _kernel(name, *args):
    key = (name, args)
    if key not in _COMPILED:
        builders = {"kernel_lse": kernel_lse_program, "slot_keys": slot_keys_program, "place_slots": place_slots_program}
        _COMPILED[key] = compile_program(builders[name](*args))
    return _COMPILED[key]


def kernel_lse(lse, sink):
    """wrapper.kernel_lse in one launch."""
    import torch

    lse = lse.contiguous()
    lse2 = torch.empty_like(lse)
    sink2 = torch.empty_like(sink)
    _kernel("kernel_lse")(lse, sink.contiguous(), lse2, sink2)
    return lse2, sink2


def global_slots(token_indices, problem):
    """wrapper.global_slots (the canonical order) as two launches around torch's sort; indices of
    int32 or int64 (others through int64), every row in one step."""
    import torch

    p = problem
    flat = token_indices.reshape(p.rows, p.L)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int64)
    nkv = p.B * p.S_kv
    keys = torch.empty((p.rows, p.L), dtype=torch.int32, device=flat.device)
    _kernel("slot_keys", str(flat.dtype).removeprefix("torch."))(flat.contiguous(), keys, p.S, p.S_kv, nkv)
    ordered = torch.sort(keys, dim=1).values
    slots = torch.empty((p.rows, p.padded_slots), dtype=torch.int32, device=flat.device)
    _kernel("place_slots")(ordered, slots, nkv)
    return slots


STEPS = dataclasses.replace(wrapper.STEPS, kernel_lse=kernel_lse, global_slots=global_slots)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="dsv32,fleet")
    parser.add_argument("--repeats", type=int, default=12)
    a = parser.parse_args()
    for shape in [s for name in a.shapes.split(",") for s in bench.SHAPES[name]]:
        args = bench.production_inputs(**shape)
        q, kv, out, grad_out, lse, sink, idx, sm_scale = args
        problem = wrapper.validate(*args, None, None, launch.TileLangLauncher(True), design=True)
        same_slots = bench.same_bits((wrapper.global_slots(idx, problem),), (global_slots(idx, problem),))
        calls = {}
        for design, deterministic in (("det", True), ("control", False)):
            for steps_name, steps in (("torch steps", wrapper.STEPS), ("kernel steps", STEPS)):
                calls[f"{design}, {steps_name}"] = bench.prepared_wrapper_call(args, launch.TileLangLauncher(deterministic),
                                                                               steps)
        same = bench.same_bits(calls["det, torch steps"](), calls["det, kernel steps"]())
        times = bench.time_interleaved(calls, warmup=2, repeats=a.repeats)
        print(f"{bench.describe(shape)}: slot layouts equal {same_slots}; deterministic outputs equal {same}")
        for name, t in times.items():
            print(f"   {name:<22} median {statistics.median(t):7.3f} ms  min {min(t):7.3f}")


if __name__ == "__main__":
    main()
