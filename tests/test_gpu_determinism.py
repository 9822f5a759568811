"""Determinism as docs/SPEC.md defines it, on the H200: every run, every process, whatever else runs on the GPU.

- Fresh processes: a capture replayed in three fresh processes (each with
  its own CUDA context, allocator history and kernel order) gives one SHA-256
  per output; the atomic control's dkv differs between two.
- Under load: the same call while a second process runs large matmuls, and
  while a second stream runs another backward, gives the bits of the idle
  GPU.
- Many reruns: 1000 at dsv32 H=64, H=128 and fleet (mqa_bwd.bench.SHAPES),
  1,000,000 at a small shape (CUDA-graph replays of 100 calls each), compared
  by checksums computed on the GPU, with no host synchronisation per run.

Each test also runs the atomic control ('tilelang-atomic') until it differs
from its own first run (a bounded number of runs) and asserts that it did:
the test's proof that it can fail. Figures (runs, mismatches, seconds) are
printed; run with -s to see them:

    pytest -s -m gpu tests/test_gpu_determinism.py
"""

import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from mqa_bwd import bench, capture, mqa_latent_sparse_bwd, repro  # noqa: E402
from properties.case import Case, to_framework  # noqa: E402
from properties.compare import OutputChecksums as Checksums  # noqa: E402

from hopper import ON_HOPPER  # noqa: E402

pytestmark = [*ON_HOPPER, pytest.mark.determinism]

RERUNS = 1000
SMALL_RUNS = 1_000_000
CALLS_PER_GRAPH = 100
#: Runs of the atomic control before the test gives up on seeing it drift.
ATOMIC_LIMIT = 200
#: About 4 ms a call: long enough to overlap with the load, short enough to run often.
LOAD_SHAPE = dict(B=1, S=1024, S_kv=8192, H=64, L=2048)
RUNS_UNDER_LOAD = 100
#: A small production-width case. Its cancelling query-row pairs leave batch 0's dkv a rounding
#: residue whose bits follow the order of the adds, so the atomic control drifts even here.
SMALL = Case(B=1, S=16, S_kv=64, H=16, L=64, d_k=576, d_v=512, sink="random", cancelling_rows=True, seed=7)
BENCH_SHAPES = [(f"dsv32 H={s['H']}", s) for s in bench.SHAPES["dsv32"]] + [("fleet", s) for s in bench.SHAPES["fleet"]]


class RunLog:
    """Per-run checksums kept on the device; compared with run 0's at the end (one synchronisation)."""

    def __init__(self, first_outputs, runs: int):
        self.checksum = Checksums(first_outputs)
        self.table = torch.zeros((runs, 3), dtype=torch.int64, device=first_outputs[0].device)
        self.runs = 0
        self.add(first_outputs)

    def add(self, outputs) -> None:
        self.table[self.runs] = self.checksum(outputs)
        self.runs += 1

    def mismatches(self) -> tuple:
        """(runs whose checksums differ from run 0's, [per output], distinct results per output)."""
        table = self.table[: self.runs]
        differs = table != table[0]
        return (int(differs.any(dim=1).sum()), [int(n) for n in differs.sum(dim=0)],
                [int(torch.unique(table[:, k]).numel()) for k in range(3)])


def _call(args, backend):
    return lambda: mqa_latent_sparse_bwd(*args, backend=backend)


def _runs_until_drift(call, limit: int = ATOMIC_LIMIT, check_every: int = 5) -> int | None:
    """The first run whose checksums differ from run 0's, within ``limit`` runs; None if none did."""
    log = RunLog(call(), limit)
    for run in range(1, limit):
        log.add(call())
        if run % check_every == 0 or run == limit - 1:
            differs = (log.table[1 : run + 1] != log.table[0]).any(dim=1)
            if bool(differs.any()):
                return 1 + int(torch.nonzero(differs)[0])
    return None


def _report(label, runs, mismatching, per_output, distinct, seconds, drift):
    print(f"\n{label}: {runs} runs, {mismatching} mismatching (dq/dkv/d_attn_sink {per_output}, distinct {distinct}), "
          f"{seconds:.1f} s; atomic control first differs at run {drift}")


# ---------------------------------------------------------------------------
# Many reruns
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("label, shape", BENCH_SHAPES, ids=[label.replace(" H=", "-H") for label, _ in BENCH_SHAPES])
def test_1000_reruns_are_bitwise_identical_and_the_atomic_control_drifts(label, shape):
    args = bench.production_inputs(**shape)
    call = _call(args, "tilelang")
    log = RunLog(call(), RERUNS)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(1, RERUNS):
        log.add(call())
    mismatching, per_output, distinct = log.mismatches()
    seconds = time.perf_counter() - start
    drift = _runs_until_drift(_call(args, "tilelang-atomic"))
    _report(label, log.runs, mismatching, per_output, distinct, seconds, drift)
    assert log.runs == RERUNS and mismatching == 0, f"{label}: {mismatching} of {RERUNS} runs differ ({per_output})"
    assert drift is not None, f"{label}: the atomic control was bitwise stable over {ATOMIC_LIMIT} runs"


def _graph_of_calls(call, reference, checksum, calls: int):
    """A CUDA graph of ``calls`` calls, each followed by its checksum, compared on the device with
    ``reference``: replaying it adds to the returned [3] counter the calls whose outputs differ."""
    mismatches = torch.zeros(3, dtype=torch.int64, device=reference.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch asks
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            mismatches += checksum(call()) != reference
    return graph, mismatches


@pytest.mark.slow
def test_a_million_reruns_at_a_small_shape_and_the_atomic_control_drifts():
    # CUDA-graph replays: the same kernels on the same buffers each time, so the
    # host's launch overhead is out of the way; whatever the GPU does in another
    # order (the atomic control's adds) still shows. Addresses and processes
    # are varied by the tests above and below.
    tensors = to_framework(SMALL.inputs(), "torch", "cuda")
    args = [tensors[k] for k in repro.SPEC_ARGS]
    call = _call(args, "tilelang")
    first = call()
    checksum = Checksums(first)
    reference = checksum(first)
    graph, mismatches = _graph_of_calls(call, reference, checksum, CALLS_PER_GRAPH)
    torch.cuda.synchronize()
    start = time.perf_counter()
    replays = SMALL_RUNS // CALLS_PER_GRAPH
    for _ in range(replays):
        graph.replay()
    per_output = [int(n) for n in mismatches.cpu()]  # the one synchronisation
    seconds = time.perf_counter() - start
    runs = replays * CALLS_PER_GRAPH
    atomic = _call(args, "tilelang-atomic")
    atomic_graph, atomic_mismatches = _graph_of_calls(atomic, checksum(atomic()), checksum, 10)
    drift = None
    for replay in range(ATOMIC_LIMIT):
        atomic_graph.replay()
        if bool((atomic_mismatches > 0).any()):
            drift = f"graph replay {replay} (of 10 calls)"
            break
    _report(f"small shape {SMALL.to_json()}", runs, max(per_output), per_output, "-", seconds, drift)
    assert runs == SMALL_RUNS and per_output == [0, 0, 0], f"{per_output} of {runs} runs differ (dq, dkv, d_attn_sink)"
    assert drift is not None, f"the atomic control was bitwise stable over {ATOMIC_LIMIT * 10} graph-replayed runs"


# ---------------------------------------------------------------------------
# Under load
# ---------------------------------------------------------------------------


#: A second process that keeps the GPU busy with large bf16 matmuls for ARGV[1] seconds.
LOAD_SCRIPT = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("busy", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize()
"""


def _under_load(label, args, start_load, load_running):
    """The call on the idle GPU, then RUNS_UNDER_LOAD times after ``start_load()``, compared with the
    idle run; then the atomic control, RUNS_UNDER_LOAD times under the same load, compared with its first."""
    call = _call(args, "tilelang")
    log = RunLog(call(), 1 + RUNS_UNDER_LOAD)  # run 0: the idle GPU
    torch.cuda.synchronize()
    start_load()
    start = time.perf_counter()
    for _ in range(RUNS_UNDER_LOAD):
        log.add(call())
    mismatching, per_output, _ = log.mismatches()
    seconds = time.perf_counter() - start
    atomic_call = _call(args, "tilelang-atomic")
    atomic = RunLog(atomic_call(), RUNS_UNDER_LOAD)
    for _ in range(1, RUNS_UNDER_LOAD):
        atomic.add(atomic_call())
    atomic_mismatching, atomic_per_output, _ = atomic.mismatches()
    assert load_running(), f"{label}: the load ended before the runs did"
    print(f"\n{label}: {RUNS_UNDER_LOAD} runs under load against the idle run, {mismatching} mismatching "
          f"({per_output}), {seconds:.1f} s; atomic control: {atomic_mismatching} of {RUNS_UNDER_LOAD - 1} "
          f"differ from its first ({atomic_per_output})")
    assert mismatching == 0, f"{label}: {mismatching} runs under load differ from the idle GPU's ({per_output})"
    assert atomic_mismatching > 0, f"{label}: the atomic control did not drift under load either"


@pytest.mark.slow
def test_same_bits_while_another_process_keeps_the_gpu_busy():
    args = bench.production_inputs(**LOAD_SHAPE)
    load = []

    def start_load():
        load.append(subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, "120"], stdout=subprocess.PIPE, text=True))
        line = load[0].stdout.readline()  # after its CUDA context and operands exist
        assert line.strip() == "busy", f"the load process did not start: {line!r} (exit {load[0].poll()})"

    try:
        _under_load("second process running 8192^3 bf16 matmuls", args, start_load, lambda: load[0].poll() is None)
    finally:
        if load:
            load[0].kill()
            load[0].wait()


@pytest.mark.slow
def test_same_bits_while_a_second_stream_runs_another_backward():
    args = bench.production_inputs(**LOAD_SHAPE)
    other = bench.production_inputs(**LOAD_SHAPE, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    stop, calls, threads = threading.Event(), [], []

    def busy():
        with torch.cuda.stream(side):  # the current stream is per thread
            while not stop.is_set():
                mqa_latent_sparse_bwd(*other, backend="tilelang")
                calls.append(1)
                if len(calls) % 4 == 0:
                    side.synchronize()  # keep the side queue a few calls deep

    def start_load():
        threads.append(threading.Thread(target=busy, daemon=True))
        threads[0].start()
        while not calls:
            time.sleep(0.01)

    try:
        _under_load("second stream running another backward", args, start_load, lambda: threads[0].is_alive())
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        side.synchronize()
    print(f"  the second stream ran {len(calls)} backward calls meanwhile")


# ---------------------------------------------------------------------------
# Fresh processes
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_fresh_processes_give_the_same_bits_and_the_atomic_control_does_not(tmp_path):
    args = bench.production_inputs(B=1, S=512, S_kv=8192, H=64, L=2048)
    path = capture.save(tmp_path / "step.safetensors", **dict(zip(repro.SPEC_ARGS, args)))
    source = repro.load_source(path)
    start = time.perf_counter()
    fixed = repro.replay_in_processes(source, repro.resolve(None, "tilelang"), 3)
    seconds = time.perf_counter() - start
    atomic = repro.replay_in_processes(source, repro.resolve(None, "tilelang-atomic"), 2)
    print(f"\nfresh processes: {len(fixed.answers)} with 'tilelang', distinct per output "
          f"{[len(fixed.groups(n)) for n in repro.OUTPUT_NAMES]}, {seconds:.1f} s; 'tilelang-atomic' in 2: "
          f"{[len(atomic.groups(n)) for n in repro.OUTPUT_NAMES]}")
    assert fixed.ok, (fixed.problems, fixed.differing)
    assert not atomic.problems and "dkv" in atomic.differing, "the atomic control gave one dkv in two processes"
