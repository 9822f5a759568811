"""The persistent wide tile's handoffs (experiments/persistent_rows.patch) under random schedules.

    python -m experiments.persistent_handoffs [--schedules 20000]

Each warpgroup is one agent running the patch's order of waits and arrivals over a CTA's rows
(random block counts, empty rows included); an mbarrier completes a phase when its one agent
arrives, and a parity wait on block t's phase passes once more than t phases are done. Every
schedule must finish (no deadlock), every wait must pass on its own phase (never with the barrier
two phases past it: a parity wait would then alias), and warpgroup 0 may gather a row's first
block into KV_s, or load its Q and dO, only once warpgroup 1 has read those of the block before.
Dropping either of the row start's waits (KV_FREE, PDS_FREE) fails it; the product's one row a
CTA is the case of one row.
"""

import argparse
import random

PDS_READY, KV_FREE, PDS_FREE, PEAKS_READY = range(4)


def warpgroup0(rows):
    base = 0
    for live in rows:
        if live > 0:
            if base > 0:
                yield "wait", KV_FREE, base - 1
            yield "gather block 0", base
            if base > 0:
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


def run(rows, rng) -> None:
    done = [0] * 4
    agents = [warpgroup0(rows), warpgroup1(rows)]
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
                    assert done[bar] == t + 1, f"warpgroup {i} passes a wait on phase {t} of mbarrier {bar} with {done[bar]} done"
                    ready.append(i)
            else:
                ready.append(i)
        assert ready, f"deadlock: {step}, phases done {done}, rows {rows}"
        i = rng.choice(ready)
        what, arg = step[i][0], step[i][1]
        if what == "arrive":
            done[arg] += 1
        elif what.startswith("read "):
            read[what[5:]] = arg
        elif what == "gather block 0":
            assert read["KV"] == arg - 1, f"KV_s refilled for block {arg} before block {arg - 1}'s reads: {rows}"
        elif what == "load Q and dO":
            assert read["Q and dO"] == arg - 1, f"Q_s refilled for block {arg} before block {arg - 1}'s reads: {rows}"
        step[i] = next(agents[i], None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    a = parser.parse_args()
    rng = random.Random(a.seed)
    for _ in range(a.schedules):
        run([rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(rng.randint(1, 6))], rng)
    print(f"{a.schedules} schedules: no deadlock, every wait on its own phase, no buffer refilled early")


if __name__ == "__main__":
    main()
