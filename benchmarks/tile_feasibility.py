"""Will a 64-head tile fit, and how fast is it? A study of the next main kernel's shape.

    python benchmarks/tile_feasibility.py [--heads 64] [--slots 32] [--threads 256] [--cols 0:320 320:576 ...]
    python benchmarks/tile_feasibility.py --time [--shape dsv32] ...     # GPU: also time each range

Without --time it only compiles (CPU is enough: nvcc, no GPU).

The main kernel today runs 32-head tiles with mma.sync, fed by ldmatrix from
shared memory; its GEMM skeleton alone (no dKV output) takes 14.6 ms at dsv32
H=64, 4x the 3.7 ms the work needs (issue 6). TileLang lowers GEMMs with 64
rows to wgmma, but a 64-head CTA cannot also hold the 64 x 576 fp32 dQ
accumulator. This tool builds the skeleton of one alternative and reports
what ptxas makes of it: one CTA per (query row, column range). Each CTA
computes the full scores S and dP for all heads (duplicated across the
ranges), then dQ and dKV for its own columns only, so every dKV element of a
slot is summed over all heads in one CTA: one global add per (row, slot,
column), with no exchange between CTAs.

A skeleton, not a kernel, but with what costs registers in the real one: the
cp.async gather (not yet a block ahead), invalid slots masked, the softmax
mass tracked (fixed mode's range check), and the fixed-point adds of the
range's columns from shared memory, a warp per slot, and the Flag. Left
out: the deferral of the adds to the next block and the dQ store's bf16
staging. Per
column range it prints registers, spill bytes, shared memory, and how many
GEMMs became wgmma, or TileLang's refusal. With --time (GPU) it also runs
each range's skeleton on production inputs (H = heads) and prints its median
time, their sum, and in the same process the whole deterministic and atomic
calls of today's kernels: the number that says whether the redesign pays.
The skeleton's dKV sums are not checked (a fixed power-of-two row scale).
"""

import argparse
import re

from mqa_bwd import kernels as K


ADDS = ("fixed", "float", "none")


def skeleton_program(c0: int, c1: int, heads: int = 64, slots: int = 32, d_k: int = 576, d_v: int = 512,
                     threads: int = 256, adds: str = "fixed"):
    """The per-(row, column range [c0, c1)) backward skeleton of the module docstring. ``adds``:
    "fixed" adds int64 fixed point (the deterministic design), "float" adds fp32 (the atomic
    control in the same structure), "none" leaves the dKV adds out (the GEMM skeleton alone)."""
    if adds not in ADDS:
        raise ValueError(f"adds: {adds!r} (one of {ADDS})")
    tilelang, T = K._tl()
    R, NKV, Lp, HQ = T.dynamic("R"), T.dynamic("NKV"), T.dynamic("Lp"), T.dynamic("HQ")
    BS, W = slots, c1 - c0
    in_dv = max(0, min(c1, d_v) - c0)  # columns of the range inside Dv: they also get P^T dO
    f32, bf16, i32 = "float32", "bfloat16", "int32"

    @T.prim_func
    def skeleton(
        Q: T.Tensor((R, HQ, d_k), bf16),
        KV: T.Tensor((NKV, d_k), bf16),
        dO: T.Tensor((R, HQ, d_v), bf16),
        Indices: T.Tensor((R, Lp), i32),
        Lse2: T.Tensor((R, HQ), f32),
        Delta: T.Tensor((R, HQ), f32),
        dQ: T.Tensor((R, HQ, d_k), bf16),
        dKV: T.Tensor((NKV, d_k), "float32" if adds == "float" else "int64"),
        RowScale: T.Tensor((NKV,), f32),
        Allowance: T.Tensor((R, HQ), f32),
        Flag: T.Tensor((R,), i32),
        sm_scale: T.float32,
    ):
        with T.Kernel(R, threads=threads) as r:
            Q_s = T.alloc_shared((heads, d_k), bf16)
            dO_s = T.alloc_shared((heads, d_v), bf16)
            KV_s = T.alloc_shared((BS, d_k), bf16)
            P_s = T.alloc_shared((heads, BS), bf16)
            dS_s = T.alloc_shared((heads, BS), bf16)
            dKV_s = T.alloc_shared((BS, W), f32)
            slot = T.alloc_shared((BS,), i32)
            lse_s = T.alloc_shared((heads,), f32)
            delta_s = T.alloc_shared((heads,), f32)
            acc_s = T.alloc_fragment((heads, BS), f32)
            acc_dp = T.alloc_fragment((heads, BS), f32)
            acc_dq = T.alloc_fragment((heads, W), f32)
            mass = T.alloc_fragment((heads, BS), f32)
            mass_row = T.alloc_fragment((heads,), f32)
            kv_row = T.alloc_local((1,), i32)
            scale_r = T.alloc_local((1,), f32)
            warp = T.get_thread_binding() // 32
            lane = T.get_thread_binding() % 32
            # TileLang cannot accumulate a GEMM into a column slice of a
            # fragment: the range's Dv columns (dS^T Q + P^T dO) and tail
            # columns (dS^T Q) get one accumulator each.
            if in_dv > 0:
                acc_v = T.alloc_fragment((BS, in_dv), f32)
            if in_dv < W:
                acc_t = T.alloc_fragment((BS, W - in_dv), f32)
            T.copy(Q[r, 0:heads, 0:d_k], Q_s)
            T.copy(dO[r, 0:heads, 0:d_v], dO_s)
            for h in T.Parallel(heads):
                lse_s[h] = Lse2[r, h]
                delta_s[h] = Delta[r, h]
            T.clear(acc_dq)
            T.clear(mass)
            T.import_source(K.GATHER_SOURCE)
            for t in T.serial(Lp // BS):
                for j in T.Parallel(BS):
                    slot[j] = Indices[r, t * BS + j]
                T.sync_threads()
                for j, c in T.Parallel(BS, d_k // 8):
                    T.call_extern("handle", "mqa_cp_async16", T.address_of(KV_s[j, c * 8]),
                                  T.address_of(KV[T.max(T.min(slot[j], NKV - 1), 0), c * 8]), (slot[j] >= 0) and (slot[j] < NKV))
                T.call_extern("handle", "mqa_cp_async_commit")
                T.call_extern("handle", "mqa_cp_async_wait_all")
                T.sync_threads()
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True)
                for h, j in T.Parallel(heads, BS):
                    acc_s[h, j] = T.if_then_else((slot[j] >= 0) and (slot[j] < NKV),
                                                 T.exp2(acc_s[h, j] * sm_scale - lse_s[h]), T.cast(0, f32))
                T.copy(acc_s, P_s)
                for h, j in T.Parallel(heads, BS):
                    mass[h, j] += acc_s[h, j]
                T.gemm(dO_s, KV_s[0:BS, 0:d_v], acc_dp, transpose_B=True, clear_accum=True)
                for h, j in T.Parallel(heads, BS):
                    acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_s[h]) * sm_scale
                T.copy(acc_dp, dS_s)
                T.gemm(dS_s, KV_s[0:BS, c0:c1], acc_dq)
                if in_dv > 0:
                    T.gemm(dS_s, Q_s[0:heads, c0:c0 + in_dv], acc_v, transpose_A=True, clear_accum=True)
                    T.gemm(P_s, dO_s[0:heads, c0:c0 + in_dv], acc_v, transpose_A=True)
                    T.copy(acc_v, dKV_s[0:BS, 0:in_dv])
                if in_dv < W:
                    T.gemm(dS_s, Q_s[0:heads, c0 + in_dv:c1], acc_t, transpose_A=True, clear_accum=True)
                    T.copy(acc_t, dKV_s[0:BS, in_dv:W])
                T.sync_threads()
                if adds == "fixed":
                    for s_i in T.serial(BS // (threads // 32)):
                        j = warp + s_i * (threads // 32)
                        kv_row[0] = slot[j]
                        scale_r[0] = RowScale[T.max(T.min(slot[j], NKV - 1), 0)]
                        if (kv_row[0] >= 0) and (kv_row[0] < NKV):
                            for c in T.unroll(W // 32):
                                T.atomic_add(dKV[kv_row[0], c0 + c * 32 + lane],
                                             T.call_extern("int64", "__float2ll_rn", dKV_s[j, c * 32 + lane] * scale_r[0]))
                elif adds == "float":  # as the control adds: TileLang vectorises these to red.v4.f32
                    for j, d in T.Parallel(BS, W):
                        if (slot[j] >= 0) and (slot[j] < NKV):
                            T.atomic_add(dKV[slot[j], c0 + d], dKV_s[j, d])
                T.sync_threads()
            T.reduce_sum(mass, mass_row, dim=1)
            for h in T.Parallel(heads):
                if (mass_row[h] > Allowance[r, h]) or T.isnan(mass_row[h]):
                    Flag[r] = 1
            T.copy(acc_dq, dQ[r, 0:heads, c0:c1])

    return skeleton


def report(c0: int, c1: int, **shape) -> dict:
    """{"cols", "registers", "spill_stores", "shared", "wgmma"} of one column range, or {"cols", "refused"}."""
    try:
        kernel = K.compile_program(skeleton_program(c0, c1, **shape))
    except Exception as error:  # TileLang's layout and partition checks raise their own types
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = next((line for line in lines if "Error" in line or "Fatal" in line), lines[-1] if lines else repr(error))
        return {"cols": (c0, c1), "refused": reason[:200]}
    device = kernel.get_kernel_source()
    info = K.ptxas_info_of_source(device, f"columns {c0}:{c1}")
    return {"cols": (c0, c1), "registers": info["registers"], "spill_stores": info["spill_stores"],
            "shared": K.dynamic_shared_bytes(kernel, "skeleton"), "wgmma": len(re.findall(r"\bwgmma_[sr]s<", device))}


def skeleton_inputs(args, heads: int, adds: str = "fixed") -> list:
    """A skeleton launch's arguments, in its parameter order, from production_inputs' tuple
    (H must be ``heads``, L a multiple of the slot block): q, kv, dO and the slots as global kv
    rows, base-2 lse and Delta as the wrapper makes them (without the sink: timing only), an
    empty dQ, a zero dKV (fp32 for ``adds="float"``, int64 otherwise), a power-of-two row
    scale, no mass limit, no flags."""
    import math

    import torch

    q, kv, out, grad_out, lse, _sink, idx, sm_scale = args
    B, S, H, d_k = q.shape
    if H != heads:
        raise ValueError(f"H: {H} (the skeleton tile holds exactly {heads} heads)")
    R, nkv, dev = B * S, B * kv.shape[1], q.device
    base = (torch.arange(B, device=dev, dtype=idx.dtype) * kv.shape[1]).view(B, 1, 1)
    slots = torch.where(idx >= 0, idx + base, -1).reshape(R, -1).to(torch.int32).contiguous()
    delta = (out.float() * grad_out.float()).sum(-1).reshape(R, H)
    dkv_dtype = torch.float32 if adds == "float" else torch.int64
    return [q.reshape(R, H, d_k), kv.reshape(nkv, d_k), grad_out.reshape(R, H, -1), slots,
            (lse.reshape(R, H) * K.LOG2E).contiguous(), delta,
            torch.empty((R, H, d_k), dtype=torch.bfloat16, device=dev), torch.zeros((nkv, d_k), dtype=dkv_dtype, device=dev),
            torch.full((nkv,), 2.0**20, device=dev), torch.full((R, H), math.inf, device=dev),
            torch.zeros((R,), dtype=torch.int32, device=dev), float(sm_scale) * K.LOG2E]


def time_ranges(ranges, shape: dict, adds=ADDS, repeats: int = 5, **tile) -> None:
    """GPU: median ms of each (adds, range) skeleton, each adds' sum over the ranges, and
    today's whole calls, all timed interleaved in one process (bench.time_interleaved)."""
    import functools
    import statistics

    from mqa_bwd import launch
    from mqa_bwd.bench import prepared_wrapper_call, production_inputs, time_interleaved

    args = production_inputs(**shape)
    calls, skeletons = {}, {}
    for mode in adds:
        inputs = skeleton_inputs(args, tile.get("heads", 64), mode)
        for c0, c1 in ranges:
            kernel = K.compile_program(skeleton_program(c0, c1, adds=mode, **tile))
            name = f"skeleton, {mode} adds, columns [{c0}, {c1})"
            calls[name] = functools.partial(kernel, *inputs)
            skeletons.setdefault(mode, []).append(name)
    for label, deterministic in (("deterministic call (today)", True), ("atomic call (today)", False)):
        calls[label] = prepared_wrapper_call(args, launch.TileLangLauncher(deterministic))
    medians = {name: statistics.median(t) for name, t in time_interleaved(calls, warmup=2, repeats=repeats).items()}
    for mode, names in skeletons.items():
        for name in names:
            print(f"  {name}: {medians[name]:.2f} ms")
        print(f"  skeleton, {mode} adds, all ranges: {sum(medians[name] for name in names):.2f} ms")
    for label in ("deterministic call (today)", "atomic call (today)"):
        print(f"  {label}: {medians[label]:.2f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--threads", type=int, default=256)
    parser.add_argument("--cols", nargs="+", default=["0:320", "320:576"], help="column ranges c0:c1 of Dk = 576")
    parser.add_argument("--time", action="store_true", help="GPU: also time each range on production inputs")
    parser.add_argument("--shape", default="dsv32", help="with --time: a bench shape set (H must equal --heads)")
    parser.add_argument("--adds", nargs="+", choices=ADDS, default=list(ADDS),
                        help="dKV adds: fixed (deterministic), float (the control's), none (GEMMs alone)")
    a = parser.parse_args()
    tile = dict(heads=a.heads, slots=a.slots, threads=a.threads)
    ranges = [tuple(map(int, cols.split(":"))) for cols in a.cols]
    for mode in a.adds:
        for c0, c1 in ranges:
            print(mode, report(c0, c1, adds=mode, **tile))
    if a.time:
        from mqa_bwd.bench import SHAPES

        for shape in SHAPES[a.shape]:
            if shape["H"] == a.heads:
                print(shape)
                time_ranges(ranges, shape, adds=a.adds, **tile)


if __name__ == "__main__":
    main()
