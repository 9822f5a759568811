"""The persistent wide tile's handoffs as one program a warpgroup (kernels/wide.py), and a model that
runs the two programs under a random schedule.

tests/test_kernels_compile.py reads the programs to say which waits and arrivals each
warpgroup's branch of the generated CUDA makes, in which order, under which guard;
tests/test_wide_handoffs.py runs them here. A step is (what, mbarrier, phase, when):

- what: "wait" or "arrive" on the mbarrier, or an access to shared buffers the handoffs guard
  ("gather block 0" and "load Q and dO" write, "read ..." reads);
- phase: the block whose phase a wait waits on: "row before" (the last block of the row
  before: base - 1), "block before" (t - 1) or "this block" (t), blocks counted across rows;
  for the row handoffs, the item: "this item" (the CTA's k-th, k counted from 0) or "item before";
- when: None (always), "after a block" (block t > 0, or at a row's start base > 0), "not first
  of row" (the block's index in its row > 0), "after an item" (k > 0) or "lanes" (the lanes
  design only).

The CTA's items come from a counter (kernels/wide.py, ws_claim_item): warpgroup 0 claims the next
in a row's last block, after the block's KV_FREE wait (at the row's end where it has none), and
posts it (ROW_READY) once warpgroup 1 has taken the row's own item (ROW_FREE); warpgroup 1 takes
each (ITEM_1) before its row and after its last, where it finds that none is left.
"""

from mqa_bwd.kernels.wide import KV_FREE, PDS_FREE, PDS_READY, PEAKS_READY, ROW_FREE, ROW_READY

#: Warpgroup 0's claim of the CTA's next item (its thread 0's), posted at the next item's parity.
CLAIM_0 = (
    ("wait", ROW_FREE, "this item", None),
    ("arrive", ROW_READY, None, None),
)
#: Warpgroup 1 takes an item: all its threads read the posted one, then free its word.
ITEM_1 = (
    ("wait", ROW_READY, "this item", None),
    ("arrive", ROW_FREE, None, None),
)

#: Warpgroup 0 at the start of a row with blocks: block 0's gather (whole) once warpgroup 1's dQ
#: GEMMs of the block before have read KV_s, its Q and dO once that block's chunks have read them.
ROW_START_0 = (
    ("wait", KV_FREE, "row before", "after a block"),
    ("gather block 0", None, None, None),
    ("wait", PDS_FREE, "row before", "after a block"),
    ("load Q and dO", None, None, None),
)
#: Warpgroup 0 at each block: KV_s free (its refill's second part), P_s and dS_s free, then P,
#: dS and the slots in; the lanes' chunk maxima after its adds. A row's last block claims the next
#: item after the first step, its KV_FREE wait.
BLOCK_0 = (
    ("wait", KV_FREE, "block before", "not first of row"),
    ("wait", PDS_FREE, "block before", "after a block"),
    ("arrive", PDS_READY, None, None),
    ("arrive", PEAKS_READY, None, "lanes"),
)
#: Warpgroup 1 at each block: its dQ GEMMs read KV_s, its chunks' GEMMs Q_s, dO_s, P_s and dS_s;
#: it frees P_s and dS_s only after warpgroup 0's maxima are in (after, warpgroup 0 could complete
#: the next block's phase too, and the wait would never return).
BLOCK_1 = (
    ("wait", PDS_READY, "this block", None),
    ("read KV", None, None, None),
    ("arrive", KV_FREE, None, None),
    ("read Q and dO", None, None, None),
    ("wait", PEAKS_READY, "this block", "lanes"),
    ("arrive", PDS_FREE, None, None),
)


def handoffs(program, lanes):
    """The program's waits and arrivals, as (what, mbarrier, phase, when), in order."""
    return [s for s in program if s[0] in ("wait", "arrive") and (s[3] != "lanes" or lanes)]


def _run(program, lanes, base, local, row_start_waits, item=0):
    t = base + local
    phase = {"row before": base - 1, "block before": t - 1, "this block": t, "this item": item, "item before": item - 1,
             None: None}
    holds = {None: True, "lanes": lanes, "after a block": t > 0, "not first of row": local > 0, "after an item": item > 0}
    for what, bar, when_phase, when in program:
        if not holds[when] or (what == "wait" and when_phase == "row before" and bar not in row_start_waits):
            continue
        yield (what, bar, phase[when_phase]) if what in ("wait", "arrive") else (what, t)


def warpgroup0(rows, lanes=True, row_start_waits=(KV_FREE, PDS_FREE), claim=CLAIM_0):
    base = 0
    yield ("arrive", ROW_READY, None)  # the CTA's first item, its own index: posted, not claimed
    for k, live in enumerate(rows):
        if live > 0:
            yield from _run(ROW_START_0, lanes, base, 0, row_start_waits)
        for local in range(live):
            # The row's last block claims the next item after its KV_FREE wait.
            program = BLOCK_0[:1] + claim + BLOCK_0[1:] if local == live - 1 else BLOCK_0
            yield from _run(program, lanes, base, local, row_start_waits, item=k)
        if live == 0:
            yield from _run(claim, lanes, base, 0, row_start_waits, item=k)
        base += live


def warpgroup1(rows, lanes=True):
    base = 0
    yield from _run(ITEM_1, lanes, base, 0, (), item=0)
    for k, live in enumerate(rows):
        for local in range(live):
            yield from _run(BLOCK_1, lanes, base, local, ())
        base += live
        yield from _run(ITEM_1, lanes, base, 0, (), item=k + 1)


class ProtocolError(AssertionError):
    pass


def run(rows, rng, lanes=True, row_start_waits=(KV_FREE, PDS_FREE), claim=CLAIM_0) -> None:
    """One random interleaving of the two warpgroups over a CTA's ``rows`` (each row's block
    count). An mbarrier completes a phase when its one agent arrives; a parity wait on block t's
    phase passes once more than t phases are done, and must not pass with the barrier two phases
    past it (a parity wait would then alias)."""
    done = [0] * (ROW_FREE + 1)
    agents = [warpgroup0(rows, lanes, row_start_waits, claim), warpgroup1(rows, lanes)]
    step = [next(a, None) for a in agents]
    read = {"KV": -1, "Q and dO": -1}
    while any(s is not None for s in step):
        ready = []
        for i, s in enumerate(step):
            if s is None:
                continue
            if s[0] == "wait":
                _, bar, t = s
                if done[bar] > t:
                    if done[bar] != t + 1:
                        raise ProtocolError(f"warpgroup {i} passes a wait on phase {t} of mbarrier {bar} with {done[bar]} done")
                    ready.append(i)
            else:
                ready.append(i)
        if not ready:
            raise ProtocolError(f"deadlock: {step}, phases done {done}, rows {rows}")
        i = rng.choice(ready)
        what, arg = step[i][0], step[i][1]
        if what == "arrive":
            done[arg] += 1
        elif what.startswith("read "):
            read[what[5:]] = arg
        elif what == "gather block 0" and read["KV"] != arg - 1:
            raise ProtocolError(f"KV_s refilled for block {arg} before block {arg - 1}'s reads: {rows}")
        elif what == "load Q and dO" and read["Q and dO"] != arg - 1:
            raise ProtocolError(f"Q_s refilled for block {arg} before block {arg - 1}'s reads: {rows}")
        step[i] = next(agents[i], None)


def random_rows(rng):
    """A CTA's items: 1 to 6 rows of 0 to 5 blocks, empty rows (a causal prefix's) common."""
    return [rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(rng.randint(1, 6))]
