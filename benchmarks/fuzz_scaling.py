"""`mqa-bwd fuzz` with one worker, then with N, for the same time; one of the N killed mid-call.

    python benchmarks/fuzz_scaling.py --minutes 3 --workers 2 [--backend tilelang] [--json out.json]

What it shows, from outside the fuzz driver (nothing in mqa_bwd is changed for it):

- each worker's GPU: the CUDA_VISIBLE_DEVICES its process was started with and
  the device nvidia-smi lists for its pid;
- cases per minute per worker and in total, for both runs, and the ratio of the
  N-worker total to the one-worker total (the scaling ratio);
- the kill: once the run is half over, the first worker caught inside a call
  (an ``inflight-<worker>-<pid>`` record in the failures folder) gets SIGKILL;
  its record must become ``crash-*.safetensors``, ``mqa-bwd repro`` must replay
  it, and the other workers must keep adding cases after the kill.

Counts come from the progress files the fuzz plugin writes (mqa_bwd.fuzz), read
every second from the driver's temporary folder while the run goes.
"""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

POLL_S = 1.0


def worker_environment(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def gpu_of_pids() -> dict:
    """pid -> GPU UUID of the compute processes nvidia-smi lists (empty without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            found[int(parts[0])] = parts[1]
    return found


class Monitor:
    """Polls the newest fuzz run's progress files: the last view of each (worker, pid)."""

    def __init__(self, started: float):
        self.started = started
        self.processes = {}  # (worker, pid) -> {"cases", "first_seen", "last_seen", "cases_at": [(t, cases)]}
        self.devices = {}  # pid -> {"CUDA_VISIBLE_DEVICES": ..., "gpu_uuid": ...}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _files(self):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), "mqa-bwd-fuzz-*", "round*", "*.json")):
            try:
                if os.stat(path).st_mtime >= self.started:
                    yield path
            except OSError:
                continue

    def _run(self):
        polls = 0
        while not self._stop.is_set():
            self.poll(smi=polls % 5 == 0)
            polls += 1
            self._stop.wait(POLL_S)
        self.poll(smi=False)

    def poll(self, smi: bool) -> None:
        now = time.time()
        gpus = gpu_of_pids() if smi else {}
        for path in self._files():
            try:
                data = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError):
                continue
            worker, pid = data.get("worker"), data.get("pid")
            if worker in (None, "controller"):
                continue
            cases = sum(t.get("cases", 0) for t in data.get("tests", {}).values())
            rec = self.processes.setdefault((worker, pid), {"cases": 0, "first_seen": now, "cases_at": []})
            if cases != rec["cases"]:
                rec["cases_at"].append((now, cases))
            rec["cases"], rec["last_seen"] = cases, now
            device = self.devices.setdefault(pid, {})
            if "CUDA_VISIBLE_DEVICES" not in device:
                env = worker_environment(pid)
                if env:
                    device["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "(unset)")
            if pid in gpus:
                device["gpu_uuid"] = gpus[pid]

    def per_worker(self) -> dict:
        """worker -> cases over all its processes (a killed worker is restarted under a new pid)."""
        totals = {}
        for (worker, _pid), rec in self.processes.items():
            totals[worker] = totals.get(worker, 0) + rec["cases"]
        return totals

    def cases_after(self, moment: float, exclude_pid=None) -> int:
        """Cases the processes other than ``exclude_pid`` added after ``moment``."""
        added = 0
        for (_worker, pid), rec in self.processes.items():
            if pid == exclude_pid:
                continue
            before = max([c for t, c in rec["cases_at"] if t <= moment], default=0)
            added += rec["cases"] - before
        return added


def kill_one_worker_mid_call(failures_dir: Path, at: float, give_up: float) -> dict | None:
    """From ``at``, SIGKILL the first worker holding an in-flight record; None if none by ``give_up``."""
    while time.time() < at:
        time.sleep(0.2)
    while time.time() < give_up:
        for record in sorted(failures_dir.glob("inflight-gw*-*.safetensors")):
            pid = record.stem.rsplit("-", 1)[-1]
            if pid.isdigit():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    continue
                return {"pid": int(pid), "record": record.name, "killed_at": time.time()}
        time.sleep(0.005)
    return None


def _reported_total(output: str) -> str | None:
    """The fuzz command's own closing line ("No failure: N cases, ..." or what it found)."""
    lines = [line.strip() for line in output.splitlines() if " cases, " in line]
    return lines[-1] if lines else None


def fuzz_run(minutes: float, workers: int, backend: str | None, failures_dir: Path, kill: bool) -> dict:
    failures_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mqa_bwd", "fuzz", "--minutes", str(minutes), "--workers", str(workers),
           "--failures-dir", str(failures_dir)]
    if backend:
        cmd += ["--backend", backend]
    started = time.time()
    killed = {}
    with Monitor(started) as monitor:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killer = None
        if kill:
            def kill_job():
                killed.update(kill_one_worker_mid_call(failures_dir, started + minutes * 30.0, started + minutes * 60.0) or {})

            killer = threading.Thread(target=kill_job, daemon=True)
            killer.start()
        output, _ = proc.communicate()
        if killer is not None:
            killer.join()
    seconds = time.time() - started
    per_worker = monitor.per_worker()
    result = {
        "workers": workers, "minutes": minutes, "seconds": round(seconds, 1), "exit_code": proc.returncode,
        "cases_per_worker": per_worker, "cases_total": sum(per_worker.values()),
        "fuzz_reported": _reported_total(output),
        "cases_per_minute_total": round(sum(per_worker.values()) / (seconds / 60.0), 1),
        "cases_per_minute_per_worker": {w: round(c / (seconds / 60.0), 1) for w, c in per_worker.items()},
        "devices": {str(pid): d for pid, d in monitor.devices.items()},
        "fuzz_output_tail": output[-4000:],
    }
    if kill:
        result["kill"] = killed or {"error": "no worker was caught inside a call"}
        if killed:
            crash = failures_dir / killed["record"].replace("inflight-", "crash-", 1)
            result["kill"]["crash_record"] = crash.name if crash.exists() else None
            result["kill"]["cases_by_the_others_after_the_kill"] = monitor.cases_after(killed["killed_at"], killed["pid"])
            if crash.exists():
                replay = subprocess.run([sys.executable, "-m", "mqa_bwd", "repro", str(crash)]
                                        + (["--backend", backend] if backend else []),
                                        capture_output=True, text=True)
                result["kill"]["repro_exit_code"] = replay.returncode
                result["kill"]["repro_output_tail"] = (replay.stdout + replay.stderr)[-1500:]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0, help="length of each of the two runs")
    parser.add_argument("--workers", type=int, default=2, help="workers of the second run (one per GPU, or more)")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--failures-dir", default="fuzz-scaling")
    parser.add_argument("--json", default=None, help="also write the figures here")
    a = parser.parse_args()
    if a.workers < 2:
        raise SystemExit("--workers: at least 2 (the second run is the fan-out)")
    if a.minutes <= 0:
        raise SystemExit("--minutes: must be positive")
    root = Path(a.failures_dir)
    one = fuzz_run(a.minutes, 1, a.backend, root / "one-worker", kill=False)
    many = fuzz_run(a.minutes, a.workers, a.backend, root / f"{a.workers}-workers", kill=True)
    figures = {"one_worker": one, "fan_out": many,
               "scaling_ratio": round(many["cases_total"] / one["cases_total"], 3) if one["cases_total"] else None}
    for run in (one, many):
        tail = run.pop("fuzz_output_tail")
        print(f"--- {run['workers']} worker(s), {run['seconds']} s: the fuzz table\n{tail[-2500:]}")
    print(json.dumps(figures, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
