"""Adaptive per-layer loss scaling for PyTorch, with ``torch.amp.GradScaler``'s interface.

Runs the same solver and takes the same :class:`AdaLossConfig` as ``jax_adaloss``;
importing it does not import JAX.

>>> scaler = torch_bridge.AdaLossScaler(model)                   # doctest: +SKIP
>>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()  # doctest: +SKIP
"""

from adaloss.config import AdaLossConfig
from adaloss.report import LayerReport, LayerUnderflow
from torch_bridge.float8 import Float8Linear, convert_to_float8_training
from torch_bridge.graph import ScalePlan
from torch_bridge.scaler import AdaLossScaler, IncompatibleLayers
from torch_bridge.underflow import layer_cotangents, measure_underflow

__all__ = ["AdaLossConfig", "AdaLossScaler", "Float8Linear", "IncompatibleLayers", "LayerReport",
           "LayerUnderflow", "ScalePlan", "convert_to_float8_training", "layer_cotangents",
           "measure_underflow"]
