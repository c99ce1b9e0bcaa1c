"""FP8 gradients on the JAX zoo: adaloss's decisions against current and delayed scaling.

    python benchmarks/fp8.py                                  # docs/fp8.json, the table printed
    python benchmarks/fp8.py --models linen-transformer --dtypes float16 --seeds 1 --json /tmp/fp8.json

For each zoo model (:mod:`adaloss_zoo.jax_zoo`) with its forward in bf16 (FP8 training's dtype;
``--dtypes float16`` adds fp16, where flax's delayed scaling computes its scale in fp16, which
flushes it to zero: its cold backward is NaN), each gradient format (e5m2, e4m3fn) and loss
factor, one backward of the same forward under each method, against that forward's fp32
backward at loss ×1 (median and worst per-parameter ``‖g − g_ref‖/‖g_ref‖``, each the mean over
``--seeds`` initialisations and batches):

- ``adaloss``: ``AdaLossConfig(grad_format=fmt)``, every layer's incoming cotangent quantized once
  at the scale the decisions set before its GEMM;
- ``current``: ``fp8_rule="current"``, per-tensor current scaling as Transformer Engine's
  ``Float8CurrentScaling`` computes it (each cast's own ``max|g|``, a power of two);
- ``current exact``: the same with ``power_of_two=False``: ``max|g|`` mapped exactly to the
  format's max, as delayed scaling's scale is (``fp8_max / amax``);
- ``cast-only``: ``layer_rule=False``: the loss cotangent's scale alone, no per-layer scale;
- ``delayed-16 cold`` / ``delayed-16``: flax's ``fp8_ops.out_qdq`` on every layer's output
  (:mod:`adaloss_zoo.fp8_delayed`), amax history 16, at step 0 (scale 1, empty history) and after
  16 steps on the same batch (``--histories 16 1024`` adds ``delayed-1024``: on one repeated batch
  it holds the same amax; the study, ``adaloss-study --grad-format``, trains with both);
- ``spike``: after those 16 steps, one step with the loss ×1000 (``delayed-16 spike``: its
  stale history) and the step after it, back at the factor (``delayed-16 after``), against
  adaloss on the same steps (it keeps no history).

``casts`` / ``own max``: fp8 casts in the backward and those whose scale reads a full
reduction of the tensor they convert (:func:`jax_adaloss.audit.fp8_casts`): each of those
needs a second pass over its tensor. ``saturated``/``flushed``: adaloss's largest per-layer
fractions. Not a test: ``tests/test_fp8.py`` pins the behaviour on small models.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_adaloss
from adaloss import AdaLossConfig
from adaloss_zoo import jax_zoo as jz
from adaloss_zoo.fp8_delayed import count_layers, delayed_value_and_grad, init_metas, pure
from adaloss_zoo.fp8_tables import COLUMNS, summary, table
from adaloss_zoo.fp8_tables import fmt as _fmt
from adaloss_zoo.metrics import grad_error
from jax_adaloss.audit import fp8_casts

FORMATS = ("float8_e5m2", "float8_e4m3fn")
WARM = 16
SPIKE = 1000.0


def _times(loss: Any, factor: float) -> Any:
    def f(x: Any) -> Any:
        value, aux = loss(x)
        return value * factor, aux
    return f


def _error(grads: Any, ref: dict[str, np.ndarray], factor: float, exclude: tuple[str, ...]
           ) -> dict[str, float]:
    e = grad_error(jz._names(jax.tree.map(lambda a: np.asarray(a, np.float64) / factor, grads)), ref, exclude)
    return {"median": e.median, "worst": e.worst}


def _adaloss(case: jz.JaxCase, factor: float, config: AdaLossConfig, ref: Any) -> dict[str, Any]:
    g = case.grads("adaloss", factor, config)
    e = grad_error(g.grads, ref, case.exclude)
    reps = [r for r in g.report.layers.values() if r.saturated is not None]
    loss, x = case.objective()
    loss_p, params = pure(loss, x)
    vg = jax_adaloss.value_and_grad(_times(loss_p, factor), has_aux=True, config=config)
    casts = fp8_casts(lambda p: vg(p, adaloss_state=None), params)
    return {"median": e.median, "worst": e.worst,
            "saturated": max(float(r.saturated) for r in reps),
            "flushed": max(float(r.flushed) for r in reps),
            "casts": len(casts), "own_max": sum(c.reads_own_max for c in casts)}


def _delayed(case: jz.JaxCase, factor: float, fmt: str, ref: Any, histories: tuple[int, ...]
             ) -> dict[str, Any]:
    loss, x = case.objective()
    loss_p, params = pure(loss, x)
    n = count_layers(loss_p, params)
    q = jnp.dtype(getattr(jnp, fmt))
    run = jax.jit(delayed_value_and_grad(_times(loss_p, factor), q))
    spike = jax.jit(delayed_value_and_grad(_times(loss_p, factor * SPIKE), q))
    out: dict[str, Any] = {"layers": n}
    for history in histories:
        metas = init_metas(n, history)
        for step in range(WARM + 1):
            _, g, new = run(params, metas)
            if step == 0 and history == 16:
                out["delayed-16 cold"] = _error(g, ref, factor, case.exclude)
            metas = new if step < WARM else metas
        out[f"delayed-{history}"] = _error(g, ref, factor, case.exclude)
        if history == 16:
            _, g, metas = spike(params, metas)
            out["delayed-16 spike"] = _error(g, ref, factor * SPIKE, case.exclude)
            _, g, _ = run(params, metas)
            out["delayed-16 after"] = _error(g, ref, factor, case.exclude)
    return out


def _one(case: jz.JaxCase, ref: Any, fmt: str, factor: float, histories: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "adaloss": _adaloss(case, factor, AdaLossConfig(grad_format=fmt), ref),
        "current": _adaloss(case, factor, AdaLossConfig(grad_format=fmt, fp8_rule="current"), ref),
        "current exact": _adaloss(case, factor, AdaLossConfig(grad_format=fmt, fp8_rule="current",
                                                              power_of_two=False), ref),
        "cast-only": _adaloss(case, factor, AdaLossConfig(grad_format=fmt, layer_rule=False), ref)}
    spiked = _adaloss(case, factor * SPIKE, AdaLossConfig(grad_format=fmt), ref)
    out["adaloss spike"] = {k: spiked[k] for k in ("median", "worst")}
    out.update(_delayed(case, factor, fmt, ref, histories))
    return out


def rows(models: list[str], dtypes: list[str], factors: list[float], seeds: int,
         histories: tuple[int, ...] = (16,), done: Any = None) -> list[dict[str, Any]]:
    """One row per model, forward dtype, format and factor: each method's errors per seed
    (``runs``) and their mean (the method's key); ``done(rows)`` after each row."""
    out: list[dict[str, Any]] = []
    for name in models:
        for dtype in dtypes:
            cases = [jz.CASES[name](seed=s, dtype=getattr(jnp, dtype)) for s in range(seeds)]
            refs = [c.grads("reference", 1.0, AdaLossConfig(grad_format=dtype)).grads for c in cases]
            for fmt in FORMATS:
                for factor in factors:
                    t0 = time.perf_counter()
                    runs = [_one(c, r, fmt, factor, histories) for c, r in zip(cases, refs)]
                    row: dict[str, Any] = {"model": name, "dtype": dtype, "format": fmt, "factor": factor,
                                           "runs": runs}
                    for key, v in runs[0].items():
                        if isinstance(v, dict):
                            row[key] = {k: float(np.mean([r[key][k] for r in runs])) for k in v}
                    row["seconds"] = round(time.perf_counter() - t0, 1)
                    out.append(row)
                    print(_line(row), flush=True)
                    if done is not None:
                        done(out)
    return out


def _line(r: dict[str, Any]) -> str:
    cells = " ".join(_fmt(r[c]["median"]) for c in COLUMNS)
    return f"{r['model']} {r['dtype']} {r['format']} ×{r['factor']:g}: {cells}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(jz.CASES), choices=list(jz.CASES))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    ap.add_argument("--factors", nargs="+", type=float, default=[1.0, 1e-3, 1e-6])
    ap.add_argument("--seeds", type=int, default=2, help="model/batch seeds; the table shows the mean")
    ap.add_argument("--histories", nargs="+", type=int, default=[16],
                    help="delayed scaling's amax history lengths (16 is warmed up, cold and spiked; "
                         "on one repeated batch a longer history holds the same amax, so gives the same)")
    ap.add_argument("--json", type=Path, default=Path("docs/fp8.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # flax's deprecations, coverage warnings of the ablations
    def write(rs: list[dict[str, Any]]) -> None:  # after every row: a long run keeps what it has
        args.json.write_text(json.dumps({"command": "python benchmarks/fp8.py", "seeds": args.seeds,
                                         "rows": rs}, indent=1))
    rs = rows(args.models, args.dtypes, args.factors, args.seeds, tuple(args.histories), write)
    print(table(rs))
    print("\n".join(summary(rs)))


if __name__ == "__main__":
    main()
