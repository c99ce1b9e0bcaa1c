"""The failure-case gallery and ``docs/results.md``: every number and plot on the page is
produced by ``adaloss-study`` runs; each section shows the command that regenerates it.

    adaloss-study --gallery --out docs
"""

from __future__ import annotations

import dataclasses
import json
import re
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


ABLATIONS = ("fp32", "static", "dynamic", "dynamic-grow", "adaloss-product", "cast-only", "largest-safe")
CASES = (
    Case("default", "Default run: loss ×1e-3, the mean over a 1M-token batch", (),
         "The README's first command, as it runs (one seed). The loss is a mean over N tokens, so "
         "each logit's cotangent is "
         "(p − onehot)/N: ~1e-5 at this batch's 1024 tokens, ~1e-8 at a 1M-token batch (×1e-3), below "
         "fp16's smallest subnormal (6e-8). Unscaled fp16 loses it; a global 2^15-2^16 lifts it to "
         "~5e-4 at the logits but leaves the attenuated cotangents of lower layers in fp16's subnormal "
         "range (below 2^-14: fewer bits); adaptive scaling aims to leave at most T of each below it."),
    Case("natural", "Natural loss (×1): does anything need scaling at this batch size?",
         ("--loss-factor", "1", "--methods", "fp32", "fp16", "dynamic", "adaloss-product", "cast-only"),
         "At 1024 tokens the cotangents are ~1e-5: fp16 keeps them (subnormal at the smallest)."),
    Case("deep", "Tiny loss (×1e-8): beyond the global scales' reach",
         ("--loss-factor", "1e-8", "--methods", *ABLATIONS),
         "Cotangents 1e8 below the natural ones (a 1M-token mean attenuated 1e5 more, as deep stacks "
         "do): 2^15 and 2^16 leave the logits' cotangent at ~1e-8, mostly zero; GradScaler's rule "
         "doubles only after 2000 clean steps; dynamic-grow (the same rule with its interval scaled "
         "to the run, steps/20) climbs 2^24 in about 24 intervals; the cast decision picks the "
         "needed scale at the first step."),
    Case("overflow", "Large loss (×1e3): a static scale overflows",
         ("--loss-factor", "1e3", "--methods", "fp32", "static", "dynamic", "dynamic-grow",
          "adaloss-product", "cast-only"),
         "A scale chosen for typical losses overflows when the loss is large: static 2^15 skips every "
         "step; the dynamic scales lose their first steps backing off; the caps keep adaptive "
         "scaling finite."),
    Case("torch-default", "PyTorch, loss ×1e-3: torch.amp.GradScaler vs AdaLossScaler",
         ("--framework", "torch"),
         "The default run with the PyTorch bridge and torch's own GradScaler."),
)


#: the study with FP8 gradients (``--grad-format``): its own section, apart from the fp16 cases
FP8_CASES = (
    Case("fp8-e5m2", "FP8 e5m2 gradients", ("--grad-format", "float8_e5m2", "--seeds", "2"),
         "Every method but fp32 computes in bf16; adaloss, current and delayed scaling quantize each "
         "layer's cotangent to e5m2 (Transformer Engine's HYBRID gradients), bf16 does not quantize. "
         "`fp32-cold` is fp32 with no gradient at step 0, what delayed scaling's cold start does (its "
         "scale of 1 flushes every cotangent): Adam's bias correction then damps the next updates, a "
         "warm-up this short run at a fixed learning rate gains from; compare delayed scaling with it."),
    Case("fp8-e4m3", "FP8 e4m3 gradients per tensor", ("--grad-format", "float8_e4m3fn", "--seeds", "2"),
         "The same with e4m3 gradients (3 mantissa bits, ~18 binades), per tensor: no production "
         "stack trains this way (Transformer Engine's all-e4m3 recipe needs 1×128 tiles); how far "
         "does each way of choosing the scale get?"),
    Case("fp8-torch", "FP8 e5m2 gradients in PyTorch, against torchao",
         ("--framework", "torch", "--grad-format", "float8_e5m2", "--seeds", "2"),
         "The same in PyTorch: the bridge's fp8 casts against torchao's float8 training "
         "(`convert_to_float8_training`, `emulate=True`; `tensorwise`: inputs and weights in e4m3 "
         "and gradients in e5m2, each at its own amax; `rowwise`: e4m3 per row), whose forward is "
         "quantized too. No delayed scaling: torchao removed it."),
    Case("fp8-spike", "FP8 e5m2 gradients, a loss spike mid-run",
         ("--grad-format", "float8_e5m2", "--spike-at", "150", "--seeds", "2", "--methods", "fp32", "bf16",
          "adaloss-product", "current", "delayed-16", "delayed-1024"),
         "From step 150 the loss is ×1000 for 10 steps, where a stale amax history mis-scales "
         "(`spike loss`: the mean train loss over the spike and the 20 steps after it). Adam's second "
         "moment keeps the spike's gradients for ~1000 steps, so every method, fp32 included, trains "
         "slower after it: compare the methods with each other."),
)


def slug(title: str) -> str:
    """The anchor GitHub and MyST (``myst_heading_anchors``) give a heading: lower case, the
    characters other than letters, digits, ``_``, ``-`` and spaces dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def case_anchor(name: str) -> str:
    """The anchor of a study case's section on the results page."""
    return slug(next(c.title for c in CASES if c.name == name))


ADALOSS = ("adaloss-product", "adaloss-output", "adaloss-gradient")
OVERHEAD = (
    Case("overhead-jax", "JAX: adaloss vs jmp.DynamicLossScale", ("--overhead",),
         "The study model, fp16 compute, Adam."),
    Case("overhead-torch", "PyTorch: AdaLossScaler vs torch.amp.GradScaler",
         ("--overhead", "--framework", "torch"), "The same model in PyTorch, fp16 autocast, Adam."),
)


def cell(vals: np.ndarray, fmt: str) -> str:
    """Mean ± std over seeds (``–`` where nothing was measured)."""
    if np.isnan(vals).all():
        return "–"
    return f"{vals.mean():{fmt}}" + (f" ± {vals.std():{fmt}}" if len(vals) > 1 else "")


#: the study table's columns that measure 16-bit underflow (an fp8 run measures its casts instead)
UNDERFLOW_COLUMNS = ("underflow_mean", "underflow_max", "within_T", "carried_mean")


def _markdown(rows: dict[str, list[dict[str, float]]], ref: str = "fp32", fp8: bool = False) -> str:
    """The study table; ``vs fp32``: the relative val-loss difference to fp32 at the same seed
    (same initialisation and batches), mean ± std over seeds; ``fp8``: without the 16-bit
    underflow columns."""
    cols = [("spike_loss", "spike loss", ".4f"), ("val_loss", "val loss", ".4f"),
            ("val_ppl", "val ppl", ".3f"), ("skipped", "skipped", ".0f"),
            ("underflow_mean", "underflow mean", ".2e"), ("underflow_max", "underflow max", ".2e"),
            ("within_T", "within T", ".2f"), ("carried_mean", "carried mean", ".2e"),
            ("flushed_max", "flushed max", ".2e"),
            ("step_ms", "ms/step", ".1f")]
    first = next(iter(rows.values()))[0]
    cols = [c for c in cols if c[0] in first]  # records written before a column existed
    if fp8:
        cols = [c for c in cols if c[0] not in UNDERFLOW_COLUMNS]
    paired = ref in rows
    head = "| method | " + " | ".join(c[1] for c in cols) + (" | vs fp32 |" if paired else " |")
    lines = [head, "|" + "---|" * (len(cols) + 1 + paired)]
    for method, runs in rows.items():
        cells = []
        for key, _, fmt in cols:
            cells.append(cell(np.array([r[key] for r in runs], float), fmt))
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
        record = json.loads(saved.read_text())
        if result_file == "study.json" and not record.get("args", {}).get("no_plots"):
            from adaloss_study.cli import replot  # the plots as this version draws them
            replot(record, out / case.name)
        return argv, record
    return argv, run(argv)


def write_results(out: Path, run: Callable[[list[str]], dict[str, Any]],
                  cases: tuple[Case, ...] = CASES, reuse: bool = False,
                  overhead: tuple[Case, ...] = OVERHEAD, fp8: tuple[Case, ...] = FP8_CASES) -> Path:
    """Run ``cases``, ``fp8`` and ``overhead`` (``run(argv)`` is ``adaloss-study argv``) into
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
             "Underflow: per layer, the fraction of the incoming cotangent's entries (non-zero in an "
             "fp32 backward at the same weights) whose value, times the scale the fp16 cotangent "
             "carries, is below u_min = 2^-14, fp16's smallest normal number: what the scale "
             "decisions leave below it, what T bounds; `within T`: the share of measured "
             "layer-steps at most T; `carried mean`: the fraction the fp16 backward holds below "
             "u_min as carried, which adds what fp16 arithmetic loses at any scale (the "
             "tanh-approximated GELU's derivative is exactly 0 in fp16 where tanh saturates); "
             "`flushed max`: the largest fraction held at zero. Measured every 50 steps. Adam's ε "
             "is 1e-8 × the loss factor, so the fp32 reference is the same at every factor.", ""]
    intro = len(parts)
    for case in cases:
        argv, record = _run_case(out, case, "study.json", run, reuse)
        records[case.name] = record
        parts += _case_section(out, case, argv, record, "##", "underflow")
        parts += _against_threshold(record)
    parts[intro:intro] = _overview(records)
    parts += _which_model(records)
    parts += _threshold_summary(records)
    parts += _fp8_cases(out, fp8, run, reuse)
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
    parts += _zoo(out / "zoo.json")
    parts += _fp8_benchmark(out / "fp8.json")
    from adaloss_study import cost_tables, depth_tables, parallel_tables
    parts += _benchmark(out / "depth.json", depth_tables.section)
    parts += _benchmark(out / "cost_breakdown.json", cost_tables.section)
    parts += _benchmark(out / "gpu_cost.json", cost_tables.gpu_section)
    parts += _benchmark(out / "data_parallel.json", parallel_tables.section)
    path = out / "results.md"
    path.write_text("\n".join(parts))
    return path


def _fp8_cases(out: Path, cases: tuple[Case, ...], run: Callable[[list[str]], dict[str, Any]],
               reuse: bool) -> list[str]:
    """The FP8 study's sections: the table (no underflow columns: the casts report their own
    fractions; `flushed max`: the largest fraction any cast flushed), loss curves, the casts'
    flushed and saturated fractions over steps, adaloss's per-layer scales."""
    if not cases:
        return []
    parts = ["## FP8 gradients: the study", "",
             "The same model and data; `vs fp32`: the relative val-loss difference to fp32 at the "
             "same seed. `current`: per-tensor current scaling (each cast's own max, Transformer "
             "Engine's `Float8CurrentScaling`); `delayed-16` / `delayed-1024`: flax's `fp8_ops` "
             "delayed scaling (amax histories of 16 and 1024 steps, scale 1 at step 0) on every "
             "layer's output cotangent; `cast-only`: adaloss with one scale, the loss cotangent's.", ""]
    for case in cases:
        argv, record = _run_case(out, case, "study.json", run, reuse)
        parts += _case_section(out, case, argv, record, "###", "fp8_fractions")
    return parts


def _case_section(out: Path, case: Case, argv: list[str], record: dict[str, Any], level: str,
                  second_plot: str) -> list[str]:
    """A study case's heading, question, command, table, loss curves and ``second_plot``, and
    adaloss's per-layer scales where plotted."""
    rel = Path(case.name)
    alt = second_plot.replace("_", " ")
    parts = [f"{level} {case.title}", "", case.question, "",
             f"```\nadaloss-study {shlex.join(argv)}\n```", "",
             _markdown(record["summary"], fp8=second_plot == "fp8_fractions"), "",
             f"![loss]({rel / 'loss.png'}) ![{alt}]({rel / (second_plot + '.png')})", ""]
    heat = out / case.name / "scales_adaloss-product.png"
    if heat.exists():
        parts += [f"![per-layer scales, adaloss-product]({rel / heat.name})", ""]
    return parts


FP8_COMMAND = "python benchmarks/fp8.py"


def _fp8_benchmark(path: Path) -> list[str]:
    """The FP8 benchmark's tables and summaries, from its JSON (if it was run)."""
    if not path.exists():
        return []
    from adaloss_zoo.fp8_tables import section

    return ["## FP8 gradients on the model zoo: one backward per model, format and loss factor", "",
            f"```\n{FP8_COMMAND}\n```", "",
            "The JAX and PyTorch zoos with a bf16 forward; median per-parameter error against the same "
            "forward's fp32 backward at loss ×1, the mean over two initialisations and batches. Methods "
            "in the benchmark's docstring; `own max / casts`: the casts whose scale reads a full "
            "reduction of the tensor they convert (a second pass over it), for adaloss and current "
            "scaling.", "", *section(json.loads(path.read_text()))]


def _benchmark(path: Path, section: Any) -> list[str]:
    """A benchmark's section of the results page, from its JSON (if it was run)."""
    if not path.exists():
        return []
    return section(json.loads(path.read_text()))


ZOO_COMMAND = "python benchmarks/zoo.py --factors 1 1e-3 1e-6 1e-8 --logits 1 10 30 --json docs/zoo.json"


def _zoo(path: Path) -> list[str]:
    """The model-zoo benchmark's table and summary, from its JSON (if it was run)."""
    if not path.exists():
        return []
    from adaloss_zoo.tables import summary, table

    rows = json.loads(path.read_text())
    return ["## Model zoo: one backward per model, loss factor and logit multiplier", "",
            f"```\n{ZOO_COMMAND}\n```", "",
            "Third-party models (HF GPT2, Llama, BERT, torchvision resnet18, timm ViT; Flax linen CNN "
            "and transformer, nnx with BatchNorm/Dropout, Equinox), tiny configs, random init, CPU "
            "fp16; the logits multiplied in fp32 by ×10/×30 for a confident softmax. Median "
            "per-parameter error ‖g − g_ref‖/‖g_ref‖ against the same fp16 forward's loss-×1 gradients "
            "(JAX: its exact fp32-backward gradient; torch: its fp16 backward); the worst per row is "
            "in `docs/zoo.json`. Methods: `adaloss` (the default), `largest-safe` (only the overflow "
            "caps decide), `cast-only` (the loss cotangent's statistical decision alone, "
            "`layer_rule=False`), `dynamic` (GradScaler / `jmp.DynamicLossScale` from 2^16, retried on "
            "the batch until finite), `converged` (the largest finite power-of-two global scale: where "
            "a dynamic scale settles once its growth has acted), `static` (2^15), `fp16`.", "",
            *summary(rows), "", table(rows), ""]


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


def overview_table(records: dict[str, dict[str, Any]], page: str = "") -> list[str]:
    """One line per case: val loss relative to fp32 at the same seed (mean over seeds), each case
    linked to its section of the results page (``page``: the link's file, "" on that page)."""
    methods = ("fp16", "static", "dynamic", "dynamic-grow", "adaloss-product", "cast-only", "largest-safe")
    rows = [f"| [{name}]({page}#{case_anchor(name)}) | {len(next(iter(r['summary'].values())))} | "
            + " | ".join(_paired(r, m) for m in methods) + " |" for name, r in records.items()]
    return ["| case | seeds | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods), *rows]


def _overview(records: dict[str, dict[str, Any]]) -> list[str]:
    """The results page's overview section."""
    return ["## Overview", "",
            "Final val loss relative to fp32 at the same seed (same initialisation and batches), mean "
            "over seeds, with the mean number of skipped steps; each case's section below has the "
            "command, the spread and the plots.", "", *overview_table(records), ""]


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
    return [row[:3] for row in _held_rows(record, method)]


def _held_rows(record: dict[str, Any], method: str) -> list[tuple[str, float, float, bool]]:
    """(layer, measured, predicted, held back) per measured step of ``method``'s first seed.
    Held back: a cap or bound set a decision behind the layer's incoming scale below its
    statistical scale (``LayerReport.incoming_held``); records written before that was kept
    fall back to the normal model predicting > T at the carried scale."""
    run = record.get("runs", {}).get(method)
    if not run:
        return []
    t = record["config"]["adaloss"]["threshold"]
    held = run.get("held")
    return [(layer, rate, pred := run["predicted"][step][layer],
             layer in held.get(step, []) if held is not None else pred > t)
            for step, rates in run["underflow"].items() for layer, rate in rates.items()]


def _carried_means(record: dict[str, Any], method: str) -> dict[str, float]:
    """Per layer: mean over the measured steps of the fraction held below u_min as carried."""
    run = record.get("runs", {}).get(method) or {}
    got: dict[str, list[float]] = {}
    for rates in run.get("carried", {}).values():
        for layer, rate in rates.items():
            got.setdefault(layer, []).append(rate)
    return {k: float(np.mean(v)) for k, v in got.items()}


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
    carried = _carried_means(record, method)
    lines = []
    for layer, got in layers.items():
        rates, preds = np.array(got).T
        held = f"{carried[layer]:.2e}" if layer in carried else "–"
        lines.append(f"| {layer} | {rates.mean():.2e} | {rates.max():.2e} | {preds.mean():.2e} | "
                     f"{held} | {int((rates > t).sum())} / {len(got)} |")
    return ["<details><summary>Per-layer measured underflow vs T = "
            f"{t:g} ({method}, seed 0)</summary>", "",
            "| layer | measured mean | measured max | predicted mean | carried mean | steps above T |",
            "|---|---|---|---|---|---|", *lines, "", "</details>", ""]


def _threshold_summary(records: dict[str, dict[str, Any]], method: str = "adaloss-product") -> list[str]:
    """The target: measured underflow ≤ T wherever the bounds let the statistical scale through."""
    rows, misses = [], {}
    for name, record in records.items():
        pairs = _held_rows(record, method)
        if not pairs:
            continue
        t = record["config"]["adaloss"]["threshold"]
        short = sum(1 for _, rate, _, held in pairs if rate > t and held)
        missed = [layer for layer, rate, _, held in pairs if rate > t and not held]
        misses[name] = sorted(set(missed))
        limited, decisions = _limited_share(record, method)
        ok = len(pairs) - short - len(missed)
        rows.append(f"| {name} | {len(pairs)} | {ok} | {short} | {len(missed)} | {limited} / {decisions} |")
    if not rows:
        return []
    listed = [f"- {name}: " + ", ".join(f"`{x}`" for x in free) for name, free in misses.items() if free]
    return ["## Measured underflow against the threshold", "",
            f"Each (measured step, layer) of {method} (seed 0), for the cotangent entering the layer: "
            "at most T; above T where a cap or bound set a decision behind the scale it carried "
            "below that decision's statistical scale (held back: no larger scale was available, "
            "`LayerReport.incoming_held`); or above T although nothing held it back (the "
            "decisions' miss: the normal model and the measured lift, "
            "`AdaLossConfig.underflow_feedback`, left more than T there; the lift starts at 0, "
            "so step 0 has only the model). Last column: the decisions (layers and casts) at "
            "those steps whose scale a cap or bound set below the statistical one.", "",
            "| case | layer-steps | ≤ T | > T, scale held back | > T, decisions' miss | decisions limited |",
            "|---|---|---|---|---|---|", *rows, "",
            "Layers above T that nothing held back:" if listed else
            "No layer was above T where nothing held its scale back.", "", *listed, ""]
