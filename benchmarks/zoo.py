"""The model zoo under every scaling method: layers found, gradient error, skipped passes.

    python benchmarks/zoo.py                          # both frameworks, loss ×1 and ×1e-6
    python benchmarks/zoo.py --factors 1 1e-3 1e-6 1e-8 --logits 1 10 30 --json zoo.json

For each zoo model (:mod:`adaloss_zoo`), loss factor and logit multiplier (×10, ×30: a
confident softmax), one backward of the same fp16 forward under each method, against that
forward's loss-×1 gradients (JAX: its exact, fp32-backward gradient; torch: its fp16
backward), worst and median per-parameter error ``‖g − g_ref‖/‖g_ref‖``:

- ``adaloss``: the default config, repeated on the same batch until a backward is finite
  with its back-off raised after each non-finite one (as a skipped step does); its skipped
  passes are reported;
- ``largest-safe``: per-layer scales that only the overflow caps decide (``u_min = 2^15``:
  every statistical scale saturates), each layer's cotangent scaled to just below overflow
  as Transformer Engine's current scaling does per tensor: is the statistical decision
  better than simply the largest safe scale?
- ``cast-only``: the statistical cast decision alone (``layer_rule=False``): the loss
  cotangent's statistics choose one global scale, layers apply none of their own (they
  lower it only where a cap requires): how much of the benefit is per-layer at all?
- ``dynamic``: a global dynamic scale started at 2^16, repeated on the same batch until a
  backward is finite (torch: ``torch.amp.GradScaler``; JAX: ``jmp.DynamicLossScale``);
  its skipped passes are reported;
- ``converged``: a dynamic scale given the time to grow (GradScaler doubles it every 2000
  clean steps): the largest power of two whose backward is finite, found by bisection,
  which is what it settles at on a stationary batch; ``2^k`` is reported;
- ``static``: a fixed 2^15 (torch: a multiplied loss; JAX: ``jmp.StaticLossScale``);
- ``fp16``: no scaling.

Not a test: the suite (``tests/test_zoo.py``) asserts the layer counts and tolerances on a
subset.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

from adaloss.config import AdaLossConfig
from adaloss_study.jax_runner import adaloss_config
from adaloss_zoo.metrics import grad_error
from adaloss_zoo.tables import summary, table

#: the ablations, as the study defines them (one definition): per-layer scales decided by the
#: overflow caps alone (every statistical scale saturates); the statistical cast decision alone
LARGEST_SAFE = adaloss_config("largest-safe", AdaLossConfig())
CAST_ONLY = adaloss_config("cast-only", AdaLossConfig())
STATIC = 2.0**15


def torch_rows(factors: list[float], logits: list[float], names: list[str] | None
               ) -> list[dict[str, Any]]:
    from adaloss_zoo import torch_zoo as tz
    rows = []
    for name in _pick(names, tz.CASES):
        case = tz.CASES[name]
        model, batch = case.build(0)
        expected = tz.expected_layers(model, batch, case.loss)
        for k in logits:
            with tz.logit_scale(k):
                ref = tz.reference_grads(case, model, batch)
            for f in factors:
                t0 = time.perf_counter()
                with tz.logit_scale(k):
                    ada = tz.run_adaloss(case, model, batch, f)
                    safe = tz.run_adaloss(case, model, batch, f, LARGEST_SAFE)
                    cast = tz.run_adaloss(case, model, batch, f, CAST_ONLY)
                    gs = tz.run_gradscaler(case, model, batch, f)
                    k_conv, conv = tz.run_converged(case, model, batch, f)
                    static = tz.run_static(case, model, batch, f, STATIC)
                    fp16 = tz.run_static(case, model, batch, f, 1.0)
                found = tz.found_layers(ada.layers)
                rows.append(_row("torch", name, f, k, expected, found, ref, case.exclude,
                                 {"adaloss": ada.grads, "largest-safe": safe.grads, "cast-only": cast.grads,
                                  "dynamic": gs.grads, "converged": conv.grads, "static": static.grads,
                                  "fp16": fp16.grads},
                                 ada.warnings,
                                 {"adaloss skipped": ada.skipped, "dynamic skipped": gs.skipped,
                                  "cast-only skipped": cast.skipped, "converged log2": k_conv},
                                 time.perf_counter() - t0))
                print(_line(rows[-1]), flush=True)
    return rows


def jax_rows(factors: list[float], logits: list[float], names: list[str] | None) -> list[dict[str, Any]]:
    from adaloss_zoo import jax_zoo as jz
    rows = []
    for name in _pick(names, jz.CASES):
        case = jz.CASES[name]()
        for k in logits:
            with jz.logit_scale(k):
                ref = case.grads("reference", 1.0).grads
            for f in factors:
                t0 = time.perf_counter()
                with jz.logit_scale(k):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        ada, ada_skipped = case.adaloss(f)
                    safe, _ = case.adaloss(f, LARGEST_SAFE)
                    cast, cast_skipped = case.adaloss(f, CAST_ONLY)
                    dyn, skipped = case.dynamic(f)
                    k_conv, conv = case.converged(f)
                    static = case.grads("static", f, scale=STATIC)
                    fp16 = case.grads("fp16", f)
                rows.append(_row("jax", name, f, k, case.expected, ada.layers, ref, case.exclude,
                                 {"adaloss": ada.grads, "largest-safe": safe.grads, "cast-only": cast.grads,
                                  "dynamic": dyn.grads, "converged": conv.grads, "static": static.grads,
                                  "fp16": fp16.grads},
                                 [str(w.message) for w in caught],
                                 {"adaloss skipped": ada_skipped, "dynamic skipped": skipped,
                                  "cast-only skipped": cast_skipped, "converged log2": k_conv},
                                 time.perf_counter() - t0))
                print(_line(rows[-1]), flush=True)
    return rows


def _pick(names: list[str] | None, cases: dict[str, Any]) -> list[str]:
    return list(cases) if names is None else [n for n in names if n in cases]


def _row(framework: str, name: str, factor: float, logits: float, expected: Any, found: Any, ref: Any,
         exclude: tuple[str, ...], grads: dict[str, Any], warns: list[str], extra: dict[str, Any],
         seconds: float) -> dict[str, Any]:
    errors = {}
    for method, g in grads.items():
        e = grad_error(g, ref, exclude)
        worst_leaf = max(e.per_leaf, key=e.per_leaf.get)
        errors[method] = {"worst": e.worst, "median": e.median, "worst_leaf": worst_leaf,
                          "zero_leaves": len(e.zero)}
    return {"framework": framework, "model": name, "factor": factor, "logits": logits,
            "layers_found": sum((found & expected).values()), "layers_expected": sum(expected.values()),
            "extra_layers": sum((found - expected).values()), "errors": errors, "warnings": warns,
            **extra, "seconds": seconds}


def _line(r: dict[str, Any]) -> str:
    errs = "  ".join(f"{m} {e['worst']:.3g}/{e['median']:.3g}" for m, e in r["errors"].items())
    return (f"{r['framework']:5} {r['model']:22} ×{r['factor']:<6g} logits ×{r['logits']:<3g} layers "
            f"{r['layers_found']}/{r['layers_expected']}  {errs}  skipped adaloss "
            f"{r['adaloss skipped']} dynamic {r['dynamic skipped']}  converged 2^{r['converged log2']}"
            f"  warnings {len(r['warnings'])}"
            f"  ({r['seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "jax", "both"], default="both")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 1e-6])
    ap.add_argument("--logits", type=float, nargs="+", default=[1.0],
                    help="logit multipliers (10, 30: a confident softmax)")
    ap.add_argument("--models", nargs="+", default=None, help="zoo names (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    if args.framework in ("torch", "both"):
        rows += torch_rows(args.factors, args.logits, args.models)
    if args.framework in ("jax", "both"):
        rows += jax_rows(args.factors, args.logits, args.models)
    print("\nmedian per-parameter error against the same fp16 forward's loss-×1 gradients\n")
    print(table(rows))
    print("\n" + "\n".join(summary(rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
