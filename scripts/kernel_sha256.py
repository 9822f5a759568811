"""sha256 of the generated CUDA of every kept kernel configuration (kernels.gpu_configs).

    CUDA_HOME=/usr/local/cuda python scripts/kernel_sha256.py [--workers 2] > sha.txt

One line per configuration: its compile-cache key as the pre-package kernels.py
spelled it (for comparison with docs/kernel-sha256.txt's baseline), the sha256,
and the configuration value. Compiles (no GPU needed).
"""

import argparse
import hashlib

from mqa_bwd import kernels as K


def old_key(config) -> tuple:
    """The (kind, *key) the kernels.py before the package used for ``config``."""
    if isinstance(config, K.MainConfig):
        return ("main_bwd", config.heads, config.d_k, config.d_v, config.accumulate) + (
            (config.cluster,) if config.cluster > 1 else ()) + ((("tiles", config.tiles),) if config.tiles > 1 else ())
    return (config.kind,) + config.args


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    a = parser.parse_args()
    configs = K.gpu_configs()
    sources = K.precompile(configs, a.workers)
    for config in configs:
        print(f"{old_key(config)!r}  {hashlib.sha256(sources[config].encode()).hexdigest()}  {config!r}")


if __name__ == "__main__":
    main()
