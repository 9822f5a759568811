"""How long the host takes to enqueue one backward call, and where (GPU).

    python benchmarks/host_overhead.py [--H 64] [--S 4096] [--S_kv 8192] [--L 2048] [--timeline] [--profile-launch 15]
        [--profile-call 30]

A call's time as the bench measures it (events around wrapper.run) includes the
GPU's idle time while the host is still enqueuing what comes before the main
kernel: the kernels before it are short, so the GPU waits for the host. It prints
first what one launch costs the host, by kind (a torch op, TileLang kernels through
the launcher and called directly; with --profile-launch, the functions a direct launch
spends that time in), then what each step of a public call before the wrapper's own work
costs the host (the edge, the launcher, validation), then, per design (deterministic default,
atomic control), on an idle GPU:

- enqueue: host wall time of wrapper.run, without synchronising;
- to main: host time until the first main_bwd launch has been enqueued;
- GPU: event time of the call (what the bench reports);
- queued: event time a call of calls enqueued back to back behind a spin, so that the host
  runs ahead and the GPU never waits for it (bench.queued_time, the bench's queued column: the
  GPU's own pace; the difference from GPU is what the host's enqueuing costs a call timed alone);
- public: event time of the public function's call (validation and the edge included),
  alone, as ``mqa-bwd bench`` times it;
- the launcher's methods of the last call: when each starts, how long it takes
  on the host, and the host time since the previous one (the wrapper's own
  Python and torch ops);
- with --timeline, one call's timeline from the torch profiler: every host op and runtime
  call (cudaLaunchKernel, synchronisations, ...) and every GPU kernel, with its
  start relative to the call's and its duration, in microseconds: where the
  host spends the time the GPU waits;
- with --profile-call N, the N functions where a public call spends most host time (cProfile).
"""

import argparse
import cProfile
import pstats
import time

import torch

from mqa_bwd import bench, launch
from mqa_bwd import kernels as K


class HostClock(launch.TileLangLauncher):
    """The TileLang launcher, noting the host time each of its methods starts and ends (marks)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.marks = []

    @property
    def first_main(self):
        return next((end for name, _, end in self.marks if name == "main_bwd"), None)


def _timed(name):
    base = getattr(launch.TileLangLauncher, name)

    def method(self, *args, **kw):
        start = time.perf_counter()
        result = base(self, *args, **kw)
        self.marks.append((name, start, time.perf_counter()))
        return result

    return method


for _name in ("empty", "zeros", "zeros_together", "sorted_slots", "row_blocks", "delta", "main_bwd", "dsink_reduce", "mark_slots", "plan",
              "lanes_failed", "zero_gated", "poisoned_batches", "cast_bf16", "fixed_to_bf16", "lanes_to_bf16"):
    setattr(HostClock, _name, _timed(_name))


def print_timeline(call, width: int) -> None:
    """One call under the torch profiler: host ops (top level and runtime calls) and GPU kernels in
    start order, microseconds from the call's first event."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    rows = []
    for e in prof.events():
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        top_level = e.cpu_parent is None or e.name.startswith("cuda")
        if on_gpu or top_level:
            rows.append((e.time_range.start, e.time_range.end - e.time_range.start, "GPU" if on_gpu else "host", e.name))
    rows.sort()
    t0 = rows[0][0]
    for start, length, where, name in rows:
        if where == "GPU" or length >= 5 or name.startswith("cuda"):
            print(f"  {start - t0:9.1f} us  {length:8.1f}  {where:<4} {name[:width]}")


def print_launch_costs(calls: int = 200, profile_top: int = 0) -> None:
    """Host microseconds a launch of each kind costs, alone: a torch elementwise op and two
    TileLang kernels through the launcher (dsink_reduce, 2 tensors; fixed_to_bf16, 4) and the
    second without it, on tiny tensors, so that the GPU is never the limit; with ``profile_top``,
    the functions where a direct launch spends its host time."""
    x = torch.zeros((64, 64), device="cuda")
    out = torch.empty((64,), device="cuda")
    tilelang = launch.TileLangLauncher(True)
    acc, scale, dst = (torch.zeros((16, 576), dtype=torch.int64, device="cuda"), torch.ones(16, device="cuda"),
                       torch.empty((16, 576), dtype=torch.bfloat16, device="cuda"))
    poisoned = torch.zeros((1,), dtype=torch.int32, device="cuda")
    kernel = K.compiled(K.KernelConfig("fixed_to_bf16", (576,)))
    kinds = {
        "torch add": lambda: torch.add(x, 1.0, out=x),
        "TileLang dsink_reduce (2 tensors)": lambda: tilelang.dsink_reduce(x, out),
        "TileLang fixed_to_bf16 (4 tensors)": lambda: tilelang.fixed_to_bf16(acc, scale, poisoned, dst),
        "the same kernel, called directly": lambda: kernel(acc, scale, poisoned, dst, 16),
    }
    for name, fn in kinds.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"   {name:<36} {(t1 - t0) / calls * 1e6:7.1f} us a launch on the host")
    if profile_top:
        print(f"   where a direct launch's host time goes ({calls} launches, cProfile, by own time):")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            kernel(acc, scale, dst)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile_top)


def print_front_costs(args, calls: int = 200) -> None:
    """Host microseconds of each step a public call takes before the wrapper's run (the
    edge, the launcher, validation), and of the whole call without and with them."""
    from mqa_bwd import wrapper
    from mqa_bwd.backends import get_launcher

    launcher = launch.TileLangLauncher(True)
    framework, tensors = wrapper.torch_inputs(*args[:7])
    problem = wrapper.validate(*tensors, args[7], None, None, launcher, framework=framework, design=True)
    steps = {
        "torch_inputs (the edge)": lambda: wrapper.torch_inputs(*args[:7]),
        "get_launcher": lambda: get_launcher("tilelang", tensors[0].device),
        "validate": lambda: wrapper.validate(*tensors, args[7], None, None, launcher, framework=framework, design=True),
        "run (enqueue, no validation)": lambda: wrapper.run(problem, *tensors, args[7], launcher),
        "backward_with (validate, then run)": lambda: wrapper.backward_with(launcher, *tensors, args[7]),
        "public call (enqueue)": lambda: wrapper.mqa_latent_sparse_bwd(*args),
    }
    for name, fn in steps.items():
        n = calls if name.startswith(("torch", "get", "validate")) else 10
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
            if n == 10:
                torch.cuda.synchronize()
        print(f"   {name:<36} {total / n * 1e6:7.1f} us on the host")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_shape_arguments(parser, repeats=None)
    parser.add_argument("--top", type=int, default=70, help="characters of each name")
    parser.add_argument("--timeline", action="store_true", help="also print a profiled call's timeline")
    parser.add_argument("--profile-launch", type=int, default=0, metavar="N",
                        help="also print the N functions where a TileLang launch spends most host time")
    parser.add_argument("--profile-call", type=int, default=0, metavar="N",
                        help="also print the N functions where a public call spends most host time")
    a = parser.parse_args()
    print("== launch costs")
    print_launch_costs(profile_top=a.profile_launch)
    args = bench.production_inputs(a.B, a.S, a.S_kv, a.H, a.L)
    print(f"B={a.B} S={a.S} S_kv={a.S_kv} H={a.H} L={a.L}")
    print("== a public call's steps (deterministic)")
    print_front_costs(args)
    for label, deterministic in (("deterministic", True), ("atomic", False)):
        launcher = HostClock(deterministic)
        call = bench.prepared_wrapper_call(args, launcher)
        for _ in range(3):
            call()
        enqueue, to_main, gpu = [], [], []
        for _ in range(10):
            torch.cuda.synchronize()
            launcher.marks = []
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start_event.record()
            call()
            end_event.record()
            t1 = time.perf_counter()
            end_event.synchronize()
            enqueue.append((t1 - t0) * 1e3)
            to_main.append((launcher.first_main - t0) * 1e3)
            gpu.append(start_event.elapsed_time(end_event))
        marks = list(launcher.marks)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        queued = [bench.queued_time(call) for _ in range(5)]
        public = bench.backend_call("tilelang" if deterministic else "tilelang-atomic", args)
        alone = [bench.event_time(public) for _ in range(10)]
        print(f"== {label}: enqueue {med(enqueue):.3f} ms, to the first main launch {med(to_main):.3f} ms, "
              f"call (events) {med(gpu):.3f} ms, queued {med(queued):.3f} ms a call, public call {med(alone):.3f} ms")
        print("   the last call's launcher methods (us from the call's start: start, length; then the host time")
        print("   since the previous method ended, spent in the wrapper's own code and torch ops):")
        previous = t0
        for name, start, end in marks:
            print(f"   {(start - t0) * 1e6:8.1f} {(end - start) * 1e6:7.1f}  {name:<14} after {(start - previous) * 1e6:7.1f}")
            previous = end
        if a.timeline:
            print_timeline(call, a.top)
        if a.profile_call:
            print("   where a public call's host time goes (20 calls, cProfile; by own time, then cumulative):")
            profiler = cProfile.Profile()
            for _ in range(20):
                torch.cuda.synchronize()
                profiler.enable()
                public()
                profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(a.profile_call)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(a.profile_call)


if __name__ == "__main__":
    main()
