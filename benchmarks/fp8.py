"""FP8 gradients on the zoo: adaloss's decisions against current and delayed scaling, and end
to end against flax's ``Fp8DotGeneralOp`` and torchao's float8 training.

    python benchmarks/fp8.py                        # docs/fp8.json (JAX and torch zoo), tables printed
    python benchmarks/fp8.py --frameworks jax --models linen-transformer --seeds 1 --json /tmp/fp8.json

**JAX** (:mod:`adaloss_zoo.jax_zoo`; ``--dtypes float16`` adds fp16 forwards, where flax's
delayed scaling computes its scale in fp16, which flushes it to zero: its cold backward is NaN):
for each model with its forward in bf16 (FP8 training's dtype), each gradient format (e5m2,
e4m3fn) and loss factor, one backward of the same forward under each method, against that
forward's fp32 backward at loss ×1 (median and worst per-parameter ``‖g − g_ref‖/‖g_ref‖``, each
the mean over ``--seeds`` initialisations and batches):

- ``adaloss``: ``AdaLossConfig(grad_format=fmt)``, every layer's incoming cotangent quantized once
  at the scale the decisions set before its GEMM;
- ``current``: ``fp8_rule="current"``, per-tensor current scaling as Transformer Engine's
  ``Float8CurrentScaling`` computes it (each cast's own ``max|g|``, a power of two);
  ``current exact``: with ``power_of_two=False`` (``max|g|`` mapped exactly to the format's max,
  as delayed scaling's scale is);
- the decision rule's alternatives: ``adaloss exact`` (``power_of_two=False``: the model's scale
  itself, not the power of two below it) and ``adaloss T_sat=1e-2`` / ``1e-6`` (the saturation
  budget: more entries clipped at the top for fewer flushed at the bottom, or the reverse);
- ``cast-only``: ``layer_rule=False``: the loss cotangent's scale alone, no per-layer scale;
- ``delayed-16 cold`` / ``delayed-16``: flax's ``fp8_ops.out_qdq`` on every layer's output
  (:mod:`adaloss_zoo.fp8_delayed`), amax history 16, at step 0 (scale 1, empty history) and after
  16 steps on the same batch (``--histories 16 1024`` adds ``delayed-1024``: on one repeated batch
  it holds the same amax; the study, ``adaloss-study --grad-format``, trains with both);
- ``spike``: after those 16 steps, one step with the loss ×1000 (``delayed-16 spike``: its
  stale history) and the mean error of the ten steps after it, back at the factor
  (``delayed-16 after``), against adaloss on the same steps (it keeps no history: its error is
  the ``adaloss`` column's);
- end to end, the layers' inputs and weights quantized to e4m3 too, so that every GEMM
  multiplies fp8 by fp8 (Transformer Engine's ``HYBRID`` recipe with e5m2 gradients):
  ``adaloss e2e`` and ``current e2e`` (``operand_format="float8_e4m3fn"``: per-tensor current
  scaling of each operand) against flax's ``Fp8DotGeneralOp`` pattern (``in_qdq`` on both
  operands, ``out_qdq`` on the output, delayed scaling of all three, history 16) cold and warm.

``casts`` / ``own max``: fp8 casts in the backward and those whose scale reads a full
reduction of the tensor they convert (:func:`adaloss_tools.audit.fp8_casts`): each of those
needs a second pass over its tensor. ``saturated``/``flushed``: adaloss's largest per-layer
fractions.

**PyTorch** (:mod:`adaloss_zoo.torch_zoo`, bf16 autocast): ``adaloss`` and ``current`` through
:class:`torch_bridge.AdaLossScaler` (gradients only: the forward stays in bf16), against
torchao's ``convert_to_float8_training`` (``emulate=True``) with its ``tensorwise`` (e5m2
gradients) and ``rowwise`` (e4m3 gradients, per row) recipes, whose forward is quantized too: its
``nn.Linear`` layers' inputs and weights in e4m3.

Not a test: ``tests/test_fp8.py`` pins the behaviour on small models.
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
import optax

import jax_adaloss
from adaloss import AdaLossConfig
from adaloss_study.overhead import machine
from adaloss_tools.audit import fp8_casts
from adaloss_zoo import jax_zoo as jz
from adaloss_zoo.fp8_delayed import count_layers, delayed_value_and_grad, init_metas, pure
from adaloss_zoo.fp8_tables import COLUMNS, TORCH_COLUMNS, summary, table, torch_summary, torch_table
from adaloss_zoo.fp8_tables import fmt as _fmt
from adaloss_zoo.metrics import grad_error

FORMATS = ("float8_e5m2", "float8_e4m3fn")
E4M3 = "float8_e4m3fn"
WARM = 16
SPIKE = 1000.0
AFTER = 10  # steps after the spike
#: JAX columns that are adaloss configurations: the overrides of ``AdaLossConfig(grad_format=fmt)``
VARIANTS: dict[str, dict[str, Any]] = {
    "adaloss": {}, "current": {"fp8_rule": "current"},
    "current exact": {"fp8_rule": "current", "power_of_two": False}, "cast-only": {"layer_rule": False},
    "adaloss exact": {"power_of_two": False}, "adaloss T_sat=1e-2": {"saturation": 1e-2},
    "adaloss T_sat=1e-6": {"saturation": 1e-6},
    "adaloss e2e": {"operand_format": E4M3}, "current e2e": {"fp8_rule": "current", "operand_format": E4M3}}
COUNTED = ("adaloss", "current")  # their casts are read off the jaxpr


def _times(loss: Any, factor: float) -> Any:
    return lambda x: jz._times(loss(x), factor)


def _error(grads: Any, ref: dict[str, np.ndarray], factor: float, exclude: tuple[str, ...]
           ) -> dict[str, float]:
    e = grad_error(jz._names(jax.tree.map(lambda a: np.asarray(a, np.float64) / factor, grads)), ref, exclude)
    return {"median": e.median, "worst": e.worst}


def _adaloss(case: jz.JaxCase, factor: float, config: AdaLossConfig, ref: Any, casts: bool = False
             ) -> dict[str, Any]:
    g = case.grads("adaloss", factor, config)
    e = grad_error(g.grads, ref, case.exclude)
    reps = [r for r in g.report.layers.values() if r.saturated is not None]
    out = {"median": e.median, "worst": e.worst,
           "saturated": max(float(r.saturated) for r in reps),
           "flushed": max(float(r.flushed) for r in reps)}
    if casts:
        loss, x = case.objective()
        loss_p, params = pure(loss, x)
        vg = jax_adaloss.value_and_grad(_times(loss_p, factor), has_aux=True, config=config)
        found = fp8_casts(lambda p: vg(p, adaloss_state=None), params)
        out.update(casts=len(found), own_max=sum(c.reads_own_max for c in found))
    return out


def _adaloss_warm(case: jz.JaxCase, factor: float, config: AdaLossConfig, ref: Any) -> dict[str, float]:
    """adaloss after ``WARM`` steps on the same batch (learning rate 0), as delayed scaling is
    warmed: its state's lift has heard the casts' feedback."""
    loss, x = case.objective()
    loss_p, params = pure(loss, x)
    tx = jax_adaloss.adaloss(config, inner=optax.sgd(0.0))
    vg = jax_adaloss.value_and_grad(_times(loss_p, factor), has_aux=True, config=config)

    @jax.jit
    def step(p: Any, s: Any) -> Any:
        _, g = vg(p, adaloss_state=s)
        return g, tx.update(g, s, p)[1]
    state = tx.init(params)
    for _ in range(WARM + 1):
        g, new = step(params, state)
        state = new
    return _error(jax_adaloss.unscale_tree(g), ref, factor, case.exclude)


def _delayed(case: jz.JaxCase, factor: float, fmt: str, ref: Any, histories: tuple[int, ...]
             ) -> dict[str, Any]:
    loss, x = case.objective()
    loss_p, params = pure(loss, x)
    n = count_layers(loss_p, params)
    q = jnp.dtype(getattr(jnp, fmt))
    run = jax.jit(delayed_value_and_grad(_times(loss_p, factor), q))
    spike = jax.jit(delayed_value_and_grad(_times(loss_p, factor * SPIKE), q))

    def err(g: Any, f: float = factor) -> dict[str, float]:
        return _error(g, ref, f, case.exclude)
    out: dict[str, Any] = {"layers": n}
    for history in histories:
        metas = init_metas(n, history)
        for step in range(WARM + 1):
            _, g, new = run(params, metas)
            if step == 0 and history == 16:
                out["delayed-16 cold"] = err(g)
            metas = new if step < WARM else metas
        out[f"delayed-{history}"] = err(g)
        if history == 16:
            _, g, metas = spike(params, metas)
            out["delayed-16 spike"] = err(g, factor * SPIKE)
            after = []
            for _ in range(AFTER):
                _, g, metas = run(params, metas)
                after.append(err(g))
            out["delayed-16 after"] = {k: float(np.mean([a[k] for a in after])) for k in after[0]}
    # Fp8DotGeneralOp at every layer: e4m3 operands and fp8 output gradients, all delayed
    e2e = jax.jit(delayed_value_and_grad(_times(loss_p, factor), q, operands=True))
    metas = init_metas(n, 16, operands=True)
    for step in range(WARM + 1):
        _, g, new = e2e(params, metas)
        if step == 0:
            out["Fp8DotGeneralOp cold"] = err(g)
        metas = new if step < WARM else metas
    out["Fp8DotGeneralOp"] = err(g)
    return out


def _one(case: jz.JaxCase, ref: Any, fmt: str, factor: float, histories: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {name: _adaloss(case, factor, AdaLossConfig(grad_format=fmt, **kw), ref,
                                          casts=name in COUNTED)
                           for name, kw in VARIANTS.items()}
    out["adaloss warm"] = _adaloss_warm(case, factor, AdaLossConfig(grad_format=fmt), ref)
    spiked = _adaloss(case, factor * SPIKE, AdaLossConfig(grad_format=fmt), ref)
    out["adaloss spike"] = {k: spiked[k] for k in ("median", "worst")}
    out.update(_delayed(case, factor, fmt, ref, histories))
    return out


#: the cost section's methods: ``AdaLossConfig(grad_format="float8_e5m2", **overrides)``
COSTED: dict[str, dict[str, Any]] = {
    "adaloss": {}, "adaloss, no feedback": {"underflow_feedback": False}, "current": {"fp8_rule": "current"},
    "cast-only": {"layer_rule": False}, "adaloss e2e": {"operand_format": E4M3}}


def _compiled_cost(f: Any, *args: Any, repeats: int = 30) -> dict[str, float]:
    """XLA's cost analysis of ``jit(f)(*args)`` (bytes accessed, flops) and its median wall
    time on this machine (ms)."""
    c = jax.jit(f).lower(*args).compile()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    for _ in range(3):
        jax.block_until_ready(c(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        times.append(time.perf_counter() - t0)
    return {"bytes": float(ca["bytes accessed"]), "flops": float(ca["flops"]),
            "ms": float(np.median(times) * 1e3)}


def costs(name: str, dtype: str = "bfloat16") -> dict[str, dict[str, float]]:
    """What choosing the casts' scales costs, one e5m2 backward of the zoo model ``name`` (its
    ``dtype`` forward, loss ×1) per method: XLA's bytes accessed and flops, and the time on this
    CPU, next to ``jax.value_and_grad`` (no quantization) and flax's delayed scaling."""
    case = jz.CASES[name](seed=0, dtype=getattr(jnp, dtype))
    loss, x = case.objective()
    loss_p, params = pure(loss, x)
    out = {"jax.value_and_grad": _compiled_cost(jax.value_and_grad(loss_p, has_aux=True), params)}
    for method, kw in COSTED.items():
        cfg = AdaLossConfig(grad_format=FORMATS[0], **kw)
        vg = jax_adaloss.value_and_grad(loss_p, has_aux=True, config=cfg)
        out[method] = _compiled_cost(lambda p, vg=vg: vg(p, adaloss_state=None), params)
    n = count_layers(loss_p, params)
    out["delayed-16"] = _compiled_cost(delayed_value_and_grad(loss_p), params, init_metas(n, 16))
    out["Fp8DotGeneralOp"] = _compiled_cost(delayed_value_and_grad(loss_p, operands=True), params,
                                            init_metas(n, 16, operands=True))
    return out


def _torch_one(case: Any, model: Any, batch: Any, ref: Any, fmt: str, factor: float, seed: int
               ) -> dict[str, Any]:
    import torch

    from adaloss_zoo import torch_zoo as tz

    def err(r: Any) -> dict[str, float]:
        e = grad_error(r.grads, ref, case.exclude)
        return {"median": e.median, "worst": e.worst}
    out: dict[str, Any] = {}
    methods = (("adaloss", {}, 0), ("adaloss warm", {}, WARM), ("current", {"fp8_rule": "current"}, 0))
    for name, kw, warm in methods:
        r = tz.run_adaloss(case, model, batch, factor, AdaLossConfig(grad_format=fmt, **kw), seed,
                           dtype=torch.bfloat16, warm=warm)
        out[name] = err(r) | {"skipped": r.skipped}
        if name == "adaloss":
            reps = [v for v in r.layers.values() if v.saturated is not None]
            out[name].update(saturated=max(float(v.saturated) for v in reps),
                             flushed=max(float(v.flushed) for v in reps))
    for recipe in ("tensorwise", "rowwise"):
        out[f"torchao {recipe}"] = err(tz.run_torchao(case, model, batch, factor, recipe, seed))
    return out


def _row(name: str, dtype: str, fmt: str, factor: float, runs: list[dict[str, Any]], t0: float,
         framework: str, logits: float) -> dict[str, Any]:
    row: dict[str, Any] = {"framework": framework, "model": name, "dtype": dtype, "format": fmt,
                           "factor": factor, "logits": logits, "runs": runs}
    for key, v in runs[0].items():
        if isinstance(v, dict):
            row[key] = {k: float(np.mean([r[key][k] for r in runs])) for k in ("median", "worst")}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def torch_rows(models: list[str], factors: list[float], seeds: int, done: Any = None,
               logits: list[float] = ()) -> list[dict[str, Any]]:
    """One row per torch zoo model, format and (factor, logits) setting (bf16 autocast), as
    :func:`rows`."""
    import torch

    from adaloss_zoo import torch_zoo as tz
    out: list[dict[str, Any]] = []
    for name in models:
        case = tz.CASES[name]
        built = [case.build(s) for s in range(seeds)]
        refs: dict[float, list[Any]] = {}
        for fmt in FORMATS:
            for factor, k in settings(factors, list(logits)):
                t0 = time.perf_counter()
                with tz.logit_scale(k):
                    if k not in refs:
                        refs[k] = [tz.reference_grads(case, m, b, s, dtype=torch.bfloat16)
                                   for s, (m, b) in enumerate(built)]
                    runs = [_torch_one(case, m, b, r, fmt, factor, s)
                            for s, ((m, b), r) in enumerate(zip(built, refs[k]))]
                out.append(_row(name, "bfloat16", fmt, factor, runs, t0, "torch", k))
                print(_line(out[-1], TORCH_COLUMNS), flush=True)
                if done is not None:
                    done(out)
    return out


def settings(factors: list[float], logits: list[float]) -> list[tuple[float, float]]:
    """``(loss factor, logit multiplier)`` of the rows: every factor at logits ×1, then logits ×k
    at loss ×1 (a confident softmax: at initialisation the loss cotangent's largest entries, one
    per row, are all about ``(1/C − 1)/N``, the same value, and how that one value falls on the
    format's grid would decide the error of every gradient behind it)."""
    return [(f, 1.0) for f in factors] + [(1.0, k) for k in logits if k != 1.0]


def rows(models: list[str], dtypes: list[str], factors: list[float], seeds: int,
         histories: tuple[int, ...] = (16,), done: Any = None, logits: list[float] = ()
         ) -> list[dict[str, Any]]:
    """One row per model, forward dtype, format and (factor, logits) setting: each method's errors
    per seed (``runs``) and their mean (the method's key); ``done(rows)`` after each row."""
    out: list[dict[str, Any]] = []
    for name in models:
        for dtype in dtypes:
            cases = [jz.CASES[name](seed=s, dtype=getattr(jnp, dtype)) for s in range(seeds)]
            refs: dict[float, list[Any]] = {}
            for fmt in FORMATS:
                for factor, k in settings(factors, list(logits)):
                    t0 = time.perf_counter()
                    with jz.logit_scale(k):
                        if k not in refs:
                            refs[k] = [c.grads("reference", 1.0, AdaLossConfig(grad_format=dtype)).grads
                                       for c in cases]
                        runs = [_one(c, r, fmt, factor, histories) for c, r in zip(cases, refs[k])]
                    out.append(_row(name, dtype, fmt, factor, runs, t0, "jax", k))
                    print(_line(out[-1], COLUMNS), flush=True)
                    if done is not None:
                        done(out)
    return out


def _line(r: dict[str, Any], columns: tuple[str, ...]) -> str:
    cells = " ".join(_fmt(r[c]["median"]) for c in columns)
    return f"{r['model']} {r['dtype']} {r['format']} ×{r['factor']:g} logits ×{r['logits']:g}: {cells}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frameworks", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"JAX zoo models (default: all of {list(jz.CASES)})")
    ap.add_argument("--torch-models", nargs="+", default=None,
                    help="torch zoo models (default: all of adaloss_zoo.torch_zoo.CASES)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    ap.add_argument("--factors", nargs="+", type=float, default=[1.0, 1e-3, 1e-6])
    ap.add_argument("--torch-factors", nargs="+", type=float, default=[1.0, 1e-6],
                    help="the torch rows' loss factors (bf16 and current scaling: the factor matters "
                         "little; torchao keeps no history)")
    ap.add_argument("--logits", nargs="+", type=float, default=[10.0],
                    help="logit multipliers of further rows at loss ×1 (a confident softmax)")
    ap.add_argument("--seeds", type=int, default=2, help="model/batch seeds; the table shows the mean")
    ap.add_argument("--histories", nargs="+", type=int, default=[16],
                    help="delayed scaling's amax history lengths (16 is warmed up, cold and spiked; "
                         "on one repeated batch a longer history holds the same amax, so gives the same)")
    ap.add_argument("--json", type=Path, default=Path("docs/fp8.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # flax's deprecations, coverage warnings of the ablations
    jax_rows: list[dict[str, Any]] = []

    cost: dict[str, Any] = {}

    def write(rs: list[dict[str, Any]], torch_part: bool = False) -> None:  # after every row
        args.json.write_text(json.dumps({"command": "python benchmarks/fp8.py", "seeds": args.seeds,
                                         "machine": machine(), "costs": cost,
                                         "rows": jax_rows if torch_part else rs,
                                         "torch_rows": rs if torch_part else []}, indent=1))
    if "jax" in args.frameworks:
        for name in args.models or list(jz.CASES):
            cost[name] = costs(name)
            print(name, {k: round(v["bytes"] / cost[name]["jax.value_and_grad"]["bytes"], 3)
                         for k, v in cost[name].items()}, flush=True)
        jax_rows = rows(args.models or list(jz.CASES), args.dtypes, args.factors, args.seeds,
                        tuple(args.histories), write, args.logits)
        print(table(jax_rows))
        print("\n".join(summary(jax_rows)))
    if "torch" in args.frameworks:
        from adaloss_zoo import torch_zoo as tz
        trs = torch_rows(args.torch_models or list(tz.CASES), args.torch_factors, args.seeds,
                         lambda rs: write(rs, torch_part=True), args.logits)
        print(torch_table(trs))
        print("\n".join(torch_summary(trs)))


if __name__ == "__main__":
    main()
