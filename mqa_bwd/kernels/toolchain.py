"""The CUDA toolchain: the compile cache, nvcc and ptxas on generated source, precompilation.

Nothing here needs a GPU: TileLang lowers and compiles for sm_90a on any
machine with nvcc.
"""

import functools

from .config import KernelConfig, MainConfig, _pass_configs, _tl, gpu_configs
from .delta import delta_program
from .main_bwd import main_bwd_program
from .plan import mark_slots_program, plan_program
from .prologue import place_slots_program, row_blocks_program, slot_keys_program, sorted_slots_program
from .reductions import (cast_bf16_program, dsink_reduce_program, fixed_to_bf16_program, lanes_failed_program,
                         lanes_to_bf16_program, poisoned_batches_program, zero_gated_program)
from .wide import wide_program

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def compile_program(program, target=None):
    tilelang, _ = _tl()
    return tilelang.compile(program, target=target or SM90A, pass_configs=_pass_configs(tilelang))


def compiled(config):
    """The compiled kernel of a configuration (a MainConfig or a KernelConfig), once per process
    (a MainConfig's kernel, MainConfig.kernel: every tile count above one launches the same one)."""
    return _compiled(config.kernel if isinstance(config, MainConfig) else config)


@functools.lru_cache(maxsize=None)
def _compiled(config):
    return compile_program(program_of(config))


@functools.lru_cache(maxsize=None)
def small_kernel(kind: str, *args):
    """compiled(KernelConfig(kind, args)), looked up without building the configuration: the
    launcher asks for a small kernel at every launch, on the host's critical path."""
    return compiled(KernelConfig(kind, args))


def program_of(config):
    """The TileLang program a configuration builds."""
    if isinstance(config, MainConfig):
        return wide_program(config.kernel) if config.wide else main_bwd_program(config)
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config: expected a MainConfig or KernelConfig, got {config!r}")
    builders = {
        "delta": delta_program,
        "delta_max": lambda d_v: delta_program(d_v, peak_do=True),
        "dsink_reduce": dsink_reduce_program,
        "mark_slots": mark_slots_program,
        "cast_bf16": cast_bf16_program,
        "fixed_to_bf16": fixed_to_bf16_program,
        "lanes_to_bf16": lanes_to_bf16_program,
        "lanes_failed": lanes_failed_program,
        "poisoned_batches": poisoned_batches_program,
        "zero_gated": zero_gated_program,
        "plan": plan_program,
        "slot_keys": slot_keys_program,
        "place_slots": place_slots_program,
        "row_blocks": row_blocks_program,
        "sorted_slots": sorted_slots_program,
        "sorted_marks": sorted_slots_program,
    }
    return builders[config.kind](*config.args)


def _nvcc(config, output: str, code: str, extra=()):
    """Compile a configuration's CUDA source with the machine's nvcc (no GPU needed):
    (the output file's text, nvcc's stderr)."""
    return _nvcc_source(compiled(config).get_kernel_source(), output, code, extra)


def cuda_tool(name: str) -> str | None:
    """A CUDA toolkit executable: CUDA_HOME's (default /usr/local/cuda) bin, else the one on
    PATH; None where there is neither. Every tool is looked up this way (nvcc_path,
    bench.compute_sanitizer), so they come from one toolkit where both are set."""
    import os
    import shutil

    tool = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)
    return tool if os.path.exists(tool) else shutil.which(name)


def nvcc_path() -> str | None:
    """The nvcc that builds for sm_90a here (cuda_tool); None where there is none (tests that
    compile then skip)."""
    return cuda_tool("nvcc")


def require_nvcc() -> str:
    """nvcc_path for a compile that cannot skip: RuntimeError where there is no nvcc."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    return nvcc


def _nvcc_source(source: str, output: str, code: str, extra=(), binary: bool = False):
    import os
    import subprocess
    import tempfile

    from tilelang import env

    nvcc = require_nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.out")
        with open(cu, "w") as f:
            f.write(source)
        done = subprocess.run(
            [nvcc, output, "-std=c++17", f"-gencode=arch=compute_90a,code={code}", "-DENABLE_BF16",
             "-I" + env.TILELANG_TEMPLATE_PATH, "-I" + env.CUTLASS_INCLUDE_DIR, "-w", *extra, cu, "-o", out],
            check=True, capture_output=True, text=True,
        )
        with open(out, "rb") if binary else open(out, errors="replace") as f:
            return f.read(), done.stderr


def ptx_of(config) -> str:
    """PTX of a compiled configuration.

    PTX shows every atomic the kernel can issue (atom.*, red.*), whether it came
    from the kernel body or from a library template it includes.
    """
    return _nvcc(config, "-ptx", "compute_90a")[0]


def ptxas_info(config) -> dict:
    """ptxas's resource report for sm_90a: registers, spill_stores, spill_loads (bytes), stack (bytes)."""
    return ptxas_info_of_source(compiled(config).get_kernel_source(), config)


def ptxas_info_of_source(source: str, name="kernel") -> dict:
    """ptxas_info of generated CUDA source (any TileLang program, not only the configurations here)."""
    return ptxas_info_of_report(_nvcc_source(source, "-cubin", "sm_90a", ("-Xptxas", "-v"))[1], name)


def ptxas_info_of_report(report: str, name="kernel") -> dict:
    """ptxas_info from ptxas's -v report (RuntimeError naming ``name`` where it has no resource line)."""
    import re

    numbers = {
        "registers": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack": r"(\d+) bytes stack frame",
    }
    found = {key: re.findall(pattern, report) for key, pattern in numbers.items()}
    if not all(found.values()):
        raise RuntimeError(f"unexpected ptxas report for {name}:\n{report}")
    return {key: max(int(v) for v in values) for key, values in found.items()}


def nvdisasm_path() -> str | None:
    """nvdisasm: the toolkit's (cuda_tool), else the nvidia-cuda-nvdisasm wheel's (the newest
    CUDA's where several are installed); None where there is neither."""
    import glob
    import importlib.util
    import os
    import re

    tool = cuda_tool("nvdisasm")
    if tool:
        return tool
    spec = importlib.util.find_spec("nvidia")
    found = [path for root in ((spec.submodule_search_locations or ()) if spec else ())
             for path in glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))]

    def cuda_major(path):  # the wheels' folders: nvidia/cu13/bin (CUDA 13 on), nvidia/cuda_nvdisasm/bin (before)
        folder = re.fullmatch(r"cu(\d+)", os.path.basename(os.path.dirname(os.path.dirname(path))))
        return int(folder[1]) if folder else 0

    return max(found, key=lambda path: (cuda_major(path), path)) if found else None


def sass_and_ptxas_info(source: str, name="kernel") -> tuple:
    """(the SASS listing, nvdisasm -c, of the sm_90a cubin nvcc makes of generated CUDA source;
    its ptxas_info), from one nvcc run: no GPU needed. RuntimeError where there is no nvdisasm."""
    import os
    import subprocess
    import tempfile

    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        raise RuntimeError("nvdisasm not found: set CUDA_HOME to a full toolkit or pip install nvidia-cuda-nvdisasm")
    cubin, report = _nvcc_source(source, "-cubin", "sm_90a", ("-Xptxas", "-v"), binary=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        listing = subprocess.run([nvdisasm, "-c", path], check=True, capture_output=True, text=True).stdout
    return listing, ptxas_info_of_report(report, name)


def sass_in_line(listing: str) -> str:
    """A SASS listing up to its last EXIT. ptxas places past it what the code reaches out of line:
    called subroutines (a 64-bit division), mbarrier retry loops, and the WARPSYNC.COLLECTIVE
    copies of the code after a shuffle, which run only where a warp reaches the shuffle with
    lanes missing. ValueError where the listing has no EXIT."""
    import re

    exits = [m.start() for m in re.finditer(r"\bEXIT\b", listing)]
    if not exits:
        raise ValueError("listing: no EXIT (not an nvdisasm listing of a kernel)")
    return listing[:exits[-1]]


def dynamic_shared_bytes(kernel, name: str = "main_bwd"):
    """The dynamic shared memory a compiled kernel's host code launches ``name``_kernel
    with (the last integer it packs before looking the kernel up), or None if not found."""
    import re

    host = kernel.get_host_source()
    lookup = host.find(f"if ({name}_kernel_packed == NULL)")
    found = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);", host[:lookup]) if lookup >= 0 else []
    return int(found[-1]) if found else None


def _compile_source(config):
    return config, compiled(config).get_kernel_source()


def precompile(configs, workers: int = 1):
    """Compile configurations in parallel processes; TileLang's disk cache keeps them.

    Returns {config: CUDA source}.
    """
    configs = list(configs)
    if workers <= 1:
        return dict(map(_compile_source, configs))
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return dict(pool.map(_compile_source, configs))
