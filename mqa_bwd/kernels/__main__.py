"""``python -m mqa_bwd.kernels [--workers N] [--d_k 576] [--group-heads 32]``: compile every kept
configuration for sm_90a (fills TileLang's cache), or those of one width or head group."""

import argparse
import time

from .config import GPU_WIDTHS, GROUP_WIDTHS, gpu_configs
from .toolchain import precompile


def chosen_configs(d_k=None, group_heads=None) -> list:
    """gpu_configs for the widths with this d_k and head groups of this size (None: all of them);
    ValueError naming the argument for one the wrapper never launches."""
    widths = [w for w in GPU_WIDTHS if d_k is None or w[0] == d_k]
    if not widths:
        raise ValueError(f"--d_k: {d_k} is none of {', '.join(str(w[0]) for w in GPU_WIDTHS)}")
    if group_heads is not None and group_heads not in GROUP_WIDTHS:
        raise ValueError(f"--group-heads: {group_heads} is none of {', '.join(map(str, GROUP_WIDTHS))}")
    return gpu_configs(widths, GROUP_WIDTHS if group_heads is None else (group_heads,))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Compile every kernel configuration for sm_90a (fills the cache).")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--d_k", type=int, help="only the configurations of this width (a package A/B at the "
                                               "bench shapes needs 576's)")
    parser.add_argument("--group-heads", type=int, help="only head groups of this size (the wide tile's: 32)")
    args = parser.parse_args(argv)
    try:
        configs = chosen_configs(args.d_k, args.group_heads)
    except ValueError as error:
        parser.error(str(error))
    start = time.time()
    sources = precompile(configs, args.workers)
    print(f"compiled {len(sources)} kernels in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
