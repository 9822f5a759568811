"""The persistent wide tile's handoffs, as a protocol under random schedules (no GPU, no compiler).

tests/test_kernels_compile.py checks that each warpgroup's branch of the generated CUDA makes the
waits and arrivals below, in this order; this module checks that the order is safe. Each
warpgroup is an agent running its order over a CTA's rows (random block counts, empty rows
included); an mbarrier completes a phase when its one agent arrives, and a parity wait on block
t's phase passes once more than t phases are done. Every schedule must finish (no deadlock),
every wait must pass on its own phase (never with the barrier two phases past it: a parity wait
would then alias), and warpgroup 0 may gather a row's first block into KV_s, or load its Q and
dO, only once warpgroup 1 has read those of the block before.
"""

import random

import pytest

from mqa_bwd.kernels.wide import KV_FREE, PDS_FREE, PDS_READY, PEAKS_READY


def warpgroup0(rows, row_start_waits=(KV_FREE, PDS_FREE)):
    base = 0
    for live in rows:
        if live > 0:
            if base > 0 and KV_FREE in row_start_waits:
                yield "wait", KV_FREE, base - 1
            yield "gather block 0", base
            if base > 0 and PDS_FREE in row_start_waits:
                yield "wait", PDS_FREE, base - 1
            yield "load Q and dO", base
        for local in range(live):
            t = base + local
            if local > 0:
                yield "wait", KV_FREE, t - 1
            if t > 0:
                yield "wait", PDS_FREE, t - 1
            yield "arrive", PDS_READY
            yield "arrive", PEAKS_READY  # after its chunks' adds
        base += live


def warpgroup1(rows):
    base = 0
    for live in rows:
        for t in range(base, base + live):
            yield "wait", PDS_READY, t
            yield "read KV", t  # its dQ GEMMs
            yield "arrive", KV_FREE
            yield "read Q and dO", t  # its chunks' GEMMs
            yield "wait", PEAKS_READY, t
            yield "arrive", PDS_FREE
        base += live


class ProtocolError(AssertionError):
    pass


def run(rows, rng, wg0=warpgroup0) -> None:
    """One random interleaving of the two warpgroups over ``rows`` (each row's block count)."""
    done = [0] * 4
    agents = [wg0(rows), warpgroup1(rows)]
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


def test_the_persistent_handoffs_hold_under_random_schedules():
    rng = random.Random(1)
    for _ in range(3000):
        run(random_rows(rng), rng)


@pytest.mark.parametrize("kept", [(KV_FREE,), (PDS_FREE,)], ids=["without PDS_FREE", "without KV_FREE"])
def test_a_row_start_without_either_wait_is_caught(kept):
    # The model must be able to fail: with one of a row start's two waits dropped, some schedule
    # refills a buffer warpgroup 1 still reads.
    rng = random.Random(2)

    def wg0(rows):
        return warpgroup0(rows, row_start_waits=kept)

    with pytest.raises(ProtocolError, match="refilled"):
        for _ in range(3000):
            run(random_rows(rng), rng, wg0)
