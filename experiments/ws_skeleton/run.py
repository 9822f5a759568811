"""The skeleton against the product (and cuDNN where installed), in one process, on a GPU.

    python -m experiments.ws_skeleton.run [--shapes tiny,dsv32,fleet] [--repeats 8] [--no-reference]
    python -m experiments.ws_skeleton.run --compile-only          # CPU: every variant compiles, registers

Per shape: every backend's outputs against the product's deterministic call (rel L2),
each deterministic variant (VARIANTS) rerun for the same bits, the lanes design's redo
count, the error against the float64 reference (bench.oracle_errors: the admissibility
column, issue 30), and the times interleaved (bench.time_interleaved), medians in ms.
The lanes launcher's redo test synchronises with the host once a call, inside its time.
"""

import argparse
import statistics
import sys

SHAPES = {
    "tiny": dict(B=1, S=128, S_kv=256, H=64, L=128),
    "dsv32": dict(B=1, S=4096, S_kv=8192, H=64, L=2048),
    "dsv32-h128": dict(B=1, S=4096, S_kv=8192, H=128, L=2048),
    "fleet": dict(B=1, S=8192, S_kv=8192, H=64, L=640),
}


#: The skeleton's variants: name -> (kernel, gain). kernel: skeleton_program's arguments after the
#: widths (accumulate, overlap, sector_adds, prefetch, pair_stores, wg0_chunks, row_stages); gain: the lanes design's
#: (launcher.LanesLauncher), None for the others.
VARIANTS = {
    "skel-det": (("fixed", True, True, False, False, 0, 0), None),
    "skel-det-v1": (("fixed", False, False, False, False, 0, 0), None),
    "skel-atomic": (("atomic", True, False, False, False, 0, 0), None),
    "skel-atomic-v1": (("atomic", False, False, False, False, 0, 0), None),
    "skel-noadd": (("none", True, False, False, False, 0, 0), None),
    "lanes-g12": (("lanes", True, True, False, False, 0, 0), 12),
    "lanes-g18": (("lanes", True, True, False, False, 0, 0), 18),
    # Warpgroup 0's path shortened: the gather split around the dQ GEMM, paired P and dS stores.
    "skel-noadd-pf": (("none", True, False, True, True, 0, 0), None),
    "skel-atomic-pf": (("atomic", True, True, True, True, 0, 0), None),
    "skel-det-pf": (("fixed", True, True, True, True, 0, 0), None),
    "lanes-g18-pf": (("lanes", True, True, True, True, 0, 0), 18),
    "lanes-g16-pf": (("lanes", True, True, True, True, 0, 0), 16),
    # Warpgroup 0, which waited for warpgroup 1's dKV, takes the last one or two chunks.
    "skel-atomic-w1": (("atomic", True, True, True, True, 1, 0), None),
    "skel-atomic-w2": (("atomic", True, True, True, True, 2, 0), None),
    "lanes-g16-w1": (("lanes", True, True, True, True, 1, 0), 16),
    "lanes-g16-w2": (("lanes", True, True, True, True, 2, 0), 16),
    # One lanes add instruction a warp on 64 or 128 contiguous bytes a row (shuffled first).
    "lanes-g16-r1": (("lanes", True, True, True, True, 0, 1), 16),
    "lanes-g16-r2": (("lanes", True, True, True, True, 0, 2), 16),
    "lanes-g16-w1r2": (("lanes", True, True, True, True, 1, 2), 16),
}


def launcher_of(name):
    from .launcher import LanesLauncher, SkeletonLauncher

    (accumulate, overlap, sector, prefetch, pairs, wg0, stages), gain = VARIANTS[name]
    if accumulate == "lanes":
        return LanesLauncher(gain, overlap=overlap, prefetch=prefetch, pair_stores=pairs, wg0_chunks=wg0,
                             row_stages=stages)
    return SkeletonLauncher(accumulate == "fixed", overlap=overlap, sector_adds=sector,
                            accumulate="none" if accumulate == "none" else None, prefetch=prefetch, pair_stores=pairs,
                            wg0_chunks=wg0)


def kernels_of(variants):
    """The skeleton kernels the variants launch: their own, and the lanes design's int64 redo."""
    kernels = set()
    for v in variants:
        kernel = VARIANTS[v][0]
        kernels.add(kernel)
        if kernel[0] == "lanes":
            kernels.add(("fixed", kernel[1], True, *kernel[3:6], 0))  # the redo: the same kernel, int64 adds
    return sorted(kernels)


def _compile(kernel):
    from .launcher import compiled_skeleton

    compiled_skeleton(576, 512, *kernel)
    return kernel


def precompile(variants, workers=8):
    """Fill TileLang's kernel cache in worker processes, so this process loads each kernel."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for kernel in pool.map(_compile, kernels_of(variants)):
            print(f"compiled {kernel}", flush=True)


def compile_only():
    from mqa_bwd.kernels import toolchain

    from .kernel import skeleton_program

    for kernel in kernels_of(VARIANTS):
        for d_k, d_v in ((576, 512), (512, 512)):
            program = skeleton_program(d_k, d_v, *kernel)
            source = toolchain.compile_program(program).get_kernel_source()
            print(kernel, d_k, d_v, toolchain.ptxas_info_of_source(source), flush=True)


def one_call(backend, shape, calls):
    import torch

    from mqa_bwd import bench, launch

    if backend in VARIANTS:
        precompile([backend])
        launcher = launcher_of(backend)
    else:
        launcher = launch.TileLangLauncher(backend == "det")
    call = bench.prepared_wrapper_call(bench.production_inputs(**SHAPES[shape]), launcher)
    for _ in range(calls):
        with torch.cuda.nvtx.range("backward"):
            call()
    torch.cuda.synchronize()
    print(f"{calls} calls of {backend} at {shape}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,dsv32,fleet")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--no-reference", action="store_true", help="skip the float64 reference errors")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="skeleton variants to run (VARIANTS)")
    parser.add_argument("--one-call", metavar="BACKEND",
                        help="for a profiler: --calls calls of one backend (det, atomic or a variant) at the first "
                             "shape, each in the NVTX range 'backward' (ncu -k regex:skeleton --launch-skip calls-1)")
    parser.add_argument("--calls", type=int, default=3)
    a = parser.parse_args(argv)
    if a.compile_only:
        return compile_only()
    import torch

    from mqa_bwd import bench, launch

    if a.one_call:
        return one_call(a.one_call, a.shapes.split(",")[0], a.calls)
    variants = a.variants.split(",")
    precompile(variants)
    launchers = {"det": launch.TileLangLauncher(True), "atomic": launch.TileLangLauncher(False)}
    for name in variants:
        launchers[name] = launcher_of(name)
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        args = bench.production_inputs(**shape)
        calls = {k: bench.prepared_wrapper_call(args, v) for k, v in launchers.items()}
        if not bench.backend_unavailable("cudnn"):
            calls["cudnn"] = bench.backend_call("cudnn", args)
        outputs = {k: fn() for k, fn in calls.items()}
        torch.cuda.synchronize()
        print(f"== {name} {shape}", flush=True)
        for k, out in outputs.items():
            errs = " ".join(f"{n} {bench.rel_l2(x, y):.2e}" for n, x, y in zip(("dq", "dkv", "dsink"), out, outputs["det"]))
            print(f"  {k:12} vs det: {errs}", flush=True)
        for k in variants:
            if VARIANTS[k][0][0] in ("fixed", "lanes"):
                again = calls[k]()
                print(f"  {k} rerun same bits: {bench.same_bits(again, outputs[k])}", flush=True)
            if VARIANTS[k][0][0] == "lanes":
                print(f"  {k}: calls redone in int64 so far: {launchers[k].redos}", flush=True)
        if not a.no_reference:
            for k, errs in bench.oracle_errors(args, outputs).items():
                print(f"  {k:12} vs float64: " + " ".join(f"{n} {e:.3e}" for n, e in errs.items()), flush=True)
        if name != "tiny":
            times = bench.time_interleaved(calls, warmup=2, repeats=a.repeats)
            med = {k: statistics.median(v) for k, v in times.items()}
            print("  ms: " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
            if "cudnn" in med:
                print("  /cudnn: " + "  ".join(f"{k} {v / med['cudnn']:.2f}" for k, v in med.items()), flush=True)
        del outputs, calls, args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
