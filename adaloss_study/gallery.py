"""The failure-case gallery and ``docs/results.md``: every number and plot on the page is
produced by ``adaloss-study`` runs; each section shows the command that regenerates it.

    adaloss-study --gallery --out docs
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from adaloss_study.overhead import table as overhead_table


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    title: str
    argv: tuple[str, ...]
    question: str


ALL = ("fp32", "fp16", "static", "dynamic", "adaloss-product", "adaloss-output", "adaloss-gradient")
CASES = (
    Case("default", "Default run (loss ×1)", ("--seeds", "3"),
         "Does anything need scaling at the loss's natural magnitude?"),
    Case("overflow", "Large loss (×1e3): a static scale overflows", ("--loss-factor", "1e3", "--seeds", "3"),
         "A loss scale chosen for typical losses overflows when the loss is large: static "
         "2^15 skips every step; dynamic loses its first steps while it backs off."),
    Case("underflow", "Tiny loss (×1e-6): gradients underflow", ("--loss-factor", "1e-6", "--seeds", "3"),
         "Gradients 10^6 smaller than usual: how much do 2^15 (static), 2^16 (dynamic, which "
         "grows only every 2000 steps) and adaptive scaling recover?"),
    Case("underflow-bounds", "Tiny loss (×1e-6), adaptive with looser bounds",
         ("--loss-factor", "1e-6", "--accum-bound", "1e12", "--layer-bound", "1e12", "--seeds", "3",
          "--methods", "fp32", "dynamic", "adaloss-product", "adaloss-output", "adaloss-gradient"),
         "The default bounds (layer and accumulated: u_max = 65504) cap the loss cast's scale, the "
         "first decision of the backward, at 2^15: the ceiling of the global scales. The overflow "
         "caps alone keep every scaled cotangent finite; raising both bounds lets the loss cast take "
         "the scale its statistics ask for."),
    Case("underflow-normal", "Tiny loss (×1e-6), looser bounds, aiming at the normal range",
         ("--loss-factor", "1e-6", "--accum-bound", "1e12", "--layer-bound", "1e12", "--u-min",
          "6.103515625e-05", "--methods", "fp32", "dynamic", "adaloss-product", "adaloss-output",
          "adaloss-gradient"),
         "With u_min = 2^-14 (the smallest normal fp16 number) instead of 2^-24, the scales keep "
         "cotangents out of the subnormal range, where they have few significant bits."),
    Case("underflow-deep", "Tinier loss (×1e-8): the global scales' ceiling",
         ("--loss-factor", "1e-8", "--accum-bound", "1e12", "--layer-bound", "1e12", "--seeds", "3",
          "--methods", "fp32", "fp16", "static", "dynamic", "adaloss-product", "adaloss-output",
          "adaloss-gradient"),
         "Cotangents 10^8 below the usual: 2^15 and 2^16 leave most of the logits' cotangent at "
         "zero (dynamic grows ×2 only every 2000 clean steps); adaptive scaling with loose bounds "
         "scales the loss cast by what its statistics ask for. (fp32 itself trains slower "
         "here: Adam's ε = 1e-8 is no longer small against gradients of ~1e-10.)"),
    Case("loose-bounds", "Looser bounds at the usual loss (×1) and a large one (×1e3)",
         ("--accum-bound", "1e12", "--layer-bound", "1e12", "--seeds", "3", "--methods", "fp32",
          "dynamic", "adaloss-product"),
         "Do the looser bounds that rescue tiny losses cost anything where the default bounds were "
         "already enough? (The ×1e3 run is the next section.) A scale the bounds no longer hold "
         "back could overflow a weight gradient, which carries the accumulated scale unguarded: "
         "such steps would show up as skipped."),
    Case("loose-bounds-overflow", "Looser bounds, large loss (×1e3)",
         ("--loss-factor", "1e3", "--accum-bound", "1e12", "--layer-bound", "1e12", "--seeds", "3",
          "--methods", "fp32", "dynamic", "adaloss-product"),
         "The overflow case with the looser bounds."),
    Case("overflow-torch", "Large loss (×1e3), PyTorch: torch.amp.GradScaler vs AdaLossScaler",
         ("--framework", "torch", "--loss-factor", "1e3", "--seeds", "3"),
         "The overflow case with the PyTorch bridge and torch's own GradScaler."),
    Case("digits-underflow", "CNN on digits, tiny loss (×1e-6)",
         ("--task", "digits", "--loss-factor", "1e-6", "--steps", "150", "--batch", "64"),
         "A convolutional model: 2 convolutions and a linear head on scikit-learn's 8x8 digits."),
    Case("digits-loose-bounds", "CNN on digits, tiny loss (×1e-6), looser bounds",
         ("--task", "digits", "--loss-factor", "1e-6", "--steps", "150", "--batch", "64",
          "--accum-bound", "1e12", "--layer-bound", "1e12", "--methods", "fp32", "dynamic", "adaloss-product",
          "adaloss-output", "adaloss-gradient"),
         "The digits case with the bounds raised (the default bounds held most decisions back: "
         "see the last table's decisions-limited column)."),
)
ADALOSS = ("adaloss-product", "adaloss-output", "adaloss-gradient")
OVERHEAD = (
    Case("overhead-jax", "JAX: adaloss vs jmp.DynamicLossScale", ("--overhead",),
         "The study model, fp16 compute, Adam."),
    Case("overhead-torch", "PyTorch: AdaLossScaler vs torch.amp.GradScaler",
         ("--overhead", "--framework", "torch"), "The same model in PyTorch, fp16 autocast, Adam."),
)


def _markdown(rows: dict[str, list[dict[str, float]]], ref: str = "fp32") -> str:
    """The study table; ``vs fp32``: the relative val-loss difference to fp32 at the same seed
    (same initialisation and batches), mean ± std over seeds."""
    cols = [("val_loss", "val loss", ".4f"), ("val_ppl", "val ppl", ".3f"), ("skipped", "skipped", ".0f"),
            ("underflow_mean", "underflow mean", ".2e"), ("underflow_max", "underflow max", ".2e"),
            ("step_ms", "ms/step", ".1f")]
    paired = ref in rows
    head = "| method | " + " | ".join(c[1] for c in cols) + (" | vs fp32 |" if paired else " |")
    lines = [head, "|" + "---|" * (len(cols) + 1 + paired)]
    for method, runs in rows.items():
        cells = []
        for key, _, fmt in cols:
            v = np.array([r[key] for r in runs], float)
            cells.append(f"{v.mean():{fmt}}" + (f" ± {v.std():{fmt}}" if len(v) > 1 else ""))
        if paired:
            rel = _relative_to(rows, method, ref)
            cells.append(f"{rel.mean():+.2f}%" + (f" ± {rel.std():.2f}" if len(rel) > 1 else ""))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_case(out: Path, case: Case, result_file: str, run: Callable[[list[str]], dict[str, Any]],
              reuse: bool) -> tuple[list[str], dict[str, Any]]:
    argv = [*case.argv, "--out", str(out / case.name)]
    saved = out / case.name / result_file
    if reuse and saved.exists():
        return argv, json.loads(saved.read_text())
    return argv, run(argv)


def write_results(out: Path, run: Callable[[list[str]], dict[str, Any]],
                  cases: tuple[Case, ...] = CASES, reuse: bool = False,
                  overhead: tuple[Case, ...] = OVERHEAD) -> Path:
    """Run ``cases`` and ``overhead`` (``run(argv)`` is ``adaloss-study argv``) into
    ``out/<case>/`` and write ``out/results.md``.

    ``reuse``: a case whose ``study.json`` / ``overhead.json`` exists (from the same
    command) is read, not rerun.
    """
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict[str, Any]] = {}
    parts = ["# Results", "",
             "Generated by `adaloss-study --gallery --out docs` (each section: its own command). "
             "Char-level GPT on Shakespeare (held-out plays for val loss) unless said otherwise; "
             "JAX unless `--framework torch`; 2-core CPU. "
             "Underflow: per layer, the fraction of the incoming cotangent that is zero in fp16 "
             "but not in fp32 at the same weights, measured every 50 steps.", ""]
    intro = len(parts)
    for case in cases:
        argv, record = _run_case(out, case, "study.json", run, reuse)
        records[case.name] = record
        rel = Path(case.name)
        parts += [f'<a id="{case.name}"></a>', "", f"## {case.title}", "", case.question, "",
                  f"```\nadaloss-study {shlex.join(argv)}\n```", "", _markdown(record["summary"]), "",
                  f"![loss]({rel / 'loss.png'}) ![underflow]({rel / 'underflow.png'})", ""]
        heat = out / case.name / "scales_adaloss-product.png"
        if heat.exists():
            parts += [f"![per-layer scales, adaloss-product]({rel / heat.name})", ""]
        parts += _against_threshold(record)
    parts[intro:intro] = _overview(records)
    parts += _which_model(records)
    parts += _threshold_summary(records)
    if overhead:
        parts += ["## Overhead", "",
                  "Step time of fp16 with no scaling, dynamic global scaling and adaloss-product, "
                  "timed in alternation in one process (rounds of 30 steps after a warm-up; forward, "
                  "backward, (un)scaling, Adam). This CPU is shared and noisy: the rounds show the spread.",
                  ""]
        for case in overhead:
            argv, result = _run_case(out, case, "overhead.json", run, reuse)
            parts += [f"### {case.title}", "", case.question, "",
                      f"```\nadaloss-study {shlex.join(argv)}\n```", "",
                      f"{result['parameters']:,} parameters; {result['machine']}.", "",
                      overhead_table(result), ""]
    path = out / "results.md"
    path.write_text("\n".join(parts))
    return path


def _relative_to(rows: dict[str, list[dict[str, float]]], method: str, ref: str) -> np.ndarray:
    """Per seed: 100·(val loss of ``method`` / val loss of ``ref`` − 1), the seeds paired."""
    return 100 * (np.array([r["val_loss"] for r in rows[method]])
                  / np.array([r["val_loss"] for r in rows[ref]]) - 1)


def _paired(record: dict[str, Any], method: str, ref: str = "fp32") -> str:
    rows = record["summary"]
    if method not in rows or ref not in rows:
        return "–"
    rel = _relative_to(rows, method, ref)
    skipped = int(np.mean([r["skipped"] for r in rows[method]]))
    return f"{rel.mean():+.2f}%" + (f" ({skipped} skipped)" if skipped else "")


def _overview(records: dict[str, dict[str, Any]]) -> list[str]:
    """One line per case: val loss relative to fp32 at the same seed (mean over seeds)."""
    methods = ("fp16", "static", "dynamic", "adaloss-product")
    rows = [f"| [{name}](#{name}) | {len(next(iter(r['summary'].values())))} | "
            + " | ".join(_paired(r, m) for m in methods) + " |" for name, r in records.items()]
    return ["## Overview", "",
            "Final val loss relative to fp32 at the same seed (same initialisation and batches), mean "
            "over seeds, with the mean number of skipped steps; each case's section below has the "
            "command, the spread and the plots.", "",
            "| case | seeds | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods), *rows, ""]


def _which_model(records: dict[str, dict[str, Any]]) -> list[str]:
    """The three statistical models side by side over the cases that ran all three."""
    rows, wins, ties, spread = [], {m: 0 for m in ADALOSS}, 0, 0.0
    for name, record in records.items():
        summary = record["summary"]
        if not all(m in summary for m in ADALOSS):
            continue
        under = {m: float(np.mean([r["underflow_mean"] for r in summary[m]])) for m in ADALOSS}
        val = {m: float(np.mean([r["val_loss"] for r in summary[m]])) for m in ADALOSS}
        best = min(under.values())
        leaders = [m for m in ADALOSS if under[m] == best]
        if len(leaders) == 1:
            wins[leaders[0]] += 1
        else:
            ties += 1
        spread = max(spread, 100 * (max(val.values()) / min(val.values()) - 1))
        rows.append(f"| {name} | " + " | ".join(f"{val[m]:.4f} / {under[m]:.2e}" for m in ADALOSS) + " |")
    if not rows:
        return []
    best_model = max(wins, key=wins.get)
    return ["## Which statistical model", "",
            "Val loss / mean measured underflow of the three models, per case:", "",
            "| case | " + " | ".join(ADALOSS) + " |", "|---|---|---|---|", *rows, "",
            "Strictly lowest mean underflow: " + ", ".join(f"{m} in {k}" for m, k in wins.items())
            + f" of {len(rows)} cases; tied in {ties}. The three val losses differ by at most "
            f"{spread:.2f}% in any case.", "",
            f"Default: `{best_model.split('-', 1)[1]}`: where the models differ at all, it leaves the "
            "least underflow, at the same loss and cost.", ""]


def _threshold_rows(record: dict[str, Any], method: str) -> list[tuple[str, float, float]]:
    """(layer, measured, predicted underflow) over the measured steps of ``method``'s first seed."""
    run = record.get("runs", {}).get(method)
    if not run:
        return []
    return [(layer, rate, run["predicted"][step][layer])
            for step, rates in run["underflow"].items() for layer, rate in rates.items()]


def _limited_share(record: dict[str, Any], method: str) -> tuple[int, int]:
    """(decisions a cap or bound set, all decisions) over the recorded steps of ``method``."""
    run = record["runs"][method]
    steps = [k for k in run.get("limited", {}) if k in run["underflow"]]
    return (sum(len(run["limited"][k]) for k in steps),
            sum(len([n for n in run["scales"][k] if n != "global"]) for k in steps))


def _against_threshold(record: dict[str, Any], method: str = "adaloss-product") -> list[str]:
    """Per layer: measured underflow of the incoming cotangent against T, and what the
    normal model predicted at the scale it carried."""
    rows = _threshold_rows(record, method)
    if not rows:
        return []
    t = record["config"]["adaloss"]["threshold"]
    layers: dict[str, list[tuple[float, float]]] = {}
    for layer, rate, pred in rows:
        layers.setdefault(layer, []).append((rate, pred))
    lines = []
    for layer, got in layers.items():
        rates, preds = np.array(got).T
        lines.append(f"| {layer} | {rates.mean():.2e} | {rates.max():.2e} | {preds.mean():.2e} | "
                     f"{int((rates > t).sum())} / {len(got)} |")
    return ["<details><summary>Per-layer measured underflow vs T = "
            f"{t:g} ({method}, seed 0)</summary>", "",
            "| layer | measured mean | measured max | predicted mean | steps above T |",
            "|---|---|---|---|---|", *lines, "", "</details>", ""]


def _threshold_summary(records: dict[str, dict[str, Any]], method: str = "adaloss-product") -> list[str]:
    """The target: measured underflow ≤ T wherever the bounds let the statistical scale through."""
    rows, misses = [], {}
    for name, record in records.items():
        pairs = _threshold_rows(record, method)
        if not pairs:
            continue
        t = record["config"]["adaloss"]["threshold"]
        short = sum(1 for _, rate, pred in pairs if rate > t and pred > t)
        missed = [layer for layer, rate, pred in pairs if rate > t >= pred]
        misses[name] = sorted(set(missed))
        limited, decisions = _limited_share(record, method)
        ok = len(pairs) - short - len(missed)
        rows.append(f"| {name} | {len(pairs)} | {ok} | {short} | {len(missed)} | {limited} / {decisions} |")
    if not rows:
        return []
    listed = [f"- {name}: " + ", ".join(f"`{x}`" for x in free) for name, free in misses.items() if free]
    return ["## Measured underflow against the threshold", "",
            f"Each (measured step, layer) of {method} (seed 0), for the cotangent entering the layer: "
            "at most T; above T where the scale it carried was too small for T (the normal model "
            "at that scale predicts > T too: a cap or bound downstream held the scale back); or "
            "above T although the model predicted ≤ T (the model's miss: more tiny entries than a "
            "normal distribution has, e.g. after an activation's derivative). Last column: the "
            "decisions (layers and casts) at those steps whose scale a cap or bound set below the "
            "statistical one.", "",
            "| case | layer-steps | ≤ T | > T, scale held back | > T, model's miss | decisions limited |",
            "|---|---|---|---|---|---|", *rows, "",
            "Layers above T where the model predicted ≤ T:" if listed else
            "No layer was above T where the model predicted ≤ T.", "", *listed, ""]
