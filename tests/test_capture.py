"""mqa_bwd.capture: exact round trips, atomic writes, and refusal of damaged or incomplete captures."""

import json
import os
import signal
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from mqa_bwd import capture
from properties.case import Case, to_framework


def _inputs(**case_fields):
    return Case(**{"H": 5, "S": 3, "L": 9, "seed": 7, **case_fields}).inputs()


def _same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is b
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_round_trip(host, loaded):
    for name in capture.TENSOR_NAMES:
        assert _same_bits(host[name], loaded.inputs[name]), f"{name} changed in the round trip"
    assert loaded.inputs["sm_scale"] == host["sm_scale"]


def test_torch_round_trip_keeps_every_bit_and_the_metadata(tmp_path):
    host = _inputs()
    tensors = to_framework(host, "torch")
    # Bit patterns a lossy conversion would change: -0, a NaN payload, infinities, subnormals.
    special = np.array([0x8000, 0x7FC1, 0x7F80, 0xFF80, 0x0001], dtype=np.uint16)
    tensors["query"].view(torch.int16).reshape(-1)[:5] = torch.from_numpy(special.view(np.int16))
    host["query"] = tensors["query"].view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    path = capture.save(tmp_path / "step.safetensors", **tensors, step=1234, rank=3, block_h=16)
    loaded = capture.load(path)
    _assert_round_trip(host, loaded)
    assert loaded.meta == {"step": 1234, "rank": 3, "block_h": 16}
    assert loaded.framework == "torch"


def test_capture_without_sink_loads_as_none(tmp_path):
    host = _inputs(sink="none")
    assert host["attn_sink"] is None
    loaded = capture.load(capture.save(tmp_path / "c.safetensors", **to_framework(host, "torch")))
    _assert_round_trip(host, loaded)


def test_numpy_bf16_arrays_are_accepted_and_sm_scale_round_trips_exactly(tmp_path):
    host = _inputs()
    host["sm_scale"] = 1 / 3  # not a short decimal: repr must round-trip it
    loaded = capture.load(capture.save(tmp_path / "n.safetensors", **host))
    _assert_round_trip(host, loaded)
    assert loaded.inputs["sm_scale"] == 1 / 3


def test_paddle_tensors_round_trip(tmp_path):
    pytest.importorskip("paddle")
    host = _inputs()
    loaded = capture.load(capture.save(tmp_path / "p.safetensors", **to_framework(host, "paddle")))
    _assert_round_trip(host, loaded)
    assert loaded.framework == "paddle"


@pytest.mark.parametrize(
    "change, names",
    [
        (lambda t: t.update(query=t["query"].float()), "query"),
        (lambda t: t.update(lse=t["lse"].double()), "lse"),
        (lambda t: t.update(token_indices=t["token_indices"].float()), "token_indices"),
        (lambda t: t.update(grad_out=t["grad_out"][:, :1]), "grad_out"),
        (lambda t: t.update(attn_sink=t["attn_sink"][:2]), "attn_sink"),
        (lambda t: t.update(kv=t["kv"][0]), "kv"),
        (lambda t: t.update(sm_scale=float("nan")), "sm_scale"),
        (lambda t: t.update(out=None), "out"),
        (lambda t: t.update(query=[1.0, 2.0]), "query"),
    ],
)
def test_save_rejects_a_call_that_cannot_be_replayed_naming_the_argument(tmp_path, change, names):
    tensors = to_framework(_inputs(), "torch")
    change(tensors)
    with pytest.raises(ValueError, match=rf"\b{names}\b"):
        capture.save(tmp_path / "bad.safetensors", **tensors)
    assert list(tmp_path.iterdir()) == []


def test_save_rejects_metadata_that_is_not_json(tmp_path):
    with pytest.raises(ValueError, match="meta"):
        capture.save(tmp_path / "m.safetensors", **to_framework(_inputs(), "torch"), when=object())
    assert list(tmp_path.iterdir()) == []


def test_save_into_a_missing_directory_names_it(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        capture.save(tmp_path / "nope" / "c.safetensors", **to_framework(_inputs(), "torch"))


# ---------------------------------------------------------------------------
# Damaged and incomplete captures
# ---------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    return capture.save(tmp_path / "good.safetensors", **to_framework(_inputs(), "torch"))


def _rewrite(path, tensors=None, metadata_changes=None, drop=()):
    """Rewrite a capture's safetensors container with changed tensors or metadata (a forged file)."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        current = {k: f.get_tensor(k) for k in f.keys()}
    current.update(tensors or {})
    for name in drop:
        current.pop(name)
    metadata.update(metadata_changes or {})
    metadata = {k: v for k, v in metadata.items() if v is not None}
    safetensors.torch.save_file(current, str(path), metadata=metadata)


def test_truncated_capture_is_refused(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="not a complete safetensors file"):
        capture.load(saved)


def test_flipped_bit_in_tensor_data_is_refused_naming_the_tensor(saved):
    with safetensors.safe_open(str(saved), framework="pt") as f:
        kv = f.get_tensor("kv")
    kv.view(torch.int16).reshape(-1)[3] ^= 1
    _rewrite(saved, tensors={"kv": kv})  # the checksum in the metadata stays that of the original
    with pytest.raises(ValueError, match="tensor 'kv' is damaged"):
        capture.load(saved)


def test_damaged_header_is_refused(saved):
    data = bytearray(saved.read_bytes())
    data[12] = ord("#")  # inside the JSON header
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="capture"):
        capture.load(saved)


def test_missing_tensor_is_named(saved):
    _rewrite(saved, drop=("grad_out",))
    with pytest.raises(ValueError, match="incomplete: tensor.*grad_out.* missing"):
        capture.load(saved)


def test_missing_sink_that_the_metadata_promises_is_named(saved):
    _rewrite(saved, drop=("attn_sink",))
    with pytest.raises(ValueError, match="attn_sink"):
        capture.load(saved)


@pytest.mark.parametrize("key, value, message", [
    ("format", None, "format"),
    ("format", "something-else/9", "format"),
    ("sm_scale", None, "sm_scale"),
    ("sm_scale", "a lot", "sm_scale"),
    ("sha256", None, "sha256"),
    ("sha256", "{not json", "sha256"),
    ("attn_sink", "maybe", "attn_sink"),
])
def test_damaged_or_missing_metadata_is_named(saved, key, value, message):
    _rewrite(saved, metadata_changes={key: value})
    with pytest.raises(ValueError, match=message):
        capture.load(saved)


def test_wrong_dtype_in_a_forged_capture_is_named(saved):
    with safetensors.safe_open(str(saved), framework="pt") as f:
        metadata = dict(f.metadata())
        out = f.get_tensor("out").float()
    digests = json.loads(metadata["sha256"])
    digests["out"] = capture._digest(out)  # a consistent file, just the wrong dtype
    _rewrite(saved, tensors={"out": out}, metadata_changes={"sha256": json.dumps(digests)})
    with pytest.raises(ValueError, match="out: dtype"):
        capture.load(saved)


def test_not_a_capture_at_all_is_refused(tmp_path):
    path = tmp_path / "other.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(3)}, str(path))
    with pytest.raises(ValueError, match="not written by mqa_bwd.capture.save"):
        capture.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        capture.load(tmp_path / "absent.safetensors")


# ---------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------


def test_interrupted_write_leaves_the_old_capture_and_no_partial_file(tmp_path, monkeypatch):
    path = capture.save(tmp_path / "c.safetensors", **to_framework(_inputs(seed=1), "torch"), version="old")

    def interrupted(fd):
        raise KeyboardInterrupt  # as if Ctrl-C landed between writing and renaming

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        capture.save(path, **to_framework(_inputs(seed=2), "torch"), version="new")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"], "a partial file was left behind"
    assert capture.load(path).meta == {"version": "old"}


def test_a_process_killed_mid_write_leaves_no_half_capture(tmp_path):
    """SIGKILL after the bytes are written but before the rename: the target never holds a partial file."""
    target = tmp_path / "c.safetensors"
    script = f"""
import os, signal
from mqa_bwd import capture
from properties.case import Case, to_framework
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
capture.save({str(target)!r}, **to_framework(Case(H=3).inputs(), "torch"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert not target.exists()
    leftovers = list(tmp_path.iterdir())
    assert leftovers and all(p.name.startswith(".c.safetensors.") and p.name.endswith(".partial") for p in leftovers)


def test_write_atomic_creates_files_with_the_callers_umask(tmp_path):
    path = capture.save(tmp_path / "c.safetensors", **to_framework(_inputs(), "torch"))
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
