"""Measure gradient underflow per layer of a torch model: a low-precision backward
against an fp32 one at the same weights (the counterpart of ``jax_adaloss.underflow``).

``loss_low`` and ``loss_ref`` are callables that run the forward and return the
loss, e.g. the model under ``torch.autocast`` and the same model in fp32. The
parameters' ``.grad`` are left as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaloss import solver
from adaloss.config import AdaLossConfig
from adaloss.report import LayerUnderflow, compare_layers, measurement_config
from torch_bridge._xp import xp
from torch_bridge.graph import ScalePlan, parameter_names
from torch_bridge.hooks import BackwardRecord, ScaledBackward
from torch_bridge.scaler import AdaLossScaler
from torch_bridge.stats import tensor_stats


def layer_cotangents(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], *,
                     loss_scale: float | None = None, config: AdaLossConfig | None = None,
                     scaler: AdaLossScaler | None = None
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer name: (incoming cotangent as carried, the scale it carries)}`` in
    ``loss_fn()``'s backward (casts included, named ``cast:k``).

    ``loss_scale=None``: adaptive per-layer scaling with ``config``; a number: one
    global loss scale, no per-layer scales. ``scaler``: the :class:`AdaLossScaler` of a
    training run, whose config, back-off and lift the adaptive backward then uses (as the
    run's next backward would); its state is not changed.
    """
    if scaler is not None:
        config = scaler.config
    config = measurement_config(config, loss_scale)
    levels = {} if scaler is None or loss_scale is not None else scaler.levels()
    saved = {p: p.grad for p in model.parameters()}
    try:
        for p in saved:
            p.grad = None
        loss = loss_fn()
        plan = ScalePlan(loss.grad_fn, parameter_names(model), cast_rule=config.cast_rule)
        records: list[BackwardRecord] = []
        sb = ScaledBackward(plan, config, lambda p, g, s, old: (g, s), records.append, capture=True,
                            reference=None if loss_scale is None else "global", **levels)
        loss.backward()
        del sb
        rec = records[0]
        return {k: (v, rec.captured_scales[k]) for k, v in rec.captured.items()}
    finally:
        for p, g in saved.items():
            p.grad = g


def compare_cotangents(low: dict[str, tuple[torch.Tensor, torch.Tensor]],
                       ref: dict[str, tuple[torch.Tensor, torch.Tensor]],
                       config: AdaLossConfig) -> dict[str, LayerUnderflow]:
    """Per layer present in both (casts left out): measured and predicted underflow.

    ``ref``'s cotangents must be unscaled (carried scale 1)."""
    def predicted(r: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        sigma = torch.sqrt(solver.variance(tensor_stats(r), xp))
        return solver.predicted_underflow(config, sigma, scale.to(torch.float32), torch.special.erf, xp)
    return compare_layers(low, ref, predicted, config.underflow_limit, _numpy)


def _numpy(t: torch.Tensor) -> Any:
    """``t`` as a NumPy array, a 16-bit one widened to fp32 first (exact; NumPy has no bf16)."""
    t = t.detach()
    return (t if t.dtype == torch.float64 else t.to(torch.float32)).cpu().numpy()


def measure_underflow(model: torch.nn.Module, loss_low: Callable[[], torch.Tensor],
                      loss_ref: Callable[[], torch.Tensor], *, loss_scale: float | None = None,
                      config: AdaLossConfig | None = None) -> dict[str, LayerUnderflow]:
    """Per-layer underflow of ``loss_low()``'s backward against ``loss_ref()``'s.

    ``loss_scale=None`` measures adaptive scaling (``config``); a number measures
    one global loss scale (``1``: no scaling).
    """
    config = AdaLossConfig() if config is None else config
    low = layer_cotangents(model, loss_low, loss_scale=loss_scale, config=config)
    ref = layer_cotangents(model, loss_ref, loss_scale=1.0, config=config)
    return compare_cotangents(low, ref, config)


__all__ = ["LayerUnderflow", "compare_cotangents", "layer_cotangents", "measure_underflow"]
