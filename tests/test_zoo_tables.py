"""The zoo benchmark's helpers: the converged dynamic scale's bisection and the computed
table and summary (no framework needed)."""

import pytest

from adaloss_zoo.metrics import largest_finite_power
from adaloss_zoo.tables import ratio, summary, table


@pytest.mark.parametrize("limit", [0, 1, 17, 43, 100])
def test_bisection_finds_the_largest_finite_power_with_few_passes(limit):
    calls = []

    def at(k):
        calls.append(k)
        return k <= limit, f"grads at 2^{k}"

    k, out = largest_finite_power(at)
    assert (k, out) == (limit, f"grads at 2^{limit}")
    assert len(calls) <= 9  # 1 + ceil(log2(101)), not a walk up from 2^0


def test_bisection_returns_the_lowest_power_when_even_it_overflows():
    assert largest_finite_power(lambda k: (False, k), lo=3) == (3, 3)


def _row(framework, factor, logits, **medians):
    return {"framework": framework, "model": "m", "factor": factor, "logits": logits,
            "errors": {m: {"median": v, "worst": 2 * v} for m, v in medians.items()},
            "adaloss skipped": 0, "dynamic skipped": 3, "cast-only skipped": 1, "converged log2": 40,
            "layers_found": 5, "layers_expected": 5, "warnings": []}


def test_ratio_is_against_the_best_global_scale():
    r = _row("jax", 1e-8, 1, adaloss=0.001, dynamic=0.1, converged=0.002, static=0.2)
    assert ratio(r) == pytest.approx(0.5)  # the converged scale is the best global one
    assert ratio(r, against=("dynamic",)) == pytest.approx(0.01)


def test_table_and_summary_are_computed_from_the_rows():
    rows = [_row("jax", 1e-8, 1, adaloss=0.001, **{"cast-only": 0.0012}, dynamic=0.1, converged=0.002,
                 static=0.2),
            _row("torch", 1e-8, 30, adaloss=0.004, **{"cast-only": 0.004}, dynamic=0.004,
                 converged=0.004, static=0.01)]
    md = table(rows)
    assert ("| jax | m | 1e-08 | 1 | 0.001 | 0.0012 | 0.1 | 0.002 | 0.2 | 0.50 | 0.60 | 2^40 | 0 / 3 "
            "| 5/5 | 0 |") in md
    text = "\n".join(summary(rows))
    assert "cast-only 1" in text and "from 2^16 3" in text
    assert "**jax, adaloss / best global** (dynamic from 2^16, converged, static 2^15): 0.50-0.50" in text
    assert "**×1e-8, logits ×10/×30**: adaloss / best global 1.00-1.00" in text
    assert "**cast-only / adaloss**: median 1.10, range 1.00-1.20" in text


def test_torch_fp8_summary_counts_the_models_within_the_time_target():
    """The FP8-GEMM block's sentences come from the rows: which models meet the step-time
    target against torchao tensorwise, and the error ratios against each baseline."""
    from adaloss_zoo.fp8_tables import GEMM_METHODS, gemm_summary, gemm_table

    def row(model, ada_ms, errs):
        ms = dict.fromkeys(GEMM_METHODS, 100.0) | {"adaloss": ada_ms, "current": 90.0}
        return {"model": model, "parameters": 1e6, "median_ms": ms, "layers": dict.fromkeys(GEMM_METHODS, 4),
                "errors": {m: {"median": e, "worst": 2 * e} for m, e in zip(GEMM_METHODS[1:], errs)}}
    payload = {"rows": [row("a", 105.0, (0.10, 0.10, 0.08, 0.11, 0.09)),
                        row("b", 150.0, (0.12, 0.12, 0.10, 0.12, 0.10))]}
    text = "\n".join(gemm_summary(payload))
    assert "1.05–1.50× torchao tensorwise's; within 1.10× on 1 of 2 models (a)" in text
    assert "1.00–1.00× current scaling's" in text and "1.20–1.25× torchao tensorwise's" in text
    assert "14%–40% of adaloss's step" in text
    assert gemm_table(payload).count("\n") == 1 + 2 * len(GEMM_METHODS)
    # GEMMs run as bf16 stand-ins: the comparison is of the time outside them, the table has it
    stand_in = {"gemm": "stand-in", "rows": [
        r | {"outside_gemm_ms": dict.fromkeys(GEMM_METHODS, 50.0) | {"adaloss": o}, "errors": {}}
        for r, o in zip(payload["rows"], (60.0, 52.0))]}
    text = "\n".join(gemm_summary(stand_in))
    assert "Time outside the GEMMs" in text and "1.04–1.20× torchao tensorwise's" in text
    assert "within 1.10× on 1 of 2 models (b)" in text and "Error" not in text
    assert "| 60.0 | 1.20 | (not measured) |" in gemm_table(stand_in)
