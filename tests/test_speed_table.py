"""The README's speed table is the bench run it names, shipped in docs/bench/: a table edited by
hand, or a run replaced without its table, fails here."""

import json
import re
from pathlib import Path

import pytest

from mqa_bwd import cli

ROOT = Path(__file__).resolve().parents[1]
#: The README's shape labels, as the bench's rows name them.
SHAPES = {"dsv32 H=64": dict(S=4096, S_kv=8192, H=64, L=2048), "dsv32 H=128": dict(S=4096, S_kv=8192, H=128, L=2048),
          "fleet H=64": dict(S=8192, S_kv=8192, H=64, L=640)}
COLUMNS = ("tilelang", "tilelang-atomic", "cudnn")


def _speed_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("\n## Speed\n", 1)[1].split("\n## ", 1)[0]


def _run_it_names() -> Path:
    (path,) = set(re.findall(r"docs/bench/[\w.-]+\.json", _speed_section()))
    return ROOT / path


def _table_rows() -> dict:
    rows = {}
    for line in _speed_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in SHAPES:
            rows[cells[0]] = [float(c.removesuffix(" ms")) for c in cells[1:]]
    return rows


def test_the_speed_table_shows_the_shipped_run_it_names():
    recorded = json.loads(_run_it_names().read_text())["rows"]
    table = _table_rows()
    assert set(table) == set(SHAPES)
    for label, shape in SHAPES.items():
        by_backend = {r["backend"]: r for r in recorded
                      if r["indices"] == "uniform" and all(r[k] == v for k, v in shape.items())}
        det = by_backend["tilelang"]
        want = [by_backend[b]["ms"] for b in COLUMNS] + [det["det_over_atomic"], det["det_over_cudnn"]]
        want += [det["queued_ms"], by_backend["cudnn"]["queued_ms"], det["queued_det_over_cudnn"]]
        assert len(table[label]) == len(want), (label, table[label])
        for shown, value in zip(table[label], want):
            assert shown == pytest.approx(value, abs=0.005 + 1e-9), (label, shown, value)


def test_the_shipped_run_renders_without_a_gpu(capsys):
    assert cli.main(["bench", "--from-json", str(_run_it_names())]) == 0
    assert "main_bwd_kernel" in capsys.readouterr().out
