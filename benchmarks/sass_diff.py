"""The main kernel's static footprint, this tree against other versions of the package (no GPU).

    bash scripts/ab-packages.sh experiments/dq_whole_lines.patch
    python benchmarks/sass_diff.py --against .ab/dq_whole_lines/mqa_bwd [--against ...] [--d_k 576]
        [--heads 64] [--top 12]

For each main_bwd launch of a call (kernels.main_launches: the deterministic call's and the
control's, at the given d_k and head count), each version's ptxas registers and spill bytes and
its SASS instruction count, all and in line (up to the last EXIT: past it ptxas puts what the
code reaches out of line, kernels.sass_in_line), and in each warpgroup's block loop (the
innermost loops that issue a wgmma: what a block pays), with the change from this tree's, then the
opcodes whose counts (all of them) differ most from this tree's. The SASS
is nvdisasm's listing of the sm_90a cubin nvcc makes of each version's generated CUDA (this
tree's nvcc; nvdisasm from CUDA_HOME, or `pip install nvidia-cuda-nvdisasm`). A variant that
grows a block loop by a quarter, or that ptxas duplicates, shows here before it costs a device
call (docs/performance-log.md, thirty-fourth session).
"""

import argparse
import collections
import importlib
import os
import re
import sys

#: One instruction of an nvdisasm -c listing, its address and text:
#: "/*ea30*/  @!P6 STG.E.128 desc[UR60][R8.64], R20 ;".
INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+([^;{}]+?)\s*;")
#: A label line of an nvdisasm listing (".L_x_12:"), and a branch to one ("BRA `(.L_x_12)").
LABEL = re.compile(r"^\s*(\.L_x_\d+):", re.M)
BRANCH = re.compile(r"/\*([0-9a-f]+)\*/[^;]*\bBRA(?:\.\w+)*\s+`\((\.L_x_\d+)\)")


def instructions(listing: str) -> list:
    """[(address, full mnemonic ("STG.E.128"))] of an nvdisasm listing, predicate guards left out."""
    found = []
    for match in INSTRUCTION.finditer(listing):
        words = match[2].split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words:
            found.append((int(match[1], 16), words[0]))
    return found


def opcode_counts(listing: str) -> collections.Counter:
    """Instructions of an nvdisasm listing by full mnemonic ("STG.E.128"), predicate guards left out."""
    return collections.Counter(op for _, op in instructions(listing))


def block_loops(in_line: str) -> list:
    """[(first address, last address, instructions)] of the innermost loops that issue a wgmma
    (HGMMA) in a listing's code in line (kernels.sass_in_line: past the last EXIT, ptxas's
    WARPSYNC.COLLECTIVE copies branch back into the loops they leave, which is no loop), in address
    order: the warpgroups' block loops, whose length a block pays (a loop is a backward branch's
    range; a wait's retry loop inside a block loop has no HGMMA, and the item loop around it is not
    innermost). NOPs are not counted."""
    found = instructions(in_line)
    at = {}
    for label in LABEL.finditer(in_line):
        following = INSTRUCTION.search(in_line, label.end())
        if following:
            at[label[1]] = int(following[1], 16)
    loops = {(at[target], int(address, 16)) for address, target in BRANCH.findall(in_line)
             if target in at and at[target] <= int(address, 16)}

    def opcodes(first, last):
        return [op for address, op in found if first <= address <= last]

    gemm = [(a, b) for a, b in loops if any(op.startswith("HGMMA") for op in opcodes(a, b))]
    innermost = [(a, b) for a, b in gemm if not any((c, d) != (a, b) and a <= c and d <= b for c, d in gemm)]
    return [(a, b, sum(op != "NOP" for op in opcodes(a, b))) for a, b in sorted(innermost)]


def by_base(counts: collections.Counter) -> collections.Counter:
    """Counts by base mnemonic ("STG.E.128" and "STG.E" -> "STG")."""
    merged = collections.Counter()
    for name, n in counts.items():
        merged[name.split(".")[0]] += n
    return merged


def short_name(path: str) -> str:
    """A version's column title: the folder that holds its mqa_bwd/ (".ab/x/mqa_bwd" -> "x")."""
    parts = [p for p in path.replace(os.sep, "/").split("/") if p]
    return parts[-2] if len(parts) > 1 and parts[-1] == "mqa_bwd" else (parts[-1] if parts else path)


def launch_label(config) -> str:
    """A main launch's name across versions: its accumulation, tiles and corrections."""
    tiles = getattr(config, "tiles", 1)
    label = config.accumulate + (f"-tiles{tiles}" if tiles > 1 else "")
    return label + ("-corrections" if getattr(config, "corrections", False) else "")


def footprint(kernels, toolchain, heads: int, d_k: int, d_v: int) -> dict:
    """{launch label: (ptxas info with the in-line instruction count, opcode counts)} of one
    version's main launches: ``kernels`` is that version's mqa_bwd.kernels (its sources),
    ``toolchain`` this tree's (nvcc, nvdisasm)."""
    found = {}
    for deterministic in (True, False):
        for _, config in kernels.main_launches(heads // 32, 32, d_k, d_v, deterministic):
            label = launch_label(config)
            if label not in found:
                listing, info = toolchain.sass_and_ptxas_info(kernels.compiled(config).get_kernel_source(), label)
                in_line = toolchain.sass_in_line(listing)
                info["in_line"] = sum(opcode_counts(in_line).values())
                info["block_loops"] = [n for *_, n in block_loops(in_line)]
                found[label] = (info, opcode_counts(listing))
    return found


def diff_lines(versions: dict, top: int = 12) -> list:
    """The report's lines: per launch label (of any version), each version's registers, spills and
    instruction counts, all and in line, with their change from the first version's, then the
    ``top`` opcodes (base mnemonics) whose counts differ most from the first version's in another
    (a version without the launch shows none)."""
    names = list(versions)
    base = names[0]
    labels = list(dict.fromkeys(label for name in names for label in versions[name]))
    lines = []
    for label in labels:
        lines.append(f"{label}:")
        lines.append(f"  {'':<32} {'registers':>9} {'spills st/ld':>13} {'instructions':>13} {'in line':>8} "
                     f"{'block loops':>12}")
        have = [name for name in names if label in versions[name]]
        for name in names:
            if name not in have:
                lines.append(f"  {name:<32} (no such launch)")
                continue
            info, counts = versions[name][label]
            total = sum(counts.values())
            change = ""
            if name != base and base in have:
                first, first_in_line = sum(versions[base][label][1].values()), versions[base][label][0]["in_line"]
                change = (f"  {total - first:+d} ({(total - first) / first:+.1%}), in line "
                          f"{info['in_line'] - first_in_line:+d} ({(info['in_line'] - first_in_line) / first_in_line:+.1%})")
            loops = info.get("block_loops") or []
            if name != base and base in have and loops and versions[base][label][0].get("block_loops"):
                change += f", block loops {sum(loops) - sum(versions[base][label][0]['block_loops']):+d}"
            spills = f"{info['spill_stores']}/{info['spill_loads']}"
            shown = "+".join(map(str, loops)) or "-"
            lines.append(f"  {name:<32} {info['registers']:>9} {spills:>13} {total:>13} {info['in_line']:>8} "
                         f"{shown:>12}{change}")
        if base not in have or len(have) < 2:
            continue
        mine = by_base(versions[base][label][1])
        others = [(name, by_base(versions[name][label][1])) for name in have if name != base]
        moved = sorted({op for _, other in others for op in set(mine) | set(other) if other[op] != mine[op]},
                       key=lambda op: (-max(abs(other[op] - mine[op]) for _, other in others), op))
        if moved[:top]:
            lines.append(f"    {'opcode':<14} {'':>6}    " + " ".join(f"{short_name(name)[:16]:>16}" for name, _ in others))
        for op in moved[:top]:
            cells = " ".join(f"{f'{other[op]} ({other[op] - mine[op]:+d})':>16}" for _, other in others)
            lines.append(f"    {op:<14} {mine[op]:>6} -> {cells}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from package_ab import add_against_argument, check_against, load_against

    add_against_argument(parser)
    parser.add_argument("--heads", type=int, default=64, help="the call's head count (a multiple of 32)")
    parser.add_argument("--d_k", type=int, default=576)
    parser.add_argument("--d_v", type=int, default=512)
    parser.add_argument("--top", type=int, default=12, help="how many of the opcodes that moved most to list")
    a = parser.parse_args()
    if a.heads <= 0 or a.heads % 32:
        raise ValueError(f"--heads: {a.heads} is not a positive multiple of 32")
    check_against(a.against)

    from mqa_bwd import kernels
    from mqa_bwd.kernels import toolchain

    if toolchain.nvdisasm_path() is None:
        raise SystemExit("nvdisasm not found: set CUDA_HOME to a full toolkit or pip install nvidia-cuda-nvdisasm")
    versions = {"this tree": footprint(kernels, toolchain, a.heads, a.d_k, a.d_v)}
    for path, other in zip(a.against, load_against(a.against)):
        versions[path] = footprint(importlib.import_module(f"{other.__name__}.kernels"), toolchain, a.heads, a.d_k,
                                   a.d_v)
    print("\n".join(diff_lines(versions, a.top)))


if __name__ == "__main__":
    main()
