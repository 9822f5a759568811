"""Can clusters of four use the SMs they leave idle? The fixed-mode main kernel
alone at H=128, with clusters of two, of four, and of four over most rows plus
clusters of two over the rest on a second stream (GPU only).

    python benchmarks/cluster_mix.py [--S 4096] [--S_kv 8192] [--L 2048] [--repeats 7] [--shares 0.05,0.09,0.14]

On the H200 a launch of clusters of four keeps 120 of the 132 SMs busy
(cluster_occupancy.py), so at H=128 one such launch (each element added once)
is slower than two launches of clusters of two (each element added twice).
Launched first, the four-CTA clusters take their 120 SMs; a two-CTA launch
over a share of the rows, on another stream, can run its clusters on the
idle SMs meanwhile. Integer adds commute, so the launches may overlap in
any way; with a fixed split (a function of the shapes) the bits stay the
same on every run. The inputs are random, with row scale 1: only the time
means anything here.

Measured on the H200 at S=4096, S_kv=8192, L=2048 (median of 5): C=2 49.50
ms, C=4 51.58, C=4 with C=2 over 6 % of the rows 48.67 (0.983), over 10 %
48.72, over 15 % 48.94. The mix gains 1.7 % of the main kernel; the wrapper
does not use it (a second stream and its events in every call).
"""

import argparse
import statistics

import torch

from mqa_bwd import kernels, launch
from mqa_bwd.bench import time_interleaved

H, GROUP = 128, 32


def inputs(S, S_kv, L, seed=0, device="cuda", scale=1.0):
    """(main-kernel tensors, int64 dKV accumulator, row scales) for one batch element."""
    g = torch.Generator(device=device).manual_seed(seed)
    visible = torch.arange(S, device=device) + (S_kv - S) + 1
    t = dict(
        q=torch.randn((S, H, 576), device=device, generator=g).bfloat16(),
        kv=torch.randn((S_kv, 576), device=device, generator=g).bfloat16(),
        grad_out=torch.randn((S, H, 512), device=device, generator=g).bfloat16(),
        indices=(torch.rand((S, L), device=device, generator=g) * visible.view(S, 1)).to(torch.int32),
        lse2=torch.full((S, H), 30.0, device=device),
        delta=torch.randn((S, H), device=device, generator=g),
        dq=torch.empty((S, H, 576), dtype=torch.bfloat16, device=device),
        allowance=torch.full((S, H), float("inf"), device=device),
        flag=torch.zeros((S,), dtype=torch.int32, device=device),
    )
    return t, torch.zeros((S_kv, 576), dtype=torch.int64, device=device), torch.full((S_kv,), scale, device=device)


def launches(t, dkv, row_scale, rows: slice, cluster: int, launcher=None):
    """The fixed-mode launches covering all H heads of ``rows`` with clusters of ``cluster`` groups."""
    launcher = launcher or launch.TileLangLauncher(deterministic=True)
    part = {k: v[rows] for k, v in t.items() if k != "kv"}
    for g, size in kernels.cluster_launches(H // GROUP, largest=cluster):
        launcher.main_bwd(part["q"], t["kv"], part["grad_out"], part["indices"], part["lse2"], part["delta"], part["dq"],
                          dkv, sm_scale=576**-0.5, mode="fixed", heads=GROUP, head_base=g * GROUP, cluster=size,
                          row_scale=row_scale, allowance=part["allowance"], flag=part["flag"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("S", 4096), ("S_kv", 8192), ("L", 2048), ("repeats", 7)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--shares", default="0.05,0.09,0.14", help="fractions of the rows given to the clusters of two")
    a = parser.parse_args()
    S = a.S
    t, dkv, row_scale = inputs(S, a.S_kv, a.L)
    side, other = torch.cuda.Stream(), torch.cuda.Stream()

    def mixed(share):
        split = S - int(S * share)

        def call():
            here = torch.cuda.current_stream()
            side.wait_stream(here)
            other.wait_stream(here)
            with torch.cuda.stream(side):
                launches(t, dkv, row_scale, slice(0, split), 4)
            with torch.cuda.stream(other):
                launches(t, dkv, row_scale, slice(split, S), 2)
            here.wait_stream(side)
            here.wait_stream(other)
        return call

    calls = {"C=2": lambda: launches(t, dkv, row_scale, slice(0, S), 2),
             "C=4": lambda: launches(t, dkv, row_scale, slice(0, S), 4)}
    for share in map(float, a.shares.split(",")):
        calls[f"C=4 + C=2 over {share:.0%} of rows"] = mixed(share)

    times = time_interleaved(calls, repeats=a.repeats)
    print(f"S={a.S} S_kv={a.S_kv} H={H} L={a.L}: the main kernel alone, median of {a.repeats} (interleaved)")
    base = statistics.median(times["C=2"])
    for name, ms in times.items():
        print(f"  {name:<28} {statistics.median(ms):8.2f} ms  min {min(ms):8.2f}  /C=2 {statistics.median(ms) / base:.3f}")


if __name__ == "__main__":
    main()
