"""The one frozen, validated configuration that every front end consumes.

``AdaLossConfig`` holds what the adaptive loss-scaling solver needs: the
underflow threshold ``T``, the statistical model, the bounds and the gradient
number format. It imports neither JAX nor PyTorch, so ``jax_adaloss`` and
``torch_bridge`` share it (and the solver in :mod:`adaloss.solver`) unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Literal, NamedTuple

import ml_dtypes
import numpy as np

StatModel = Literal["product", "output", "gradient"]
STAT_MODELS: tuple[str, ...] = ("product", "output", "gradient")
Fp8Rule = Literal["decision", "current"]
FP8_RULES: tuple[str, ...] = ("decision", "current")

#: Gradient number formats by name, the format of the cotangents the decisions govern.
#: A 16-bit format is the dtype the model's backward runs in (a cotangent in another 16-bit
#: format is refused); an 8-bit format is the one every layer's incoming cotangent is stored
#: in for its two backward GEMMs (:data:`FP8_FORMATS`), whatever the model's dtype.
GRAD_FORMATS: dict[str, type] = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}
#: The 8-bit formats of :data:`GRAD_FORMATS`: each layer quantizes its incoming cotangent to
#: one (saturating at the format's max) at the scale the backward carries.
FP8_FORMATS: tuple[str, ...] = ("float8_e5m2", "float8_e4m3fn")


#: The largest scale "no bound" allows (``layer_bound``/``accum_bound`` = None): far beyond
#: any useful scale (a gradient of 2^-126, fp32's smallest normal, needs 2^112 to reach fp16's
#: normal range only if it is to be kept at all), small enough that ``1/scale`` is a normal
#: fp32 number and a scaled fp32 weight gradient stays finite.
UNBOUNDED = 2.0**64


class FormatLimits(NamedTuple):
    """Range of a gradient format: smallest positive normal, smallest positive (subnormal)
    and largest finite value."""

    u_min: float  # smallest normal: below it fewer than 11 (fp16) significant bits remain
    u_max: float
    subnormal: float


def format_limits(grad_format: str) -> FormatLimits:
    """``FormatLimits`` of a format named in ``GRAD_FORMATS``, read from ``ml_dtypes.finfo``."""
    if grad_format not in GRAD_FORMATS:
        raise ValueError(
            f"grad_format must be one of {sorted(GRAD_FORMATS)}, got {grad_format!r}"
        )
    info = ml_dtypes.finfo(GRAD_FORMATS[grad_format])
    return FormatLimits(float(info.smallest_normal), float(info.max), float(info.smallest_subnormal))


def _check(cond: bool, field: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"AdaLossConfig.{field} must be {allowed}, got {value!r}")


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class AdaLossConfig:
    """Configuration of adaptive loss scaling (Zhao et al., arXiv:1910.12385).

    Attributes:
      threshold: ``T``, the largest tolerated fraction of underflowing entries, in (0, 0.5).
      model: statistical model of the quantity that must not underflow:
        ``"product"`` (spread of one product g·W), ``"output"`` (spread of the
        layer's input gradient, ``product`` times sqrt(relu_fraction·n)) or
        ``"gradient"`` (spread of the incoming gradient alone).
      layer_bound: largest scale one layer may apply; ``None``: no bound
        (:data:`UNBOUNDED`). The overflow caps still hold every cotangent below ``u_max``.
      accum_bound: largest accumulated scale a gradient may carry; ``None``: no bound
        (:data:`UNBOUNDED`): weight gradients are fp32 (JAX) or are unscaled in fp32, and
        an overflow backs the scales off (``AdaLossState.backoff``, ``AdaLossScaler.backoff``).
      power_of_two: round every scale down to a power of two (exact rescaling).
      init_scale: scale multiplied into the loss cotangent before backprop.
      grad_format: number format of the low-precision cotangents; ``u_min``/``u_max`` come
        from it. ``float16`` or ``bfloat16``: the dtype the model's backward runs in (a layer
        or cast whose cotangent is in another 16-bit format raises ``ValueError``).
        ``float8_e5m2`` or ``float8_e4m3fn``: every layer quantizes its incoming cotangent to
        that format once (saturating), at the scale the backward carries, and both its
        backward GEMMs read the fp8 tensor; the model keeps its dtype (fp16, bf16 or fp32).
        The layer decisions then place their output's spread below the format's max (see
        ``saturation``) instead of above its smallest normal.
      u_min: override of the format's smallest *normal* number (2^-14 for fp16), the level
        below which a value counts as underflowing. The method's own choice is the smallest
        subnormal (the authors used 6.0e-8): it keeps values from becoming zero but leaves
        them with a few bits (see the README's departures).
      u_max: override of the format's largest finite value.
      update_every: PyTorch (``AdaLossScaler``): recompute the statistical part of each
        layer's scale every N calls and reuse it in between, which spares the op-by-op
        decisions their statistics on the calls between; the overflow caps always use the
        current call's statistics. ``jax_adaloss`` refuses N > 1: under ``jit`` the
        statistics would run at every call anyway.
      relu_fraction: ``rho`` of the ``output`` model, the fraction of a layer's
        fan-in assumed non-zero.
      cast_rule: choose a scale (log-normal model) where backprop narrows a
        cotangent, e.g. the fp32 loss cotangent cast to fp16.
      layer_rule: choose a scale at every weighted layer from its statistics (step 2). With
        ``False`` a layer's statistical scale is 1: the cast decisions alone (chiefly the
        loss cotangent's, one global scale) choose the scale, and a layer only lowers it
        where an overflow cap requires. The ablation of the per-layer decisions.
      backoff_interval: finite steps in a row after which the back-off exponent (raised by
        one on every step with a non-finite gradient; kept in ``AdaLossState`` /
        ``AdaLossScaler.state_dict()``) is lowered by one, as a dynamic loss scale grows
        back after 2000 (GradScaler, jmp).
      underflow_feedback: measure, in every backward, the fraction of the non-zero entries
        below ``u_min`` where the cotangent each layer decision scaled enters the next layers
        (what ``T`` bounds, counted rather than modelled), and keep a lift exponent ``k`` per
        layer weight (``AdaLossState.lift``, ``AdaLossScaler.lift``): a step whose fraction
        exceeds ``T/2`` raises ``k`` by one, one below ``T/32`` lowers it, and the layer's
        statistical scale is multiplied by ``2^k`` (the overflow caps unchanged). It corrects
        what the normal model misses after the backward of a GELU or a softmax, whose
        derivatives leave more tiny entries than a normal distribution has. Off in
        :meth:`authors_preset`. With an fp8 ``grad_format`` the measured fraction is the one
        *saturated* at the format's max (over ``saturation``), and the exponent moves both ways
        (``-MAX_LIFT..MAX_LIFT``): down, in one step, by the powers of two the saturated fraction
        says the scale overshot, while more than ``saturation`` saturates; up by one while none
        does and more than ``T/2`` is below the smallest normal.
      saturation: ``T_sat``, fp8 formats only: the largest fraction of a layer's output
        cotangent (modelled as normal) that its decision lets exceed the format's max, where
        the cast saturates. The decision is the largest power of two allowed: under the
        normal model a floating-point format's relative rounding error does not depend on
        the scale in its normal range, so the predicted quantization error only falls as the
        scale rises (fewer entries below the smallest normal) until entries saturate.
      fp8_rule: fp8 formats only: ``"decision"`` (each layer sets its output's scale, above)
        or ``"current"``: per-tensor current scaling, as Transformer Engine's
        ``Float8CurrentScaling`` computes it: every cast takes the power of two that maps its
        own tensor's ``max|g|`` to the format's max (a reduction over the tensor before it is
        cast); the layers' statistical scales are 1 (their caps still hold).
      operand_format: ``None`` (default: the layers' GEMMs read the model's activations and
        weights), or an fp8 format (:data:`FP8_FORMATS`, ``"float8_e4m3fn"`` for Transformer
        Engine's ``HYBRID`` recipe) to which every layer's input and weight are quantized
        (saturating) at their own per-tensor ``max|x|`` (current scaling: the largest power of
        two, or with ``power_of_two=False`` the exact factor, that maps it to the format's
        max) for its forward GEMM and both backward GEMMs, so that every GEMM multiplies fp8
        by fp8. The weight's gradient passes the quantization unchanged (straight through).
        Needs an fp8 ``grad_format``. In PyTorch the layers' forward does it: the model's
        ``nn.Linear`` layers converted by ``torch_bridge.convert_to_float8_training`` with this
        config (``AdaLossScaler`` refuses the setting on a model without them).
    """

    threshold: float = 1e-3
    model: StatModel = "product"
    layer_bound: float | None = None
    accum_bound: float | None = None
    power_of_two: bool = True
    init_scale: float = 1.0
    grad_format: str = "float16"
    u_min: float | None = None
    u_max: float | None = None
    update_every: int = 1
    relu_fraction: float = 0.5
    cast_rule: bool = True
    layer_rule: bool = True
    backoff_interval: int = 2000
    underflow_feedback: bool = True
    saturation: float = 1e-4
    fp8_rule: Fp8Rule = "decision"
    operand_format: str | None = None

    def __post_init__(self) -> None:
        _check(_is_real(self.threshold) and 0.0 < self.threshold < 0.5,
               "threshold", "a float in (0, 0.5)", self.threshold)
        _check(self.model in STAT_MODELS, "model", f"one of {STAT_MODELS}", self.model)
        _check(self.grad_format in GRAD_FORMATS, "grad_format",
               f"one of {sorted(GRAD_FORMATS)}", self.grad_format)
        for name in ("u_min", "u_max"):
            value = getattr(self, name)
            _check(value is None or (_is_real(value) and value > 0), name,
                   "None or a finite float > 0", value)
        _check(self.underflow_limit < self.overflow_limit, "u_min",
               f"below u_max ({self.overflow_limit})", self.underflow_limit)
        for name in ("layer_bound", "accum_bound"):
            value = getattr(self, name)
            _check(value is None or (_is_real(value) and value >= 1), name,
                   "None or a finite float >= 1", value)
        _check(_is_real(self.init_scale) and self.init_scale > 0, "init_scale",
               "a finite float > 0", self.init_scale)
        _check(isinstance(self.power_of_two, bool), "power_of_two", "a bool", self.power_of_two)
        _check(isinstance(self.cast_rule, bool), "cast_rule", "a bool", self.cast_rule)
        _check(isinstance(self.layer_rule, bool), "layer_rule", "a bool", self.layer_rule)
        _check(isinstance(self.update_every, int) and not isinstance(self.update_every, bool)
               and self.update_every >= 1, "update_every", "an int >= 1", self.update_every)
        _check(isinstance(self.backoff_interval, int) and not isinstance(self.backoff_interval, bool)
               and self.backoff_interval >= 1, "backoff_interval", "an int >= 1", self.backoff_interval)
        _check(isinstance(self.underflow_feedback, bool), "underflow_feedback", "a bool",
               self.underflow_feedback)
        _check(_is_real(self.relu_fraction) and 0 < self.relu_fraction <= 1,
               "relu_fraction", "a float in (0, 1]", self.relu_fraction)
        _check(_is_real(self.saturation) and 0.0 < self.saturation < 0.5,
               "saturation", "a float in (0, 0.5)", self.saturation)
        _check(self.fp8_rule in FP8_RULES, "fp8_rule", f"one of {FP8_RULES}", self.fp8_rule)
        _check(self.operand_format is None or self.operand_format in FP8_FORMATS, "operand_format",
               f"None or one of {FP8_FORMATS}", self.operand_format)
        _check(self.operand_format is None or self.fp8, "operand_format",
               f"None with grad_format={self.grad_format!r} (fp8 operands need an fp8 grad_format)",
               self.operand_format)

    @classmethod
    def authors_preset(cls, model: StatModel = "gradient", **overrides: object) -> AdaLossConfig:
        """The authors' defaults: T=1e-3, layer bound 16, accumulated bound 1024,
        powers of two, u_min=6.0e-8 (fp16's smallest subnormal), u_max=65504 (fp16).

        ``model`` defaults to ``"gradient"``, the model their final code runs
        (their W-based models were unreachable there).
        """
        fields = dict(threshold=1e-3, model=model, layer_bound=16.0, accum_bound=1024.0,
                      power_of_two=True, grad_format="float16", u_min=6.0e-8, u_max=65504.0,
                      underflow_feedback=False)
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    # Resolved numbers (what the solver uses).
    @property
    def fp8(self) -> bool:
        """Whether ``grad_format`` is an 8-bit format (:data:`FP8_FORMATS`)."""
        return self.grad_format in FP8_FORMATS

    @property
    def operand_limit(self) -> float:
        """The largest finite value of ``operand_format`` (``operand_format`` must be set)."""
        if self.operand_format is None:
            raise ValueError("AdaLossConfig.operand_format is None: the layers' operands are not quantized")
        return format_limits(self.operand_format).u_max

    @property
    def z_saturation(self) -> float:
        """``sqrt(2)·erfinv(1 - T_sat)``: a N(0, σ) entry exceeds ``z·σ`` in magnitude with
        probability ``saturation``."""
        return NormalDist().inv_cdf(1.0 - self.saturation / 2.0)

    @property
    def underflow_limit(self) -> float:
        """``u_min``: the override, else the format's smallest normal number."""
        return self.u_min if self.u_min is not None else format_limits(self.grad_format).u_min

    @property
    def overflow_limit(self) -> float:
        """``u_max``: the override, else the format's largest finite value."""
        return self.u_max if self.u_max is not None else format_limits(self.grad_format).u_max

    @property
    def layer_limit(self) -> float:
        """``layer_bound``, or :data:`UNBOUNDED`."""
        return self.layer_bound if self.layer_bound is not None else UNBOUNDED

    @property
    def accum_limit(self) -> float:
        """``accum_bound``, or :data:`UNBOUNDED`."""
        return self.accum_bound if self.accum_bound is not None else UNBOUNDED

    @property
    def z_two_sided(self) -> float:
        """``sqrt(2)·erfinv(T)``: a N(0, σ) entry lies below ``z·σ`` in magnitude with probability T."""
        return NormalDist().inv_cdf((1.0 + self.threshold) / 2.0)

    @property
    def z_lower(self) -> float:
        """``sqrt(2)·erfinv(2T - 1)``: the T-quantile of a standard normal (negative)."""
        return NormalDist().inv_cdf(self.threshold)
