"""Per-layer scale decisions, the same record for every framework."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from adaloss import solver
from adaloss.config import AdaLossConfig

Array = Any  # a 0-d array of the caller's framework


class LayerReport(NamedTuple):
    """One scale decision of the last backward (a weighted layer or a narrowing cast).

    Attributes:
      scale: the scale this layer applied to its input cotangent (fp32, may be < 1).
      model_scale: the statistical part of ``scale``, before the overflow caps.
      sigma: the modelled spread σ (σ_ln of ``log|g|`` for a cast).
      incoming_scale: scale ``P`` carried by the cotangent arriving at the layer.
      outgoing_scale: ``P · scale``, carried by the cotangent it sends on.
      predicted_underflow: fraction of the modelled quantity predicted to stay below u_min.
      grad_absmax: ``max|g|`` of the incoming cotangent (fp32).
      fan_in: ``n``, terms summed into each entry of the input gradient (1 for a cast).
      unrounded_scale: ``scale`` before the power-of-two floor (after every bound);
        a value within rounding of a power of two can round differently across
        frameworks or kernels.
      incoming_held: whether a cap or bound set a decision behind ``incoming_scale`` (the
        layer decisions that scaled this cotangent, through merges) below its statistical
        scale: then a larger scale was not available, whatever underflow remains (bool;
        ``False`` for a cast, whose incoming cotangent is wide).
      flushed: fp8 formats only (else ``None``): the fraction of the incoming cotangent's
        non-zero entries its fp8 cast flushed to zero.
      subnormal: fp8 only: the fraction held non-zero below the format's smallest normal.
      saturated: fp8 only: the fraction beyond the format's max, clipped to it.
      current: fp8 only: whether this cast's scale was read from the tensor it converts
        (``max|g|``, per-tensor current scaling) because no decision set it: the first cast
        after the loss, or a narrowing cast (bool).
    """

    scale: Array
    model_scale: Array
    sigma: Array
    incoming_scale: Array
    outgoing_scale: Array
    predicted_underflow: Array
    grad_absmax: Array
    fan_in: Array
    unrounded_scale: Array
    incoming_held: Array = False
    flushed: Array | None = None
    subnormal: Array | None = None
    saturated: Array | None = None
    current: Array | None = None


def decision_report(config: AdaLossConfig, kind: str, d: Any, spread: Any, incoming: Array, outgoing: Array,
                    absmax: Array, fan_in: int, held: Any, fractions: Any, current: Any,
                    erf: Callable[[Array], Array], xp: Any) -> LayerReport:
    """The :class:`LayerReport` of one decision of ``kind`` (``"layer"``, ``"first"``: an fp8
    first layer's, ``"cast"``): ``d`` its :class:`adaloss.solver.LayerScale`, ``spread`` the
    log-statistics a cast's model read (a layer's σ is ``d.sigma``), ``fractions`` an fp8
    cast's (flushed, subnormal, saturated) or None. The predicted underflow is its model's at
    the scale chosen (:func:`adaloss.solver.predicted_underflow`, ``_lognormal`` for a cast),
    0 where no model set the scale (an fp8 cast fitted to its tensor's max, a first layer)."""
    if config.fp8 and kind in ("cast", "first"):
        pred = xp.zeros_like(d.scale)
    elif kind == "cast":
        pred = solver.predicted_underflow_lognormal(config, spread, d.scale, erf, xp)
    else:
        pred = solver.predicted_underflow(config, d.sigma, d.scale, erf, xp)
    flushed, subnormal, saturated = fractions if fractions is not None else (None,) * 3
    return LayerReport(scale=d.scale, model_scale=d.model_scale, sigma=d.sigma, incoming_scale=incoming,
                       outgoing_scale=outgoing, predicted_underflow=pred, grad_absmax=absmax,
                       fan_in=xp.asarray(fan_in, dtype=xp.int32), unrounded_scale=d.unrounded,
                       incoming_held=xp.asarray(held), flushed=flushed, subnormal=subnormal,
                       saturated=saturated, current=None if current is None else xp.asarray(current))


def weight_of(decision: str) -> str:
    """The weight a layer decision is named after: ``w@1``, a second use of ``w``, gives ``w``."""
    return decision.split("@", 1)[0]


class Coverage(NamedTuple):
    """Where per-layer scaling engaged in one backward.

    Attributes:
      weighted_ops: matmuls and convolutions on the differentiated path (outside
        opaque regions).
      layers: of those, the layers that got their own scale (one operand from the
        weights, the other from data that needs a gradient) and, with an fp8
        ``grad_format``, the first layers (their input needs no gradient), which quantize
        the cotangent of their weight gradient: in every format, one per layer in the
        layer reports (which also hold the casts' and regions' decisions).
      opaque_regions: regions whose inside gets no per-layer scale: in JAX
        ``scan``/``while``/``cond`` or custom-rule bodies holding matmuls; in torch
        regions compiled with ``torch.compile``, reentrant checkpoints and custom autograd
        Functions that use parameters.
    """

    weighted_ops: int
    layers: int
    opaque_regions: int


class AdaLossCoverageWarning(UserWarning):
    """Per-layer scaling did not engage where it should: the message says why and what to do."""


def warn_coverage(opaque: str | None, missed: Sequence[str], no_layer: str | None,
                  stacklevel: int = 2) -> None:
    """One :class:`AdaLossCoverageWarning` naming every reason layers went unscaled: opaque
    regions, weighted ops with a weight operand that got no scale, or no layer at all."""
    problems = [opaque] if opaque else []
    if missed:
        problems.append(f"{len(missed)} weighted op(s) not scaled: {sorted(set(missed))}")
    if no_layer:
        problems.append(no_layer)
    if problems:
        warnings.warn("adaptive loss scaling: " + "; ".join(problems) + ".", AdaLossCoverageWarning,
                      stacklevel=stacklevel + 1)


class LayerUnderflow(NamedTuple):
    """Measured and predicted underflow of the cotangent entering one layer.

    Attributes:
      measured: fraction of the entries, non-zero in a reference (fp32) backward at the same
        weights, whose reference value times the scale the low-precision cotangent carries
        is below ``u_min`` in magnitude: the underflow the scale decisions leave, the
        quantity the threshold ``T`` bounds and ``predicted`` models.
      predicted: fraction of the true cotangent, modelled as normal, that the scale
        it carries leaves below u_min: ``erf(u_min / (P·σ·√2))``, σ the std of the
        reference cotangent, P the carried scale.
      reference_zero: fraction of entries that are zero in the reference too
        (ReLU, masks): they cannot underflow.
      size: number of entries.
      flushed: fraction of the entries, non-zero in the reference, that are zero in the
        low-precision backward: lost outright.
      carried: fraction of the entries, non-zero in the reference, that the low-precision
        backward holds below ``u_min`` (as carried, scaled). It exceeds ``measured`` by what
        the low-precision arithmetic loses at any scale: e.g. fp16's ``tanh`` saturates at
        ``|x| ≳ 4.5``, so the derivative of the tanh-approximated GELU is exactly 0 there in
        fp16 (tiny, non-zero in fp32), and those entries are zero whatever the scale.
    """

    measured: float
    predicted: float
    reference_zero: float
    size: int
    flushed: float
    carried: float


def compare_layers(low: dict[str, tuple[Any, Any]], ref: dict[str, tuple[Any, Any]],
                   predicted: Callable[[Any, Any], Any], u_min: float,
                   to_numpy: Callable[[Any], np.ndarray] = np.asarray) -> dict[str, LayerUnderflow]:
    """Per layer present in both (casts left out): measured and predicted underflow.

    ``low``/``ref``: ``{layer: (cotangent, carried scale)}`` of the low-precision and
    the reference backward (``ref`` unscaled); ``predicted(reference cotangent,
    carried scale)`` is the framework's normal-model prediction; ``u_min`` the level below
    which an entry counts as underflowing (the config's ``underflow_limit``).
    """
    out = {}
    for name, (g, scale) in low.items():
        if name.startswith("cast:") or name not in ref:
            continue
        r = ref[name][0]
        g_np = to_numpy(g).astype(np.float64)
        r_np = to_numpy(r).astype(np.float64)
        live = r_np != 0
        carried_scale = float(to_numpy(scale))
        out[name] = LayerUnderflow(measured=float(np.mean((np.abs(r_np) * carried_scale < u_min) & live)),
                                   predicted=float(predicted(r, scale)),
                                   reference_zero=float(np.mean(~live)), size=int(g_np.size),
                                   flushed=float(np.mean((g_np == 0) & live)),
                                   carried=float(np.mean((np.abs(g_np) < u_min) & live)))
    return out


def measurement_config(config: AdaLossConfig | None, loss_scale: float | None) -> AdaLossConfig:
    """The config of an underflow measurement: ``config`` for adaptive scaling
    (``loss_scale=None``), or ``config`` seeded with one global ``loss_scale``."""
    config = AdaLossConfig() if config is None else config
    if loss_scale is None:
        return config
    if not loss_scale > 0:
        raise ValueError(f"loss_scale must be a positive number (1: no scaling), got {loss_scale!r}")
    return dataclasses.replace(config, init_scale=float(loss_scale))
