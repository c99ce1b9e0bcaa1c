"""The zoo benchmark's rows (``benchmarks/zoo.py --json``) as Markdown: the table and a
summary computed from it (no number on the page is typed by hand)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: the global loss scales every per-layer method is compared with
GLOBAL = ("dynamic", "converged", "static")
Row = dict[str, Any]


def median(r: Row, method: str) -> float:
    """``method``'s median per-parameter error in row ``r``."""
    return float(r["errors"][method]["median"])


def ratio(r: Row, method: str = "adaloss", against: Sequence[str] = GLOBAL) -> float:
    """``method``'s median error over the best of ``against`` (≤ 1: at least as good)."""
    best = min(median(r, m) for m in against if m in r["errors"])
    return median(r, method) / best if best > 0 else float("inf")


def table(rows: list[Row]) -> str:
    """One line per model, loss factor and logit multiplier: median error per method (worst
    in the JSON), the per-layer methods over the best global one, the converged dynamic
    scale, the passes adaloss and the dynamic scale skipped, layers found, warnings."""
    methods = list(dict.fromkeys(m for r in rows for m in r["errors"]))
    per_layer = [m for m in ("adaloss", "largest-safe", "cast-only") if m in methods]
    head = ["framework", "model", "loss ×", "logits ×", *methods,
            *(f"{m} / best global" for m in per_layer), "converged scale",
            "skipped (adaloss / dynamic)", "layers", "warnings"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["framework"], r["model"], f"{r['factor']:g}", f"{r['logits']:g}"]
        cells += [f"{median(r, m):.3g}" for m in methods]
        cells += [f"{ratio(r, m):.2f}" for m in per_layer]
        cells += [f"2^{r['converged log2']}" if "converged log2" in r else "–",
                  f"{r['adaloss skipped']} / {r['dynamic skipped']}",
                  f"{r['layers_found']}/{r['layers_expected']}", str(len(r["warnings"]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "–"


def summary(rows: list[Row]) -> list[str]:
    """Bullets computed from ``rows``: skips, adaloss against the best global scale per
    framework and at ×1e-8, and the two ablations (cast-only, largest-safe) against adaloss."""
    finite = [r for r in rows if np.isfinite(ratio(r))]
    out = [f"- **Rows**: {len(rows)} (models × loss factors × logit multipliers).",
           f"- **Skipped passes** (most on one row): adaloss {max(r['adaloss skipped'] for r in rows)}, "
           f"cast-only {max(r.get('cast-only skipped', 0) for r in rows)}, the dynamic scale from 2^16 "
           f"{max(r['dynamic skipped'] for r in rows)}."]
    for fw in sorted({r["framework"] for r in finite}):
        mine = [r for r in finite if r["framework"] == fw]
        ratios = [ratio(r) for r in mine]
        out.append(f"- **{fw}, adaloss / best global** (dynamic from 2^16, converged, static 2^15): "
                   f"{_span(ratios)} over {len(mine)} rows; ≤ 1 on {sum(x <= 1 for x in ratios)}, "
                   f"≤ 1.05 on {sum(x <= 1.05 for x in ratios)}.")
    for label, confident in (("logits ×1", False), ("logits ×10/×30", True)):
        deep = [r for r in finite if r["factor"] == 1e-8 and (r["logits"] != 1) == confident]
        if deep:
            out.append(f"- **×1e-8, {label}**: adaloss / best global {_span([ratio(r) for r in deep])}; "
                       f"against the dynamic scale from 2^16 alone "
                       f"{_span([ratio(r, against=('dynamic',)) for r in deep])}.")
    for method in ("cast-only", "largest-safe", "converged"):
        pairs = [r for r in finite if method in r["errors"] and median(r, "adaloss") > 0]
        if pairs:
            rel = [median(r, method) / median(r, "adaloss") for r in pairs]
            out.append(f"- **{method} / adaloss**: median {np.median(rel):.2f}, range {_span(rel)}; "
                       f"worse than adaloss by more than 5 % on {sum(x > 1.05 for x in rel)} of "
                       f"{len(rel)} rows, better by more than 5 % on {sum(x < 1 / 1.05 for x in rel)}.")
    return out
