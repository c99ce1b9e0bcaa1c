"""Adaptive (per-layer, statistics-driven) loss scaling for JAX and optax.

>>> import jax_adaloss, optax
>>> grads = jax_adaloss.grad(loss_fn)(params, batch)           # doctest: +SKIP
>>> tx = jax_adaloss.adaloss(inner=optax.adam(1e-3))            # doctest: +SKIP
"""

from adaloss.config import AdaLossConfig
from jax_adaloss import pow2 as _pow2  # noqa: F401  (solver.pow2_floor's JAX form)
from jax_adaloss.api import grad, value_and_grad
from jax_adaloss.collectives import pmean, psum, tree_add, tree_scale
from jax_adaloss.report import BackwardReport, LayerReport
from jax_adaloss.scaled_grad import ScaledGrad, StatelessScaledGrad, is_scaled_grad, unscale_tree
from jax_adaloss.skips import SkipMonitor, skip_diagnosis
from jax_adaloss.transform import AdaLossState, SkipRecord, adaloss
from jax_adaloss.underflow import LayerUnderflow, layer_cotangents, measure_underflow

__all__ = [
    "AdaLossConfig", "AdaLossState", "BackwardReport", "LayerReport", "ScaledGrad",
    "StatelessScaledGrad", "adaloss", "grad", "is_scaled_grad", "unscale_tree", "value_and_grad",
    "LayerUnderflow", "layer_cotangents", "measure_underflow", "pmean", "psum", "tree_add", "tree_scale",
    "SkipMonitor", "SkipRecord", "skip_diagnosis",
]
