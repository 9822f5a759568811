"""The benchmark tools that rewrite kernel source (CPU: no GPU needed to check the rewrite)."""

import importlib.util
import inspect
import pathlib

import pytest

from mqa_bwd import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("adds", ["half", "none"])
def test_add_cost_variants_guard_every_add(adds):
    # The tool times the kernel with adds dropped by extending their guards; if
    # a kernel edit moved a guard, it must fail, not time an unchanged kernel.
    add_cost = _tool("add_cost")
    original = inspect.getsource(kernels)
    patched = add_cost.variant_source(adds)
    fixed_cond, atomic_cond = add_cost.DROPS[adds]
    assert patched.count(f"and ({fixed_cond}):\n") == add_cost.FIXED_GUARDS == original.count(add_cost.FIXED_GUARD)
    assert patched.count(f"and ({atomic_cond}):\n") == 2
    assert len(patched.splitlines()) == len(original.splitlines())
    compile(patched, "variant", "exec")
    with pytest.raises(RuntimeError, match="add guard"):
        add_cost.variant_source(adds, original.replace(add_cost.FIXED_GUARD, ""))


def test_add_cost_all_is_the_kernel_itself():
    assert _tool("add_cost").variant_source("all") == inspect.getsource(kernels)
