"""Adaptive per-layer loss scaling for PyTorch, with ``torch.amp.GradScaler``'s interface.

Runs the same solver and takes the same :class:`AdaLossConfig` as ``jax_adaloss``;
importing it does not import JAX.

>>> scaler = torch_bridge.AdaLossScaler(model)                   # doctest: +SKIP
>>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()  # doctest: +SKIP
"""

from adaloss.config import AdaLossConfig
from adaloss.report import LayerReport, LayerUnderflow
from torch_bridge.graph import ScalePlan
from torch_bridge.scaler import AdaLossScaler, IncompatibleLayers
from torch_bridge.underflow import layer_cotangents, measure_underflow

__all__ = ["AdaLossConfig", "AdaLossScaler", "IncompatibleLayers", "LayerReport", "LayerUnderflow",
           "ScalePlan", "layer_cotangents", "measure_underflow"]
