"""The coverage table (``docs/coverage.md``, generated from ``docs/coverage.json`` by
``python benchmarks/coverage.py --json docs/coverage.json``): every layer type users train is
per-layer, carried, a warned region or refused, never silent; its fan-in is the brute-force count;
its gradient error at loss x1e-6 is within fp16 noise of the global baseline's; and a type whose
status changes from the committed table fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaloss_zoo import coverage

TABLE = Path(__file__).resolve().parents[1] / "docs" / "coverage.json"


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_every_layer_type_is_scaled_carried_warned_or_refused(framework):
    committed = {r["layer"]: r for r in json.loads(TABLE.read_text())["rows"] if r["framework"] == framework}
    types = coverage.layer_types(framework)
    assert {t.name for t in types} == set(committed), "rerun benchmarks/coverage.py --json docs/coverage.json"
    for t in types:
        row = coverage.probe(t)
        assert not coverage.problems(row), (t.name, coverage.problems(row), row["detail"])
        assert row["status"] == committed[t.name]["status"], (t.name, row["status"], row["detail"])


def _row(**kw):
    base = {"framework": "torch", "layer": "L", "note": "", "status": "per-layer", "detail": "",
            "fan_in": 16, "counted_fan_in": 16, "error": 1e-3, "baseline": "GradScaler",
            "baseline_error": 1e-3}
    return {**base, **kw}


def test_problems_reads_hand_made_rows():
    assert coverage.problems(_row()) == []
    assert coverage.problems(_row(status="silent"))[0].startswith("silent")
    assert "brute-force" in coverage.problems(_row(fan_in=32))[0]
    assert "beyond" in coverage.problems(_row(error=0.05, baseline_error=1e-3))[0]
    assert coverage.problems(_row(status="error", error=None, fan_in=None, counted_fan_in=None)) == []
    assert coverage.problems(_row(error=float("inf"), baseline_error=float("inf")))  # non-finite


def test_page_and_line_count_every_status():
    rows = [_row(layer="a"), _row(layer="b", status="region", detail="x | y"),
            _row(framework="jax", layer="c", status="carried", fan_in=None, counted_fan_in=None)]
    data = {"command": "cmd", "date": "d", "versions": "v", "rows": rows}
    page = coverage.page(data)
    assert "## PyTorch" in page and "## JAX" in page and "x / y" in page  # a bar would split the cell
    assert "per-layer 1, carried 1, region 1, error 0, silent 0" in page
    assert coverage.line(data).startswith("3 layer types") and "0 silent" in coverage.line(data)
