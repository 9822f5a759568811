"""Every TileLang kernel lowers and compiles for sm_90a with this machine's nvcc,
and only the atomic control can issue a floating-point atomic: the fixed-point
mode issues 64-bit integer adds only (exact, so order-free), every other
deterministic kernel none. A change that brings floating-point atomics into
the deterministic path fails here, without a GPU; so does one that makes the
main kernel spill registers, need more shared memory than a CTA has, gather
KV rows with a copy that cannot skip an invalid slot, or bulk-copy a cluster
peer a byte count its barrier does not expect."""

import collections
import dataclasses
import functools
import itertools
import math
import re

import pytest
import torch

pytest.importorskip("tilelang")

from mqa_bwd import kernels as K  # noqa: E402
from mqa_bwd.kernels import wide as W  # noqa: E402
import wide_handoffs as WH  # noqa: E402

pytestmark = pytest.mark.skipif(K.nvcc_path() is None, reason="needs nvcc (CUDA_HOME=/usr/local/cuda) to compile for sm_90a")

ATOMIC_PTX = re.compile(r"\b(?:atom|red)\.[a-z0-9.]+")
CONFIGS = list(K.gpu_configs())


def _kind(config):
    return "main_bwd" if isinstance(config, K.MainConfig) else config.kind


def _id(config):
    if isinstance(config, K.MainConfig):
        return f"main_bwd-{config.heads}-{config.d_k}-{config.d_v}-{config.accumulate}" + (
            f"-{config.cluster}" if config.cluster > 1 else "") + (
            f"-wg0_{config.wg0_chunks}" if config.wide and config.wg0_chunks != K.default_wg0_chunks(config.accumulate, config.d_k) else "") + (
            f"-dq{config.dq_split}" if config.wide and config.dq_split != K.WIDE_DQ_SPLIT else "") + (
            f"-tiles{config.tiles}" if config.tiles > 1 else "") + ("-corrections" if config.corrections else "")
    return "-".join(str(c) for c in (config.kind,) + config.args)


def _mode(config):
    """The main kernel's dKV accumulation (None for the other kernels)."""
    return config.accumulate if isinstance(config, K.MainConfig) else None


MAIN_CONFIGS = [c for c in CONFIGS if isinstance(c, K.MainConfig)]


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_kernel_compiles_for_sm90a(config):
    kernel = K.compiled(config)
    source = kernel.get_kernel_source()
    assert "__global__" in source
    # The plan's stages share one device source, whose reductions are integer max and add atomics: results
    # that do not depend on order.
    has_atomics = _mode(config) in ("atomic", "fixed", "lanes") or _kind(config) == "plan"
    assert ("atomic" in source.lower()) == has_atomics, f"{_id(config)}: atomic in CUDA source = {not has_atomics}"


# PTX of the kernels that touch dKV: the main backward in both accumulations,
# the conversions. At the production widths; Dk = Dv = 512 is the same code
# without the tail products.
DKV_CONFIGS = [
    c for c in CONFIGS
    if _kind(c) in ("fixed_to_bf16", "lanes_to_bf16", "cast_bf16") and c.args == (576,) or (_mode(c) and (c.d_k, c.d_v) == (576, 512))
]


#: PTX of a configuration, compiled once a test process (several tests read it).
_ptx = functools.lru_cache(maxsize=None)(K.ptx_of)

INTEGER_ADDS = {"red.global.add.u64", "atom.global.add.u64", "red.global.add.s64", "atom.global.add.s64"}


@pytest.mark.parametrize("config", DKV_CONFIGS, ids=_id)
def test_only_the_atomic_control_has_floating_point_atomics(config):
    found = sorted(set(ATOMIC_PTX.findall(_ptx(config))))
    if _mode(config) == "atomic":
        assert any(op.startswith(("atom.global.add", "red.global.add")) and op.endswith(".f32") for op in found), found
    elif _mode(config) in ("fixed", "lanes"):  # the lanes' words and bounds are 64-bit integers too
        # (and the wide tile's count of live blocks, and the lanes' slot maxima, are merged in
        # shared memory by an integer max; its row flags are set by an integer or; its CTAs claim
        # items by a 32-bit add to a counter)
        allowed = INTEGER_ADDS | ({"atom.shared.max.u32", "atom.global.or.b32", "atom.global.add.u32"} if config.wide else set())
        assert found and set(found) <= allowed, f"{_id(config)}: expected 64-bit integer adds only, got {found}"
    else:
        assert found == [], f"{_id(config)} issues atomics: {found}"


def test_the_wide_grid_is_persistent_and_takes_its_counts_at_launch():
    one = K.MainConfig(64, 576, 512, "lanes")
    two, three = dataclasses.replace(one, tiles=2), dataclasses.replace(one, tiles=3)
    assert K.compiled(three) is K.compiled(two) is not K.compiled(one)
    # A one-dimensional grid of ``ctas`` CTAs (launch.py: at most one an SM), each taking item
    # blockIdx.x, then the items it claims (ctas plus the count claimed before): the tile count
    # and the CTA count are launch arguments, so one build serves every shape. The one-tile
    # kernel has no tile count (its items are the rows; TileLang drops the argument it never
    # reads from the device function, not from the launch).
    signature = lambda config: re.search(r"main_bwd_kernel\(([^)]*)\) \{", K.compiled(config).get_kernel_source())[1]
    assert "int ctas" in signature(two) and "int tiles" in signature(two), signature(two)
    assert "int ctas" in signature(one) and "int tiles" not in signature(one), signature(one)
    for config in (one, two):
        source = K.compiled(config).get_kernel_source()
        assert "blockIdx.y" not in source and "blockIdx.z" not in source, _id(config)
        assert "item0[0] = ((int)blockIdx.x);" in source and "ws_claim_item(" in source and "% ctas" not in source, _id(config)


def test_wide_tile_split_leaves_warpgroup_1_a_chunk_and_two_dq_gemms():
    with pytest.raises(ValueError, match="^config: wg0_chunks=9 leaves warpgroup 1 none"):
        K.wide_program(K.MainConfig(K.WIDE_HEADS, 576, 512, "lanes", wg0_chunks=9))
    for d_k, dq_split, bounds in ((576, 64, "128 to 448"), (512, 448, "64 to 384")):
        with pytest.raises(ValueError, match=f"^config: dq_split={dq_split} at d_k={d_k}, d_v=512: from {bounds}"):
            K.wide_program(K.MainConfig(K.WIDE_HEADS, d_k, 512, "lanes", dq_split=dq_split))


WIDE_CONFIGS = [c for c in MAIN_CONFIGS if c.wide]
#: The split of dKV chunks between the warpgroups is a configuration: other splits keep the handoffs.
#: The lanes at d_k = 576: 2 leaves warpgroup 1 a chunk of its own after its pairs, 1 frees P and
#: dS inside its loop over pairs and leaves warpgroup 0 no pair; dq_split 320 gives warpgroup 0 64
#: more dQ columns (one GEMM wider than wgmma's 256).
OTHER_SPLITS = [K.MainConfig(K.WIDE_HEADS, 576, 512, "lanes", wg0_chunks=w) for w in (2, 1)] + [
    K.MainConfig(K.WIDE_HEADS, 576, 512, "lanes", dq_split=320)]


def _enclosing_heads(body: str, pos: int) -> list:
    """The heads (``if (...)``, ``for (...)``, ...) of the blocks around ``pos``, innermost first."""
    heads, depth = [], 0
    for i in range(pos - 1, -1, -1):
        if body[i] == "}":
            depth += 1
        elif body[i] == "{":
            if depth == 0:
                heads.append(body[body.rfind("\n", 0, i) + 1:i].strip())
            else:
                depth -= 1
    return heads


def _enclosing_condition(body: str, pos: int):
    """The condition of the innermost block around ``pos`` if that block is an if, else None."""
    heads = _enclosing_heads(body, pos)
    match = re.fullmatch(r"if \((.*)\)", heads[0]) if heads else None
    return match[1] if match else None


def branch_at(source: str, head: str, start: int = 0) -> tuple:
    """(body, end) of the first block ``head {...}`` at or after ``start``: the text
    between its braces and the index just past its closing brace."""
    i = source.index(head + " {", start) + len(head) + 2
    depth, j = 1, i
    while depth:
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        j += 1
    return source[i:j - 1], j


WARPGROUP_0, WARPGROUP_1 = "if (((int)threadIdx.x) < 128)", "if (128 <= ((int)threadIdx.x))"
#: A named barrier in generated CUDA: (kind, id, thread count).
NAMED_BARRIER = re.compile(r"(__sync_thread_partial|__named_barrier_arrive)\((\d+), (\d+)\)")
#: The wide tile's own barrier of one warpgroup (128 threads): its id.
WARPGROUP_BARRIER = re.compile(r"ws_bar_sync_wg\((\d+)\)")
#: One side of a wide-tile handoff: (kind, the mbarriers' offset, mbarrier, the wait's parity or "").
HANDOFF = re.compile(r"mqa_handoff_(wait|arrive)\(\(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\), (\d+)(?:, ([^;]*))?\);")


WGMMA_WAIT = "tl::wait_wgmma<0>();"
#: A wgmma wait of generated CUDA: the count of commit groups it leaves pending.
WGMMA_WAIT_ANY = re.compile(r"tl::wait_wgmma<(\d+)>\(\);")
#: A persistent CTA's loop over its (row, tile) items, while its item is one of the launch's: the
#: item and the count of items.
ITEM_LOOP = re.compile(r"while \(1\) \{\n\s*if \(!\(\((item[01]\[0\]) < (.*?)\)\)\) \{ break; \}\n")
#: The row handoffs' calls (kernels/wide.py): (what, the mbarriers' offset, the rest of the arguments).
ROW_HANDOFF = re.compile(r"(ws_post_first_item|ws_claim_item|ws_posted_item|ws_take_item)\(\(\(void\*\)\(\(char\*\)buf_dyn_shmem "
                         r"\+ (\d+)\)\),? ?([^;]*)\);")
#: A warpgroup's count of its row's blocks: (target, row, Lp, NKV, bars, words, thread, block slots,
#: parity, barrier).
ROW_BLOCKS = re.compile(r"(live[01])\[0\] = ws_row_blocks\(Indices, (\w+), (\w+), (\w+), \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ 0\)\), "
                        r"(\d+), ([^,]+), (\d+), \(([\w\[\]]+) & 1\), (\d+)\);")
#: Warpgroup 0's count of its row's blocks where it does not scan (any launch but the corrections):
#: a CTA's first row's loaded from RowBlocks (the row), the others' read from its words (the words'
#: offset, the parity's count of items), where its thread 0's claim fetched them (the words, the
#: row of the claimed item).
ROW_BLOCKS_LOADED = re.compile(r"live0\[0\] = ws_load_row_blocks\(RowBlocks, (\w+)\);")
ROW_BLOCKS_READ = re.compile(r"live0\[0\] = ws_fetched_row_blocks\(\(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ 0\)\), (\d+), \((\w+) & 1\)\);")
ROW_BLOCKS_FETCH = re.compile(r"ws_fetch_row_blocks\(\(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ 0\)\), (\d+), \(\(k0\[0\] \+ 1\) & 1\), "
                              r"RowBlocks, ([^;]*)\);")
#: The dKV chunks' adds of each design (kernels/wide.py's device functions).
CHUNK_ADDS = {"lanes": "ws_add_chunk_lanes<", "fixed": "ws_add_chunk_fixed(", "atomic": "ws_add_chunk_atomic("}


@pytest.mark.parametrize("config", WIDE_CONFIGS + OTHER_SPLITS, ids=_id)
def test_wide_tile_warpgroups_meet_only_at_their_mbarriers(config):
    # The warp-specialised tile: each warpgroup runs in a branch of its own and they hand
    # over through three mbarriers, one phase a block. A barrier of all the CTA's threads
    # inside a branch (TileLang's planner inserts a __syncthreads where it sees a hazard
    # between them) deadlocks: each warpgroup would wait at a different barrier for the
    # other. A wait on any parity but the block's passes at once: a race.
    source = K.compiled(config).get_kernel_source()
    source = source[source.index('extern "C" __global__'):]
    # One thread sets the mbarriers up, a __syncthreads publishes them, then the roles start.
    init = source.index("ws_bars_init(")
    assert source.rindex("if (((int)threadIdx.x) == 0)", 0, init) > source.rfind("}", 0, init)
    published = source.index("__syncthreads();", init)
    roles = source.index(WARPGROUP_0, published)
    assert source[published + len("__syncthreads();"):roles].strip() == "", f"{_id(config)}: code before the roles"
    first, end = branch_at(source, WARPGROUP_0, roles)
    second, _ = branch_at(source, WARPGROUP_1, end)
    assert source[end:source.index(WARPGROUP_1, end)].strip() == "", f"{_id(config)}: code between the branches"
    own_barriers = []
    for name, body in (("warpgroup 0", first), ("warpgroup 1", second)):
        assert "wgmma_ss" in body and WGMMA_WAIT in body, f"{_id(config)}: {name} has no GEMM of its own"
        assert "__syncthreads" not in body, f"{_id(config)}: __syncthreads inside {name}'s branch"
        wide = [m for m in NAMED_BARRIER.findall(body) if m[2] != str(W.WARPGROUP)]
        assert not wide, f"{_id(config)}: barriers of more than one warpgroup inside {name}'s branch: {wide}"
        own = ({m[1] for m in NAMED_BARRIER.findall(body)} | set(WARPGROUP_BARRIER.findall(body))
               | {m[-1] for m in ROW_BLOCKS.findall(body)})
        own_barriers.append(own)
    # 128 arrivals from both warpgroups on one id would complete a barrier meant for one.
    assert not own_barriers[0] & own_barriers[1], f"{_id(config)}: both warpgroups sync on {own_barriers[0] & own_barriers[1]}"
    # Persistent: both warpgroups walk the CTA's items in the same order (warpgroup 0 claims each and
    # posts it, warpgroup 1 takes it: the row handoffs, below), and each takes its row's count of
    # blocks (warpgroup 1 by ws_row_blocks, warpgroup 0 from RowBlocks, counted by the same rule:
    # row_blocks; a corrections launch's both by ws_row_blocks): an item or a block one walks and
    # the other skips leaves a handoff phase unmatched. The blocks are numbered across rows (base plus the
    # block's index in its row), so the phases run on from row to row.
    walks = []
    for name, body, w in (("warpgroup 0", first, "0"), ("warpgroup 1", second, "1")):
        items = ITEM_LOOP.findall(body)
        assert len(items) == 1, f"{_id(config)}: {name}'s item loops: {items}"
        item, bound = items[0]
        # TileLang binds an expression to a name at times (int _tmp = ...;): the expression.
        bound_to = lambda e: (re.search(rf"int {re.escape(e)} = (.*);", body) or [None, e])[1]
        row_expr, head_expr = (bound_to(re.search(rf"at{w}\[{i}\] = (.*);", body)[1]) for i in (0, 1))
        counts = ROW_BLOCKS.findall(body)
        if w == "0" and not config.corrections:
            # Warpgroup 0 takes its count from RowBlocks (row_blocks, below): a CTA's first row's
            # loaded, the others' read from its words where its claim fetched them. The same
            # fields as a scan's: its row, its words, its block slots (RowBlocks counts blocks of
            # WIDE_SLOTS) and its parity; no slots, kv rows or barrier of its own.
            assert not counts, f"{_id(config)}: warpgroup 0 scans its row's slots: {counts}"
            loaded, read = ROW_BLOCKS_LOADED.findall(body), ROW_BLOCKS_READ.findall(body)
            assert len(loaded) == 1 and len(read) == 1, f"{_id(config)}: warpgroup 0's counts: {loaded}, {read}"
            counts = [("live0", loaded[0], None, None, read[0][0], "((int)threadIdx.x)", str(W.WIDE_SLOTS), read[0][1],
                       None)]
        assert len(counts) == 1, f"{_id(config)}: {name} counts its row's blocks {len(counts)} times"
        target, row, *_, parity, _ = counts[0]
        # A corrections launch counts the blocks of the rows its lanes launch flagged only, its words
        # by the parity of those rows (row_blocks); the rows it skips have no blocks in either
        # warpgroup. Any other, by the CTA's count of items, one more after each.
        expected = f"done{w}[0]" if config.corrections else f"k{w}[0]"
        assert target == f"live{w}" and bound_to(parity) == expected and f"int {row} = at{w}[0];" in body, f"{_id(config)}: {counts[0]}"
        assert body.count(f"k{w}[0] = (k{w}[0] + 1);") == 1, f"{_id(config)}: {name}'s count of items"
        if config.corrections:
            assert f"ws_row_flagged(Flag, {row})" in body and body.count(f"done{w}[0] = (done{w}[0] + 1);") == 1, _id(config)
        blocks = re.findall(rf"for \(int (\w+) = 0; \1 < live{w}\[0\]; \+\+\1\)", body)
        assert len(blocks) == 1, f"{_id(config)}: {name}'s block loops: {blocks}"
        assert f"base{w}[0] = 0;" in body[:body.index(ITEM_LOOP.search(body)[0])]
        assert body.count(f"base{w}[0] = (base{w}[0] + live{w}[0]);") == 1, f"{_id(config)}: {name}'s block numbering"
        block = re.search(rf"int (\w+) = \(base{w}\[0\] \+ {blocks[0]}\);", body)
        assert block, f"{_id(config)}: {name} numbers no block from base{w}"
        same = lambda text: re.sub(r"\b(rmod|rdiv)(_\d+)?\b", r"\1", text.replace(item, "ITEM"))
        walks.append((same(bound), same(row_expr), same(head_expr), counts[0], block[1], blocks[0]))
    (*item0, count0, t0, local0), (*item1, count1, t1, _) = walks
    assert item0 == item1, f"{_id(config)}: the warpgroups walk different items: {walks}"
    # The row handoffs (tests/wide_handoffs.py runs them with the block handoffs under random
    # schedules): warpgroup 0's thread 0 posts the CTA's first item, its own index, before the item
    # loop; claims the next in a row's last block, after the block's KV_FREE wait (by then warpgroup
    # 1 has taken this row's item, unless the row has one block), or at the row's end where it has
    # none; each of its threads reads the posted item after a barrier of the warpgroup. Warpgroup 1
    # takes the first item before its loop and each next at its row's end. A claim or a take of
    # another item's phase than the count's would wait on the wrong parity.
    calls = {w: [(m[1], m[3], m.start()) for m in ROW_HANDOFF.finditer(body)] for w, body in (("0", first), ("1", second))}
    loops = {w: body.index(ITEM_LOOP.search(body)[0]) for w, body in (("0", first), ("1", second))}
    assert [c[:2] for c in calls["0"]] == [("ws_post_first_item", "((int)blockIdx.x)"),
                                            ("ws_claim_item", "Claims, k0[0], ctas"), ("ws_claim_item", "Claims, k0[0], ctas"),
                                            ("ws_posted_item", "k0[0]")], f"{_id(config)}: {calls['0']}"
    assert [c[:2] for c in calls["1"]] == [("ws_take_item", "0"), ("ws_take_item", "k1[0]")], f"{_id(config)}: {calls['1']}"
    posted, in_block, at_end, read = (at for *_, at in calls["0"])
    assert posted < loops["0"] < in_block and "(((int)threadIdx.x) == 0)" in _enclosing_heads(first, posted)[0]
    last_block = " ".join(_enclosing_heads(first, in_block))
    for term in (f"({local0} == (live0[0] - 1))", "(((int)threadIdx.x) == 0)"):
        assert term in last_block, f"{_id(config)}: the claim's guard lacks {term}: {last_block}"
    block_top = first.rindex(f"for (int {local0} = 0;", 0, in_block)
    kv_free = [m.start() for m in HANDOFF.finditer(first, block_top, in_block) if m[1] == "wait" and int(m[3]) == W.KV_FREE]
    assert len(kv_free) == 1, f"{_id(config)}: the claim in a block is not after its KV_FREE wait"
    assert "((live0[0] == 0) && (((int)threadIdx.x) == 0))" in _enclosing_heads(first, at_end)[0], _id(config)
    counted = first.index("k0[0] = (k0[0] + 1);", at_end)
    synced = first.index("ws_bar_sync_wg(", counted)
    assert at_end < counted < synced < read, f"{_id(config)}: warpgroup 0 reads the posted item before its barrier"
    # Warpgroup 0's counts: each claim's thread fetches the claimed item's row's into the words of
    # the next item's parity, where a claim found one, and the copy lands before the row's end: the
    # claim in a block before both of the block's cp.async waits (block 0's and a later block's),
    # the claim at the row's end with a wait of its own. The warpgroup reads it at the next row's
    # start (after the row-end barrier above); a CTA's first row's comes by a load instead.
    fetches = [(m.start(), m[1], m[2]) for m in ROW_BLOCKS_FETCH.finditer(first)]
    if config.corrections:
        assert not fetches, f"{_id(config)}: a corrections launch fetches counts it does not read"
    else:
        assert len(fetches) == 2 and in_block < fetches[0][0] < at_end < fetches[1][0], f"{_id(config)}: {fetches}"
        row_end = first.index("k0[0] = (k0[0] + 1);", at_end)
        claimed_row = re.sub(r"\b(rmod|rdiv)(_\d+)?\b", r"\1", walks[0][1].replace("ITEM", "next0[0]"))
        for at, words_at, row in fetches:
            assert words_at == count0[4], f"{_id(config)}: fetched into words {words_at}, read from {count0[4]}"
            assert row == claimed_row, f"{_id(config)}: the fetch's row {row}, the claimed item's {claimed_row}"
            guard = " ".join(_enclosing_heads(first, at))
            for term in ("(((int)threadIdx.x) == 0)", "(next0[0] < "):
                assert term in guard, f"{_id(config)}: the fetch's guard lacks {term}: {guard}"
        in_block_fetch, end_fetch = fetches[0][0], fetches[1][0]
        for head in (f"if ({local0} == 0)", f"if (0 < {local0})"):
            wait = re.compile(re.escape(head) + r" \{\s*mqa_cp_async_wait_all\(\);").search(first, in_block_fetch, at_end)
            assert wait, f"{_id(config)}: no {head} cp.async wait after the claim's fetch in the block"
        landed = first.find("mqa_cp_async_wait_all();", end_fetch, row_end)
        assert landed > 0 and "(next0[0] < " in " ".join(_enclosing_heads(first, landed)), \
            f"{_id(config)}: the fetch at the row's end lands after it, or waits where it fetched nothing"
        loaded, read = (first.index(regex.search(first)[0]) for regex in (ROW_BLOCKS_LOADED, ROW_BLOCKS_READ))
        assert loops["0"] < loaded < read < first.index(f"for (int {local0} = 0;"), f"{_id(config)}: the count read outside the row's start"
        first_row = f"if ({count0[7]} == 0)"
        assert _enclosing_heads(first, loaded)[0] == first_row and _enclosing_heads(first, read)[0] == "} else", \
            f"{_id(config)}: the first row's load and the fetched read under {_enclosing_heads(first, loaded)[:1]}, {_enclosing_heads(first, read)[:1]}"
    took_first, took_next = (at for *_, at in calls["1"])
    assert took_first < loops["1"] < second.index("k1[0] = (k1[0] + 1);") < took_next, f"{_id(config)}: {calls['1']}"
    # The same row's slots (Lp, NKV, block slots), each warpgroup's thread index and its own words
    # of its parity, 4 a parity, after the 4 mbarriers and inside their allocation.
    assert count0[2:4] in (count1[2:4], (None, None)) and count0[6] == count1[6], f"{_id(config)}: {count0} against {count1}"
    assert (count0[5], count1[5]) == ("((int)threadIdx.x)", f"(((int)threadIdx.x) - {W.WARPGROUP})"), _id(config)
    words = sorted((int(count0[4]), int(count1[4])))
    bars_bytes = _shared_bytes(config)["bars"]
    assert 4 * 2 <= words[0] and words[0] + 8 <= words[1] and (words[1] + 8) * 4 <= bars_bytes, f"{_id(config)}: {words}"
    # Each warpgroup makes its program's waits and arrivals (tests/wide_handoffs.py: warpgroup 0's
    # at a row's start and at each block, warpgroup 1's at each block; tests/test_wide_handoffs.py
    # runs them under random schedules: no deadlock, no race), in the program's order, on its
    # phases; warpgroup 0's each under its guard (the innermost if around it: none where it always
    # runs; warpgroup 1's last two sit in its loop over chunks, at the last chunk's turn).
    lanes = config.accumulate == "lanes"
    block_loop = first.index(re.search(rf"for \(int {local0} = 0; {local0} < live0\[0\]; \+\+{local0}\)", first)[0])
    parity = {"row before": "((base0[0] + 1) & 1)",  # (base - 1) % 2 as TileLang writes it
              "block before": f"(({t0} + 1) & 1)", "this block": f"({t1} & 1)", None: ""}
    row_guards = {"after a block": "0 < base0[0]", None: None, "lanes": None}
    block_guards = {"after a block": f"0 < {t0}", "not first of row": f"0 < {local0}", None: None, "lanes": None}
    programs = (("warpgroup 0", first, [(s, row_guards) for s in WH.handoffs(WH.ROW_START_0, lanes)]
                 + [(s, block_guards) for s in WH.handoffs(WH.BLOCK_0, lanes)]),
                ("warpgroup 1", second, [(s, None) for s in WH.handoffs(WH.BLOCK_1, lanes)]))
    offsets = set()
    for name, body, program in programs:
        found = [(m[1], int(m[3]), m[4] or "", _enclosing_condition(body, m.start()))
                 for m in HANDOFF.finditer(body)]
        assert len(found) == len(program), f"{_id(config)}: {name}'s handoffs are {found}, its program's {program}"
        want = [(what, bar, parity[phase], guards[when] if guards else found_guard)
                for ((what, bar, phase, when), guards), (*_, found_guard) in zip(program, found)]
        assert found == want, f"{_id(config)}: {name}'s handoffs (what, mbarrier, parity, guard) are {found}, not {want}"
        offsets |= {m[2] for m in HANDOFF.finditer(body)}
    assert len(HANDOFF.findall(source)) == 8 + 2 * lanes, f"{_id(config)}: handoffs outside the two branches"
    assert f"buf_dyn_shmem + {offsets.pop()}" in source[init:init + 80] and not offsets
    # The row's start, in the program's order: block 0's gather (whole) after its KV_FREE wait, Q
    # and dO after the PDS_FREE wait, both before the block loop; lse and Delta after the row's
    # block count (the row-end barrier, or in a corrections launch ws_row_blocks' own, orders them
    # after the row before's last reads). Every copy and
    # commit of a row's start only where the row has blocks: an empty row's would refill KV_s
    # under warpgroup 1's reads, or leave a copy in flight when the CTA ends.
    start = first.index(ITEM_LOOP.search(first)[0])
    waits = [m for m in HANDOFF.finditer(first) if m.start() < block_loop]
    gather, q_load = first.index("((bfloat16_t*)KV_s)["), first.index("((bfloat16_t*)Q_s)[")
    assert waits[0].end() < gather < waits[1].start() < q_load < block_loop, f"{_id(config)}: the row start's order"
    counted = first.index((ROW_BLOCKS.search(first) or ROW_BLOCKS_READ.search(first))[0])
    for buffer in ("((float*)lse_s)[", "((float*)delta_s)["):
        assert counted < first.index(buffer) < block_loop, f"{_id(config)}: {buffer} before the row's block count"
    for copy in re.finditer(r"mqa_cp_async16\(|mqa_cp_async_commit\(", first[start:block_loop]):
        heads = _enclosing_heads(first, start + copy.start())
        assert "if (0 < live0[0])" in heads, f"{_id(config)}: a row start's {copy[0]} outside if (0 < live0[0]): {heads}"
    # One thread prefetches the next item's Q and dO rows into L2, in the row's last block, and
    # only where it claimed one (past the last item, a row would lie before Q).
    prefetches = [m.start() for m in re.finditer(r"ws_prefetch_l2\(", first)]
    assert len(prefetches) == 2 and "ws_prefetch_l2(" not in second, _id(config)
    for at in prefetches:
        guard = " ".join(_enclosing_heads(first, at))
        for term in (f"({local0} == (live0[0] - 1))", "(((int)threadIdx.x) == 0)", "(next0[0] < "):
            assert term in guard, f"{_id(config)}: the prefetch's guard lacks {term}: {guard}"
    # Warpgroup 0's dQ GEMM takes dS from its registers (the one RS wgmma), issued before the wait
    # for P_s and dS_s to be free, so that it runs under the wait and the stores of P and dS.
    loop = first[block_loop:]
    pds_free_wait = next(m.start() for m in HANDOFF.finditer(loop) if m[1] == "wait" and int(m[3]) == W.PDS_FREE)
    assert first.count("tl::wgmma_rs<") == 1 and "wgmma_rs" not in second, f"{_id(config)}: RS GEMMs"
    rs = loop.index("tl::wgmma_rs<")
    assert rs < pds_free_wait, f"{_id(config)}: warpgroup 0's dQ GEMM after the PDS_FREE wait"
    assert "wait_wgmma<" not in loop[rs:pds_free_wait], f"{_id(config)}: a wgmma wait before the PDS_FREE wait"
    # PTX leaves reading an in-flight wgmma's A registers undefined: dS goes to shared memory from
    # acc_dp, and the fragment is touched again only by fences until the GEMMs' wait.
    issued = loop.index("tl::warpgroup_commit_batch();", rs)
    assert "dS_r[" not in loop[issued:loop.index("tl::wait_wgmma<", issued)], f"{_id(config)}: dS_r read in flight"
    # The dKV adds, a 64-column chunk at a time: warpgroup 0's last wg0_chunks at one site;
    # warpgroup 1's two sites in the loop over pairs of chunks, and the last one or two after it
    # (an odd or even count); the lanes' warpgroup 1, one site in its loop over chunk pairs
    # (ws_add_pair_lanes) and one for the chunks left, if any. Each wgmma wait is followed by the
    # fence of what it waited for (without one, the compiler may read wgmma's registers before the wait).
    adds, n1 = CHUNK_ADDS[config.accumulate], config.d_k // W.CHUNK - config.wg0_chunks
    pairs = W.lane_pairs(config)
    sites = (n1 > 2 * pairs) if pairs else 2 + 2 - n1 % 2
    assert (pairs > 0) == (config.accumulate == "lanes") and second.count("ws_add_pair_lanes<") == (pairs > 0)
    wg0_pair = W.wg0_pairs(config)  # its first two chunks a pair, at one site of their own
    assert first.count("ws_add_pair_lanes<") == wg0_pair
    # The lanes launch adds the FFMA words, its corrections launch their corrections (the template argument).
    other = "<false>(" if config.corrections else "<true>("
    assert other not in source, f"{_id(config)}: adds of the other launch's words"
    assert first.count(adds) == (config.wg0_chunks > 2 * wg0_pair), f"{_id(config)}: {first.count(adds)} chunk add sites in warpgroup 0"
    assert second.count(adds) == sites, f"{_id(config)}: {second.count(adds)} chunk add sites in warpgroup 1"
    for wait in WGMMA_WAIT_ANY.finditer(source):
        assert source[wait.end():].strip().startswith("tl::warpgroup_fence_operand("), f"{_id(config)}: a wait without its fence"
    # The lanes add their bounds once a block, the warpgroup's peaks staged between two of its
    # barriers; the int64 redo and the corrections leave at once where their gate is 0, before any
    # barrier, and the lanes launch opens its corrections' gate where it flags a row.
    bounded = config.accumulate == "lanes" and not config.corrections
    assert (second.count("ws_add_bounds(") == 1) == bounded and "ws_add_bounds(" not in first
    if bounded:
        bounds = second[second.index("ws_stage_peaks(") - 200 : second.index("ws_add_bounds(")]
        assert bounds.count(f"ws_bar_sync_wg({W.BOUNDS_BARRIER})") == 2, f"{_id(config)}: the bounds' barriers"
    gate = source.find("ws_exit_unless(")
    assert (gate >= 0) == (config.accumulate == "fixed" or config.corrections), f"{_id(config)}: gated = {gate >= 0}"
    if gate >= 0:
        assert gate < init and "__sync" not in source[:gate], f"{_id(config)}: the gate is not the kernel's first step"
    if config.accumulate == "lanes":
        flags = [m.group(1) for m in re.finditer(r"ws_flag_magic\(([^;]*)\);", second)]
        assert len(flags) == (not config.corrections) and all(f.rstrip(")").endswith("Gate") for f in flags), flags


@pytest.mark.parametrize("config", WIDE_CONFIGS + OTHER_SPLITS, ids=_id)
def test_wide_tile_frees_kv_only_once_its_dq_gemms_have_read_it(config):
    # Warpgroup 1's dQ GEMMs read KV_s, and its KV_FREE arrival lets warpgroup 0 gather the next
    # block into it. GEMMs issued between the dQ GEMMs and that arrival's wait (the lanes' first
    # chunk pair, which reads Q, dO, P and dS, never KV_s) may stay pending, and no more: wgmma
    # commit groups complete in order, so a wait that leaves n pending has finished every group
    # but the last n.
    source = K.compiled(config).get_kernel_source()
    source = source[source.index('extern "C" __global__'):]
    _, end = branch_at(source, WARPGROUP_0, source.index(WARPGROUP_0))
    second, _ = branch_at(source, WARPGROUP_1, end)
    arrive = next(m for m in HANDOFF.finditer(second) if m[1] == "arrive" and int(m[3]) == W.KV_FREE)
    before = second[:arrive.start()]
    dq_gemm = before.rindex("(acc_dq2 + 0))")
    dq_done = before.index("tl::warpgroup_commit_batch();", dq_gemm)
    waits = list(WGMMA_WAIT_ANY.finditer(before, dq_done))
    assert waits, f"{_id(config)}: no wgmma wait between the dQ GEMMs and KV_FREE"
    between = before[dq_done + len("tl::warpgroup_commit_batch();"):waits[-1].start()]
    issued = between.count("tl::warpgroup_commit_batch();")
    assert int(waits[-1][1]) <= issued, f"{_id(config)}: waits leaving {waits[-1][1]} groups, {issued} issued after dQ's"
    assert "KV_s" not in between, f"{_id(config)}: a GEMM that reads KV_s issued before KV_FREE's wait"
    assert (issued > 0) == (W.lane_pairs(config) > 0), f"{_id(config)}: {issued} groups issued under the dQ GEMMs"


@pytest.mark.parametrize("config", MAIN_CONFIGS, ids=_id)
def test_main_kernel_spills_within_its_spill_budget(config):
    # One CTA per SM at up to 255 registers a thread: a kernel change that
    # pushes live values past that spills to local memory inside the slot loop.
    info = K.ptxas_info(config)
    budget = SPILL_BUDGET.get((config.heads, config.d_k, config.accumulate, config.tiles), {})
    for field in ("spill_stores", "spill_loads", "stack"):
        assert info[field] <= budget.get(field, 0), f"{_id(config)}: {field} over {budget.get(field, 0)}: {info}"


#: Bytes of spills a kernel had when it was timed, per (heads, d_k, accumulate, tiles): the wide tile's two warpgroups share one 255-register allocation; the lanes'
#: transposed adds fit it only with ptxas's scheduling held in check (wide.py's ws_thread_again, the
#: adds' wait for the peak, __syncwarp). The one-row CTA spilled 24 bytes of stores and 44 of
#: loads there, uniform values stored before the slot loops and loaded once a block (the peaks'
#: reduce-scatter, block 0's gather beside the prologue, warpgroup 1's chunk pairs: each faster
#: for its spill; docs/performance-log.md, twelfth, fourteenth and seventeenth sessions). The
#: persistent CTA's item loop holds each warpgroup's row, heads and block base besides: 68 bytes
#: of stores, 84 of loads, warpgroup 1 some four stores and nine loads a block, and is faster than
#: the one-row CTA that spilled less (twentieth session); since the peak orders a slot pair's
#: first add rather than the next pair's slot load, 64 and 76 (twenty-second session); since the
#: adds read their thread index again from %tid.x (ws_thread_again) and dQ leaves through
#: ws_store_dq, 44 and 60, with no spill store left in warpgroup 1's block loop; since the lanes
#: round by FFMA and flag the rows past its range (twenty-eighth session), 48 and 56; since the CTAs
#: claim their items (thirty-third session: no count of a CTA's items stays live), 40 and 48 at one
#: tile, 44 and 56 at two; since the peaks are of |x|, scaled in the bounds (thirty-fifth session:
#: 79 FMUL fewer, faster in two A/B runs), 48 and 60 at one tile, 52 and 68 at two. Their
#: corrections launch (no dQ, so far fewer live values) spills nothing. The int64 redo (fixed),
#: launched on every call but run only where a lanes bound
#: failed, spilled 4/4 bytes at one tile and at two; with the claims 8/8 and 4/8; with dQ stored in
#: whole lines (thirty-fifth session; the lanes' unchanged) 8/16 at two tiles, not timed alone.
SPILL_BUDGET = {(64, 576, "lanes", 1): {"spill_stores": 48, "spill_loads": 60, "stack": 32},
                (64, 576, "lanes", K.MULTI_TILE): {"spill_stores": 52, "spill_loads": 68, "stack": 40},
                (64, 576, "fixed", 1): {"spill_stores": 8, "spill_loads": 8, "stack": 8},
                (64, 576, "fixed", K.MULTI_TILE): {"spill_stores": 8, "spill_loads": 16, "stack": 8}}


CP_ASYNC = re.compile(r"cp\.async\.(?:ca|cg)\.shared\.global\S*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*\d+(?P<src_size>,\s*[^;]+)?;")


@pytest.mark.parametrize("config", [c for c in DKV_CONFIGS if _mode(c)], ids=_id)
def test_every_kv_gather_copy_can_read_nothing(config):
    # The main kernel gathers KV rows with cp.async a block ahead. An invalid
    # slot must read nothing: every copy carries a source size (0 for an
    # invalid slot, which zero-fills). A copy without one always reads.
    copies = list(CP_ASYNC.finditer(_ptx(config)))
    assert copies, f"{_id(config)}: no cp.async gather in the PTX"
    unguarded = [m.group(0) for m in copies if not m.group("src_size")]
    assert not unguarded, f"{_id(config)}: cp.async without a source size: {unguarded[:3]}"


@pytest.mark.parametrize("config", [c for c in WIDE_CONFIGS if c.accumulate == "lanes"], ids=_id)
def test_lanes_slot_scales_come_with_the_gather(config):
    # A valid slot's row scale is copied into the slot's word by cp.async (ws_lanes_store_slot), in
    # the group of the block's gather, not loaded into a register and stored: a load would be a
    # second round trip after the slot's index on warpgroup 0's path. One copy site a kernel, beside
    # the claims' fetches of a row's block count (ws_fetch_row_blocks), the other 4-byte copies.
    ptx = _ptx(config)
    source = K.compiled(config).get_kernel_source()
    fetches = len(ROW_BLOCKS_FETCH.findall(source))
    assert fetches == 2 - 2 * config.corrections, _id(config)
    assert len(re.findall(r"cp\.async\.ca\.shared\.global \[%r\d+\], \[%rd\d+\], 4, 4;", ptx)) == 1 + fetches, _id(config)
    assert "row_scale[row]" not in source[source.index("ws_lanes_store_slot("):source.index("ws_row_blocks(")], _id(config)


@pytest.mark.parametrize("config", WIDE_CONFIGS, ids=_id)
def test_wide_tile_forms_p_while_only_dp_gemms_run(config):
    # Warpgroup 0 forms P from S while dP's last GEMM still runs: the wait before the exp2 leaves
    # pending only groups that write acc_dp (wgmma commit groups complete in order, so a wait that
    # leaves n pending has finished every group but the last n), and nothing reads acc_dp before a
    # wait that leaves none.
    source = K.compiled(config).get_kernel_source()
    source = source[source.index('extern "C" __global__'):]
    first, _ = branch_at(source, WARPGROUP_0, source.index(WARPGROUP_0))
    exp = first.index("mqa_masked_exp2(")
    wait = list(WGMMA_WAIT_ANY.finditer(first, 0, exp))[-1]
    pending = int(wait[1])
    assert pending >= 1, f"{_id(config)}: P waits for dP's GEMMs too"
    commits = [m.start() for m in re.finditer(re.escape("tl::warpgroup_commit_batch();"), first[:wait.start()])]
    for commit in commits[len(commits) - pending:]:
        gemm = first[first.rindex("tl::wgmma_", 0, commit):commit]
        assert "(acc_dp + 0)" in gemm and "(acc_s + 0)" not in gemm, f"{_id(config)}: a pending group besides dP's"
    after = first[exp:]
    lines = after.split("\n")
    read = next(i for i, line in enumerate(lines) if "acc_dp +" in line and "warpgroup_fence_operand" not in line)
    assert "tl::wait_wgmma<0>();" in "\n".join(lines[:read]), f"{_id(config)}: acc_dp read while its GEMM may run"


@pytest.mark.parametrize("config", [c for c in DKV_CONFIGS if _mode(c)], ids=_id)
def test_every_main_kernel_forms_p_by_the_ftz_exp2(config):
    # P is mqa_masked_exp2 of the score (device_functions.SOFTMAX_SOURCE): the hardware's
    # ex2.approx.ftz and a select. exp2f (ex2.approx.f32 in PTX) rescales arguments below -126
    # with a compare and two predicated multiplies a score; and a head tile forming P that way
    # beside one that does not would break pad heads inert (the 32-head tile against the wide
    # one) wherever P is below 2^-126.
    ptx = _ptx(config)
    assert "ex2.approx.ftz.f32" in ptx, f"{_id(config)}: no ex2.approx.ftz"
    assert "ex2.approx.f32" not in ptx, f"{_id(config)}: an exp2f"


#: Dynamic shared memory one CTA may use on sm_90 (227 KB).
SM90_MAX_DYNAMIC_SMEM = 227 * 1024
SMEM_OFFSET = re.compile(r"buf_dyn_shmem \+ (\d+)\)")


@pytest.mark.parametrize("config", MAIN_CONFIGS, ids=_id)
def test_main_kernel_fits_in_shared_memory(config):
    # A launch over the limit fails only on the GPU (every launch of the
    # kernel); the wide lanes tile uses all of it, so one more buffer, a
    # wider padding or tile shows here first.
    kernel = K.compiled(config)
    smem = K.dynamic_shared_bytes(kernel)
    assert smem is not None, f"{_id(config)}: no launch arguments in the host code; update kernels.dynamic_shared_bytes"
    offsets = [int(o) for o in SMEM_OFFSET.findall(kernel.get_kernel_source())]
    assert offsets and max(offsets) < smem, f"{_id(config)}: {smem} bytes parsed, buffers up to {max(offsets, default=0)}"
    assert smem <= SM90_MAX_DYNAMIC_SMEM, f"{_id(config)}: {smem} bytes of shared memory > {SM90_MAX_DYNAMIC_SMEM}"


#: A shared buffer's place in the generated CUDA, and its allocation in the TileLang program.
SHARED_BUFFER = re.compile(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);")
SHARED_ALLOCATION = re.compile(r'(\w+) = T\.\w*alloc_buffer\(\(([\d, ]+)\)(?:, "(\w+)")?, scope="shared\.dyn"\)')


def _shared_bytes(config) -> dict:
    """Bytes of each shared buffer the TileLang program of ``config`` allocates, by name."""
    return {name: math.prod(int(d) for d in shape.split(",") if d.strip()) * getattr(torch, dtype or "float32").itemsize
            for name, shape, dtype in SHARED_ALLOCATION.findall(K.program_of(config).script())}


@pytest.mark.parametrize("config", WIDE_CONFIGS, ids=_id)
def test_wide_tile_buffers_do_not_share_shared_memory(config):
    # Every buffer of the warp-specialised tile lives through the whole slot loop, but TileLang's
    # planner reads the warpgroups' branches as one sequence: a buffer touched only through calls
    # in warpgroup 1's branch it placed on delta_s and lse_s, which warpgroup 0 still reads, and
    # dq came back wrong on the H200 (docs/performance-log.md, 2026-12-03, eighth session).
    sizes = _shared_bytes(config)
    placed = sorted((int(offset), name) for name, offset in SHARED_BUFFER.findall(K.compiled(config).get_kernel_source()))
    # (a buffer the kernel never touches, the control's scales, gets no place)
    assert placed and {name for _, name in placed} <= set(sizes), f"{_id(config)}: placed {placed}, allocated {sizes}"
    for (start, name), (next_start, next_name) in zip(placed, placed[1:]):
        assert start + sizes[name] <= next_start, f"{_id(config)}: {name} [{start}, +{sizes[name]}) overlaps {next_name} at {next_start}"


EXPECT_TX = re.compile(r"mqa_mbar_expect\([^;]*?, 0, (\d+)\);")
BULK_TO_PEER = re.compile(r"mqa_bulk_to_peer\(\(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\), (\d+), (\d+), (\d+),")
_SMEM_PTR = r"\(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)"
BULK_PTR_TO_PEER = re.compile(rf"mqa_bulk_ptr_to_peer\({_SMEM_PTR}, (.+?), {_SMEM_PTR}, (\d+),")


@pytest.mark.parametrize("config", [c for c in MAIN_CONFIGS if c.cluster > 1], ids=_id)
def test_cluster_bulk_copies_fill_exactly_what_the_peer_expects(config):
    # The receiver arms its full barrier for a fixed byte count; the sender's
    # bulk copies must add up to it, or the wait never completes (a hang on
    # the GPU) or completes early (stale inbox rows). cp.async.bulk also
    # needs 16-byte aligned addresses and sizes, and the copies must not
    # overlap the rows they are read from.
    source = K.compiled(config).get_kernel_source()
    expected = {int(b) for b in EXPECT_TX.findall(source)}
    # (source, destination, bytes), offsets in the dynamic shared memory (the destination's in the peer)
    copies = [(base + src, base + dst, size) for base, src, dst, size in
              (tuple(map(int, m)) for m in BULK_TO_PEER.findall(source))]
    loops = {name: int(n) for name, n in UNROLLED_LOOP.findall(source)}
    for dst, offset, src, size in BULK_PTR_TO_PEER.findall(source):  # offset: an expression of unrolled loop variables
        names = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]*\b", offset)))
        for values in itertools.product(*(range(loops[name]) for name in names)):
            copies.append((int(src), int(dst) + eval(offset, {}, dict(zip(names, values))), int(size)))
    assert len(expected) == 1 and copies, f"{_id(config)}: expect_tx {expected}, copies {copies}"
    assert sum(size for *_, size in copies) == expected.pop(), f"{_id(config)}: {copies}"
    for src, dst, size in copies:
        assert src % 16 == dst % 16 == size % 16 == 0, f"{_id(config)}: {src, dst, size}"
    for src, _, size in copies:  # no copy's source is another's (or its own) destination
        for _, dst, other in copies:
            assert src + size <= dst or dst + other <= src, f"{_id(config)}: staging and inbox overlap {copies}"


# A GEMM's A-operand load, with its k loop when the operand has more than one 16-row step.
LDMATRIX_A = re.compile(r"(?:for \(int (ki_\d+) = 0; \1 < (\d+); \+\+\1\) \{\s*)?tl::ptx_ldmatrix_x4_trans\("
                        r"\(&\(\(\(bfloat16_t\*\)(\w+)\)\[(.+?)\]\)\)")


@pytest.mark.parametrize("config", [c for c in MAIN_CONFIGS if c.accumulate == "fixed" and c.cluster > 1], ids=_id)
def test_cluster_inboxes_are_laid_out_as_the_tiles_they_receive(config):
    # The peers' P and dS tiles arrive as raw bytes, so each tile's rows of
    # the taller inbox buffers must be read as P_s and dS_s are: every
    # thread's ldmatrix of k step k of peer i at P_s's element for step k,
    # plus i tiles.
    heads, cluster = config.heads, config.cluster
    tile, threads = K.main_tile_heads(heads) * K.BLOCK_SLOTS, 256 if K.main_tile_heads(heads) >= 32 else 128
    source = K.compiled(config).get_kernel_source()
    reads = {}
    for var, bound, buffer, index in LDMATRIX_A.findall(source):
        if buffer not in ("P_s", "P_in", "dS_s", "dS_in"):
            continue
        code = compile(index.replace("((int)threadIdx.x)", "tx").replace(var or "ki", "ki"), buffer, "eval")
        reads.setdefault(buffer, set()).add((int(bound or 1), code))
    # The staging copies read P_s and dS_s without a barrier of their own:
    # the one TileLang puts between the dS_s store and the dQ GEMM must be there.
    staging = source.index("mqa_copy16((")
    stores = [m.start() for m in re.finditer(r"tl::ptx_stmatrix\w*\(\(&\(\(\(bfloat16_t\*\)dS_s\)", source[:staging])]
    assert stores, f"{_id(config)}: no stmatrix into dS_s before the staging; update this test"
    assert "__syncthreads();" in source[stores[-1]:staging], f"{_id(config)}: no barrier between dS_s and its staging"
    for own, inbox in (("P_s", "P_in"), ("dS_s", "dS_in")):
        assert len(reads.get(own, ())) == len(reads.get(inbox, ())) == 1, f"{_id(config)}: {own}, {inbox}: update this test"
        (steps, own_index), = reads[own]
        (inbox_steps, inbox_index), = reads[inbox]
        assert inbox_steps == steps * (cluster - 1), f"{_id(config)}: {inbox_steps} k steps for {steps}"
        for tx, k, i in itertools.product(range(threads), range(steps), range(cluster - 1)):
            got = eval(inbox_index, {}, dict(tx=tx, ki=i * steps + k))
            assert got == eval(own_index, {}, dict(tx=tx, ki=k)) + i * tile, f"{_id(config)}: {inbox}, tx {tx}, step {k}"


# fp32 tile stores in the generated CUDA: *(float2*)(((float*)BUF) + (INDEX)) = *(float2*)(...),
# and word stores: ((float*)BUF)[INDEX] = acc_dkv[...]
FLOAT2_STORE = re.compile(r"\*\(float2\*\)\(\(\(float\*\)(\w+)\) \+ (.+?)\) = \*\(float2\*\)")
FLOAT_STORE = re.compile(r"\(\(float\*\)(\w+)\)\[(.+?)\] = acc_dkvt?\[")
UNROLLED_LOOP = re.compile(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\)")


def _shared_store_wavefronts(source: str, threads: int = 256) -> dict:
    """buffer -> the most wavefronts any phase of a warp needs for one of its dKV tile stores (1: conflict-free).

    Evaluates each store's index for every thread, cluster rank and value of
    the loop variables it names. A 64-bit store is served a half-warp at a
    time (16 lanes x 2 words on 32 banks), a 32-bit one a warp at a time (32
    lanes x 1 word), so a conflict-free phase needs one wavefront, and k words
    on one bank need k. The model agrees with ncu on the H200 (2026-11-30):
    2-way for 4-word padded rows, 4-way and 2-way for the cluster's staging
    layout before and after the 8-word padding."""
    loops = {name: int(n) for name, n in UNROLLED_LOOP.findall(source)}
    worst = {}
    stores = [(buffer, index, 16, 2) for buffer, index in FLOAT2_STORE.findall(source)]
    stores += [(buffer, index, 32, 1) for buffer, index in FLOAT_STORE.findall(source)]
    for buffer, index, phase, words in stores:
        expr = index.replace("((int)threadIdx.x)", "tx").replace("((int)blockIdx.y)", "rank")
        assert "blockIdx" not in expr and "/" not in expr, expr  # only what the model evaluates
        names = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]*\b", expr)) - {"tx", "rank"})
        code = compile(expr, buffer, "eval")
        for values in itertools.product(*(range(loops.get(name, 2)) for name in names)):
            for rank, warp, part in itertools.product((0, 1), range(threads // 32), range(32 // phase)):
                words_on_bank = collections.defaultdict(set)
                for lane in range(phase * part, phase * part + phase):
                    word = eval(code, {}, dict(zip(names, values), tx=32 * warp + lane, rank=rank))
                    for w in range(word, word + words):
                        words_on_bank[w % 32].add(w)
                need = max(len(words) for words in words_on_bank.values())
                worst[buffer] = max(worst.get(buffer, 0), need)
    return worst


@pytest.mark.parametrize("config", [c for c in DKV_CONFIGS if _mode(c) and not c.wide], ids=_id)
def test_dkv_tile_stores_are_bank_conflict_free(config):
    # The dKV GEMMs' fp32 accumulators go to shared memory every slot block,
    # as float2 per lane (mma.sync fragments); the wide tile has no dKV tile in shared
    # memory (test_wide_tile_adds_from_registers). Conflicted, they cost the H200 1.2 ms
    # per dsv32 H=64 call in each design (4-word padding of the float2 layout,
    # measured); this catches a padding or layout change that brings conflicts
    # back, without a GPU.
    worst = _shared_store_wavefronts(K.compiled(config).get_kernel_source())
    assert worst, f"{_id(config)}: no store of the dKV tile found; update this test"
    assert all(need == 1 for need in worst.values()), f"{_id(config)}: wavefronts per phase {worst}"


@pytest.mark.parametrize("config", WIDE_CONFIGS, ids=_id)
def test_wide_tile_adds_from_registers(config):
    # No fp32 tile of dKV in shared memory: its chunks go from the wgmma accumulators to the
    # global adds. A staging buffer coming back would take the bytes the 64-slot KV tile needs.
    source = K.compiled(config).get_kernel_source()
    narrow = K.compiled(K.MainConfig(32, config.d_k, config.d_v, "atomic")).get_kernel_source()
    assert STORES_FROM_DKV_ACCUMULATOR.findall(narrow), "the pattern must find the 32-head tile's staging"
    staged = STORES_FROM_DKV_ACCUMULATOR.findall(source)
    assert not staged, f"{_id(config)}: dKV staged: {staged[:2]}"


@pytest.mark.parametrize("config", [c for c in WIDE_CONFIGS if not c.corrections], ids=_id)
def test_wide_tile_stores_dq_sixteen_bytes_a_thread(config):
    # dQ leaves through ws_store_dq: a quad's lanes swap their bf16 pairs so that each holds 8
    # consecutive columns, quad pairs swap halves, and a warp's 16-byte stores cover 4 rows x 128
    # bytes (whole lines), where TileLang's copy of the accumulator stores 4 bytes a thread (8 rows
    # x 16 bytes: twice the ideal sectors, eight times the L2's requests; docs/performance-log.md,
    # twenty-fourth and thirty-fourth sessions).
    source = K.compiled(config).get_kernel_source()
    kernel = source[source.index("__global__"):]
    widths = [int(w) for w in re.findall(r"ws_store_dq<(\d+)>", kernel)]
    assert len(widths) == 3 and sum(widths) == config.d_k and all(w % 64 == 0 for w in widths), widths
    assert not re.search(r"\(dQ \+|\bdQ\[[^\]]*\]\s*=[^=]", kernel), f"{_id(config)}: dQ stored element-wise"
    # Each thread's 16-byte stores, d_k columns x 64 rows x 2 bytes over 256 threads, 16 bytes
    # each: in the PTX at least that many (NVVM sinks the select of a quad pair's halves into two
    # stores under a branch); test_wide_tile_sass_has_each_sixteen_byte_store_once_in_line counts
    # what ptxas makes of them.
    stores = re.findall(r"st\.global\.v4\.(?:u32|b32)", _ptx(config))
    assert len(stores) >= config.d_k // 16, f"{_id(config)}: {len(stores)} 16-byte stores"


@pytest.mark.skipif(K.nvdisasm_path() is None, reason="needs nvdisasm (a full CUDA toolkit, or pip install nvidia-cuda-nvdisasm)")
@pytest.mark.parametrize("config", [c for c in WIDE_CONFIGS if not c.corrections], ids=_id)
def test_wide_tile_sass_has_each_sixteen_byte_store_once_in_line(config):
    # What runs, as ptxas made it: the wide tile's 16-byte global stores (dQ's) appear d_k / 16
    # times in the code up to the kernel's last EXIT (kernels.sass_in_line), once per store the
    # source writes. More means store code copied in line (a loop or branch ptxas duplicated) or
    # another 16-byte store; the PTX's count may differ (NVVM can sink a select between two stored
    # values into two stores under a branch, which ptxas merges). Copies past the last EXIT (the
    # WARPSYNC.COLLECTIVE code for a warp that reaches a shuffle with lanes missing) are allowed.
    listing, _ = K.sass_and_ptxas_info(K.compiled(config).get_kernel_source(), _id(config))
    stores = re.findall(r"\bSTG\.E\.128\b", K.sass_in_line(listing))
    assert len(stores) == config.d_k // 16, f"{_id(config)}: {len(stores)} 16-byte stores in the SASS's code in line"
    assert "HGMMA" in listing and "REDG" in listing and "LDGSTS" in listing, f"{_id(config)}: not the wide tile's SASS"


@pytest.mark.parametrize("tiles", [1, K.MULTI_TILE])
def test_lanes_round_by_ffma_and_only_their_corrections_convert(tiles):
    # The lanes launch rounds each value by FFMA (ws_magic_word: no cvt.rni, a quarter-rate
    # conversion) and flags, by an atomic or, the rows with a value past that rounding's range.
    # Its corrections launch forms each word both ways and adds the difference; dQ, the flags and
    # the bounds are the lanes launch's: it stores no 16-byte dQ, sets no flag, adds no bound (its
    # one global atomic add, 32 bits, claims items: in ws_claim_item, inlined twice).
    def count(config, pattern):
        return len(re.findall(pattern, _ptx(config)))

    lanes = K.MainConfig(64, 576, 512, "lanes", tiles=tiles)
    fixes = K.lanes_corrections(lanes)
    words = 576 // 2 * K.WIDE_SLOTS // 2 // 128  # a thread's words of a block: two FFMAs each
    assert count(lanes, r"cvt\.rni\.s32\.f32") == 0 and count(lanes, r"fma\.rn\.f32") >= 2 * words
    assert count(lanes, r"atom\.global\.or\.b32") >= 2 and count(lanes, r"atom\.global\.add\.u64") == 1
    assert count(fixes, r"cvt\.rni\.s32\.f32") == count(fixes, r"fma\.rn\.f32") == count(lanes, r"fma\.rn\.f32")
    assert count(fixes, r"st\.global\.v4") == 0, "the corrections launch stores dQ"
    assert count(fixes, r"atom\.global\.(?:or|add\.u64)") == 0, "the corrections launch sets flags or bounds"
    assert count(fixes, r"atom\.global\.add\.u32") == count(lanes, r"atom\.global\.add\.u32") == 2
    assert "ws_row_flagged" in K.compiled(fixes).get_kernel_source()


#: An assignment that reads a dKV accumulator (acc_dkv, acc_dkv2, ...): the staging of the 16- and
#: 32-head tiles, as float2 or as words. The wide tile only hands its accumulators to the add calls.
STORES_FROM_DKV_ACCUMULATOR = re.compile(r"[\])] = [^;]*\bacc_dkv\w*")


@pytest.mark.parametrize("config", [c for c in CONFIGS if _kind(c) == "delta_max"], ids=_id)
def test_delta_maxima_reduce_within_a_warp(config):
    # The Delta launch reduces each head row within one warp (shuffles, no block barrier); a
    # first version reduced max |dO| across 64 threads with block barriers and took 2.4 times as
    # long (docs/performance-log.md). Only the fixed design's build reduces the maxima.
    for build, maxima in ((config, 1), (K.KernelConfig("delta", config.args), 0)):
        source = K.compiled(build).get_kernel_source()
        kernel = source[source.index("__global__"):]
        assert "__syncthreads" not in kernel and "AllReduce" not in kernel, f"{_id(build)}: a block-wide reduction"
        calls = re.findall(r"mqa_delta_heads<(true|false)>", kernel)
        assert calls == ["true" if maxima else "false"], f"{_id(build)}: {calls}"
