"""Train a Flax model and its torch twin in lockstep; record every scale decision.

Each step both frameworks run, at the same weights, the fp16 adaptive backward and
an fp32 backward (capturing each layer's incoming cotangent), and record the
per-layer scales, the measured underflow rates and the unscaled gradients. The
weights follow JAX's SGD trajectory (skipped when a gradient is not finite) and
are loaded into the torch twin before every step: trained separately, the two
drift apart by rounding, and measured underflow at a later step (a count of
entries near the flush threshold) then compares different weights, which
differs from machine to machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from twin_models import PAIRS, flax_xent, load_flax, to_torch_layout, torch_name, torch_xent

import jax_adaloss
import torch_bridge
from adaloss.config import AdaLossConfig
from adaloss_zoo.metrics import relative_error
from jax_adaloss.scaled_grad import is_scaled_grad
from jax_adaloss.underflow import compare_cotangents as compare_jax
from torch_bridge.underflow import compare_cotangents as compare_torch


@dataclasses.dataclass
class StepRecord:
    """One step of one framework; layer and parameter names in torch's spelling."""

    scale: dict[str, float]
    unrounded: dict[str, float]
    incoming: dict[str, float]
    underflow: dict[str, float]  # measured, layers only
    skipped: bool
    loss: float
    order: list[str] = dataclasses.field(default_factory=list)  # layers in forward order
    grads: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # unscaled, torch layout
    # per weight: the underflow ratio its layer decisions reported (underflow_feedback)
    signal: dict[str, float] = dataclasses.field(default_factory=dict)
    # fp8 formats: per layer, the (flushed, subnormal, saturated) fractions of its cast
    fractions: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)


def _fractions(reports: dict[str, Any], name: Any = lambda k: k) -> dict[str, tuple[float, float, float]]:
    return {name(k): (float(r.flushed), float(r.subnormal), float(r.saturated))
            for k, r in reports.items() if r.flushed is not None}


def _data(name: str, step: int, seed: int) -> tuple[Any, Any, np.ndarray]:
    return PAIRS[name][2](jax.random.fold_in(jax.random.key(seed), step))


def init_params(name: str, seed: int) -> Any:
    cls = PAIRS[name][0]
    x, _, _ = _data(name, 0, seed)
    return cls(dtype=jnp.float32).init(jax.random.key(seed + 1), x)


def _torch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, factor: float) -> torch.Tensor:
    return factor * torch_xent(model(x), y)


def run_pair(name: str, steps: int, config: AdaLossConfig, lr: float, loss_factor: float,
             seed: int = 0, dtype: str = "float16") -> tuple[list[StepRecord], list[StepRecord]]:
    """``steps`` steps of both frameworks at the same weights, computing in ``dtype`` (Flax's
    ``dtype``, torch's autocast dtype): (JAX records, torch records)."""
    cls = PAIRS[name][0]
    params = init_params(name, seed)

    def loss(p: Any, x: Any, y: Any, dt: Any) -> jax.Array:
        return loss_factor * flax_xent(cls(dtype=dt).apply(p, x), y)

    vg16 = jax.jit(jax_adaloss.value_and_grad(functools.partial(loss, dt=getattr(jnp, dtype)), config=config,
                                              return_report=True, capture_cotangents=True))
    loss32 = functools.partial(loss, dt=jnp.float32)
    # the optax state carries the back-off and the lifts (underflow_feedback). The lifts come
    # from counted fractions, where one entry of these small tensors is ~T: the frameworks'
    # fp16 kernels, rounding one entry apart, would move them apart. So torch runs each step
    # at JAX's lifts, and the counted ratios are compared on their own (signal_tol).
    tx = jax_adaloss.adaloss(config)
    state = tx.init(params)
    model = PAIRS[name][1]()
    if config.operand_format is not None:  # JAX quantizes every weight's dot_general
        model = torch_bridge.convert_to_float8_training(model, config)
    scaler = torch_bridge.AdaLossScaler(model, config, capture=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    jax_records, torch_records = [], []
    for step in range(steps):
        x, xt, y = _data(name, step, seed)
        # JAX
        lifts = {torch_name(_key(path)): int(k) for path, k in
                 jax.tree_util.tree_flatten_with_path(optax.tree.get(state, "lift"))[0]}
        (value, grads), rep = vg16(params, x, y, adaloss_state=state)
        signal = {torch_name(_key(path)): float(g.underflow) for path, g in
                  jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_scaled_grad)[0]
                  if isinstance(g, jax_adaloss.ScaledGrad) and g.underflow is not None}
        _, state = tx.update(grads, state, params)
        ref = jax_adaloss.layer_cotangents(loss32, params, x, y, loss_scale=1.0, config=config)
        plain = jax_adaloss.unscale_tree(grads)
        finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(plain))
        low = {k: (v, rep.cotangent_scales[k]) for k, v in rep.cotangents.items()}
        under = {torch_name(k): u.measured for k, u in compare_jax(low, ref, config).items()}
        jax_records.append(StepRecord(
            scale={torch_name(k): float(r.scale) for k, r in rep.layers.items()},
            unrounded={torch_name(k): float(r.unrounded_scale) for k, r in rep.layers.items()},
            incoming={torch_name(k): float(r.incoming_scale) for k, r in rep.layers.items()},
            underflow=under, skipped=not finite, loss=float(value), grads=to_torch_layout(plain),
            signal=signal, fractions=_fractions(rep.layers, torch_name)))
        # torch, at the same weights
        load_flax(model, params)
        yt = torch.from_numpy(y.astype(np.int64))
        tloss = functools.partial(_torch_loss, model, xt, yt, loss_factor)
        tref = torch_bridge.layer_cotangents(model, tloss, loss_scale=1.0, config=config)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=getattr(torch, dtype)):
            tvalue = loss_factor * torch_xent(model(xt), yt)
        skipped_before = scaler.skipped_steps
        scaler._lift = {k: torch.tensor(v, dtype=torch.int32) for k, v in lifts.items()}
        scaler.scale(tvalue).backward()
        tsignal = {k: float(v) for k, v in scaler._last.underflow.items()}
        reps = scaler.layer_reports()
        tlow = scaler.captured_cotangents()
        scaler.unscale_(opt)
        tgrads = {n: p.grad.detach().float().numpy().copy() for n, p in model.named_parameters()
                  if p.grad is not None}
        scaler.step(opt)
        scaler.update()
        torch_records.append(StepRecord(
            scale={k: float(r.scale) for k, r in reps.items()},
            unrounded={k: float(r.unrounded_scale) for k, r in reps.items()},
            incoming={k: float(r.incoming_scale) for k, r in reps.items()},
            underflow={k: u.measured for k, u in compare_torch(tlow, tref, config).items()},
            skipped=scaler.skipped_steps > skipped_before, loss=float(tvalue.detach()), grads=tgrads,
            signal=tsignal, fractions=_fractions(reps)))
        if finite:
            params = jax.tree_util.tree_map(lambda p, g: p - lr * g.astype(p.dtype), params, plain)
    return jax_records, torch_records


def _key(path: Any) -> str:
    """A JAX leaf path as the backward names weights (``params/head/kernel``)."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def near_power_of_two(value: float, rel: float) -> bool:
    """``value`` within relative ``rel`` of a power of two (so its floor is rounding-sensitive)."""
    if not value > 0 or math.isinf(value):
        return False
    return abs(math.log2(value) - round(math.log2(value))) < math.log2(1 + rel)


@dataclasses.dataclass
class Comparison:
    mismatches: list[str]  # unexplained: failures
    boundary: list[str]  # explained: a decision within rounding of a power of two (and what follows it)
    underflow_diffs: list[str]  # layers whose measured rates differ by more than the tolerance
    grad_diffs: list[str] = dataclasses.field(default_factory=list)  # gradients further apart than grad_tol
    worst_grad: float = 0.0  # the largest relative gradient difference compared


def compare(jx: list[StepRecord], tr: list[StepRecord], rel: float = 1e-3,
            underflow_tol: float = 1e-3, mean_underflow_tol: float = 1.0,
            grad_tol: float = float("inf"), signal_tol: float = float("inf")) -> Comparison:
    """Scales bitwise; a difference is explained only when the decision lies within ``rel`` of
    a power-of-two boundary in either framework, or when the incoming scale already differs
    because of such a decision earlier in the same backward. Measured underflow per layer
    and step within ``underflow_tol``, and its mean over the steps within
    ``mean_underflow_tol``. Unscaled gradients of steps neither framework skipped, with no
    boundary case, within ``grad_tol`` (relative). The counted underflow ratios of the
    feedback, per weight and step, within ``signal_tol`` (in units of T); both frameworks must
    report the same weights."""
    out = Comparison([], [], [])
    layers = set.intersection(*(set(r.underflow) for r in jx + tr)) if jx else set()
    for k in sorted(layers):
        a, b = np.mean([r.underflow[k] for r in jx]), np.mean([r.underflow[k] for r in tr])
        if abs(a - b) > mean_underflow_tol:
            out.underflow_diffs.append(f"{k}: mean over {len(jx)} steps jax {a:.2e}, torch {b:.2e}")
    for step, (a, b) in enumerate(zip(jx, tr)):
        if set(a.scale) != set(b.scale):
            out.mismatches.append(f"step {step}: layers differ: {sorted(set(a.scale) ^ set(b.scale))}")
            continue
        if a.skipped != b.skipped:
            out.mismatches.append(f"step {step}: skip decisions differ (jax {a.skipped}, torch {b.skipped})")
        explained = False
        affected = set()
        for k in reversed(b.order or list(b.scale)):  # backward order
            same_in = a.incoming[k] == b.incoming[k]
            if a.scale[k] == b.scale[k] and same_in:
                continue
            where = (f"step {step} {k}: jax {a.scale[k]:g} (unrounded {a.unrounded[k]:.6g}, in "
                     f"{a.incoming[k]:g}), torch {b.scale[k]:g} (unrounded {b.unrounded[k]:.6g}, in "
                     f"{b.incoming[k]:g})")
            boundary = near_power_of_two(a.unrounded[k], rel) or near_power_of_two(b.unrounded[k], rel)
            if (same_in and boundary) or (not same_in and explained):
                out.boundary.append(where)
                explained = True
                affected.add(k)
            else:
                out.mismatches.append(where)
        if set(a.signal) != set(b.signal):
            out.underflow_diffs.append(f"step {step}: feedback reported for different weights: "
                                       f"{sorted(set(a.signal) ^ set(b.signal))}")
        for k in sorted(set(a.signal) & set(b.signal) - affected):
            if abs(a.signal[k] - b.signal[k]) > signal_tol:
                out.underflow_diffs.append(f"step {step} {k}: underflow ratio jax {a.signal[k]:.3g}, "
                                           f"torch {b.signal[k]:.3g}")
        for k in set(a.underflow) & set(b.underflow) - affected:
            if abs(a.underflow[k] - b.underflow[k]) > underflow_tol:
                out.underflow_diffs.append(f"step {step} {k}: jax {a.underflow[k]:.2e}, "
                                           f"torch {b.underflow[k]:.2e}")
        if affected or a.skipped or b.skipped:
            continue
        for k in sorted(set(a.grads) & set(b.grads)):
            if not np.any(a.grads[k]):
                continue
            err = relative_error(b.grads[k], a.grads[k])
            out.worst_grad = max(out.worst_grad, err)
            if err > grad_tol:
                out.grad_diffs.append(f"step {step} {k}: gradients differ by {err:.2e} (relative)")
    return out
