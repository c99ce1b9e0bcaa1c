"""The FP8 benchmark's rows (``benchmarks/fp8.py --json``) as Markdown: the table and a summary
computed from it (no number on the page is typed by hand)."""

from __future__ import annotations

from typing import Any

import numpy as np

Row = dict[str, Any]

#: the methods of a row, in the table's order (each a ``{"median", "worst"}`` mean over seeds)
COLUMNS = ("adaloss", "current", "current exact", "cast-only", "delayed-16 cold", "delayed-16",
           "adaloss spike", "delayed-16 spike", "delayed-16 after")


def fmt(x: float) -> str:
    return "nan" if not np.isfinite(x) else f"{x:.4f}"


def table(rows: list[Row]) -> str:
    """Median per-parameter error by method (mean over seeds), then adaloss's casts that read
    their own max against current scaling's, and adaloss's largest saturated and flushed
    fractions over the seeds."""
    head = ["model", "forward", "grads", "loss ×", *COLUMNS, "own max / casts (adaloss, current)",
            "saturated", "flushed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a, c = r["runs"][0]["adaloss"], r["runs"][0]["current"]
        sat = max(run["adaloss"]["saturated"] for run in r["runs"])
        flushed = max(run["adaloss"]["flushed"] for run in r["runs"])
        cells = [r["model"], r["dtype"], r["format"].removeprefix("float8_"), f"{r['factor']:g}",
                 *(fmt(r[k]["median"]) for k in COLUMNS),
                 f"{a['own_max']}/{a['casts']}, {c['own_max']}/{c['casts']}", f"{sat:.1e}", f"{flushed:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _count(rows: list[Row], better: Any) -> int:
    return sum(1 for r in rows if better(r))


def summary(rows: list[Row], tol: float = 0.01) -> list[str]:
    """Sentences on the rows: adaloss against current scaling (within ``tol``, relative), against
    delayed scaling cold, warm and after a spike."""
    def med(r: Row, k: str) -> float:
        v = r[k]["median"]
        return v if np.isfinite(v) else float("inf")

    n = len(rows)
    ties = _count(rows, lambda r: med(r, "adaloss") <= med(r, "current") * (1 + tol))
    cold = _count(rows, lambda r: med(r, "adaloss") < med(r, "delayed-16 cold"))
    warm = _count(rows, lambda r: med(r, "adaloss") <= med(r, "delayed-16") * (1 + tol))
    spike = _count(rows, lambda r: med(r, "adaloss spike") < med(r, "delayed-16 spike"))
    after = _count(rows, lambda r: med(r, "adaloss") <= med(r, "delayed-16 after") * (1 + tol))
    nan = _count(rows, lambda r: not np.isfinite(r["delayed-16 cold"]["median"]))
    exact = _count(rows, lambda r: med(r, "current exact") < med(r, "current") * (1 - tol))
    own = sorted({(r["runs"][0]["adaloss"]["own_max"], r["runs"][0]["adaloss"]["casts"]) for r in rows})
    worst_sat = max(run["adaloss"]["saturated"] for r in rows for run in r["runs"])
    return [
        f"- **against current scaling**: adaloss's median error within {tol:.0%} of it or lower on "
        f"{ties} of {n} rows (median ratio "
        f"{np.median([med(r, 'adaloss') / med(r, 'current') for r in rows]):.3f}).",
        f"- **against delayed scaling at step 0** (scale 1, empty history): lower on {cold} of {n} rows"
        + (f"; the delayed backward is NaN on {nan} (flax computes its scale in the model's dtype: "
           "fp16 flushes it to zero)." if nan else "."),
        f"- **against delayed scaling warmed for 16 steps on the same batch**: within {tol:.0%} or lower "
        f"on {warm} of {n} rows. Current scaling with the exact scale (`max|g|` mapped to the format's "
        f"max, not a power of two below it) is more than {tol:.0%} better than with a power of two on "
        f"{exact} of {n} rows (on tensors this small a few entries near `max|g|`, such as the loss "
        "cotangent's target entries, carry much of the norm, and an exact scale represents the largest "
        "exactly); adaloss's scales are powers of two.",
        f"- **one scale for the whole backward** (`cast-only`): within {tol:.0%} of adaloss on "
        f"{_count(rows, lambda r: abs(med(r, 'cast-only') - med(r, 'adaloss')) <= tol * med(r, 'adaloss'))} "
        f"of {n} rows: at these depths and at initialisation one scale fits every layer's range.",
        f"- **a spike** (one step at the loss ×1000 after those 16): lower on {spike} of {n} rows; "
        f"the step after it: within {tol:.0%} or lower on {after} of {n}.",
        "- **casts that read their own max** (a second pass over the tensor) out of the casts per "
        "backward, adaloss: " + ", ".join(f"{o}/{c}" for o, c in own) + "; current scaling: all of "
        f"them. Largest saturated fraction of any adaloss cast: {worst_sat:.1e}.",
    ]
