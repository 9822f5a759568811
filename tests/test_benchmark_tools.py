"""The benchmark tools (CPU: no GPU needed to check their probes, parsers and counts)."""

import argparse
import collections
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from mqa_bwd import bench, kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: A SIMT global add or atomic in PTX (not the bulk unit's cp.reduce.async.bulk).
ATOMIC_PTX_ADD = re.compile(r"\b(?:atom|red)\.global\.[a-z0-9.]*add[a-z0-9.]*")


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["racecheck_handoff"])
def test_cuda_probe_builds(name, tmp_path):
    # The probes are plain CUDA (racecheck_handoff's with inline PTX: named
    # barriers, mbarriers), built where they run: a source or API slip must
    # fail here, not on the GPU machine.
    tool = _tool(name)
    if kernels.nvcc_path() is None:
        pytest.skip("needs nvcc (CUDA toolkit)")
    assert os.path.exists(tool.build_probe(str(tmp_path)))


@pytest.mark.parametrize("name", ["nvcc", "compute-sanitizer"])
def test_cuda_tools_prefer_cuda_home_then_path(name, tmp_path, monkeypatch):
    # Every compile (kernels.toolchain._nvcc_source, bench.build_cuda_program) and every
    # skip test asks kernels.nvcc_path, so they agree on whether nvcc exists;
    # compute-sanitizer is looked up the same way, so both come from one
    # toolkit where CUDA_HOME and PATH name different ones.
    from mqa_bwd.bench import compute_sanitizer

    lookup = {"nvcc": kernels.nvcc_path, "compute-sanitizer": compute_sanitizer}[name]
    home, other = tmp_path / "cuda", tmp_path / "other"
    for root in (home, other):
        (root / "bin").mkdir(parents=True)
        tool = root / "bin" / name
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("PATH", str(other / "bin"))
    assert lookup() == str(home / "bin" / name)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    assert lookup() == str(other / "bin" / name)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert lookup() is None


def test_add_floor_kernels_issue_their_adds():
    # The floor is only a floor if each variant issues exactly its adds: the
    # 64-bit integer add (atom in PTX, a RED in SASS as in the main kernel;
    # u64pair issues half as many, two columns a word), the 32-bit one, the
    # vector fp32 add, TMA bulk reductions, or none (index loads only).
    tool = _tool("add_floor")
    found, counts, bulk = {}, {}, {}
    for variant in tool.VARIANTS:
        source = kernels.compile_program(tool.adds_program(variant)).get_kernel_source()
        ptx = kernels.toolchain._nvcc_source(source, "-ptx", "compute_90a")[0]
        adds = re.findall(r"\b(?:atom|red)\.[a-z0-9.]+", ptx)
        found[variant], counts[variant] = sorted(set(adds)), len(adds)
        bulk[variant] = len(re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.u64", ptx))
    assert found == {"u64": ["atom.global.add.u64"], "u64pair": ["atom.global.add.u64"], "u32": ["atom.global.add.u32"],
                     "f32x4": ["red.global.add.v4.f32"], "u64pair64": ["atom.global.add.u64"],
                     "f32x4_64": ["red.global.add.v4.f32"], "bulk256": [], "indices": []}, found
    assert counts["u64pair"] * 2 == counts["u64"], counts
    # A warp's share of a block, 4 slots' 288 words each, in 36 instructions either way: u64pair
    # a slot at a time (32 words an instruction), u64pair64 4 slots at a time (8 words each);
    # f32x4_64 half the columns of 8 slots, 16 a quad an instruction (nvcc may copy that loop);
    # f32x4 a row in 5 instructions, the last one's lanes past 576 idle.
    assert counts["u64pair64"] == counts["u64pair"] == 4 * 576 // 64, counts
    assert counts["f32x4_64"] % (576 // 2 // 16) == 0 and counts["f32x4"] == 4 * 5, counts
    # bulk256 adds by TMA bulk reductions only (a block's 32 x 9 spread over its threads).
    assert bulk["bulk256"] and not any(bulk[v] for v in tool.VARIANTS if v != "bulk256"), bulk
    with pytest.raises(ValueError, match="variant"):
        tool.adds_program("f64")
    with pytest.raises(ValueError, match="^slots, threads"):
        tool.adds_program("u64pair64", slots=64)


def test_load_probe_times_each_load_until_it_lands_beside_whole_line_reductions():
    # load_under_reds' figures are latencies only if the clock is read after the load's value is
    # used (a predicate formed from it), by an L2 load (ld.global.cg) or a bulk copy waited for on
    # its mbarrier, while the busy warps send 64-bit fire-and-forget reductions as the lanes do.
    tool = _tool("load_under_reds")
    source = kernels.compile_program(tool.probe_program(8)).get_kernel_source()
    ptx = kernels.toolchain._nvcc_source(source, "-ptx", "compute_90a")[0]
    assert set(re.findall(r"\b(?:atom|red)\.global\.[a-z0-9.]+", ptx)) == {"red.global.add.u64"}, "the reductions"
    # nvcc unrolls the probes' loop: a probe has a load and a bulk copy (one taken, by the launch's
    # argument) and one clock read after the value either gave.
    loads = len(re.findall(r"ld\.global\.cg\.s32", ptx))
    copies = len(re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes", ptx))
    after = len(re.findall(r"setp\.ge\.s32\s+(%?\w+), %r\d+, 0;\s*@\1 mov\.u64 %rd\d+, %clock64;", ptx))
    assert loads >= 1 and loads == copies == after, (loads, copies, after)
    assert "mbarrier.try_wait.parity" in ptx
    assert set(tool.MODES) == {0, 1, 2, 3}


def test_exchange_probe_swaps_the_partials_through_the_partners_shared_memory_beside_reductions():
    # dsmem_exchange's cycles are an exchange's only if each CTA writes its partials into the
    # partner's shared memory (a mapa'd address; plain stores then a release-arrive on the
    # partner's barrier, st.async completing the bytes on it, or a bulk copy a warp of the staged
    # partials, after the proxy fence that shows them to the copy) and reads its own inbox only
    # after an acquire-wait, while the busy warps send the lanes' 64-bit fire-and-forget adds.
    tool = _tool("dsmem_exchange")
    source = kernels.compile_program(tool.probe_program(8)).get_kernel_source()
    ptx = kernels.toolchain._nvcc_source(source, "-ptx", "compute_90a")[0]
    assert set(re.findall(r"\b(?:atom|red)\.global\.[a-z0-9.]+", ptx)) == {"red.global.add.u64"}, "the reductions"
    assert "mapa.shared::cluster" in ptx
    stores = len(re.findall(r"st\.shared::cluster\.v4\.f32", ptx))
    asyncs = len(re.findall(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.v4\.f32", ptx))
    # Every thread of the exchanging warpgroup writes its share of both 64 x 64 fp32 partials.
    assert stores == asyncs == tool.WORDS // 4 // tool.EXCHANGE_THREADS, (stores, asyncs)
    bulk = re.findall(r"cp\.async\.bulk\.shared::cluster\.shared::cta\.mbarrier::complete_tx::bytes", ptx)
    assert len(bulk) == 1 and "fence.proxy.async.shared::cta" in ptx and "cp.async.bulk.wait_group.read 0" in ptx
    assert set(tool.VIAS) == {0, 1, 2}
    assert "mbarrier.arrive.release.cluster.shared::cluster.b64" in ptx
    assert "mbarrier.arrive.expect_tx.shared::cta.b64" in ptx  # st.async's bytes, expected by the reader
    assert "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64" in ptx
    assert "barrier.cluster.arrive" in ptx and "%cluster_ctarank" in ptx
    assert tool.WORDS * 4 == 2 * 64 * 64 * 4  # S's and dP's partials, 16 KB each


def test_red_supply_sends_each_form_it_names():
    # red_supply's rates compare forms by the bytes an instruction carries: each form's instruction
    # must be in the kernel, fire-and-forget (red, no atom), and FORMS' bytes 32 lanes of it.
    tool = _tool("red_supply")
    source = kernels.compile_program(tool.supply_program()).get_kernel_source()
    ptx = kernels.toolchain._nvcc_source(source, "-ptx", "compute_90a")[0]
    sent = set(re.findall(r"\b(?:atom|red)\.global\.[a-z0-9.]+", ptx))
    assert sent == {"red.global.add.u64", "red.global.add.v4.f32", "red.global.add.u32"}, sent
    lane_bytes = {"u64": 8, "f32x4": 16, "u32": 4}
    for name, (form, per_instruction) in tool.FORMS.items():
        assert per_instruction == 32 * lane_bytes[name.split()[0]], name
        rows, width = (int(x) for x in name.split()[1].split("x"))
        assert rows * width == per_instruction, name  # whole or half lines of distinct rows
    assert sorted(form for form, _ in tool.FORMS.values()) == list(range(len(tool.FORMS)))
    assert "* 2304 +" in source and "line == 18 - 1" in source  # rows of d_k = 576 4-byte columns, 18 lines each
    # A sender's loop must not divide (the remainders belong to its start): nvcc unrolls each form's
    # loop four times, so at least three stretches a form between its adds hold no division.
    between = re.split(r"\bred\.global\.add\.[a-z0-9.]+", ptx)[1:-1]
    plain = sum(not re.search(r"\b(?:rem|div)\.", stretch) for stretch in between)
    assert plain >= 3 * len(tool.FORMS), f"{plain} of {len(between)} stretches between adds hold no division"
    assert "%clock64" in ptx, "the pauses between bursts (--burst, --gap) time themselves on the SM's clock"


def test_fence_probe_issues_reductions_then_each_fence():
    # The probe's numbers mean something only if the reductions are 64-bit
    # fire-and-forget ones (as the main kernel's) and each mode is its fence.
    tool = _tool("fence_probe")
    source = kernels.compile_program(tool.probe_program()).get_kernel_source()
    ptx = kernels.toolchain._nvcc_source(source, "-ptx", "compute_90a")[0]
    assert "red.global.add.u64" in ptx and "atom." not in ptx
    for fence in ("fence.proxy.async.shared::cta", "membar.cta", "bar.sync", "membar.gl"):
        assert fence in ptx, fence


def _write_listing(path, rows):
    """An ncu per-instruction export: a kernel line, the header, then rows."""
    import csv

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "stall_barrier", "stall_mio", "stall_short_sb",
              "stall_barrier (Not Issued)"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "main_bwd_kernel", ""])
        writer.writerow(header)
        for row in rows:
            writer.writerow(row)


def test_ncu_stalls_summary(tmp_path):
    # Shares are of all samples; predicates are not opcodes; "x ideal" shows a
    # 2-way conflicted store first; the top list keeps listing order.
    tool = _tool("ncu_stalls")
    path = tmp_path / "sass.csv"
    _write_listing(path, [
        ["0x0", "      BAR.SYNC.DEFER_BLOCKING 0x0", "10", "100", "0", "0", "10", "0", "0", "99"],
        ["0x10", "@P3   BRA 0x7f", "30", "100", "-", "-", "30", "0", "0", "0"],
        ["0x20", "      STS.64 [R1+0x10], R2", "60", "100", "400", "200", "0", "60", "0", "0"],
        ["0x30", "      HMMA.16816.F32.BF16 R4, R8, R12, R4", "100", "100", "0", "0", "0", "0", "100", "0"],
        ["0x40", "      LDSM.16.M88.4 R60, [R60]", "0", "100", "300", "300", "0", "0", "0", "0"],
    ])
    s = tool.summarize(*tool.read_listing(str(path)), top=3)
    assert s["samples"] == 200
    assert s["reasons"] == [("stall_short_sb", 50.0), ("stall_mio", 30.0), ("stall_barrier", 20.0)]
    assert [op for op, *_ in s["opcodes"]] == ["HMMA", "STS", "BRA", "BAR"]
    assert s["shared"][0][:3] == ("STS.64", 400.0, 200.0)
    assert [(i, share) for i, _, share, _ in s["top"]] == [(1, 15.0), (2, 30.0), (3, 50.0)]
    assert tool.opcode("@!P4  SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ", full=True) == "SYNCS.ARRIVE.TRANS64.RED.A1T0"
    tool.print_summary(s)  # the printed form takes what summarize returns


def test_ncu_stalls_shared_pipe_floor(tmp_path):
    # 3,000 wavefronts on 2 SMs at 1 MHz: 1.5 ms at one per SM per cycle, whatever
    # units ncu chose; a rule row (no unit) is skipped; wgmma's share is its wavefronts'.
    import csv

    tool = _tool("ncu_stalls")
    _write_listing(tmp_path / "sass.csv", [
        ["0x0", "      HGMMA.64x32x16.F32.BF16 R152, gdesc[UR8], R152", "1", "1", "1800", "1800", "0", "0", "1", "0"],
        ["0x10", "      STS [R1], R2", "1", "1", "1200", "600", "0", "0", "1", "0"],
    ])
    with open(tmp_path / "details.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        w.writerow(["0", "Launch Statistics", "# SMs", "", "2"])
        w.writerow(["0", "GPU Speed Of Light Throughput", "SM Frequency", "Mhz", "1.00"])
        w.writerow(["0", "GPU Speed Of Light Throughput", "Duration", "us", "3,000"])
        w.writerow(["0", "SOLBottleneck", "", "", "OPT"])
    s = tool.summary_of(str(tmp_path / "sass.csv"), top=1)
    pipe = s["pipe"]
    assert pipe["wavefronts"] == 3000 and pipe["gmma_share"] == 60.0
    assert pipe["floor_ms"] == pytest.approx(1.5) and pipe["duration_ms"] == pytest.approx(3.0)
    tool.print_summary(s)
    (tmp_path / "details.csv").unlink()  # an older export: the shares, no floor
    assert "floor_ms" not in tool.summary_of(str(tmp_path / "sass.csv"), top=1)["pipe"]


def test_ncu_stalls_l2_traffic_counts_sectors_spills_and_requests(tmp_path, capsys):
    # Sectors and requests summed per full opcode (predicates are not opcodes), spills as local
    # sectors, rows without either left out; the L2's busy share comes from details.csv, and
    # compare's "L2 busy ms" is the launch's time at that share.
    import csv

    tool = _tool("ncu_stalls")
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
              tool.L2_SECTORS, tool.L2_EXCESS, tool.L2_LOCAL, tool.L2_REQUESTS]
    rows = [["0x0", "      REDG.E.ADD.64.STRONG.GPU desc[UR60][R20.64], R22", "5", "10", "5", "80", "0", "0", "20"],
            ["0x10", "@!P0  REDG.E.ADD.64.STRONG.GPU desc[UR60][R8.64], R10", "5", "10", "5", "80", "8", "0", "25"],
            ["0x20", "      STL.64 [R1+0x28], R2", "1", "4", "1", "0", "0", "16", "0"],
            ["0x30", "      LDGSTS.E.BYPASS.128 desc[UR60][R4.64], [R23+0x400]", "2", "3", "2", "48", "0", "0", "12"],
            ["0x40", "      FFMA R1, R2, R3, R4", "9", "50", "9", "0", "0", "0", "0"]]
    for name in ("det", "other"):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "sass.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["Kernel Name", "main_bwd_kernel", ""])
            writer.writerow(header)
            writer.writerows(rows)
    with open(tmp_path / "det" / "details.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        w.writerow(["0", "GPU Speed Of Light Throughput", "L2 Cache Throughput", "%", "80.00"])
        w.writerow(["0", "GPU Speed Of Light Throughput", "Duration", "ms", "2.50"])
        w.writerow(["0", "Memory Workload Analysis", "Local Memory Spilling Requests", "", "1,024"])
    s = tool.summary_of(str(tmp_path / "det" / "sass.csv"), top=1)
    l2 = s["l2"]
    assert [x[0] for x in l2["opcodes"]] == ["REDG.E.ADD.64.STRONG.GPU", "LDGSTS.E.BYPASS.128", "STL.64"]
    assert l2["opcodes"][0][1:] == (160.0, 8.0, 0.0, 45.0, 20.0)
    assert (l2["sectors"], l2["excess"], l2["local"], l2["requests"]) == (208.0, 8.0, 16.0, 57.0)
    assert l2["l2_busy"] == 80.0 and l2["spill_requests"] == 1024.0 and "dram_busy" not in l2
    assert "l2_busy" not in tool.summary_of(str(tmp_path / "other" / "sass.csv"), top=1)["l2"]  # no details.csv
    tool.compare([("det", s)])
    out = capsys.readouterr().out
    assert "det" in out and " 2.00" in out.splitlines()[1]  # 2.5 ms at 80 % busy: 2.0 ms of L2 work
    assert "spills in 0.0M requests" in out
    assert tool._profile_dir(f"x={tmp_path / 'det'}") == ("x", str(tmp_path / "det" / "sass.csv"))
    assert tool._profile_dir(str(tmp_path / "other"))[0] == "other"
    with pytest.raises(argparse.ArgumentTypeError, match="no sass.csv"):
        tool._profile_dir(str(tmp_path))


def _write_sass(path, lines):
    """_write_listing of (SASS, warp samples) lines at consecutive addresses, every sample a
    barrier stall."""
    _write_listing(path, [[f"{16 * i:#x}", "      " + sass, str(n), "1", "0", "0", str(n), "0", "0", "0"]
                          for i, (sass, n) in enumerate(lines)])


def test_ncu_stalls_says_where_each_warpgroup_waits(tmp_path):
    # The listing cut at its EXITs: the prologue (to the last CTA barrier before the first
    # mbarrier wait), then a region per warpgroup named by the mbarriers it waits on (offsets
    # from the lowest, in the wide tile's order); the out-of-line retry loop of PDS_READY counts
    # in the region that waits on PDS_READY; REDUX is no global reduction.
    tool = _tool("ncu_stalls")

    _write_sass(tmp_path / "sass.csv", [
        ("SYNCS.EXCH.64 URZ, [UR4+0x34200], UR8", 1),
        ("REDUX.MAX UR5, R3", 1),
        ("BAR.SYNC.DEFER_BLOCKING 0x0", 8),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x34208], R2", 10),  # warpgroup 0: KV_FREE
        ("REDG.E.ADD.64.STRONG.GPU desc[UR6][R4.64], R8", 20),
        ("BAR.SYNC.DEFER_BLOCKING 0x1, 0x80", 5),
        ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", 15),
        ("@!P0 EXIT", 0),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x34200], R0", 30),  # warpgroup 1: PDS_READY
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 10),
        ("EXIT", 0),
        ("YIELD", 5),  # PDS_READY's retry loop
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x34200], R0", 40),
        ("@!P0 BRA 0xb0", 5),
        ("BRA 0x90", 0),
    ])
    s = tool.summary_of(str(tmp_path / "sass.csv"), top=3)
    got = {label: (share, dict(parts)) for label, share, parts in s["handoffs"]}
    assert list(got) == ["prologue", "waits on KV_FREE", "waits on PDS_READY"]
    assert got["prologue"] == (pytest.approx(100 / 15), {"CTA barrier": pytest.approx(80.0), "other": pytest.approx(20.0)})
    assert got["waits on KV_FREE"] == (pytest.approx(100 / 3), {"global reductions": 40.0, "other": 30.0, "wait KV_FREE": 20.0,
                                              "gather barrier": 10.0})
    assert got["waits on PDS_READY"] == (60.0, {"wait PDS_READY": pytest.approx(700 / 9), "wgmma wait": pytest.approx(100 / 9),
                                                "other": pytest.approx(100 / 9)})
    tool.print_summary(s)


def test_ncu_stalls_names_only_the_mbarriers_it_can_place(tmp_path):
    # Offsets are taken from the base register most SYNCS instructions use; another base, an
    # address of another form and a barrier id held in a register are named as such, never
    # guessed, and the summary still comes out.
    tool = _tool("ncu_stalls")

    _write_sass(tmp_path / "sass.csv", [
        ("SYNCS.EXCH.64 URZ, [UR4+0x34200], UR8", 1),
        ("SYNCS.EXCH.64 URZ, [UR4+0x34208], UR8", 1),
        ("BAR.RED.POPC P0, 0x0, P1", 2),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x34208], R2", 10),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ+-0x8], R2", 6),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3.X4+0x10], R2", 4),
        ("BAR.SYNC R5", 3),
        ("EXIT", 0),
    ])
    (label, share, parts), = [h for h in tool.summary_of(str(tmp_path / "sass.csv"), top=2)["handoffs"]
                              if h[0] != "prologue"]
    assert label == "waits on KV_FREE, mbarrier R3+0x0, mbarrier ?"
    assert dict(parts) == {"wait KV_FREE": pytest.approx(1000 / 23), "wait mbarrier R3+0x0": pytest.approx(600 / 23),
                           "wait mbarrier ?": pytest.approx(400 / 23), "named barrier ?": pytest.approx(300 / 23)}
    renamed = tool.summary_of(str(tmp_path / "sass.csv"), top=2, mbarriers=("A", "B"))["handoffs"]
    assert renamed[-1][0] == "waits on B, mbarrier R3+0x0, mbarrier ?"


def test_ncu_stalls_add_stretches(tmp_path, capsys):
    # A stretch is the code between two fences (wgmma, its wait, mbarriers, named barriers, EXIT);
    # only those with four reductions or more are listed, with their samples per executed
    # reduction, their reasons as shares of the stretch and the scoreboard waits by producer.
    tool = _tool("ncu_stalls")
    red = "REDG.E.ADD.64.STRONG.GPU desc[UR60][R12.64], R14"
    _write_listing(tmp_path / "sass.csv", [[f"{16 * i:#x}", "      " + sass, str(n), str(x), "0", "0", "0", str(m), str(n - m), "0"]
                                           for i, (sass, n, x, m) in enumerate([
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 9, 4, 0),
        ("SHFL.BFLY PT, R23, R23, 0x1, 0x1f", 20, 8, 20),
        (red, 10, 4, 10),
        (red, 0, 4, 0),
        ("SEL R14, R23, R14, !P1", 40, 8, 0),
        ("@P0 " + red, 10, 2, 6),
        (red, 10, 2, 0),
        ("HGMMA.64x64x16.F32.BF16 R184, gdesc[UR20], R184", 5, 4, 0),
        (red, 50, 4, 50),  # three reductions between fences: not a stretch
        (red, 0, 4, 0),
        (red, 0, 4, 0),
        ("EXIT", 0, 1, 0),
    ])])
    (s,) = tool.add_stretches(*tool.read_listing(str(tmp_path / "sass.csv")))
    assert (s["first"], s["last"], s["addresses"], s["instructions"], s["reductions"]) == (1, 6, ("0x10", "0x60"), 6, 4)
    assert s["share"] == pytest.approx(9000 / 154) and s["per_add"] == pytest.approx(90 / 12)
    assert s["reasons"] == [("stall_short_sb", pytest.approx(5400 / 90)), ("stall_mio", pytest.approx(3600 / 90))]
    assert s["opcodes"] == [("SEL", pytest.approx(4000 / 90), "stall_short_sb"), ("REDG", pytest.approx(3000 / 90), "stall_mio"),
                            ("SHFL", pytest.approx(2000 / 90), "stall_mio")]
    # The select waits on the shuffle before it; the reductions on registers no producer wrote.
    assert s["waits"] == [("short_sb on SHFL", pytest.approx(4000 / 90)), ("short_sb on other", pytest.approx(1400 / 90))]
    assert tool._registers("LDS.128 R8, [R251+UR7+0x38400]") == ((8, 9, 10, 11), (251,))
    assert tool._registers("@P1 SHFL.BFLY PT, R23, R22, 0x1, 0x1f") == ((23,), (22,))
    assert tool._registers(red) == ((), (12, 14, 13))
    # A warpgroup's region counts a stretch's instructions but its reductions as "add stretches".
    _write_sass(tmp_path / "region.csv", [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x34200], R0", 10)]
                + [(red, 5)] * 4 + [("SEL R14, R23, R14, !P1", 20), ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", 10),
                                    ("IADD3 R1, R1, 0x1, RZ", 40), ("EXIT", 0)])
    (_, _, parts), = tool.handoffs(tool.read_listing(str(tmp_path / "region.csv"))[1])
    assert dict(parts) == {"other": 50.0, "add stretches": 20.0, "global reductions": 20.0, "wait PDS_READY": 10.0}
    tool.print_add_stretches(*tool.read_listing(str(tmp_path / "sass.csv")), lines=1)
    out = capsys.readouterr().out
    assert "rows 1-6" in out and "SHFL.BFLY" in out


def test_ncu_stalls_rejects_an_export_without_source_counters(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Section Name","Metric Name"\n"0","SpeedOfLight","Duration"\n')
    with pytest.raises(ValueError, match="per-instruction header"):
        _tool("ncu_stalls").read_listing(str(path))


def _write_pm_export(path, l2, tensor, interval_us=3):
    """ncu's raw page of one PM-sampled kernel: the header, the units, the kernel's row, each
    sampled metric as its total and then its samples in parentheses."""
    import csv

    tool = _tool("l2_timeline")
    cell = lambda values: f"{sum(values) / len(values):,.2f} (" + "; ".join(f"{v:g}" for v in values) + ")"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        writer.writerow(["ID", "Kernel Name", tool.INTERVAL, tool.L2, tool.TENSOR])
        writer.writerow(["", "", "us", "%", "%"])
        writer.writerow(["0", "main_bwd_kernel", f"{interval_us} ({interval_us})", cell(l2), cell(tensor)])


def test_l2_timeline_finds_the_span_its_steady_level_ramp_and_tail(tmp_path):
    # Idle samples around the launch, a ramp of 3 samples, 100 at the steady 90 %, a tail of 2.
    tool = _tool("l2_timeline")
    l2 = [0.0, 1.0] + [30.0, 60.0, 80.0] + [89.0, 90.0, 91.0] * 33 + [90.0] + [50.0, 10.0] + [0.0]
    tensor = [0.0] * 2 + [40.0] * 105 + [0.0]
    path = tmp_path / "fixed.csv"
    _write_pm_export(path, l2, tensor)
    s = tool.summarize(tool.read_samples(str(path)))
    assert s["samples"] == 105 and s["span_us"] == 315
    assert s["steady"] == 90.0 and (s["p10"], s["p90"]) == (89.0, 91.0)
    assert (s["ramp_up_us"], s["tail_us"]) == (9, 6)  # 80 % is under 0.9 x 90 %
    # The ramp's and the tail's shortfall from 90 %, over the span: (60 + 30 + 10 + 40 + 80) / 105.
    assert s["ramp_and_tail_cost"] == pytest.approx(220 / 105)
    assert s["tensor"] == pytest.approx(40.0)
    assert len(s["bins"]) == tool.BINS and s["bins"][0] < s["bins"][20] == pytest.approx(90.0, abs=1)
    tool.print_summary("fixed", s)  # the printed form takes what summarize returns


def test_l2_timeline_refuses_an_export_without_pm_samples(tmp_path):
    tool = _tool("l2_timeline")
    path = tmp_path / "fixed.csv"
    _write_pm_export(path, [90.0] * 4, [40.0] * 4)
    path.write_text(path.read_text().replace(tool.L2, "lts__throughput.avg.pct_of_peak_sustained_elapsed"))
    with pytest.raises(ValueError, match="PmSampling"):
        tool.read_samples(str(path))
    with pytest.raises(ValueError, match="instance values"):
        tool.series("88.5")
    _write_pm_export(path, [0.0, 90.0, 89.0, float("nan"), 91.0, 0.0], [40.0] * 6)  # ncu's "n/a" inside the launch
    with pytest.raises(ValueError, match="1 of the launch's 4 samples have no value"):
        tool.summarize(tool.read_samples(str(path)))


def test_ncu_stalls_counts_main_launches_per_call():
    tool = _tool("ncu_stalls")
    # two 32-head groups: one wide tile, then its corrections and its gated redo
    assert tool.main_launches_per_call(64, "fixed") == 3
    assert tool.main_launches_per_call(64, "atomic") == 1  # the pair runs as one 64-head CTA
    assert tool.main_launches_per_call(128, "atomic") == 1  # both 64-head tiles in one grid
    assert tool.main_launches_per_call(128, "fixed") == 3
    assert tool.main_launches_per_call(96, "fixed") == 4  # the wide tile, the lone group, the corrections, the redo
    assert tool.main_launches_per_call(40, "atomic") == 3  # 16-head groups of the control are never paired
    assert tool.main_launches_per_call(40, "fixed") == 2  # three 16-head groups: a cluster and one alone


def test_package_ab_imports_another_copy_of_the_package_beside_this_one(tmp_path):
    # The other version's modules are its own (relative imports resolve inside
    # the copy), not this tree's; a directory that is not the package is refused.
    import shutil
    import sys

    import mqa_bwd
    from mqa_bwd import wrapper

    copy = tmp_path / "mqa_bwd"
    shutil.copytree(ROOT / "mqa_bwd", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "wrapper.py").write_text((copy / "wrapper.py").read_text() + "\nMARK = 'the copy'\n")
    tool = _tool("package_ab")
    try:
        other = tool.load_package(str(copy), "mqa_bwd_test_copy")
        other_wrapper = importlib.import_module("mqa_bwd_test_copy.wrapper")
        assert other is not mqa_bwd and other_wrapper is not wrapper
        assert other_wrapper.MARK == "the copy" and not hasattr(wrapper, "MARK")
        assert importlib.import_module("mqa_bwd_test_copy.launch").K.__name__ == "mqa_bwd_test_copy.kernels"
    finally:
        for name in [m for m in sys.modules if m.startswith("mqa_bwd_test_copy")]:
            del sys.modules[name]
    with pytest.raises(ValueError, match="--against"):
        tool.load_package(str(tmp_path))


def test_ab_tools_time_the_default_sets_unless_a_shape_of_their_own_is_given():
    given = "B=1,S=4096,S_kv=4096,H=64,L=2048"
    assert bench.ab_shapes(None, (), default="dsv32,fleet") == bench.SHAPES["dsv32"] + bench.SHAPES["fleet"]
    assert bench.ab_shapes(None, (given,), default="dsv32,fleet") == [bench.parse_shape(given)]
    assert bench.ab_shapes("fleet", (given,)) == bench.SHAPES["fleet"] + [bench.parse_shape(given)]
    with pytest.raises(ValueError, match="--shapes"):
        bench.ab_shapes("dsv33")


def test_precompile_of_one_width_and_head_group_holds_what_the_bench_shapes_launch():
    # A package A/B compiles each copy's kernels on the device: --d_k 576 --group-heads 32 must
    # hold every main launch of dsv32 (H=64, 128) and fleet, with the lanes' int64 redo, and
    # nothing of d_k = 512; a width or group the wrapper never launches is refused by name.
    from mqa_bwd import kernels
    from mqa_bwd.kernels.__main__ import chosen_configs

    narrow = set(chosen_configs(576, 32))
    assert narrow < set(chosen_configs())
    for groups in (2, 4):
        for deterministic in (True, False):
            for _, config in kernels.main_launches(groups, 32, 576, 512, deterministic):
                assert config.kernel in narrow or config in narrow
                if config.accumulate == "lanes":
                    for follower in (kernels.lanes_corrections(config), kernels.lanes_redo(config)):
                        assert follower.kernel in narrow or follower in narrow
    assert all(c.d_k == 576 for c in narrow if isinstance(c, kernels.MainConfig))
    assert not any(isinstance(c, kernels.MainConfig) and c.heads == 16 for c in narrow)
    with pytest.raises(ValueError, match="--d_k"):
        chosen_configs(575)
    with pytest.raises(ValueError, match="--group-heads"):
        chosen_configs(None, 8)


def test_package_ab_refuses_one_package_twice_before_loading_any(monkeypatch, tmp_path):
    tool = _tool("package_ab")
    monkeypatch.setattr(tool, "load_package", lambda *a: pytest.fail("loaded a package"))
    monkeypatch.setattr("sys.argv", ["package_ab.py", "--against", str(tmp_path), "--against", str(tmp_path) + "/"])
    with pytest.raises(ValueError, match="^--against: the same package twice"):
        tool.main()


def test_score_chain_forms_issue_their_gemms_and_keep_them():
    # The separate form is S's 36 and dP's 32 m64n64k16 GEMMs a chain; the stacked one 32 m64n128k16
    # and 4 m64n64k16; warpgroup 1 contends with six chunks of two 4-step m64n64k16 GEMMs. ptxas
    # drops a wgmma whose accumulator nobody reads (the chains then time nothing): every GEMM's
    # accumulator is stored to Sink after its loop.
    if kernels.nvcc_path() is None:
        pytest.skip("needs nvcc (CUDA toolkit)")
    tool = _tool("score_chain")
    gemm = re.compile(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\) \{\s*tl::wgmma_ss<[^>]*?kFloat32, 64, (\d+), 16,")
    expected = {"separate": [("36", "64"), ("32", "64")], "stacked": [("32", "128"), ("4", "64")]}
    for form, contended in tool.variants():
        source = kernels.compile_program(tool.chain_program(form, contended)).get_kernel_source()
        found = [(steps, n) for _, steps, n in gemm.findall(source)]
        assert found == expected[form] + [("4", "64"), ("4", "64")] * contended, (form, contended, found)
        accumulators = set(re.findall(r"\(\(uint32_t\*\)\((\w+) \+ 0\)\)", source))
        stored = set(re.findall(r"\*\(float2\*\)\(Sink \+ .*? = \*\(float2\*\)\((\w+) \+", source))
        assert accumulators and accumulators <= stored, (form, contended, accumulators - stored)
    with pytest.raises(ValueError, match="form"):
        tool.chain_program("merged", False)


def test_package_ab_judges_each_version_by_this_trees_control():
    # A version whose bits differ is judged by issue 30's standard: each output's error at most
    # 1.1x this tree's control's; a control that is exact where a version is not is an inf ratio.
    control = "atomic, this tree"
    lines = _tool("package_ab").error_lines({
        control: {"dq": 1e-3, "dkv": 2e-3, "d_attn_sink": 0.0},
        "fixed, within": {"dq": 1.05e-3, "dkv": 2e-3, "d_attn_sink": 0.0},
        "fixed, dkv over": {"dq": 1e-3, "dkv": 2.4e-3, "d_attn_sink": 0.0},
        "fixed, sink not exact": {"dq": 1e-3, "dkv": 2e-3, "d_attn_sink": 1e-9},
    }, control)
    assert lines[0] == "  error, atomic, this tree: dq 1.000e-03 (1.00x), dkv 2.000e-03 (1.00x), d_attn_sink 0.000e+00 (1.00x); the control"
    assert "dq 1.050e-03 (1.05x)" in lines[1] and lines[1].endswith("; admissible")
    assert "dkv 2.400e-03 (1.20x)" in lines[2] and lines[2].endswith("NOT admissible (over 1.1x)")
    assert "d_attn_sink 1.000e-09 (infx)" in lines[3] and "NOT admissible" in lines[3]


def test_package_ab_says_which_outputs_keep_their_bits():
    # A version that sums dQ in another order keeps dkv's and d_attn_sink's bits: the line names
    # the outputs that differ, and only says True where all three are equal.
    bits_equal = _tool("package_ab").bits_equal
    mine = (torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([0.5]))
    assert bits_equal(mine, tuple(x.clone() for x in mine)) == "True"
    other_dq = (torch.tensor([1.0, 2.0000002]), mine[1].clone(), mine[2].clone())
    assert bits_equal(mine, other_dq) == "False (dq False, dkv True, d_attn_sink True)"
    negative_zero = (mine[0].clone(), mine[1].clone(), torch.tensor([-0.0]))
    assert bits_equal((mine[0], mine[1], torch.tensor([0.0])), negative_zero) == "False (dq True, dkv True, d_attn_sink False)"


def test_walk_overlap_counts_the_ctas_on_one_kv_row_a_step():
    # Four rows that name the same 64 kv rows: walked in ascending order, every step's four CTAs
    # add into the same 32 kv rows (4 a row); rotated, rows 1 and 3 start at the second block,
    # so two CTAs share each kv row. Two head groups a row double every count.
    from mqa_bwd import layout

    overlap = _tool("walk_overlap").overlap
    ascending = torch.arange(64, dtype=torch.int32).repeat(4, 1)
    rotated = layout.rotate_walks(ascending, 0, 4)
    assert overlap(ascending, groups=1, sms=4, waves=1) == (4.0, 4.0)
    assert overlap(rotated, groups=1, sms=4, waves=1) == (2.0, 2.0)
    assert overlap(ascending, groups=2, sms=8, waves=1) == (8.0, 8.0)
    # One CTA a kv row with one of two rows' slots invalid: those add nothing.
    half = ascending[:2].clone()
    half[1] = -1
    assert overlap(half, groups=1, sms=2, waves=1) == (1.0, 1.0)


def test_config_ab_compiles_each_value_for_every_wide_launch():
    # Each value must time the kernels the wrapper launches (lanes, their int64 redo and the
    # control, at every width), differing only in the field: the default value, the product's own.
    variants = _tool("config_ab").wide_variants("wg0_chunks", [2, 3])
    product = [c for c in kernels.gpu_configs() if isinstance(c, kernels.MainConfig) and c.wide]
    assert set(product) <= set(variants) and len(variants) == 2 * len(product)
    for value in (2, 3):
        assert {(c.d_k, c.d_v, c.accumulate) for c in variants if c.wg0_chunks == value} == {
            (d_k, d_v, accumulate) for d_k, d_v in kernels.GPU_WIDTHS for accumulate in ("lanes", "fixed", "atomic")}


def test_interleaved_report_sets_each_median_against_the_controls(monkeypatch):
    from mqa_bwd import bench

    times = {"fixed, this tree": [2.0, 4.0, 3.0], "atomic, this tree": [2.0, 1.0, 3.0]}
    monkeypatch.setattr(bench, "time_interleaved", lambda calls, warmup, repeats: times)
    lines = bench.interleaved_report(dict.fromkeys(times), "atomic, this tree", 3)
    assert lines[0].endswith("fixed, this tree  median   3.000 ms  min   2.000  /atomic 1.500"), lines
    assert lines[1].endswith("median   2.000 ms  min   1.000  /atomic 1.000"), lines


def test_queued_time_spins_the_stream_before_its_start_event(monkeypatch):
    # The host must be ahead of the GPU from the first call on: the spin goes on the stream
    # before the start event, every call between the two events, one wait at the end.
    import torch

    steps = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.name = "start" if not any(s.startswith("event") for s in steps) else "end"
            steps.append("event")

        def record(self):
            steps.append(f"record {self.name}")

        def synchronize(self):
            steps.append(f"wait {self.name}")

        def elapsed_time(self, other):
            return 12.0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: steps.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: steps.append(f"spin {cycles}"))
    assert bench.queued_time(lambda: steps.append("call"), calls=3) == 4.0
    assert steps == ["synchronize", f"spin {bench.QUEUE_HEAD_START_CYCLES}", "event", "event", "record start",
                     "call", "call", "call", "record end", "wait end"]


def test_queued_rounds_interleave_the_backends(monkeypatch):
    order = []
    monkeypatch.setattr(bench, "queued_time", lambda fn: (fn(), float(len(order)))[-1])
    calls = {"det": lambda: order.append("det"), "cudnn": lambda: order.append("cudnn")}
    assert bench.time_queued(calls, rounds=2) == {"det": [1.0, 3.0], "cudnn": [2.0, 4.0]}
    assert order == ["det", "cudnn", "det", "cudnn"]


def test_kernel_trace_sums_kernels_per_call():
    # Device microseconds of two calls: per-call ms, launches per call, most
    # time first; names past the cut are summed as one kernel.
    events = [("main_bwd_kernel", 25000.0), ("main_bwd_kernel", 25200.0), ("delta_kernel", 270.0),
              ("delta_kernel", 270.0), ("reduce_kernel<A>", 100.0), ("reduce_kernel<B>", 60.0)]
    rows = bench.per_kernel(events, calls=2, width=13)
    assert rows == [["main_bwd_kern", pytest.approx(25.1), 1.0], ["delta_kernel", pytest.approx(0.27), 1.0],
                    ["reduce_kernel", pytest.approx(0.08), 1.0]]
    lines = bench.trace_lines("det", rows, top=2)
    assert lines[0] == "== det: 25.450 ms of GPU kernels a call, 3 launches" and lines[-1].endswith("(1 more kernels)")
    assert len(lines) == 4 and "main_bwd_kern" in lines[1]
    # A row's trace goes into the bench's JSON and back, and prints under its shape and backend.
    row = bench.Row(1, 64, 128, 16, 32, 576, 512, "tilelang", 25.45, 1.0, 0.5, kernels=rows)
    again = [bench.Row(**r) for r in json.loads(bench.to_json([row, bench.Row(**{**row.as_dict(), "kernels": None})]))["rows"]]
    shown = bench.traces(again)
    assert shown.startswith("== B=1,S=64,S_kv=128,H=16,L=32 uniform, tilelang: 25.450 ms") and shown.count("==") == 1


def test_main_kernels_line_up_each_backends_longest_kernel_by_shape_and_pattern():
    make = lambda backend, indices, kernels: bench.Row(1, 64, 128, 16, 32, 576, 512, backend, 9.0, 1.0, 0.5,
                                                       indices=indices, kernels=kernels)
    rows = [make("tilelang", "uniform", [["main_bwd_kernel", 7.2, 3], ["delta_max_kernel", 0.2, 1]]),
            make("tilelang-atomic", "uniform", [["delta_kernel", 0.2, 1], ["main_bwd_kernel", 8.0, 1]]),
            make("cudnn", "uniform", [["dsa_bwd_sm90F", 6.0, 1], ["dsa_bwd_sm90_", 0.4, 2]]),
            make("tilelang", "indexer", [["main_bwd_kernel", 7.0, 3]]),
            make("cudnn", "indexer", None)]
    assert bench.main_kernel_lines(rows) == [
        "main kernels, B=1,S=64,S_kv=128,H=16,L=32 uniform: tilelang 7.200 ms, tilelang-atomic 8.000 ms, "
        "cudnn 6.000 ms; det/cuDNN 1.200, det/atomic 0.900",
        "main kernels, B=1,S=64,S_kv=128,H=16,L=32 indexer: tilelang 7.000 ms"]
    assert bench.traces(rows).endswith(bench.main_kernel_lines(rows)[-1])


def test_kernel_trace_takes_each_kernels_median_over_calls():
    # One slow call (the second's main kernel) must not move the trace: each kernel's median
    # over the calls, 0 where a call did not launch it (the third call's redo).
    per_call = [[["main", 8.0, 2], ["delta", 0.3, 1]], [["main", 9.9, 2], ["delta", 0.3, 1]],
                [["main", 8.2, 1], ["delta", 0.4, 1]]]
    assert bench.median_kernels(per_call) == [["main", 8.2, 2], ["delta", 0.3, 1]]
    assert bench.median_kernels([[["a", 1.0, 1]], [["b", 2.0, 1]]]) == [["b", 1.0, 0.5], ["a", 0.5, 0.5]]


def test_tile_feasibility_reports_a_column_half_and_a_refusal():
    # The 64-head column-range skeleton compiles for sm_90a on the CPU: its
    # report is ptxas's (no spill for [0, 256), shared memory within the
    # 227 KB limit, the 64-row GEMMs as wgmma); a tile TileLang cannot
    # partition (three warpgroups for N = 512) comes back as a refusal.
    tool = _tool("tile_feasibility")
    half = tool.report(0, 256)
    assert half["spill_stores"] == 0 and 0 < half["registers"] <= 255, half
    assert 0 < half["shared"] <= 227 * 1024 and half["wgmma"] >= 3, half
    refused = tool.report(0, 256, threads=384)
    assert set(refused) == {"cols", "refused"} and "partition" in refused["refused"], refused


def test_tile_feasibility_inputs_match_the_skeleton_signature():
    # --time launches the skeleton with these arguments: one per parameter,
    # in order, each of the parameter's dtype and rank (a mismatch would only
    # show on the GPU); the slots are global kv rows, invalid ones stay -1.
    import torch

    from mqa_bwd.bench import production_inputs

    tool = _tool("tile_feasibility")
    args = production_inputs(B=2, S=3, S_kv=40, H=64, L=32, d_k=576, d_v=512, device="cpu")
    for adds in tool.ADDS:  # the fixed, the control's and no adds: dKV is int64 or fp32
        inputs = tool.skeleton_inputs(args, heads=64, adds=adds)
        program = tool.skeleton_program(0, 320, adds=adds)
        assert len(inputs) == len(program.params)
        for value, param in zip(inputs, program.params):
            buffer = program.buffer_map.get(param)
            if buffer is None:
                assert isinstance(value, float) and str(param.dtype) == "float32", param.name
            else:
                assert str(value.dtype).removeprefix("torch.") == str(buffer.dtype), (adds, param.name)
                assert value.dim() == len(buffer.shape) and value.is_contiguous(), (adds, param.name)
    slots, idx = inputs[3], args[6]
    assert torch.equal(slots[3:].long(), torch.where(idx[1] >= 0, idx[1] + 40, -1).long())
    with pytest.raises(ValueError, match="H: 64"):
        tool.skeleton_inputs(args, heads=32)


def test_prepared_wrapper_call_is_one_whole_call():
    # The A/B tools and tile_feasibility --time time this callable: validated
    # once up front, then each call is the wrapper's whole backward.
    from mqa_bwd import wrapper
    from mqa_bwd.bench import prepared_wrapper_call, production_inputs, same_bits
    from mqa_bwd.model import ModelLauncher

    args = production_inputs(B=1, S=3, S_kv=40, H=16, L=32, device="cpu")
    call = prepared_wrapper_call(args, ModelLauncher())
    want = wrapper.backward_with(ModelLauncher(), *args)
    assert same_bits(call(), want) and same_bits(call(), want)


def test_same_bits_is_bitwise_signed_zeros_nan_payloads_and_dtypes_included():
    import torch

    from mqa_bwd.bench import same_bits

    base = (torch.tensor([1.0, -0.0, float("nan")]), torch.zeros(2, dtype=torch.bfloat16), torch.ones(3))
    assert same_bits(base, tuple(t.clone() for t in base))  # equal NaNs are the same bits
    assert not same_bits(base, (torch.tensor([1.0, 0.0, float("nan")]), *base[1:]))  # -0 is not +0
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not same_bits(base, (torch.cat([base[0][:2], other_nan]), *base[1:]))
    assert not same_bits(base, (base[0], base[1].float(), base[2]))  # equal values, another dtype
    assert not same_bits(base, (base[0], base[1].reshape(1, 2), base[2]))
    assert not same_bits(base, base[:2])


def test_narrow_fixed_point_precision_grows_with_its_bits():
    # The data scale must put each row's need in [2**(B-1), 2**B). Seven more
    # bits must shrink the rounding error (about 2**-7 of it), and the int64
    # plan must round finer still: a scale exponent off by the wrong sign, or
    # sums not scaled back, fail here.
    import torch

    study = _tool("fixed_point_headroom")
    g = torch.Generator().manual_seed(0)
    need = torch.cat([torch.zeros(1, dtype=torch.float64),
                      torch.rand(1000, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-60, 60, (1000,), generator=g)])
    for bits in (24, 31):
        put = need[1:] * study.data_scale(need, bits)[1:]
        assert ((put >= 2.0 ** (bits - 1)) & (put < 2.0**bits)).all() and study.data_scale(need, bits)[0] == 1
    found = study.narrow_precision(S=32, S_kv=64, H=16, L=16, seed=3)
    (err24, _), (err31, _), (err64, _) = found["data 24-bit"], found["data 31-bit"], found["int64"]
    assert 0 < err24 < 1e-3, found
    assert err31 < err24 / 16 and err64 < err31, found


def test_lane_study_trades_slow_adds_for_precision():
    # Each bit of shift halves every scaled contribution: the rounding error
    # must grow and the contributions too large for a lane must not; the
    # int64 plan (no shift) must round finer than any of them.
    study = _tool("fixed_point_headroom")
    found = study.plan_lanes(S=32, S_kv=64, H=16, L=16, shifts=(2, 6, 10), seed=3)
    (large2, slots2, err2, _), (large6, _, err6, _), (large10, slots10, err10, _) = found[2], found[6], found[10]
    assert large2 >= large6 >= large10 and slots2 >= slots10 and large2 > 0, found
    assert 0 < err2 < err6 < err10 < 1e-2, found
    assert study.narrow_precision(S=32, S_kv=64, H=16, L=16, seed=3)["int64"][0] < err2


def test_lane_pairs_decode_exact_sums_whatever_the_partial_sums_did():
    # Two signed 32-bit lanes per int64 word, summed mod 2**64: a pair decodes
    # to its exact sums whenever the final sums fit 32 signed bits, even where
    # partial sums wrapped (large terms first, their negations last, in any
    # order). A final sum out of range must not decode to itself: that is
    # what the bound check exists for.
    import torch

    study = _tool("fixed_point_headroom")
    g = torch.Generator().manual_seed(5)
    big = torch.randint(2**30, 2**31, (64, 8), generator=g, dtype=torch.int64) * torch.where(
        torch.rand(64, 8, generator=g) < 0.5, 1, -1)
    small = torch.randint(-(2**20), 2**20, (32, 8), generator=g, dtype=torch.int64)
    terms = torch.cat([big, small, -big])
    exact = terms.sum(0)
    assert (exact.abs() < 2**31).all() and (big[:, 0].cumsum(0).abs() >= 2**32).any()
    for order in (torch.arange(terms.shape[0]), torch.randperm(terms.shape[0], generator=g)):
        words = study.pack_pairs(terms[order]).sum(0)
        assert torch.equal(study.unpack_pairs(words), exact)
    over = torch.cat([big[:2, :2].abs(), big[:2, :2].abs()])  # sums in [2**32, 2**33): out of range
    assert not torch.equal(study.unpack_pairs(study.pack_pairs(over).sum(0)), over.sum(0))


def test_checked_lane_study_trades_failing_rows_for_precision():
    # More shift: fewer kv rows whose bound reaches 2**31 and coarser sums; the
    # rows that pass decode to the exact integer sums; at shift 0 the plan's
    # scale, so int64's rounding. The study's blocks of query rows must not
    # change its sums.
    study = _tool("fixed_point_headroom")
    found = study.checked_lanes(S=32, S_kv=64, H=16, L=16, shifts=(0, 8, 16), seed=3, rows_per_step=8)
    assert study.checked_lanes(S=32, S_kv=64, H=16, L=16, shifts=(0, 8, 16), seed=3, rows_per_step=32) == found
    (fail0, top0, dec0, err0, _), (fail8, top8, dec8, err8, _), (fail16, _, dec16, err16, _) = found[0], found[8], found[16]
    assert fail0 >= fail8 >= fail16 and fail0 > 0 and fail16 == 0, found
    assert top0 - top8 == pytest.approx(8, abs=0.1) and dec0 and dec8 and dec16, found
    assert 0 < err0 < err8 < err16 < 1e-2, found
    assert study.narrow_precision(S=32, S_kv=64, H=16, L=16, seed=3)["int64"][0] == err0
    assert 0 < found["fp32"][0] < 1e-5, found


def test_sampled_offset_samples_the_rows_it_names():
    # Sampling every row must reproduce the full bound exactly (same sums);
    # every 4th row must scale its sample by 4, so on these uniform inputs it
    # lands within a few bits of the full bound, not 2 bits below it. A
    # temperature reaches the forward: the bound moves with it.
    study = _tool("fixed_point_headroom")
    found = study.sampled_offset(S=64, S_kv=128, H=16, L=32, every=(1, 4), seed=3, rows_per_step=16)
    assert found[1] == found["full"], found
    assert -1 < found[4] - found["full"] < 4, found
    hot = study.sampled_offset(S=64, S_kv=128, H=16, L=32, every=(1,), temperature=4.0, seed=3, rows_per_step=16)
    assert hot[1] == hot["full"] != found["full"], (hot, found)


def test_cheaper_lane_checks_still_bound_the_per_slot_one():
    # A warp's group max and the bound from P and dS must stand at or above
    # the per-slot bound on every kv row (else a check built on them could
    # pass an overflowing lane); the group one is the tighter of the two.
    found = _tool("fixed_point_headroom").bound_excess(S=32, S_kv=64, H=16, L=64, seed=3)
    for name, (top, least, median, most) in found.items():
        assert least >= -1e-9 and least <= median <= most and top >= -1e-9, (name, found)
    assert found["group"][2] < found["P, dS"][2], found


def test_fixed_point_headroom_bounds_hold_on_production_inputs():
    # Both bounds are proofs (fixed_point's docstring; the per-slot one with
    # P <= 1): on production inputs neither may fall below what a kv row's
    # partial sums can reach, max over columns of sum |c|, which in turn is at
    # least the row's largest final sum. A mis-indexed scatter of the
    # contributions, or a plan that under-bounds them, fails here.
    found = _tool("fixed_point_headroom").headroom(S=32, S_kv=64, H=16, L=16, seed=3)
    partial = found["|c| sum"]
    assert partial.numel() > 0 and found["contributions"] >= 1
    assert (partial >= -1e-12).all(), partial.min()
    for name in ("plan", "per-slot"):
        assert (found[name] >= partial).all(), f"{name}: {(found[name] - partial).min():.3f} below the magnitude sums"


@pytest.mark.parametrize("script", sorted(p.name for p in (pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py")))
def test_every_benchmark_script_parses_its_arguments_here(script):
    # A GPU-only study must still import and explain itself on a machine without a GPU.
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / script
    done = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr[-2000:]


def test_sample_scale_study_flags_redos_and_prices_rounding():
    # Rows whose Bound outside the sample is 15 times the sample's: the prototype's rule (the
    # sample's largest times 16, put at 2**23) leaves every row below 2**24, and a rule that gives
    # a row the sample never reached the finest scale must flag a redo. The error model is
    # n q^2 / 12 per element: one rounding of a unit quantum in one element of a unit-norm dkv
    # adds sqrt(1 / 12).
    import math

    import torch

    study = _tool("sample_scales")
    assert math.isclose(study.added_error(torch.ones(1), torch.ones(1), 1.0, 1), math.sqrt(1 / 12))
    sample = torch.tensor([1.0, 2.0, 0.0, 4.0], dtype=torch.float64)
    case = {"bound": 16 * sample, "bound0": sample, "bound8": sample, "counts": torch.tensor([32, 32, 32, 32]),
            "counts0": torch.tensor([2, 2, 0, 2]), "counts8": torch.tensor([2, 2, 0, 2]),
            "plan_scale": torch.full((4,), 2.0**40, dtype=torch.float64), "heads": 64}
    case["bound"][2] = 8.0  # a row only the rows outside the sample reach
    found = study.rules(case)
    scale, largest, every = found["element, max x16 -> 2^23.0"]
    assert not every and largest < 24 and math.isclose(largest, math.log2(15 * 4 * float(scale[0])))
    assert found["row, x16 -> 2^23.0"][1] < 24  # the unreached row takes the element's scale
    assert found["every row, fixed gain 16"][1] == math.log2(16 * 4 * 2.0**26)


def test_row_cost_fit_recovers_a_rows_cost_and_refuses_one_row_count():
    # Calls of equal slot counts whose times grow by 0.1 us a row on top of 7 ms: the fit
    # gives back both, from any spread of row counts; one row count cannot separate them.
    fit = _tool("row_cost").fit_row_cost
    rows = [16384, 8192, 4096]
    per_row, rest = fit(rows, [7.0 + 1e-4 * s for s in rows])
    assert per_row == pytest.approx(1e-4) and rest == pytest.approx(7.0)
    noisy = [7.0 + 1e-4 * s + e for s, e in zip(rows, (0.002, -0.003, 0.001))]
    assert fit(rows, noisy)[0] == pytest.approx(1e-4, rel=0.05)
    with pytest.raises(ValueError, match="^rows"):
        fit([4096, 4096], [7.1, 7.2])


def test_the_drift_overhead_benchmark_parses_and_refuses_a_cpu(capsys):
    tool = _tool("drift_overhead")
    args = tool.parse_args([])
    assert (args.H, args.every, args.shape) == (64, 10, dict(B=1, S=4096, S_kv=8192, H=64, L=2048))
    assert tool.parse_args(["--H", "128", "--rounds", "3"]).shape["H"] == 128
    with pytest.raises(SystemExit):
        tool.parse_args(["--H", "32"])  # not a dsv32 shape
    with pytest.raises(SystemExit):
        tool.parse_args(["--every", "0"])
    from mqa_bwd import backends

    if backends.hopper_available():
        pytest.skip("a Hopper GPU is here: the benchmark would run")
    assert tool.main([]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err


def test_host_lines_clocks_every_statement_and_changes_no_bits():
    # The line clock recompiles the wrapper's path from its source: it must run the same code
    # (the same bits as the call it stands for) and put each statement's time on its own line.
    import inspect
    import time

    from mqa_bwd import edge, wrapper
    from mqa_bwd.contract import SPEC_ARGS
    from mqa_bwd.model import ModelLauncher
    from properties.case import Case, to_framework

    host_lines = _tool("host_lines")
    named = to_framework(Case(B=1, S=3, S_kv=40, H=64, L=70, d_k=576, d_v=512, sink="random", seed=4).inputs())
    inputs = tuple(named[k] for k in SPEC_ARGS)
    marks = []
    call = host_lines.lined_call(inputs, ModelLauncher, True, marks)
    got = call()
    want = wrapper.backward_with(ModelLauncher(True), *inputs)
    assert all(edge.same_bits(a, b) for a, b in zip(got, want))
    costs, runs = host_lines.line_costs(call, marks, 2, synchronize=lambda: None)
    assert all(len(per_call) == 2 for per_call in costs.values()) and set(runs) == set(costs)
    lines = host_lines.report(costs, runs, min_us=0.0)
    source, first = inspect.getsourcelines(wrapper.run)
    main_lines = {str(first + i) for i, text in enumerate(source) if "launcher.main_bwd(" in text}
    assert any(line.split()[:1] and line.split()[0] in main_lines and float(line.split()[1]) > 0 for line in lines), lines
    assert lines[0].startswith("== wrapper.run:") and lines[-1].startswith("== all the listed functions:")
    # Every clock read is a statement of a listed function, each call's reads in time order.
    assert all(isinstance(key, tuple) and key[1] > 0 for key, _ in marks[:-1]) and marks[-1][0] is None
    assert [t for _, t in marks] == sorted(t for _, t in marks) and time.perf_counter() >= marks[-1][1]


def test_magic_range_names_the_rows_the_model_flags_for_corrections():
    # magic_range's largest |scaled value| a row, from torch ops, against the CPU model's lanes
    # launch: the rows the model flags for the corrections launch (fixed_point.FLAG_MAGIC) are the
    # ones at or past 2^22. At this shape some rows are and most are not (a row within 0.1 % of
    # 2^22 would be left out: the sums' order differs between the two).
    import torch

    from mqa_bwd import fixed_point, wrapper
    from mqa_bwd.model import ModelLauncher

    class FlagsKept(ModelLauncher):
        flag = None

        def main_bwd(self, *args, config, flag=None, **kw):
            if config.accumulate == "lanes" and not config.corrections:
                self.flag = flag
            super().main_bwd(*args, config=config, flag=flag, **kw)

    study = _tool("magic_range")
    args = bench.production_inputs(1, 256, 1024, 64, 256, device="cpu")
    peaks = study.row_peaks(args, range(256))
    launcher = FlagsKept()
    wrapper.backward_with(launcher, *args)
    flagged = (launcher.flag & fixed_point.FLAG_MAGIC) != 0
    beyond = peaks >= fixed_point.MAGIC_RANGE
    clear = (peaks / fixed_point.MAGIC_RANGE - 1).abs() > 1e-3
    assert 0 < int(beyond.sum()) < 256 // 4, int(beyond.sum())
    assert torch.equal(flagged[clear], beyond[clear]), (torch.nonzero(flagged).view(-1), torch.nonzero(beyond).view(-1))


def _synthetic_timeline(blocks=4, ctas=2):
    """A block_timeline trace whose warpgroups take known cycles: warpgroup 0 stamps events 0-8 at
    fixed offsets in a 1000-cycle period, warpgroup 1 events 9-15; block b starts at 1000 b."""
    trace = np.zeros((ctas, 8, 16), dtype=np.int64)
    wg0 = (0, 100, 150, 350, 400, 500, 520, 600, 800)  # wait KV_FREE 100, ..., adds 200, tail 200
    wg1 = (300, 520, 700, 850, 900, 1100, 1150)  # events 9, 10, 11, 12, 13, 14, 15
    for c in range(ctas):
        for b in range(blocks):
            trace[c, b, :9] = 10_000 + 1000 * b + np.array(wg0)
            trace[c, b, 9:] = 10_000 + 1000 * b + np.array(wg1)
    return trace


def test_block_timeline_times_each_phase_between_its_stamps():
    tool = _tool("block_timeline")
    trace = _synthetic_timeline()
    found = tool.phase_cycles(trace)
    assert set(found[(0, "wait for KV_FREE")]) == {100}
    assert set(found[(0, "its chunks' adds")]) == {200}
    assert set(found[(1, "wait for PDS_READY")]) == {220}
    assert (1, "chunks, adds (control)") not in found  # the lanes' pairs say it finer
    # The next block's start closes a block's tail: three of four blocks have a next one, per CTA.
    assert found[(0, "peaks, to next block")].tolist() == [200] * 6
    assert found[(1, "to next block")].tolist() == [150] * 6
    assert all(set(p) == {1000} for p in tool.periods(trace).values())


def test_block_timeline_counts_time_with_adds_under_way():
    tool = _tool("block_timeline")
    trace = _synthetic_timeline(blocks=1, ctas=1)
    # One block, 10000 .. 11150: warpgroup 0 adds over [10600, 10800], warpgroup 1 over
    # [10700, 11100]; both over [10700, 10800].
    neither, one, both = tool.adds_overlap(trace)
    assert both == pytest.approx(100 / 1150)
    assert one == pytest.approx(400 / 1150)
    assert neither == pytest.approx(650 / 1150)
    # A control launch has no events 12 and 13: its pairs' phases are absent, not zero.
    trace[..., 12:14] = 0
    found = tool.phase_cycles(trace)
    assert (1, "first pair's adds") not in found and set(found[(1, "chunks, adds (control)")]) == {400}
    assert any("dKV adds under way" in line for line in tool.report(trace))


def test_block_timeline_counts_a_ctas_cycles_a_block_with_its_gaps():
    tool = _tool("block_timeline")
    trace = _synthetic_timeline(blocks=4, ctas=2)
    trace[1, 2:4] += 3000  # CTA 1 waits 3000 cycles between its blocks 1 and 2 (a row's change)
    spans, blocks = tool.cta_spans(trace)
    # Each CTA spans its first block's event 0 to its last block's event 15 (1150 past its start).
    assert spans.tolist() == [3000 + 1150, 6000 + 1150] and blocks.tolist() == [4, 4]
    # The wait moves warpgroup 0's mean period, not its median: the means say where slow blocks lose.
    lines = tool.report(trace, kernel_ms=0.001)
    period = next(line for line in lines if line.startswith("warpgroup 0"))
    assert "median 1000 cycles, mean 1500" in period, period
    # 7150 cycles in a microsecond: a 7150 MHz clock, by the slowest CTA.
    assert any("7150 MHz" in line for line in lines), lines


def test_block_timeline_sets_the_rows_first_blocks_against_the_rest():
    tool = _tool("block_timeline")
    trace = _synthetic_timeline(blocks=8, ctas=2)
    # Rows of four blocks: each row's first block waits 400 cycles more for KV_FREE, so every stamp
    # from its event 1 on (warpgroup 1's too) and all later blocks move by 400 a row.
    for row_start in (0, 4):
        trace[:, row_start:, 1:] += 400
        trace[:, row_start + 1:, :1] += 400
    rows = {(wg, name): (starts, rest) for wg, name, starts, rest in tool.row_starts_against_rest(trace, 4)}
    assert rows[(0, "wait for KV_FREE")] == (500, 100)
    assert rows[(0, "its chunks' adds")] == (200, 200)
    # A period runs from a block's start to the next's, so the first block's holds its own wait.
    assert rows[(0, "period")] == (1400, 1000)
    # Warpgroup 1's block starts before its PDS_READY wait: the delay falls in the period before
    # (block 3's of the second row's four; block 7 has no next one).
    assert rows[(1, "period")] == (1000, (1000 * 4 + 1400) / 5)
    lines = tool.report(trace, blocks_per_row=4)
    assert any("rows' first blocks (one in 4)" in line for line in lines)
    assert any("wait for KV_FREE" in line and "+100 a block" in line for line in lines), lines


def test_block_timeline_measures_how_far_apart_a_warpgroups_warps_end_their_adds():
    tool = _tool("block_timeline")
    thread_zero = _synthetic_timeline(blocks=3, ctas=1)
    assert tool.warp_skew(thread_zero) == {}  # a trace without the warps' stamps
    trace = np.zeros((1, 8, 24), dtype=np.int64)  # blocks 3-7 unstamped, as past a CTA's last
    trace[..., :16] = thread_zero
    for wg, (event, first) in {0: (8, 20), 1: (14, 16)}.items():
        trace[..., first:first + 4] = trace[..., event:event + 1] + np.array([0, 30, 10, 20 + 100 * wg])
    trace[0, 2, 17] = 0  # a block where one of warpgroup 1's warps did not stamp is left out
    skew = tool.warp_skew(trace)
    assert skew[0].tolist() == [30, 30, 30] and skew[1].tolist() == [120, 120]
    assert any("warpgroup 1: its warps end their adds 120 cycles apart" in line for line in tool.report(trace))


def test_block_timeline_calibrates_the_clock_and_finds_time_outside_the_blocks():
    tool = _tool("block_timeline")
    assert tool.outside_blocks(_synthetic_timeline()) is None  # a trace without the timer's stamps
    trace = np.zeros((2, 8, 32), dtype=np.int64)
    trace[..., :16] = _synthetic_timeline(blocks=4, ctas=2)  # blocks from cycle 10000 to 14150
    entry_ns = np.array([5_000, 5_400])  # the second CTA enters 0.4 us after the first
    trace[:, 0, 26], trace[:, 0, 27] = 9_000, entry_ns  # each enters 1000 cycles before its first block
    # Warpgroup 1 leaves last, 2000 cycles after its last stamp; at 2000 MHz a cycle is half a ns.
    trace[:, 0, 28], trace[:, 0, 29] = 15_000, entry_ns + 3_000
    trace[:, 0, 30], trace[:, 0, 31] = 16_150, entry_ns + (16_150 - 9_000) // 2
    timer = tool.outside_blocks(trace)
    assert timer["mhz"].tolist() == [2000, 2000]
    assert timer["prologue"].tolist() == [1000, 1000] and timer["epilogue"].tolist() == [2000, 2000]
    assert timer["entry_us"].tolist() == [0.0, 0.4]
    assert timer["exit_us"].tolist() == pytest.approx([3.575, 3.975])
    lines = tool.report(trace, kernel_ms=0.004)
    assert any("clock64 runs at 2000 MHz" in line for line in lines), lines
    assert any("exit from 3.6 us to 4.0 us" in line and "kernel of 4.0 us" in line for line in lines), lines
    # The timer's events are not clock cycles: the CTAs' spans are the blocks' alone.
    assert any("slowest CTA 4150 cycles" in line for line in lines), lines
    # On the timer, each CTA adds over [10600, 11100] + 1000 b cycles: CTA 0 over [5800, 6050] + 500 b
    # ns, CTA 1 400 ns later. Both at once over [6300, 6450], [6800, 6950] and [7300, 7450]; the
    # kernel runs from CTA 0's entry (5000) to CTA 1's last exit (8975).
    assert tool.ctas_adding(_synthetic_timeline()) is None
    adding = tool.ctas_adding(trace)
    assert adding * 3975 == pytest.approx([3975 - 1100 - 450, 2 * 1000 - 2 * 450, 450])
    assert any("of 2: mean 0.5" in line for line in lines), lines
    trace[1, 0, 31] = 0  # a CTA with an exit unstamped is left out
    assert tool.outside_blocks(trace)["mhz"].size == 1
    assert tool.ctas_adding(trace).size == 2


def test_block_timeline_walks_a_rows_change_step_by_step():
    tool = _tool("block_timeline")
    assert tool.row_change(_synthetic_timeline()) is None  # a trace without the row stamps
    trace = np.zeros((1, 8, 40), dtype=np.int64)
    trace[..., :16] = _synthetic_timeline(blocks=4, ctas=1)  # block b from 10000 + 1000 b
    # Two rows of two blocks: the second row starts at block 2. Warpgroup 0 stores its dQ 50 cycles
    # after block 1's adds (10000 + 1000 + 800), then counts, waits and loads before block 2's start.
    trace[0, 1, 37] = 11_850
    trace[0, 2, 32:37] = [11_900, 11_910, 11_930, 11_960, 11_990]
    trace[0, 2, 0] = 12_000
    trace[0, 0, 32] = 9_990  # the CTA's first row: no change before it, left out
    trace[0, 1, 38], trace[0, 2, 39] = 12_200, 12_250  # warpgroup 1: its dQ stores, its next item and count
    rows = tool.row_change(trace)
    steps0 = {(a, b): c.tolist() for a, b, c in rows[0]}
    assert steps0[(8, 37)] == [50] and steps0[(37, 32)] == [50] and steps0[(35, 36)] == [30] and steps0[(36, 0)] == [10]
    assert steps0[(0, 6)] == [520]  # block 2's P and dS handed over, 520 cycles into it
    steps1 = {(a, b): c.tolist() for a, b, c in rows[1]}
    # Block 1's bounds end at 10000 + 1000 + 1150; block 2 starts for warpgroup 1 at 12300.
    assert steps1[(15, 38)] == [50] and steps1[(38, 39)] == [50] and steps1[(39, 9)] == [50]
    lines = tool.report(trace)
    assert any("warpgroup 0 at a row's change" in line and "over 1 changes" in line for line in lines), lines
    assert any("PDS_FREE passed ->" in line and "Q, dO issued" in line for line in lines), lines
    trace[0, 2, 34] = 0  # a change with a step unstamped is left out of that warpgroup's steps
    assert tool.row_change(trace)[0][0][2].size == 0 and tool.row_change(trace)[1][0][2].size == 1


def test_sass_diff_counts_a_listing_and_names_what_moved():
    tool = _tool("sass_diff")
    listing = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P6 STG.E.128 desc[UR60][R8.64], R20 ;
        /*0020*/               @P0 STG.E desc[UR4][R2.64], R5 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0040*/              @!P0 EXIT ;
        /*0050*/                   EXIT ;
    .L_x_1:
        /*0060*/                   SHFL.BFLY P5, R12, R19, R8, R9 ;
    """
    counts = tool.opcode_counts(listing)
    assert counts == {"MOV": 1, "STG.E.128": 1, "STG.E": 1, "HGMMA.64x64x16.F32.BF16": 1, "EXIT": 2, "SHFL.BFLY": 1}
    assert tool.by_base(counts)["STG"] == 2
    assert sum(tool.opcode_counts(kernels.sass_in_line(listing)).values()) == 5  # up to the last EXIT
    with pytest.raises(ValueError, match="no EXIT"):
        kernels.sass_in_line("/*0000*/ MOV R1, R2 ;")
    assert tool.short_name(".ab/dq_whole_lines/mqa_bwd") == "dq_whole_lines" and tool.short_name("/tmp/x") == "x"

    info = {"registers": 255, "spill_stores": 40, "spill_loads": 48, "in_line": 5}
    more = collections.Counter(counts) + collections.Counter({"SHFL.BFLY": 4, "STG.E.128": 1})
    versions = {"this tree": {"lanes": (info, counts)},
                "a/mqa_bwd": {"lanes": (dict(info, spill_loads=52, in_line=6), more), "atomic": (info, counts)}}
    lines = tool.diff_lines(versions, top=1)
    assert lines[0] == "lanes:" and "in line" in lines[1] and "40/52" in lines[3]
    assert lines[3].endswith("+5 (+71.4%), in line +1 (+20.0%)")
    assert lines[4].split() == ["opcode", "a"] and lines[5].split()[:4] == ["SHFL", "1", "->", "5"]  # the largest move only
    # A launch one version lacks: its row says so, and no opcode rows compare against nothing.
    assert lines[6] == "atomic:" and lines[8] == "  this tree                        (no such launch)" and len(lines) == 10
    assert lines[9].split()[:6] == ["a/mqa_bwd", "255", "40/48", "7", "5", "-"]
    # Block loops: each warpgroup's, and the change of their sum.
    versions["this tree"]["lanes"][0]["block_loops"] = [2243, 1845]
    versions["a/mqa_bwd"]["lanes"][0]["block_loops"] = [2240, 1800]
    lines = tool.diff_lines(versions, top=1)
    assert lines[2].split()[6] == "2243+1845" and lines[3].split()[5] == "2240+1800"  # "this tree" is two words
    assert lines[3].endswith("in line +1 (+20.0%), block loops -48")


def test_sass_diff_finds_the_block_loops():
    # The innermost loops that issue a wgmma, in line: not the item loop around one, not a wait's
    # retry loop inside one, not an out-of-line copy past the last EXIT that branches back into one
    # (block_loops takes the code in line).
    tool = _tool("sass_diff")
    listing = """
        /*00e0*/                   MOV R1, c[0x0][0x28] ;
    .L_x_1:
        /*00f0*/                   IADD3 R2, R2, 0x1, RZ ;
    .L_x_2:
        /*0100*/                   LDS.128 R4, [R3] ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
    .L_x_3:
        /*0120*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0130*/              @!P0 BRA `(.L_x_3) ;
        /*0140*/                   NOP ;
        /*0150*/               @P1 BRA `(.L_x_2) ;
        /*0160*/               @P2 BRA `(.L_x_1) ;
        /*0170*/                   EXIT ;
    .L_x_9:
        /*0180*/                   WARPSYNC.COLLECTIVE R0, `(.L_x_10) ;
        /*0190*/                   BRA `(.L_x_2) ;
    """
    assert tool.block_loops(kernels.sass_in_line(listing)) == [(0x100, 0x150, 5)]
    no_gemm = listing.replace("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "FFMA R1, R2, R3, R4")
    assert tool.block_loops(kernels.sass_in_line(no_gemm)) == []


def test_merged_share_counts_each_groups_distinct_kv_rows_once():
    import torch

    tool = _tool("merge_share")
    rows = torch.tensor([[[0, 1, 2, 3], [3, 2, 9, -1], [9, 8, 7, 6]], [[5, 6, 7, 8], [5, 6, 7, 8], [-1, -1, -1, 0]]])
    # 20 valid slots. g = 2: {0, 1, 2, 3, 9}, {9, 8, 7, 6} (row 2 alone: groups stay inside a batch
    # element), {5, 6, 7, 8}, {0}; g = 3: eight kv rows, then five.
    assert tool.merged_share(rows, 1) == 1.0
    assert tool.merged_share(rows, 2) == pytest.approx((5 + 4 + 4 + 1) / 20)
    assert tool.merged_share(rows, 3) == pytest.approx((8 + 5) / 20)
    assert tool.merged_share(torch.tensor([[[4, 4, -1]]]), 1) == 0.5  # one row's repeats merge too
    assert tool.merged_share(torch.full((1, 2, 3), -1), 2) == 0.0
    with pytest.raises(ValueError, match="rows_a_group"):
        tool.merged_share(rows, 0)


def test_merge_share_reads_a_captured_calls_indices(tmp_path, capsys):
    import torch

    from mqa_bwd import capture

    tool = _tool("merge_share")
    q, kv, out, grad_out, lse, sink, idx, sm_scale = bench.production_inputs(1, 8, 16, 2, 6, d_k=16, d_v=8,
                                                                             device="cpu")
    path = capture.save(tmp_path / "step.safetensors", query=q, kv=kv, out=out, grad_out=grad_out, lse=lse,
                        attn_sink=sink, token_indices=idx, sm_scale=sm_scale)
    assert tool.main(["--capture", str(path), "--groups", "1,8"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    # By sets, as the tool's sort does not: each row's distinct kv rows, then all eight rows'.
    per_row = sum(len(set(r.tolist())) for r in idx[0])
    whole = len(set(idx[0].flatten().tolist()))
    valid = idx.numel()
    want = [f"{bench.index_overlap(idx):.3f}", f"{per_row / valid:.3f}", f"{whole / valid:.3f}"]
    assert [c.strip() for c in row.strip("|").split("|")] == [str(path)] + want
