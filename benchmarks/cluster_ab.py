"""A/B (branch exp/cluster-st-async): fixed design with head-group clusters of 1 and 2 vs the atomic control, interleaved in one process; reruns bitwise, dkv distance from the unclustered path."""
import statistics, sys
import torch
import mqa_bwd.kernels as K
from mqa_bwd import wrapper
from mqa_bwd.launch import TileLangLauncher
from mqa_bwd.bench import production_inputs

def once(args, det, largest):
    K.MAX_CLUSTER = largest
    launcher = TileLangLauncher(det)
    p = wrapper.validate(*args, None, None, launcher)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); out = wrapper.run(p, *args[:-1], args[-1], launcher); e.record(); e.synchronize()
    return s.elapsed_time(e), out

for shape in ((4096, 8192, 64, 2048), (4096, 8192, 128, 2048), (8192, 8192, 64, 640)):
    S, S_kv, H, L = shape
    args = production_inputs(1, S, S_kv, H, L)
    variants = [("fixed C<=1", True, 1), ("fixed C<=2", True, 2), ("atomic", False, 1)]
    if H == 64:
        variants = [v for v in variants if v[0] != "fixed C<=4"]
    outs = {}
    for name, det, c in variants:
        _, outs[name] = once(args, det, c)
        _, again = once(args, det, c)
        if det:
            print(name, "rerun bitwise:", all(torch.equal(a, b) for a, b in zip(outs[name], again)))
    times = {v[0]: [] for v in variants}
    for _ in range(7):
        for name, det, c in variants:
            times[name].append(once(args, det, c)[0])
    base = statistics.median(times["atomic"])
    for name, v in times.items():
        m = statistics.median(v)
        print(f"S={S} H={H} L={L} {name:<12} median {m:7.2f} ms min {min(v):7.2f}  /atomic {m / base:.3f}")
    ref = outs["fixed C<=1"]
    for name in outs:
        d = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(outs[name], ref)]
        print(f"   {name:<12} rel L2 vs fixed C<=1 (dq, dkv, dsink): " + ", ".join(f"{x:.2e}" for x in d))
K.MAX_CLUSTER = 2
