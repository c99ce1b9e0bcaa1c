"""The FP8 benchmark's rows (``benchmarks/fp8.py --json``) as Markdown: tables and summaries
computed from them (no number on the page is typed by hand)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Row = dict[str, Any]

#: the JAX gradient-only methods of a row, in the table's order (each a ``{"median", "worst"}``
#: mean over seeds)
COLUMNS = ("adaloss", "adaloss warm", "current", "current exact", "cast-only", "delayed-16 cold",
           "delayed-16", "adaloss spike", "delayed-16 spike", "delayed-16 after")
#: the decision rule's alternatives, against current scaling (the rule table)
RULES = ("adaloss", "adaloss exact", "adaloss T_sat=1e-2", "adaloss T_sat=1e-6", "current exact")
#: end to end: every GEMM fp8 × fp8 (the layers' inputs and weights in e4m3)
E2E_COLUMNS = ("adaloss e2e", "current e2e", "Fp8DotGeneralOp cold", "Fp8DotGeneralOp")
TORCH_COLUMNS = ("adaloss", "adaloss warm", "current", "torchao tensorwise", "torchao rowwise")
TOL = 0.01


def fmt(x: float) -> str:
    return "nan" if not np.isfinite(x) else f"{x:.4f}"


def _med(r: Row, k: str) -> float:
    v = r[k]["median"]
    return v if np.isfinite(v) else float("inf")


def _count(rows: list[Row], better: Callable[[Row], bool]) -> int:
    return sum(1 for r in rows if better(r))


def _grid(rows: list[Row], columns: tuple[str, ...], extra: tuple[str, ...] = (),
          cells: Callable[[Row], list[str]] = lambda r: []) -> str:
    columns = tuple(c for c in columns if c in rows[0])  # a run with fewer methods
    head = ["model", "forward", "grads", "loss ×", "logits ×", *columns, *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        row = [r["model"], r["dtype"], r["format"].removeprefix("float8_"), f"{r['factor']:g}",
               f"{r.get('logits', 1.0):g}",
               *(fmt(r[k]["median"]) for k in columns), *cells(r)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _fractions(r: Row) -> list[str]:
    sat = max(run["adaloss"]["saturated"] for run in r["runs"])
    flushed = max(run["adaloss"]["flushed"] for run in r["runs"])
    return [f"{sat:.1e}", f"{flushed:.1e}"]


def table(rows: list[Row]) -> str:
    """JAX, gradients only: median per-parameter error by method (mean over seeds), then
    adaloss's casts that read their own max against current scaling's, and adaloss's largest
    saturated and flushed fractions over the seeds."""
    def cells(r: Row) -> list[str]:
        a, c = r["runs"][0]["adaloss"], r["runs"][0]["current"]
        return [f"{a['own_max']}/{a['casts']}, {c['own_max']}/{c['casts']}", *_fractions(r)]
    return _grid(rows, COLUMNS, ("own max / casts (adaloss, current)", "saturated", "flushed"), cells)


def summary(rows: list[Row], tol: float = TOL) -> list[str]:
    """Sentences on the JAX rows: adaloss against current scaling (within ``tol``, relative),
    against delayed scaling cold, warm and after a spike."""
    n = len(rows)
    ties = _count(rows, lambda r: _med(r, "adaloss") <= _med(r, "current") * (1 + tol))
    cold = _count(rows, lambda r: _med(r, "adaloss") < _med(r, "delayed-16 cold"))
    ada_warm = "adaloss warm" if "adaloss warm" in rows[0] else "adaloss"
    warm = _count(rows, lambda r: _med(r, ada_warm) <= _med(r, "delayed-16") * (1 + tol))
    warm_cur = _count(rows, lambda r: _med(r, ada_warm) <= _med(r, "current") * (1 + tol))
    spike = _count(rows, lambda r: _med(r, "adaloss spike") < _med(r, "delayed-16 spike"))
    after = _count(rows, lambda r: _med(r, ada_warm) <= _med(r, "delayed-16 after") * (1 + tol))
    after_lower = _count(rows, lambda r: _med(r, ada_warm) < _med(r, "delayed-16 after"))
    nan = _count(rows, lambda r: not np.isfinite(r["delayed-16 cold"]["median"]))
    exact = _count(rows, lambda r: _med(r, "current exact") < _med(r, "current") * (1 - tol))
    sharp = [r for r in rows if r.get("logits", 1.0) != 1.0]
    confident = len(sharp)
    exact_confident = _count(sharp, lambda r: _med(r, "current exact") < _med(r, "current") * (1 - tol))
    one = _count(rows, lambda r: abs(_med(r, "cast-only") - _med(r, "adaloss")) <= tol * _med(r, "adaloss"))
    own = sorted({(r["runs"][0]["adaloss"]["own_max"], r["runs"][0]["adaloss"]["casts"]) for r in rows})
    worst_sat = max(run["adaloss"]["saturated"] for r in rows for run in r["runs"])
    return [
        f"- **against current scaling**: adaloss's median error within {tol:.0%} of it or lower on "
        f"{ties} of {n} rows (median ratio "
        f"{np.median([_med(r, 'adaloss') / _med(r, 'current') for r in rows]):.3f}).",
        f"- **against delayed scaling at step 0** (scale 1, empty history): lower on {cold} of {n} rows"
        + (f"; the delayed backward is NaN on {nan} (flax computes its scale in the model's dtype: "
           "fp16 flushes it to zero)." if nan else "."),
        f"- **warmed, 16 steps on the same batch** (adaloss's lift has heard the casts' feedback, delayed "
        f"scaling's history holds the batch's amax): adaloss within {tol:.0%} of delayed scaling or lower "
        f"on {warm} of {n} rows, of current scaling on {warm_cur} of {n}. Current scaling with the exact "
        "scale (`max|g|` mapped to the format's "
        f"max, not a power of two below it, as delayed scaling's is) is more than {tol:.0%} better than "
        f"with a power of two on {exact} of {n} rows ({exact_confident} of {confident} at logits ×10): "
        "with two or three mantissa bits the few largest entries carry much of a tensor's norm, and an "
        "exact scale represents the largest exactly; adaloss's scales are powers of two unless "
        "`power_of_two=False` (the rule table below).",
        f"- **one scale for the whole backward** (`cast-only`): within {tol:.0%} of adaloss on "
        f"{one} of {n} rows: at these depths and at initialisation one scale fits every layer's range.",
        f"- **a spike** (one step at the loss ×1000 after those 16): lower on {spike} of {n} rows; "
        f"the ten steps after it (the spike's amax still in the history): lower on {after_lower}, within "
        f"{tol:.0%} or lower on {after} of {n}.",
        "- **casts that read their own max** (a second pass over the tensor) out of the casts per "
        "backward, adaloss: " + ", ".join(f"{o}/{c}" for o, c in own) + "; current scaling: all of "
        f"them. Largest saturated fraction of any adaloss cast: {worst_sat:.1e}.",
    ]


def rule_table(rows: list[Row], tol: float = TOL) -> str:
    """The decision rule against its alternatives, per gradient format: the median over the rows
    of each one's error over current scaling's, and on how many rows it is more than ``tol``
    better or worse than current scaling."""
    lines = ["| grads | rule | error / current's (median) | better (rows) | worse (rows) |",
             "|---|---|---|---|---|"]
    for fmt_name in dict.fromkeys(r["format"] for r in rows):
        sub = [r for r in rows if r["format"] == fmt_name]
        for k in RULES:
            ratios = [_med(r, k) / _med(r, "current") for r in sub]
            better = sum(q < 1 - tol for q in ratios)
            worse = sum(q > 1 + tol for q in ratios)
            lines.append(f"| {fmt_name.removeprefix('float8_')} | {k} | {np.median(ratios):.3f} | "
                         f"{better} of {len(sub)} | {worse} of {len(sub)} |")
    return "\n".join(lines)


def e2e_table(rows: list[Row]) -> str:
    """End to end (every GEMM fp8 × fp8): adaloss and current scaling with e4m3 operands against
    flax's ``Fp8DotGeneralOp`` pattern, cold and warmed."""
    return _grid(rows, E2E_COLUMNS)


def e2e_summary(rows: list[Row], tol: float = TOL) -> list[str]:
    n = len(rows)
    cur = _count(rows, lambda r: _med(r, "adaloss e2e") <= _med(r, "current e2e") * (1 + tol))
    cold = _count(rows, lambda r: _med(r, "adaloss e2e") < _med(r, "Fp8DotGeneralOp cold"))
    warm = _count(rows, lambda r: _med(r, "adaloss e2e") <= _med(r, "Fp8DotGeneralOp") * (1 + tol))
    share = np.median([_med(r, "adaloss") / _med(r, "adaloss e2e") for r in rows])
    return [
        f"- **end to end** (inputs and weights in e4m3 too): adaloss within {tol:.0%} of current "
        f"scaling or lower on {cur} of {n} rows; lower than `Fp8DotGeneralOp` at step 0 on {cold} of "
        f"{n}, within {tol:.0%} of it warmed or lower on {warm} of {n}. The gradient casts alone give "
        f"{share:.2f}× the end-to-end error (median): the operands' e4m3 quantization dominates."]


def rule_summary(rows: list[Row], tol: float = TOL) -> list[str]:
    def best(k: str) -> int:
        return _count(rows, lambda r: _med(r, k) < _med(r, "adaloss") * (1 - tol))
    n = len(rows)
    return [
        f"- **the decision rule's alternatives**: more than {tol:.0%} lower than adaloss's default on "
        + ", ".join(f"{k.removeprefix('adaloss ')} {best(k)} of {n} rows" for k in RULES[1:]) + "."]


def torch_table(rows: list[Row]) -> str:
    """PyTorch (bf16 autocast): adaloss and current scaling through the bridge (gradients only)
    against torchao's float8 training (its forward quantized too)."""
    def cells(r: Row) -> list[str]:
        skipped = max(run["adaloss"]["skipped"] for run in r["runs"])
        return [*_fractions(r), str(skipped)]
    return _grid(rows, TORCH_COLUMNS, ("saturated", "flushed", "skipped"), cells)


def torch_summary(rows: list[Row], tol: float = TOL) -> list[str]:
    n = len(rows)
    ties = _count(rows, lambda r: _med(r, "adaloss") <= _med(r, "current") * (1 + tol))
    warm = _count(rows, lambda r: _med(r, "adaloss warm") <= _med(r, "current") * (1 + tol))
    tao = {k: _count(rows, lambda r, k=k: _med(r, "adaloss warm") < _med(r, k))
           for k in TORCH_COLUMNS[3:]}
    return [
        f"- **PyTorch, against current scaling**: adaloss within {tol:.0%} or lower on {ties} of {n} "
        "rows at step 0 (median ratio "
        f"{np.median([_med(r, 'adaloss') / _med(r, 'current') for r in rows]):.3f}), on {warm} of {n} "
        "after 16 steps on the batch; warmed, lower than "
        + ", ".join(f"{k} on {v} of {n}" for k, v in tao.items())
        + " (torchao's error includes its forward's e4m3 quantization; adaloss's forward is bf16 here)."]


def cost_table(costs: dict[str, dict[str, dict[str, float]]]) -> str:
    """Per JAX model, each method's e5m2 backward against ``jax.value_and_grad``'s: XLA's bytes
    accessed, a machine-independent count of the passes over memory (the JSON also holds this
    CPU's times, which the benchmark's other jobs make noisy)."""
    methods = list(next(iter(costs.values())))[1:]
    lines = ["| model | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for model, c in costs.items():
        base = c["jax.value_and_grad"]
        cells = [f"{c[m]['bytes'] / base['bytes']:.2f}×" for m in methods]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_summary(costs: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    def ratios(m: str) -> list[float]:
        return [c[m]["bytes"] / c["jax.value_and_grad"]["bytes"] for c in costs.values()]

    def span(m: str) -> str:
        return f"{min(ratios(m)):.2f}–{max(ratios(m)):.2f}×"
    return [
        f"- **what the scales cost** (bytes XLA's compiled backward accesses, over `jax.value_and_grad`'s "
        f"without quantization): adaloss {span('adaloss')} (without the underflow feedback's fractions "
        f"{span('adaloss, no feedback')}), current scaling {span('current')}, flax's delayed scaling "
        f"{span('delayed-16')}. The feedback's fractions read each cast's input and output once more; "
        "the rest is the backward's own bookkeeping (merges, stored cotangents), which current scaling "
        "shares."]


def section(data: dict[str, Any]) -> list[str]:
    """Every table and summary of a ``docs/fp8.json``: the JAX gradient casts, the decision
    rule's alternatives, end to end, PyTorch."""
    rows, trows = data["rows"], data.get("torch_rows", [])
    parts: list[str] = []
    if rows:
        parts += [*summary(rows), "", table(rows), ""]
        if "adaloss exact" in rows[0]:
            parts += ["### The decision rule against its alternatives", "", *rule_summary(rows), "",
                      rule_table(rows), ""]
        if "adaloss e2e" in rows[0]:
            parts += ["### End to end: inputs and weights in e4m3 too", "", *e2e_summary(rows), "",
                      e2e_table(rows), ""]
    if data.get("costs"):
        parts += ["### What choosing the scales costs", "", *cost_summary(data["costs"]), "",
                  "Bytes accessed by the compiled gradient function (XLA's cost analysis, "
                  + str(data.get("machine", "")) + "), over `jax.value_and_grad`'s, e5m2, loss ×1:", "",
                  cost_table(data["costs"]), ""]
    if trows:
        parts += ["### PyTorch: the bridge against torchao", "", *torch_summary(trows), "",
                  torch_table(trows), ""]
    return parts


#: ``benchmarks/fp8_depth.py``'s methods, in the table's order
DEPTH_COLUMNS = ("adaloss", "one scale", "current", "delayed")


def _depth_cells(payload: dict[str, Any]) -> list[tuple[int, str, float, str, dict[str, dict[str, float]]]]:
    """(blocks, state, train loss or nan, format, {method: {"median", "worst"}}) per measured row."""
    return [(r["blocks"], state, r["train_loss"] if state == "trained" else float("nan"), f, errs)
            for r in payload["rows"] for state in ("untrained", "trained") for f, errs in r[state].items()]


def depth_table(payload: dict[str, Any]) -> str:
    """``benchmarks/fp8_depth.py``'s rows: per depth, state and format, each method's median /
    worst per-parameter error against the fp32 backward."""
    lines = ["| blocks | state | gradients | " + " | ".join(DEPTH_COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(DEPTH_COLUMNS)]
    for blocks, state, loss, f, errs in _depth_cells(payload):
        label = state if not np.isfinite(loss) else f"{state} (loss {loss:.2f})"
        cells = " | ".join(f"{errs[n]['median']:.3g} / {errs[n]['worst']:.3g}" for n in DEPTH_COLUMNS)
        lines.append(f"| {blocks} | {label} | {f.removeprefix('float8_')} | {cells} |")
    return "\n".join(lines)


def depth_summary(payload: dict[str, Any]) -> list[str]:
    """Per format, how often the per-layer scales beat (and lose to) one scale and current
    scaling by more than ``TOL``, on the median and on the worst parameter, and the largest
    gain over one scale."""
    out = []
    cells = _depth_cells(payload)
    for f in dict.fromkeys(c[3] for c in cells):
        rows = [c[4] for c in cells if c[3] == f]
        parts = []
        for other in ("one scale", "current"):
            counts = []
            for stat, label in (("median", "median error"), ("worst", "worst parameter's")):
                won = sum(e["adaloss"][stat] < (1 - TOL) * e[other][stat] for e in rows)
                lost = sum(e["adaloss"][stat] > (1 + TOL) * e[other][stat] for e in rows)
                counts.append(f"{label} lower on {won} of {len(rows)} rows, higher on {lost}")
            parts.append(f"against {other}: " + "; ".join(counts))
        gain = {s: max(e["one scale"][s] / e["adaloss"][s] for e in rows) for s in ("median", "worst")}
        verdict = (" Per-layer scales never beat one scale here." if max(gain.values()) <= 1 + TOL else
                   f" The largest gain over one scale: {gain['median']:.2f}× on a median, "
                   f"{gain['worst']:.2f}× on a worst parameter.")
        out.append(f"- **{f.removeprefix('float8_')}**, adaloss (more than {TOL:.0%} apart) "
                   + "; ".join(parts) + "." + verdict)
    return out


#: ``benchmarks/torch_fp8.py``'s methods: FP8 GEMMs in PyTorch
GEMM_METHODS = ("bf16", "adaloss", "current", "torchao tensorwise", "torchao tensorwise p2",
                "torchao rowwise")


def gemm_table(payload: dict[str, Any]) -> str:
    """``benchmarks/torch_fp8.py``'s rows: per model and method, the FP8 layers, the median ms of a
    training step (and over torchao tensorwise's) and the gradient error (median / worst)."""
    outside = all("outside_gemm_ms" in r for r in payload["rows"])
    extra = " ms outside the GEMMs | ÷ torchao's |" if outside else ""
    lines = [f"| model | method | FP8 layers | ms/step | ÷ torchao tensorwise |{extra} "
             "error median / worst |",
             "|---|---|---|---|---|" + ("---|---|" if outside else "") + "---|"]
    for r in payload["rows"]:
        t = r["median_ms"]
        for i, m in enumerate(GEMM_METHODS):
            e = r["errors"].get(m)
            err = ("(the reference's forward)" if m == "bf16" else "(not measured)") if e is None \
                else f"{e['median']:.4f} / {e['worst']:.4f}"
            model = f"{r['model']} ({r['parameters'] / 1e6:.1f}M)" if i == 0 else ""
            ratio = t[m] / t["torchao tensorwise"]
            cells = ""
            if outside:
                o = r["outside_gemm_ms"]
                cells = f" {o[m]:.1f} | {o[m] / o['torchao tensorwise']:.2f} |"
            lines.append(f"| {model} | {m} | {r['layers'][m]} | {t[m]:.1f} | {ratio:.2f} |{cells} {err} |")
    return "\n".join(lines)


def gemm_summary(payload: dict[str, Any], time_target: float = 1.10) -> list[str]:
    """adaloss's step time against torchao tensorwise's and the share of it the scaler's
    per-layer work takes (``current``: the same layers, no scaler); its error against current
    scaling's (the same power-of-two scales), torchao's with power-of-two scales and torchao's."""
    rows = payload["rows"]
    measured = all(r["errors"] for r in rows)

    stand_in = payload.get("gemm") == "stand-in"  # the GEMMs' time is not an FP8 GEMM's: left out

    def ms(r: Row, m: str) -> float:
        return r["outside_gemm_ms" if stand_in else "median_ms"][m]

    def err(r: Row, m: str) -> float:
        return r["errors"][m]["median"]
    fast = [r["model"] for r in rows if ms(r, "adaloss") <= time_target * ms(r, "torchao tensorwise")]
    spans = {k: (min(v), max(v)) for k, v in {
        "tao": [ms(r, "adaloss") / ms(r, "torchao tensorwise") for r in rows],
        "cur_t": [ms(r, "current") / ms(r, "torchao tensorwise") for r in rows],
        "share": [1 - ms(r, "current") / ms(r, "adaloss") for r in rows],
        **({"cur": [err(r, "adaloss") / err(r, "current") for r in rows],
            "p2": [err(r, "adaloss") / err(r, "torchao tensorwise p2") for r in rows],
            "exact": [err(r, "adaloss") / err(r, "torchao tensorwise") for r in rows]} if measured else {}),
    }.items()}

    def span(k: str, pct: bool = False) -> str:
        lo, hi = spans[k]
        return f"{lo:.0%}–{hi:.0%}" if pct else f"{lo:.2f}–{hi:.2f}×"
    what = ("Time outside the GEMMs** (each fp8 GEMM replaced by a bf16 stand-in whose time is left "
            "out)" if stand_in else "Step time**")
    lines = [
        f"- **{what}: adaloss {span('tao')} torchao tensorwise's; within {time_target:.2f}× on "
        f"{len(fast)} of {len(rows)} models ({', '.join(fast) or 'none'}). The converted layers without a "
        f"scaler take {span('cur_t')} torchao's: the difference is the scaler's per-layer work (its "
        f"statistics, decisions and fp8 counts), {span('share', True)} of adaloss's "
        f"{'time outside the GEMMs' if stand_in else 'step'}, the larger "
        "share on the smaller models."]
    if not measured:
        return lines
    return [*lines,
        f"- **Error**: adaloss {span('cur')} current scaling's (the same power-of-two scales: a power of "
        f"two only moves exponents, so where nothing flushes they agree), {span('p2')} torchao "
        f"tensorwise's with power-of-two scales, {span('exact')} torchao tensorwise's with its default "
        "exact scales (each tensor's max mapped to the format's max: with 3 mantissa bits the largest "
        "entries carry much of the norm)."]
