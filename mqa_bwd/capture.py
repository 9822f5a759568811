"""Capture the backward's inputs from a real training step, and load them back.

Call ``save`` from torch or paddle code at the step that drifted::

    from mqa_bwd import capture
    capture.save("step1234-rank3.safetensors", query=q, kv=kv, out=o, grad_out=do,
                 lse=lse, attn_sink=sink, token_indices=idx, sm_scale=scale,
                 step=1234, rank=3, block_h=32)

then replay it with ``mqa-bwd repro step1234-rank3.safetensors``.

The file is safetensors: bf16 stays bf16, bit for bit. Its metadata holds
``sm_scale`` (as ``repr`` of the float, which round-trips exactly), whether a
sink was given, the list of tensors the file must contain, a SHA-256 of each
tensor's bytes, and the caller's extra keywords as JSON (``block_h``,
``dkv_buf_bytes`` and ``backend`` there are used by ``repro`` as the call's
configuration). ``load`` checks all of it, so a truncated, corrupted or
incomplete file is a ValueError that names what is missing or wrong, never
a silently different replay.

Writes are atomic: the bytes go to a hidden temporary file in the target's
directory, which is flushed and fsynced before ``os.replace`` renames it over
the target (and the directory is fsynced after). A crash at any point leaves
either the old file or the new one, never half of one.
"""

import dataclasses
import hashlib
import json
import numbers
from pathlib import Path

from .contract import SPEC_ARGS
from .edge import as_cpu_torch, framework_of, to_numpy
from .files import load_tensors, save_tensors

FORMAT = "mqa-bwd-capture/1"
#: The SPEC signature's tensor arguments, in order; attn_sink may be absent.
TENSOR_NAMES = SPEC_ARGS[:-1]
BF16_NAMES = ("query", "kv", "out", "grad_out")
_RANKS = {"query": 4, "kv": 3, "out": 4, "grad_out": 4, "lse": 3, "attn_sink": 1, "token_indices": 3}


@dataclasses.dataclass(frozen=True)
class Capture:
    """A loaded capture: ``inputs`` in the layout of ``properties.case.Case.inputs()``."""

    path: Path
    inputs: dict  # NumPy arrays (bf16 as ml_dtypes.bfloat16), attn_sink possibly None, sm_scale a float
    meta: dict  # the caller's extra keywords
    framework: str = "torch"  # what the caller's tensors were: torch, paddle or numpy
    #: For a fuzz call record (meta "record" == CALL_RECORD) whose inputs break SPEC's
    #: structure (the rejection property's calls): what is wrong; None otherwise.
    structure_error: str | None = None


#: meta["record"] of the fuzzer's in-flight call records (mqa_bwd.fuzz), which may hold
#: calls that break SPEC on purpose: they load with the problem noted, not refused.
CALL_RECORD = "fuzz call record"


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------------
# Structure: what a replayable capture must look like
# ---------------------------------------------------------------------------


def check_structure(tensors: dict, sm_scale) -> None:
    """Dtypes, ranks and agreeing dimensions; ValueError naming the tensor."""
    import torch

    for name in BF16_NAMES:
        if tensors[name].dtype != torch.bfloat16:
            raise ValueError(f"{name}: dtype {tensors[name].dtype}, expected torch.bfloat16")
    for name in ("lse", "attn_sink"):
        if tensors.get(name) is not None and tensors[name].dtype != torch.float32:
            raise ValueError(f"{name}: dtype {tensors[name].dtype}, expected torch.float32")
    if tensors["token_indices"].dtype.is_floating_point or tensors["token_indices"].dtype == torch.bool:
        raise ValueError(f"token_indices: dtype {tensors['token_indices'].dtype}, expected an integer dtype")
    for name, rank in _RANKS.items():
        t = tensors.get(name)
        if t is not None and t.dim() != rank:
            raise ValueError(f"{name}: rank {t.dim()} (shape {tuple(t.shape)}), expected rank {rank}")
    B, S, H, _ = tensors["query"].shape
    d_v = tensors["out"].shape[3]
    expected = {
        "kv": (B, None, tensors["query"].shape[3]),
        "out": (B, S, H, d_v),
        "grad_out": (B, S, H, d_v),
        "lse": (B, S, H),
        "attn_sink": (H,),
        "token_indices": (B, S, None),
    }
    for name, dims in expected.items():
        t = tensors.get(name)
        if t is None:
            continue
        if any(want is not None and got != want for got, want in zip(t.shape, dims)):
            shown = tuple("*" if d is None else d for d in dims)
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match query's {shown}")
    from .wrapper import check_sm_scale

    check_sm_scale(sm_scale)


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def write(path, inputs: dict, meta: dict | None = None, *, durable: bool = True, check: bool = True) -> Path:
    """Write ``inputs`` (the SPEC arguments by name, sm_scale included) as a capture.

    ``check=False`` records a call whatever its structure (the fuzzer records
    calls the implementation must reject, too); ``load`` still checks it.
    """
    missing = [name for name in TENSOR_NAMES + ("sm_scale",) if name not in inputs]
    if missing:
        raise ValueError(f"{missing[0]}: missing (a capture needs {', '.join(TENSOR_NAMES)} and sm_scale)")
    tensors = {}
    for name in TENSOR_NAMES:
        value = inputs[name]
        if value is None:
            if name != "attn_sink":
                raise ValueError(f"{name}: is None; only attn_sink may be None")
            continue
        tensors[name] = as_cpu_torch(value, name)
    sm_scale = inputs["sm_scale"]
    if check:
        check_structure(tensors, sm_scale)
    try:
        meta_text = json.dumps(dict(meta or {}), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta: extra keywords must be JSON-serialisable ({e})") from None
    metadata = {
        "format": FORMAT,
        "sm_scale": repr(float(sm_scale)) if isinstance(sm_scale, numbers.Real) else repr(sm_scale),
        "attn_sink": "present" if "attn_sink" in tensors else "none",
        "tensors": json.dumps(sorted(tensors)),
        "sha256": json.dumps({name: _digest(t) for name, t in tensors.items()}, sort_keys=True),
        "meta": meta_text,
        "framework": framework_of(inputs["query"]) or "numpy",
    }
    return save_tensors(path, tensors, metadata, durable=durable)


def save(path, *, query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, **meta) -> Path:
    """Save one call's inputs (torch or paddle tensors, any device) to ``path``, atomically.

    Extra keywords (JSON values) are kept as metadata: say which step, rank and
    configuration (``block_h``, ``dkv_buf_bytes``, ``backend``) this was.
    """
    inputs = dict(query=query, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=attn_sink,
                  token_indices=token_indices, sm_scale=sm_scale)
    return write(path, inputs, meta)


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def _metadata_json(path, metadata, key):
    if key not in metadata:
        raise ValueError(f"capture {path}: metadata {key!r} is missing")
    try:
        return json.loads(metadata[key])
    except json.JSONDecodeError as e:
        raise ValueError(f"capture {path}: metadata {key!r} is damaged ({e})") from None


def load(path) -> Capture:
    """Load and verify a capture. ValueError naming what is missing or wrong."""
    path = Path(path)
    tensors, metadata = load_tensors(path, f"capture {path}")
    if metadata.get("format") != FORMAT:
        raise ValueError(f"capture {path}: metadata 'format' is {metadata.get('format')!r}, expected {FORMAT!r} "
                         "(not written by mqa_bwd.capture.save)")
    listed = _metadata_json(path, metadata, "tensors")
    digests = _metadata_json(path, metadata, "sha256")
    meta = _metadata_json(path, metadata, "meta")
    sink_state = metadata.get("attn_sink")
    if sink_state not in ("present", "none"):
        raise ValueError(f"capture {path}: metadata 'attn_sink' is {sink_state!r}, expected 'present' or 'none'")
    required = [n for n in TENSOR_NAMES if n != "attn_sink" or sink_state == "present"]
    missing = [n for n in dict.fromkeys(required + list(listed)) if n not in tensors]
    if missing:
        raise ValueError(f"capture {path}: incomplete: tensor(s) {', '.join(missing)} missing")
    for name in required:
        if name not in digests:
            raise ValueError(f"capture {path}: metadata 'sha256' has no checksum for {name!r}")
        if _digest(tensors[name]) != digests[name]:
            raise ValueError(f"capture {path}: tensor {name!r} is damaged (its bytes do not match the SHA-256 "
                             "recorded when it was saved)")
    try:
        sm_scale = float(metadata["sm_scale"])
    except (KeyError, ValueError):
        raise ValueError(f"capture {path}: metadata 'sm_scale' is missing or not a number "
                         f"({metadata.get('sm_scale')!r})") from None
    structure_error = None
    try:
        check_structure(tensors, sm_scale)
    except ValueError as e:
        if not isinstance(meta, dict) or meta.get("record") != CALL_RECORD:
            raise ValueError(f"capture {path}: {e}") from None
        structure_error = str(e)
    inputs = {name: (to_numpy(tensors[name]) if name in tensors else None) for name in TENSOR_NAMES}
    if sink_state == "none":
        inputs["attn_sink"] = None
    inputs["sm_scale"] = sm_scale
    framework = metadata.get("framework", "torch")
    return Capture(path=path, inputs=inputs, meta=meta, framework=framework if framework != "numpy" else "torch",
                   structure_error=structure_error)
