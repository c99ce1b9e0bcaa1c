"""The model zoo under every scaling method: layers found and gradient error.

    python benchmarks/zoo.py                          # both frameworks, loss ×1 and ×1e-6
    python benchmarks/zoo.py --framework torch --factors 1 1e-3 1e-6 1e-8 --json zoo.json

For each zoo model (:mod:`adaloss_zoo`) and loss factor: the layers adaptive
scaling found against the ones it must find (every Linear/Conv whose input
needs a gradient), and the worst and median per-parameter error
``‖g − g_ref‖/‖g_ref‖`` of adaloss (default config), of the global baseline
(torch: ``torch.amp.GradScaler`` with its defaults, repeated on the same batch
until a step is finite; JAX: a fixed ``jmp.StaticLossScale(2**15)``) and of plain
fp16, against the same fp16 forward's loss-×1 gradients. Not a test: the suite
(``tests/test_zoo.py``) asserts the layer counts and tolerances on a subset.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

from adaloss_zoo.metrics import grad_error


def torch_rows(factors: list[float], names: list[str] | None) -> list[dict[str, Any]]:
    from adaloss_zoo import torch_zoo as tz
    rows = []
    for name in _pick(names, tz.CASES):
        case = tz.CASES[name]
        model, batch = case.build(0)
        expected = tz.expected_layers(model, batch, case.loss)
        ref = tz.reference_grads(case, model, batch)
        for f in factors:
            t0 = time.perf_counter()
            ada = tz.run_adaloss(case, model, batch, f)
            gs = tz.run_gradscaler(case, model, batch, f)
            fp16 = tz.run_static(case, model, batch, f, 1.0)
            found = tz.found_layers(ada.layers)
            rows.append(_row("torch", name, f, expected, found, ref, case.exclude,
                             {"adaloss": ada.grads, "global": gs.grads, "fp16": fp16.grads},
                             ada.warnings, {"GradScaler skipped": gs.skipped}, time.perf_counter() - t0))
            print(_line(rows[-1]), flush=True)
    return rows


def jax_rows(factors: list[float], names: list[str] | None) -> list[dict[str, Any]]:
    from adaloss_zoo import jax_zoo as jz
    rows = []
    for name in _pick(names, jz.CASES):
        case = jz.CASES[name]()
        ref = case.grads("reference", 1.0).grads
        for f in factors:
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ada = case.grads("adaloss", f)
            static = case.grads("static", f)
            fp16 = case.grads("fp16", f)
            rows.append(_row("jax", name, f, case.expected, ada.layers, ref, case.exclude,
                             {"adaloss": ada.grads, "global": static.grads, "fp16": fp16.grads},
                             [str(w.message) for w in caught], {}, time.perf_counter() - t0))
            print(_line(rows[-1]), flush=True)
    return rows


def _pick(names: list[str] | None, cases: dict[str, Any]) -> list[str]:
    return list(cases) if names is None else [n for n in names if n in cases]


def _row(framework: str, name: str, factor: float, expected: Any, found: Any, ref: Any,
         exclude: tuple[str, ...], grads: dict[str, Any], warns: list[str], extra: dict[str, Any],
         seconds: float) -> dict[str, Any]:
    errors = {}
    for method, g in grads.items():
        e = grad_error(g, ref, exclude)
        worst_leaf = max(e.per_leaf, key=e.per_leaf.get)
        errors[method] = {"worst": e.worst, "median": e.median, "worst_leaf": worst_leaf,
                          "zero_leaves": len(e.zero)}
    return {"framework": framework, "model": name, "factor": factor,
            "layers_found": sum((found & expected).values()), "layers_expected": sum(expected.values()),
            "extra_layers": sum((found - expected).values()), "errors": errors, "warnings": warns,
            **extra, "seconds": seconds}


def _line(r: dict[str, Any]) -> str:
    errs = "  ".join(f"{m} {e['worst']:.3g}/{e['median']:.3g}" for m, e in r["errors"].items())
    return (f"{r['framework']:5} {r['model']:22} ×{r['factor']:<6g} layers {r['layers_found']}/"
            f"{r['layers_expected']}  {errs}  warnings {len(r['warnings'])}  ({r['seconds']:.0f} s)")


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: model × factor, layers found/expected, worst / median error per method."""
    methods = list(dict.fromkeys(m for r in rows for m in r["errors"]))
    head = ["framework", "model", "loss ×", "layers", *methods, "warnings"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["framework"], r["model"], f"{r['factor']:g}",
                 f"{r['layers_found']}/{r['layers_expected']}"]
        for m in methods:
            e = r["errors"].get(m)
            cells.append("–" if e is None else f"{e['worst']:.3g} / {e['median']:.3g}")
        cells.append(str(len(r["warnings"])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "jax", "both"], default="both")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 1e-6])
    ap.add_argument("--models", nargs="+", default=None, help="zoo names (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    if args.framework in ("torch", "both"):
        rows += torch_rows(args.factors, args.models)
    if args.framework in ("jax", "both"):
        rows += jax_rows(args.factors, args.models)
    print("\nworst / median per-parameter error against the same fp16 forward's loss-×1 gradients;"
          " global: torch.amp.GradScaler (torch), jmp.StaticLossScale(2**15) (JAX)\n")
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
