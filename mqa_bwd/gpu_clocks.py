"""What the GPU's clocks did while calls were timed: NVML samples, each counted to the call it fell in.

A ratio of two backends' times says something about the kernels only where both ran at the
same clocks. A long kernel can hold the GPU at its power cap, so one backend's calls may run at a
lower SM clock than another's in the same interleaved run; the bench then shows each backend's
SM clock over its own calls and the reasons NVML gave for holding clocks down.

The sampler reads NVML (libnvidia-ml, which every NVIDIA driver installs) through ctypes from a
background thread, every ``period_s``; each NVML call releases the GIL, so the thread takes
little from the host work it watches. Where NVML cannot be loaded (no driver, CPU CI), the
sampler says why and records nothing.
"""

import ctypes
import dataclasses
import statistics
import threading
import time
from typing import Callable

#: NVML's clock event reasons (nvmlClocksEventReasons; nvidia-smi's clocks_event_reasons), by bit.
REASONS = {
    0x1: "idle",
    0x2: "applications clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
    0x100: "display clocks setting",
}
#: The reasons that mean the GPU ran below the clocks it would otherwise have run at: not idle,
#: and not a clock someone set on purpose.
SLOWDOWNS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
#: Seconds between two samples: shorter than the shortest call the bench times.
PERIOD_S = 0.002


@dataclasses.dataclass(frozen=True)
class Sample:
    """One NVML reading: ``at`` in time.monotonic() seconds, when it was taken."""

    at: float
    sm_mhz: int
    #: NVML's power reading, which Hopper averages over about a second: it lags a short call
    power_w: float
    temperature_c: int
    reasons: int


def reason_names(mask: int) -> tuple:
    """The REASONS a bit mask names, lowest bit first; an unknown bit by its value."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    return tuple(names) + ((f"0x{unknown:x}",) if unknown else ())


@dataclasses.dataclass(frozen=True)
class ClockSummary:
    """The samples that fell inside some calls: the SM clock's median and range, the largest
    power and temperature, and every clock event reason seen (REASONS' names); with the GPU's
    top SM clock and enforced power limit where the reader knows them."""

    samples: int
    sm_mhz_median: float
    sm_mhz_min: int
    sm_mhz_max: int
    power_w_max: float
    temperature_c_max: int
    reasons: tuple
    sm_mhz_top: int | None = None
    power_limit_w: float | None = None

    @property
    def slowed(self) -> bool:
        """Whether the calls ran below the top clock, by their median, while some sample gave a
        reason in SLOWDOWNS. NVML raises the power-cap reason at the top clock too."""
        held = any(name in self.reasons for bit, name in REASONS.items() if bit & SLOWDOWNS)
        return held and (self.sm_mhz_top is None or self.sm_mhz_median < self.sm_mhz_top)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(samples, spans, sm_mhz_top=None, power_limit_w=None) -> ClockSummary | None:
    """The samples taken inside any of ``spans`` ((start, end) time.monotonic() pairs), as one
    ClockSummary; None where none was."""
    inside = [s for s in samples if any(start <= s.at <= end for start, end in spans)]
    if not inside:
        return None
    mask = 0
    for s in inside:
        mask |= s.reasons
    mhz = [s.sm_mhz for s in inside]
    return ClockSummary(len(inside), statistics.median(mhz), min(mhz), max(mhz), max(s.power_w for s in inside),
                        max(s.temperature_c for s in inside), reason_names(mask), sm_mhz_top, power_limit_w)


class NvmlError(RuntimeError):
    pass


class Nvml:
    """The few NVML calls the sampler makes, on one device (its UUID, as NVML spells it:
    "GPU-..."), through ctypes."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, uuid: str, library: str = "libnvidia-ml.so.1"):
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as e:
            raise NvmlError(f"cannot load {library} ({e})") from None
        self._call("nvmlInit_v2")
        self._device = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", uuid.encode(), ctypes.byref(self._device))
        top, limit = ctypes.c_uint(), ctypes.c_uint()
        self._call("nvmlDeviceGetMaxClockInfo", self._device, self.NVML_CLOCK_SM, ctypes.byref(top))
        self._call("nvmlDeviceGetEnforcedPowerLimit", self._device, ctypes.byref(limit))
        self.sm_mhz_top, self.power_limit_w = top.value, limit.value / 1000.0
        # The reasons' call was renamed in driver 535; the old name stays exported.
        self._reasons_call = next((name for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                                                     "nvmlDeviceGetCurrentClocksThrottleReasons")
                                   if hasattr(self._lib, name)), None)

    def _call(self, name: str, *args) -> None:
        status = getattr(self._lib, name)(*args)
        if status != 0:
            raise NvmlError(f"{name} returned NVML error {status}")

    def read(self) -> Sample:
        mhz, milliwatts, celsius = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        reasons = ctypes.c_ulonglong()
        at = time.monotonic()
        self._call("nvmlDeviceGetClockInfo", self._device, self.NVML_CLOCK_SM, ctypes.byref(mhz))
        self._call("nvmlDeviceGetPowerUsage", self._device, ctypes.byref(milliwatts))
        self._call("nvmlDeviceGetTemperature", self._device, self.NVML_TEMPERATURE_GPU, ctypes.byref(celsius))
        if self._reasons_call is not None:
            self._call(self._reasons_call, self._device, ctypes.byref(reasons))
        return Sample(at, mhz.value, milliwatts.value / 1000.0, celsius.value, reasons.value)

    def close(self) -> None:
        self._lib.nvmlShutdown()


def current_device_uuid() -> str:
    """NVML's UUID of torch's current CUDA device (CUDA_VISIBLE_DEVICES already applied)."""
    import torch

    return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"


class Sampler:
    """A context manager that samples in a background thread while its block runs. ``open``
    makes the reader (a callable returning a Sample, with a ``close``): NVML on the current
    device unless given. Where it fails, ``unavailable`` says why and ``samples`` stays empty:
    the block runs all the same."""

    def __init__(self, open_reader: Callable | None = None, period_s: float = PERIOD_S):
        self._open = open_reader or (lambda: Nvml(current_device_uuid()))
        self.period_s = period_s
        self.samples: list = []
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread = None
        self._reader = None

    def __enter__(self) -> "Sampler":
        try:
            self._reader = self._open()
        except Exception as e:  # no driver, no NVML, no such device: nothing to sample
            self.unavailable = f"no GPU clock samples: {e}"
            return self
        self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._reader.read())
            except Exception as e:
                self.unavailable = f"GPU clock samples stopped: {e}"
                return
            self._stop.wait(self.period_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._reader is not None:
            self._reader.close()

    def summary(self, spans) -> ClockSummary | None:
        return summarize(self.samples, spans, getattr(self._reader, "sm_mhz_top", None),
                         getattr(self._reader, "power_limit_w", None))
