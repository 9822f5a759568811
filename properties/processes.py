"""The same call in fresh Python processes, each with its own allocator history and kernel order.

docs/SPEC.md's determinism holds "in every process": a result must not
depend on where the allocator put the buffers, on what the process ran
before, or on which kernels it compiled first. One process cannot vary
those for itself, so the call is repeated in children:

  parent  ``run_children(requests)`` starts one ``python -m
          properties.processes`` per request, all at once, hands each its
          request as JSON on stdin and reads its answer as JSON on stdout
          (the parent's ``sys.path`` travels in PYTHONPATH, so an
          implementation importable here is importable there).
  child   ``main`` reads the request, gives the process its history
          (``make_history``), runs the call once and answers with the
          SHA-256 of each output's bytes. While it works, its stdout is
          pointed at stderr, so nothing an implementation prints (a
          compiler's log) can garble the answer.

A request:

  impl          "module:function", imported from the Python path as given
  backend       passed as backend= (null: not passed)
  device        where the inputs go ("cpu", "cuda")
  history       0, 1, 2, ...: the process's allocator history and kernel
                order (0: none, the call comes first)
  case          a Case as a dict (properties.case): the inputs are built
                from it, bit for bit as anywhere
  inputs        instead of case: a file written by ``save_inputs``
  options       the call's keyword options (block_h, dkv_buf_bytes)
  framework     "torch" or "paddle": what the tensors are handed over in
  outputs_dir   optional: each output's bytes are written there as
                <name>.bin, for the parent to compare element by element

The answer: pid, what the history did, per output {sha256, shape, dtype},
and error (null, or what went wrong: the implementation's exception, say).
"""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np

from mqa_bwd import edge
from mqa_bwd.contract import OUTPUT_NAMES, SPEC_ARGS
from mqa_bwd.files import load_tensors, save_tensors

MODULE = "properties.processes"
#: Long enough for a child that compiles kernels from scratch on a GPU.
TIMEOUT_S = 900.0


# ---------------------------------------------------------------------------
# The process's history
# ---------------------------------------------------------------------------


def disturb_allocator(history: int, device: str) -> list:
    """Allocate tensors of sizes drawn from ``history`` on ``device``, touch them, and free every
    other one: the call's own buffers then land at other addresses and in other cached blocks
    than in a process with another history. Returns the tensors kept alive (hold them over the call)."""
    import torch

    if history <= 0:
        return []
    rng = np.random.default_rng([history, 0x5EED])
    kept = []
    for i in range(4 + 3 * history):
        nbytes = int(rng.integers(1, 1 << int(rng.integers(8, 25))))  # 1 B .. 16 MiB
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t.fill_(i & 0xFF)
        if i % 2 == 0:
            kept.append(t)
    return kept


def warm_up_cases(history: int, heads: int, d_k: int, d_v: int) -> list:
    """Small other cases run before the call: on a GPU they compile and launch kernels first, in
    an order that depends on ``history`` (a head count other than ``heads`` brings other kernel
    configurations, the same one brings the call's own before the call)."""
    from .case import Case

    other = 64 if heads != 64 else 16
    order = [other, heads] if history % 2 else [heads, other]
    return [Case(B=1, S=2, S_kv=40, H=order[k % 2], L=33, d_k=d_k, d_v=d_v, seed=1000 + 7 * history + k)
            for k in range(history)]


# ---------------------------------------------------------------------------
# Inputs that are not a Case (a capture's): a file between the processes
# ---------------------------------------------------------------------------


def save_inputs(path, host: dict) -> Path:
    """The host inputs (Case.inputs() layout: NumPy arrays, attn_sink possibly None, sm_scale a
    float) as a safetensors file, bits exact; a file for the children of this run, so not fsynced."""
    tensors = {name: edge.numpy_to_torch(value) for name, value in host.items()
               if name != "sm_scale" and value is not None}
    metadata = {"sm_scale": repr(float(host["sm_scale"])), "attn_sink": "present" if host["attn_sink"] is not None
                else "none"}
    return save_tensors(path, tensors, metadata, durable=False)


def load_inputs(path) -> dict:
    tensors, metadata = load_tensors(path, f"inputs {path}")
    host = {name: edge.to_numpy(tensors[name]) if name in tensors else None for name in SPEC_ARGS[:-1]}
    host["sm_scale"] = float(metadata["sm_scale"])
    return host


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------


def digest(x) -> dict:
    """sha256, shape and dtype of an output (a tensor, or its contiguous host copy)."""
    a = x if isinstance(x, np.ndarray) else np.ascontiguousarray(edge.to_numpy(x))
    return {"sha256": hashlib.sha256(a.tobytes()).hexdigest(), "shape": list(a.shape), "dtype": str(a.dtype)}


def serve(request: dict) -> dict:
    """Run one request in this process (see the module doc); the answer as a dict."""
    from .case import Case, to_framework
    from .target import Target, load_function

    answer = {"pid": os.getpid(), "history": int(request.get("history", 0)), "digests": {}, "error": None,
              "did": []}
    try:
        device, framework = request.get("device", "cpu"), request.get("framework", "torch")
        target = Target(load_function(request["impl"], "impl"), request["impl"], request.get("backend"), device)
        host = Case.from_dict(request["case"]).inputs() if request.get("case") is not None \
            else load_inputs(request["inputs"])
        history = answer["history"]
        held = disturb_allocator(history, device)
        if held:
            answer["did"].append(f"{len(held)} of {4 + 3 * history} allocations held")
        d_k, d_v = host["query"].shape[3], host["out"].shape[3]
        for warm in warm_up_cases(history, host["query"].shape[2], d_k, d_v):
            try:
                target(to_framework(warm.inputs(), framework, device))
                answer["did"].append(f"warm-up H={warm.H}")
            except Exception as err:  # noqa: BLE001 - a warm-up only stirs the process; its failure is no verdict
                answer["did"].append(f"warm-up H={warm.H} raised {type(err).__name__}")
        result = target(to_framework(host, framework, device), **request.get("options", {}))
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise TypeError(f"expected (dq, dkv, d_attn_sink), got {type(result).__name__}")
        outputs = {name: np.ascontiguousarray(edge.to_numpy(x)) for name, x in zip(OUTPUT_NAMES, result)}
        answer["digests"] = {name: digest(a) for name, a in outputs.items()}
        if request.get("outputs_dir"):
            for name, a in outputs.items():
                (Path(request["outputs_dir"]) / f"{name}.bin").write_bytes(a.tobytes())
        del held
    except Exception as err:  # noqa: BLE001 - the parent reports it
        frames = traceback.extract_tb(err.__traceback__)[-3:]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))
        answer["error"] = f"{type(err).__name__}: {err}" + (f" (at {where})" if where else "")
    return answer


def main() -> int:
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # whatever the work prints goes to stderr; stdout carries the answer alone
    sys.stdout = sys.stderr
    request = json.loads(sys.stdin.read())
    answer = serve(request)
    with os.fdopen(answer_fd, "w") as out:
        out.write(json.dumps(answer) + "\n")
    return 0


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    request: dict
    pid: int | None
    did: list
    digests: dict  # output name -> {sha256, shape, dtype}
    error: str | None

    @property
    def history(self) -> int:
        return int(self.request.get("history", 0))

    def label(self, index: int) -> str:
        return f"fresh process {index} (pid {self.pid}, history {self.history}: {', '.join(self.did) or 'none'})"

    def outputs(self) -> dict:
        """The outputs' host arrays written to outputs_dir (the request must have asked for them)."""
        found = {}
        for name in OUTPUT_NAMES:
            info = self.digests[name]
            raw = (Path(self.request["outputs_dir"]) / f"{name}.bin").read_bytes()
            dtype = ml_dtypes.bfloat16 if info["dtype"] == "bfloat16" else np.dtype(info["dtype"])
            found[name] = np.frombuffer(raw, dtype=dtype).reshape(info["shape"])
        return found


def child_environment() -> dict:
    """This process's environment with its module search path, so the child imports what we import."""
    env = dict(os.environ)
    paths = [os.getcwd() if p == "" else p for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_children(requests: list, timeout_s: float = TIMEOUT_S) -> list:
    """One fresh process per request, all started at once; their answers, in request order."""
    env = child_environment()
    procs = []
    for request in requests:
        proc = subprocess.Popen([sys.executable, "-m", MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, text=True)
        procs.append((request, proc))
    answers = []
    for request, proc in procs:
        try:
            out, err = proc.communicate(json.dumps(request), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            answers.append(Answer(request, proc.pid, [], {}, f"did not answer within {timeout_s:.0f} s"))
            continue
        try:
            data = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            tail = "\n".join(err.strip().splitlines()[-8:])
            answers.append(Answer(request, proc.pid, [], {}, f"exited with code {proc.returncode} without an "
                                                             f"answer; the end of its stderr:\n{tail}"))
            continue
        answers.append(Answer(request, data.get("pid"), data.get("did", []), data.get("digests", {}),
                              data.get("error")))
    return answers


def requests_for(impl: str, backend, device: str, count: int, *, case=None, inputs=None, options=None,
                 framework="torch", outputs_dir=None, first_history: int = 1) -> list:
    """``count`` requests of the same call, each child with its own history, from ``first_history`` on."""
    base = {"impl": impl, "backend": backend, "device": device, "options": dict(options or {}),
            "framework": framework}
    if case is not None:
        base["case"] = case.to_dict()
    else:
        base["inputs"] = str(inputs)
    requests = []
    for k in range(first_history, first_history + count):
        request = dict(base, history=k)
        if outputs_dir is not None:
            folder = Path(outputs_dir) / f"process{k}"
            folder.mkdir(parents=True, exist_ok=True)
            request["outputs_dir"] = str(folder)
        requests.append(request)
    return requests


def names_the_function(spec: str, function) -> str | None:
    """None when ``spec`` imports as ``function`` (so a child runs what the parent tests); else why not."""
    from .target import load_function

    try:
        loaded = load_function(spec, "impl")
    except ValueError as err:
        return str(err)
    return None if loaded is function else f"{spec!r} imports as {loaded!r}, not the function under test {function!r}"


if __name__ == "__main__":
    sys.exit(main())
