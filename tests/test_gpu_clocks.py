"""The bench's GPU clock samples (mqa_bwd.gpu_clocks): decoding, counting samples to calls, the
sampler's thread, and what the table shows. CPU, with a fake reader; the last test reads NVML
on the H200."""

import json
import threading
import time

import pytest

from mqa_bwd import bench, gpu_clocks
from mqa_bwd.gpu_clocks import Sample, Sampler, reason_names, summarize

from hopper import NEEDS_HOPPER


def test_reason_names_decode_each_bit_and_keep_an_unknown_one():
    assert reason_names(0) == ()
    assert reason_names(0x4 | 0x1) == ("idle", "SW power cap")
    assert reason_names(0x40 | 0x1000) == ("HW thermal slowdown", "0x1000")


def test_samples_count_only_inside_the_calls_spans():
    samples = [Sample(0.5, 1980, 300.0, 40, 0x1), Sample(1.2, 1755, 690.0, 60, 0x4), Sample(1.8, 1650, 700.0, 62, 0x4),
               Sample(2.5, 1980, 200.0, 45, 0x0), Sample(3.1, 1900, 650.0, 58, 0x0)]
    summary = summarize(samples, [(1.0, 2.0), (3.0, 3.5)], sm_mhz_top=1980, power_limit_w=700.0)
    assert summary == gpu_clocks.ClockSummary(3, 1755, 1650, 1900, 700.0, 62, ("SW power cap",), 1980, 700.0)
    assert summary.slowed and summarize(samples, [(1.0, 2.0)]).slowed  # the top clock unknown: the reason decides
    assert not summarize(samples, [(3.0, 3.5)]).slowed  # no reason at all
    assert not summarize([Sample(1.0, 1980, 1.0, 1, 0x1 | 0x2)], [(0, 2)]).slowed  # idle and a set clock are not slowdowns
    # NVML gives the power-cap reason at the top clock too: that is not a slowdown.
    at_top = [Sample(1.0, 1980, 200.0, 50, 0x4), Sample(1.1, 1980, 200.0, 50, 0x4), Sample(1.2, 1950, 200.0, 50, 0x4)]
    assert not summarize(at_top, [(0, 2)], sm_mhz_top=1980).slowed
    assert summarize(at_top[1:], [(0, 2)], sm_mhz_top=1980).slowed  # the median, 1965, is below it
    assert summarize(samples, [(5.0, 6.0)]) is None
    assert summarize([], [(0.0, 9.0)]) is None


class FakeReader:
    """A reader whose readings count up; it may fail on its n-th read."""

    def __init__(self, fail_at=None):
        self.reads, self.closed, self.fail_at = 0, False, fail_at

    def read(self):
        self.reads += 1
        if self.reads == self.fail_at:
            raise RuntimeError("the driver went away")
        return Sample(time.monotonic(), 1000 + self.reads, 100.0, 50, 0)

    def close(self):
        self.closed = True


def test_the_sampler_reads_while_its_block_runs_then_stops_and_closes():
    reader = FakeReader()
    # The span opens before the sampler starts: its thread may read before the block's first line
    # runs (a loaded machine), and those reads are the block's too.
    start = time.monotonic()
    with Sampler(lambda: reader, period_s=0.001) as sampler:
        while reader.reads < 5:
            time.sleep(0.001)
        end = time.monotonic()
    taken = reader.reads
    time.sleep(0.01)
    assert reader.reads == taken and reader.closed and sampler.unavailable is None
    assert not any(t.name == "gpu-clocks" for t in threading.enumerate())
    assert [s.sm_mhz for s in sampler.samples] == list(range(1001, 1001 + taken))
    assert sampler.summary([(start, end)]).samples >= 4


def test_a_sampler_that_cannot_start_or_stops_says_why_and_the_block_still_runs():
    def no_nvml():
        raise gpu_clocks.NvmlError("cannot load libnvidia-ml.so.1")

    ran = False
    with Sampler(no_nvml) as sampler:
        ran = True
    assert ran and sampler.samples == [] and sampler.unavailable == "no GPU clock samples: cannot load libnvidia-ml.so.1"
    reader = FakeReader(fail_at=3)
    with Sampler(lambda: reader, period_s=0.001) as sampler:
        while sampler.unavailable is None:
            time.sleep(0.001)
    assert len(sampler.samples) == 2 and sampler.unavailable == "GPU clock samples stopped: the driver went away"
    assert reader.closed


def test_nvml_names_the_library_it_cannot_load():
    with pytest.raises(gpu_clocks.NvmlError, match="no-such-nvml.so"):
        gpu_clocks.Nvml("GPU-0", library="no-such-nvml.so")


def test_interleaved_timing_records_each_calls_span(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    order = []
    # A timed call's "time" is its place among all calls (warm-ups included), so each time
    # says which call it came from.
    monkeypatch.setattr(bench, "event_time", lambda fn: (fn(), time.sleep(0.002), float(len(order)))[-1])
    calls = {"det": lambda: order.append("det"), "atomic": lambda: order.append("atomic")}
    spans = {}
    times = bench.time_interleaved(calls, warmup=1, repeats=3, spans=spans)
    assert order == ["det", "atomic"] + ["det", "atomic"] * 3
    # The warm-ups (calls 1 and 2) are not timed; each timed call goes to its own name, in order.
    assert times == {"det": [3.0, 5.0, 7.0], "atomic": [4.0, 6.0, 8.0]}
    assert {name: len(s) for name, s in spans.items()} == {"det": 3, "atomic": 3}
    flat = sorted(spans["det"] + spans["atomic"])
    assert all(start < end for start, end in flat) and all(a[1] <= b[0] for a, b in zip(flat, flat[1:]))


def test_the_table_stars_a_slowed_rows_clock_and_notes_why_through_json():
    slowed = dict(samples=4, sm_mhz_median=1700.5, sm_mhz_min=1650, sm_mhz_max=1980, power_w_max=699.6,
                  temperature_c_max=71, reasons=("SW power cap",), sm_mhz_top=1980, power_limit_w=700.0)
    steady = dict(slowed, sm_mhz_median=1980, sm_mhz_min=1980, reasons=())
    rows = [bench.Row(1, 64, 128, 16, 32, 576, 512, "tilelang", 2.0, 1.0, 0.5, clocks=slowed),
            bench.Row(1, 64, 128, 16, 32, 576, 512, "tilelang-atomic", 1.0, 1.0, 0.5, clocks=steady),
            bench.Row(1, 64, 128, 16, 32, 576, 512, "cudnn", 1.0, 1.0, 0.5)]
    again = [bench.Row(**r) for r in json.loads(bench.to_json(rows))["rows"]]
    for shown in (rows, again):
        cells = [line.split()[-1] for line in bench.table(shown).splitlines()]
        assert cells[:3] == ["MHz", "1700*", "1980"]
        assert bench.clock_notes(shown) == ("* B=1,S=64,S_kv=128,H=16,L=32 uniform, tilelang: SM 1650-1980 MHz (top 1980) "
                                            "over 4 samples, 700 W of a 700 W limit (NVML's average), 71 C; held down "
                                            "by SW power cap")
    unsampled = [bench.Row(**{**r.as_dict(), "clocks": None, "clocks_unavailable": "no GPU clock samples: why"})
                 for r in rows]
    assert bench.clock_notes(unsampled) == "no GPU clock samples: why"


@pytest.mark.gpu
@NEEDS_HOPPER
def test_nvml_samples_the_gpu_while_it_works():
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with Sampler() as sampler:
        start = time.monotonic()
        for _ in range(200):
            a @ a
        torch.cuda.synchronize()
        end = time.monotonic()
    assert sampler.unavailable is None, sampler.unavailable
    summary = sampler.summary([(start, end)])
    assert summary is not None and summary.samples >= 10, (summary, end - start)
    assert 500 <= summary.sm_mhz_min <= summary.sm_mhz_max <= summary.sm_mhz_top <= 3000
    assert 50 < summary.power_w_max and 100 < summary.power_limit_w <= 1500
    assert "idle" not in summary.reasons
