"""Imports go one way, and none goes round in a circle.

The layers, bottom to top (docs/design.md draws them):

  base            mqa_bwd.contract, mqa_bwd.edge, mqa_bwd.files: SPEC names, the
                  instrumentation seam, the framework edge, atomic writes
  oracle          the NumPy reference (a leaf: it imports none of ours)
  implementation  mqa_bwd itself: kernels, launch, wrapper, model, fixed point, backends,
                  and the peers behind the same signature (cudnn: cuDNN's backward)
  harness         properties: cases, strategies, checks, comparisons, the plugin
  tools           mqa_bwd's cli (and console), fuzz, repro, capture, bench (and gpu_clocks),
                  mutants, autograd

A module may import its own layer and the layers its row allows below; the
implementation and the harness never see each other (the harness reaches an
implementation only through the SPEC signature and the seam). Every import
counts, at module level or inside a function, since a lazy import still ties
the two modules together. The scan is of source files, so it needs nothing
installed and runs in CI.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mqa_bwd", "oracle", "properties")

BASE = {"mqa_bwd.contract", "mqa_bwd.edge", "mqa_bwd.files"}
#: Other implementations behind the SPEC signature: implementation modules, as ours are.
PEERS = {"mqa_bwd.cudnn"}
TOOLS = {"mqa_bwd.cli", "mqa_bwd.console", "mqa_bwd.fuzz", "mqa_bwd.repro", "mqa_bwd.capture", "mqa_bwd.bench", "mqa_bwd.mutants",
         "mqa_bwd.gpu_clocks", "mqa_bwd.autograd",
         "mqa_bwd.__main__"}
#: layer -> the layers its modules may import (their own included).
ALLOWED = {
    "base": {"base"},
    "oracle": {"oracle"},
    "implementation": {"base", "implementation"},
    "harness": {"base", "oracle", "harness"},
    "tools": {"base", "oracle", "implementation", "harness", "tools"},
}


def layer_of(module: str) -> str:
    if module in BASE:
        return "base"
    if module in TOOLS:
        return "tools"
    top = module.split(".")[0]
    return {"oracle": "oracle", "properties": "harness", "mqa_bwd": "implementation"}[top]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(root: Path, packages=PACKAGES) -> dict:
    """{dotted module name: path} of every source file of our packages."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def imports_of(path: Path, name: str, known: set) -> set:
    """Our modules that ``name`` (at ``path``) imports anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()

    def resolve(base: str, names):
        if base in known or any(base == k or k.startswith(base + ".") for k in known):
            for alias in names:
                child = f"{base}.{alias}" if base else alias
                targets.add(child if child in known else base)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for i in range(len(parts), 0, -1):  # the deepest of ours that the dotted name names
                    if ".".join(parts[:i]) in known:
                        targets.add(".".join(parts[:i]))
                        break
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            resolve(base, [a.name for a in node.names])
    targets.discard(name)
    # A module importing its own parent package (or an ancestor) runs that package's __init__, which is
    # Python's doing, not a dependency of the module's own.
    return {t for t in targets if not name.startswith(t + ".")}


def graph_of(root: Path, packages=PACKAGES) -> dict:
    modules = modules_of(root, packages)
    known = set(modules)
    return {name: imports_of(path, name, known) for name, path in modules.items()}


def wrong_way(graph: dict) -> list:
    """['a imports b: layer x may not import layer y'] for every import against the layers."""
    bad = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) not in ALLOWED[layer_of(name)]:
                bad.append(f"{name} imports {target}: {layer_of(name)} may not import {layer_of(target)}")
    return bad


def circles(graph: dict) -> list:
    """Every strongly connected group of two or more modules (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_module_has_a_layer():
    for name in modules_of(ROOT):
        assert layer_of(name) in ALLOWED, name


def test_the_peers_are_implementation_modules():
    # A peer adapter may use the wrapper's validation and the edge, never the harness or the oracle.
    assert PEERS <= set(modules_of(ROOT))
    assert {layer_of(name) for name in PEERS} == {"implementation"}


def test_imports_go_one_way():
    bad = wrong_way(graph_of(ROOT))
    assert not bad, "imports against the layers (tests/test_layers.py's docstring):\n" + "\n".join(bad)


def test_no_import_circles():
    found = circles(graph_of(ROOT))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(group) for group in found)


# ---------------------------------------------------------------------------
# The checks can fail: a small tree with each kind of fault
# ---------------------------------------------------------------------------


def _tree(tmp_path, files: dict) -> Path:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("source, culprit", [
    ("from properties import checks\n", "mqa_bwd.wrapper imports properties.checks"),
    ("def f():\n    import oracle\n", "mqa_bwd.wrapper imports oracle"),  # a lazy import counts too
    ("from .cli import main\n", "mqa_bwd.wrapper imports mqa_bwd.cli"),
])
def test_a_wrong_way_import_is_found(tmp_path, source, culprit):
    root = _tree(tmp_path, {"mqa_bwd/__init__.py": "", "mqa_bwd/wrapper.py": source, "mqa_bwd/cli.py": "",
                            "properties/__init__.py": "", "properties/checks.py": "", "oracle/__init__.py": ""})
    bad = wrong_way(graph_of(root))
    assert any(line.startswith(culprit) for line in bad), bad


def test_the_harness_importing_the_implementation_is_found(tmp_path):
    root = _tree(tmp_path, {"mqa_bwd/__init__.py": "", "mqa_bwd/launch.py": "", "mqa_bwd/contract.py": "",
                            "properties/__init__.py": "",
                            "properties/checks.py": "from mqa_bwd.contract import SPEC_ARGS\nfrom mqa_bwd import launch\n",
                            "oracle/__init__.py": ""})
    assert wrong_way(graph_of(root)) == [
        "properties.checks imports mqa_bwd.launch: harness may not import implementation"]


def test_a_circle_is_found(tmp_path):
    root = _tree(tmp_path, {"mqa_bwd/__init__.py": "", "mqa_bwd/model.py": "from .wrapper import per_head\n",
                            "mqa_bwd/wrapper.py": "def f():\n    from . import backends\n",
                            "mqa_bwd/backends.py": "from .model import ModelLauncher\n",
                            "mqa_bwd/kernels/__init__.py": "from .config import X\n",
                            "mqa_bwd/kernels/config.py": "from . import helpers\n",
                            "mqa_bwd/kernels/helpers.py": "",
                            "properties/__init__.py": "", "oracle/__init__.py": ""})
    # The package's own __init__ importing its children is no circle; the three modules are.
    assert circles(graph_of(root)) == [["mqa_bwd.backends", "mqa_bwd.model", "mqa_bwd.wrapper"]]
