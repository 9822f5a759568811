"""The skeleton against the product (and cuDNN where installed), in one process, on a GPU.

    python -m experiments.ws_skeleton.run [--shapes tiny,dsv32,fleet] [--repeats 8] [--no-reference]
    python -m experiments.ws_skeleton.run --compile-only          # CPU: both kernels compile, registers

Per shape: every backend's outputs against the product's deterministic call (rel L2),
the skeleton's fixed design rerun for the same bits, the error against the float64
reference (bench.oracle_errors: the admissibility column, issue 30), and the times
interleaved (bench.time_interleaved), medians in ms.
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


def compile_only():
    from mqa_bwd.kernels import toolchain

    from .kernel import skeleton_program

    for accumulate in ("atomic", "fixed"):
        for d_k, d_v in ((576, 512), (512, 512)):
            source = toolchain.compile_program(skeleton_program(d_k, d_v, accumulate)).get_kernel_source()
            print(accumulate, d_k, d_v, toolchain.ptxas_info_of_source(source))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,dsv32,fleet")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--no-reference", action="store_true", help="skip the float64 reference errors")
    parser.add_argument("--compile-only", action="store_true")
    a = parser.parse_args(argv)
    if a.compile_only:
        return compile_only()
    import torch

    from mqa_bwd import bench, launch

    from .launcher import SkeletonLauncher

    launchers = {"det": launch.TileLangLauncher(True), "atomic": launch.TileLangLauncher(False),
                 "skel-det": SkeletonLauncher(True), "skel-atomic": SkeletonLauncher(False)}
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
        again = calls["skel-det"]()
        print(f"  skel-det rerun same bits: {bench.same_bits(again, outputs['skel-det'])}", flush=True)
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
