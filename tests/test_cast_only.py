"""``layer_rule=False`` (the ablation of the per-layer decisions): the loss cotangent's cast
decision picks one global scale, layers keep it (lowering it only where a cap requires), and
the gradients stay right. Both frameworks, the same shared solver.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from models import make_case, xent
from torch_models import make_case as torch_case
from torch_models import xent as torch_xent

import jax_adaloss
import torch_bridge
from adaloss import solver
from adaloss.config import AdaLossConfig

FACTOR = 1e-6
CAST_ONLY = AdaLossConfig(layer_rule=False)


def test_layer_rule_off_makes_the_statistical_layer_scale_one():
    sigma = np.float32(1e-9)  # would ask for ~2^22 with the rule on
    assert solver.model_scale(AdaLossConfig(), sigma, np) > 1e5
    assert solver.model_scale(CAST_ONLY, sigma, np) == 1.0
    # the cast rule is untouched
    ls = solver.log_stats(np.full(8, 1e-9, np.float32), np)
    assert solver.cast_model_scale(CAST_ONLY, ls, np) > 1e4


def test_layer_rule_must_be_a_bool():
    with pytest.raises(ValueError, match="layer_rule"):
        AdaLossConfig(layer_rule=1)


def _jax_run(config):
    cls, params, x, y = make_case("gpt", jax.random.key(0))
    model = cls(dtype=jnp.float16)

    def loss(p):
        return FACTOR * xent(model.apply(p, x), y)

    grads, report = jax.jit(jax_adaloss.grad(loss, config=config, return_report=True))(params)
    ref = jax.grad(lambda p: xent(cls(dtype=jnp.float32).apply(p, x), y))(params)
    unscaled = jax_adaloss.unscale_tree(grads)
    errs = jax.tree.leaves(jax.tree.map(
        lambda g, r: float(jnp.linalg.norm(g / FACTOR - r) / jnp.linalg.norm(r)), unscaled, ref))
    return report, max(errs)


def test_jax_cast_only_scales_once_at_the_loss_and_keeps_gradients():
    report, err = _jax_run(CAST_ONLY)
    layers = {k: r for k, r in report.layers.items() if not k.startswith("cast")}
    casts = {k: r for k, r in report.layers.items() if k.startswith("cast")}
    assert layers and casts
    assert all(float(r.model_scale) == 1.0 and float(r.scale) <= 1.0 for r in layers.values())
    assert max(float(r.scale) for r in casts.values()) >= 2.0**20  # loss ×1e-6 needs ≥ 2^20
    _, err_default = _jax_run(AdaLossConfig())
    assert err < 0.05 and err_default < 0.05, (err, err_default)


def test_torch_cast_only_scales_once_at_the_loss_and_keeps_gradients():
    model, x, y = torch_case("gpt")
    ref = torch.autograd.grad(torch_xent(model(x), y), list(model.parameters()))
    scaler = torch_bridge.AdaLossScaler(model, CAST_ONLY)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = FACTOR * torch_xent(model(x), y)
    scaler.scale(loss).backward()
    reports = scaler.layer_reports()
    layers = {k: r for k, r in reports.items() if not k.startswith("cast")}
    casts = {k: r for k, r in reports.items() if k.startswith("cast")}
    assert layers and casts, sorted(reports)
    assert all(float(r.model_scale) == 1.0 and float(r.scale) <= 1.0 for r in layers.values())
    assert max(float(r.scale) for r in casts.values()) >= 2.0**20
    scales = scaler.grad_scales()
    errs = [float((p.grad.float() / scales[n] / FACTOR - r).norm() / r.norm())
            for (n, p), r in zip(model.named_parameters(), ref)]
    assert max(errs) < 0.05, errs
