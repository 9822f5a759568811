"""Variants of this tree's wide tile side by side in one process: one MainConfig field of the
wide tile at several values, each a configuration (TileLangLauncher(wide_tile=...)), no source
rewritten (GPU only). Another revision is benchmarks/package_ab.py's job.

    python benchmarks/config_ab.py --field wg0_chunks --values 2,3,4 [--shapes dsv32,fleet] [--shape B=..,S=..,S_kv=..,H=..,L=..]
        [--indices indexer] [--repeats 8]

Compiles every value's wide kernels first (in parallel), then per shape times each value's
deterministic call and atomic control interleaved (bench.time_interleaved), and prints medians,
minima, the ratio to the first value's control, and whether each value's deterministic outputs
have the first value's bits (they must: integer adds commute).
"""

import argparse
import dataclasses
import os

from mqa_bwd import bench, launch
from mqa_bwd import kernels as K


def wide_variants(field: str, values) -> list:
    """Every wide configuration the wrapper can launch, at each value of ``field``."""
    return [dataclasses.replace(config, **{field: value})
            for config in K.gpu_configs() if isinstance(config, K.MainConfig) and config.wide for value in values]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--field", default="wg0_chunks", help="a field of kernels.MainConfig the wide tile owns")
    parser.add_argument("--values", required=True, help="comma-separated ints; the first is the reference")
    bench.add_ab_shape_arguments(parser, default="dsv32")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    a = parser.parse_args()
    values = [int(v) for v in a.values.split(",")]
    for value in values:  # a ValueError naming the field, before anything compiles
        launch.TileLangLauncher(wide_tile={a.field: value})
    shapes = bench.ab_shapes(a.shapes, a.shape, a.default_shapes)  # a ValueError before anything compiles
    K.precompile(wide_variants(a.field, values), a.workers)
    for shape in shapes:
        args = bench.production_inputs(**shape, indices=a.indices)
        calls = {}
        for value in values:
            for deterministic in (True, False):
                launcher = launch.TileLangLauncher(deterministic, wide_tile={a.field: value})
                name = f"{'fixed' if deterministic else 'atomic'}, {a.field}={value}"
                calls[name] = bench.prepared_wrapper_call(args, launcher)
        reference = calls[f"fixed, {a.field}={values[0]}"]()
        same = {v: bench.same_bits(reference, calls[f"fixed, {a.field}={v}"]()) for v in values[1:]}
        print(f"{shape}, {a.indices} indices: fixed bits equal to {a.field}={values[0]}'s: {same}")
        print("\n".join(bench.interleaved_report(calls, f"atomic, {a.field}={values[0]}", a.repeats)))


if __name__ == "__main__":
    main()
