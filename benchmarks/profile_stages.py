"""Where the time goes: per-kernel CUDA-event times of one backward call, per
design, plus probes that drop a stage (the main kernel without any dKV output).

    python benchmarks/profile_stages.py [--H 64] [--S 4096] [--S_kv 8192] [--L 2048]

Prints one table; the differences between rows are the stage costs.
"""

import argparse
import collections
import statistics

import torch

from mqa_bwd import wrapper
from mqa_bwd.bench import flops, production_inputs
from mqa_bwd.launch import TileLangLauncher

KERNELS = ("delta", "mark_slots", "plan", "main_bwd", "dkv_reduce", "shard_fold", "dsink_reduce", "cast_bf16", "fixed_to_bf16")


class TimedLauncher(TileLangLauncher):
    """Records CUDA events around every launch; can swap the main kernel's mode (a probe)."""

    def __init__(self, deterministic=True, probe_mode=None):
        super().__init__(deterministic=deterministic)
        self.probe_mode = probe_mode
        self.events = collections.defaultdict(list)

    def _timed(self, name, fn, *args, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args, **kw)
        end.record()
        self.events[name].append((start, end))
        return result

    def delta(self, *a, **k):
        self._timed("delta", super().delta, *a, **k)

    def main_bwd(self, *a, mode, **k):
        if self.probe_mode is not None:
            mode = self.probe_mode
            if mode == "none":
                a = a[:7] + (torch.empty(1, device="cuda"),)
        self._timed("main_bwd", super().main_bwd, *a, mode=mode, **k)

    def dkv_reduce(self, *a, **k):
        self._timed("dkv_reduce", super().dkv_reduce, *a, **k)

    def shard_fold(self, *a, **k):
        self._timed("shard_fold", super().shard_fold, *a, **k)

    def dsink_reduce(self, *a, **k):
        self._timed("dsink_reduce", super().dsink_reduce, *a, **k)

    def mark_slots(self, *a, **k):
        self._timed("mark_slots", super().mark_slots, *a, **k)

    def plan(self, *a, **k):
        return self._timed("plan", super().plan, *a, **k)

    def fixed_to_bf16(self, *a, **k):
        self._timed("fixed_to_bf16", super().fixed_to_bf16, *a, **k)

    def cast_bf16(self, *a, **k):
        self._timed("cast_bf16", super().cast_bf16, *a, **k)

    def per_kernel_ms(self):
        torch.cuda.synchronize()
        return {name: sum(s.elapsed_time(e) for s, e in evs) for name, evs in self.events.items()}


def run_variant(args, label, deterministic, design=None, probe_mode=None, repeats=5):
    totals = []
    stages = collections.defaultdict(list)
    for i in range(repeats + 1):
        launcher = TimedLauncher(deterministic, probe_mode)
        p = wrapper.validate(*args, None, None, launcher, dkv_design=design)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        wrapper.run(p, *args[:-1], args[-1], launcher)
        end.record()
        end.synchronize()
        if i == 0:
            continue  # warm-up (compilation, allocator)
        totals.append(start.elapsed_time(end))
        for name, ms in launcher.per_kernel_ms().items():
            stages[name].append(ms)
    med = {name: statistics.median(v) for name, v in stages.items()}
    return label, statistics.median(totals), med


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--S", type=int, default=4096)
    parser.add_argument("--S_kv", type=int, default=8192)
    parser.add_argument("--H", type=int, default=64)
    parser.add_argument("--L", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    args = production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    variants = [
        ("atomic", False, None, None),
        ("det fixed (default)", True, "fixed", None),
        ("det shards", True, "shards", None),
        ("det slots", True, "slots", None),
        ("probe: main without dKV", False, None, "none"),
    ]
    rows = [run_variant(args, label, det, design, probe, a.repeats) for label, det, design, probe in variants]
    work = flops(a.B, a.S, a.H, a.L, 576, 512)
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}: per-kernel median ms (sum over launches)")
    # "other": the call's time outside the kernels (torch layout ops, the
    # fixed-point scales, allocation).
    print(f"{'variant':<26} {'total':>8} {'TFLOP/s':>8} " + " ".join(f"{k:>13}" for k in KERNELS + ("other",)))
    for label, total, med in rows:
        other = total - sum(med.values())
        print(f"{label:<26} {total:>8.2f} {work / (total * 1e-3) / 1e12:>8.1f} "
              + " ".join(f"{med.get(k, 0.0):>13.2f}" for k in KERNELS) + f" {other:>13.2f}")


if __name__ == "__main__":
    main()
