"""``python -m mqa_bwd.kernels [--workers N]``: compile every kept configuration for sm_90a (fills TileLang's cache)."""

import argparse
import time

from .config import gpu_configs
from .toolchain import precompile


def main(argv=None):
    parser = argparse.ArgumentParser(description="Compile every kernel configuration for sm_90a (fills the cache).")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    start = time.time()
    sources = precompile(gpu_configs(), args.workers)
    print(f"compiled {len(sources)} kernels in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
