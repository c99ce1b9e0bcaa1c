"""Train a Flax model and its torch twin side by side; record every scale decision.

Each step both frameworks run the fp16 adaptive backward and an fp32 backward at
the same weights (capturing each layer's incoming cotangent), record the
per-layer scales and the measured underflow rates, and take an SGD step with
their own gradients (skipped when a gradient is not finite).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from twin_models import PAIRS, flax_xent, load_flax, torch_name, torch_xent

import jax_adaloss
import torch_bridge
from adaloss.config import AdaLossConfig
from jax_adaloss.underflow import compare_cotangents as compare_jax
from torch_bridge.underflow import compare_cotangents as compare_torch


@dataclasses.dataclass
class StepRecord:
    """One step of one framework; layer names in torch's spelling."""

    scale: dict[str, float]
    unrounded: dict[str, float]
    incoming: dict[str, float]
    underflow: dict[str, float]  # measured, layers only
    skipped: bool
    loss: float
    order: list[str] = dataclasses.field(default_factory=list)  # layers in forward order


def _data(name: str, step: int, seed: int) -> tuple[Any, Any, np.ndarray]:
    return PAIRS[name][2](jax.random.fold_in(jax.random.key(seed), step))


def init_params(name: str, seed: int) -> Any:
    cls = PAIRS[name][0]
    x, _, _ = _data(name, 0, seed)
    return cls(dtype=jnp.float32).init(jax.random.key(seed + 1), x)


def run_jax(name: str, steps: int, config: AdaLossConfig, lr: float, loss_factor: float,
            seed: int = 0) -> list[StepRecord]:
    cls = PAIRS[name][0]
    params = init_params(name, seed)

    def loss(p: Any, x: Any, y: Any, dt: Any) -> jax.Array:
        return loss_factor * flax_xent(cls(dtype=dt).apply(p, x), y)

    def vg(dt: Any) -> Any:
        return jax.jit(jax_adaloss.value_and_grad(functools.partial(loss, dt=dt), config=config,
                                                  return_report=True, capture_cotangents=True))

    vg16 = vg(jnp.float16)
    loss32 = functools.partial(loss, dt=jnp.float32)
    records = []
    for step in range(steps):
        x, _, y = _data(name, step, seed)
        (value, grads), rep = vg16(params, x, y)
        ref = jax_adaloss.layer_cotangents(loss32, params, x, y, loss_scale=1.0, config=config)
        plain = jax_adaloss.unscale_tree(grads)
        finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(plain))
        low = {k: (v, rep.cotangent_scales[k]) for k, v in rep.cotangents.items()}
        under = {torch_name(k): u.measured for k, u in compare_jax(low, ref, config).items()}
        records.append(StepRecord(
            scale={torch_name(k): float(r.scale) for k, r in rep.layers.items()},
            unrounded={torch_name(k): float(r.unrounded_scale) for k, r in rep.layers.items()},
            incoming={torch_name(k): float(r.incoming_scale) for k, r in rep.layers.items()},
            underflow=under, skipped=not finite, loss=float(value)))
        if finite:
            params = jax.tree_util.tree_map(lambda p, g: p - lr * g.astype(p.dtype), params, plain)
    return records


def _torch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, factor: float) -> torch.Tensor:
    return factor * torch_xent(model(x), y)


def run_torch(name: str, steps: int, config: AdaLossConfig, lr: float, loss_factor: float,
              seed: int = 0) -> list[StepRecord]:
    model = PAIRS[name][1]()
    load_flax(model, init_params(name, seed))
    scaler = torch_bridge.AdaLossScaler(model, config, capture=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    records = []
    for step in range(steps):
        _, x, y = _data(name, step, seed)
        y = torch.from_numpy(y.astype(np.int64))
        ref = torch_bridge.layer_cotangents(model, functools.partial(_torch_loss, model, x, y, loss_factor),
                                            loss_scale=1.0, config=config)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            value = loss_factor * torch_xent(model(x), y)
        skipped_before = scaler.skipped_steps
        scaler.scale(value).backward()
        reps = scaler.layer_reports()
        low = scaler.captured_cotangents()
        scaler.step(opt)
        scaler.update()
        records.append(StepRecord(
            scale={k: float(r.scale) for k, r in reps.items()},
            unrounded={k: float(r.unrounded_scale) for k, r in reps.items()},
            incoming={k: float(r.incoming_scale) for k, r in reps.items()},
            underflow={k: u.measured for k, u in compare_torch(low, ref, config).items()},
            skipped=scaler.skipped_steps > skipped_before, loss=float(value.detach())))
    return records


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


def compare(jx: list[StepRecord], tr: list[StepRecord], rel: float = 1e-3,
            underflow_tol: float = 1e-3) -> Comparison:
    """Scales bitwise; a difference is explained only when the decision lies within ``rel`` of
    a power-of-two boundary in either framework, or when the incoming scale already differs
    because of such a decision earlier in the same backward."""
    out = Comparison([], [], [])
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
        for k in set(a.underflow) & set(b.underflow) - affected:
            if abs(a.underflow[k] - b.underflow[k]) > underflow_tol:
                out.underflow_diffs.append(f"step {step} {k}: jax {a.underflow[k]:.2e}, "
                                           f"torch {b.underflow[k]:.2e}")
    return out
