"""The adaptive loss-scaling formulas, written once for every framework.

Every function takes ``xp``, an array namespace (``jax.numpy``, or
``array_api_compat.torch``), and works on fp32 0-d arrays of statistics, so the
same code runs inside a jitted JAX backward and inside a PyTorch autograd hook
with no host synchronisation.

For a layer ``y = x·Wᵀ`` whose incoming cotangent ``g`` carries scale ``P``
(method.md, steps 2-3):

1. Spread σ of the quantity that must not underflow, by ``config.model``:

   - ``product``:  σ² = E[g²]·E[W²]  (= (σ_g² + μ_g²)(σ_W² + μ_W²))
   - ``output``:   σ² = E[g²]·E[W²]·ρ·n
   - ``gradient``: σ² = Var[g]

2. Smallest scale putting at most a fraction T of a N(0, σ) quantity below
   u_min: ``s = u_min / (σ·√2·erfinv(T))``, times the decision's lift ``2^k`` (measured
   feedback, :func:`lift_update`); then ``s = max(s, 1)``. σ = 0 (no spread to model)
   gives 1; an estimate beyond fp32 saturates, and the caps decide.
3. Overflow cap: ``s = min(s, u_max / max|g|, u_max / (n·m))`` with ``m`` the largest
   possible ``|g·W|`` (``gradient``: ``u_max / max|g|`` only); ``s = min(s, accum_bound / P)``;
   ``s = min(s, layer_bound)``; round down to a power of two.

A narrowing cast uses a log-normal model of the non-zero ``|g|``:
``s = exp(ln u_min − μ_ln − σ_ln·√2·erfinv(2T − 1))``, then the same bounds
with ``m = max|g|``. Fan-outs merge branches with :func:`merge_scale`.

With an fp8 ``grad_format`` (:func:`fp8_layer_scale`) a layer's incoming cotangent is
quantized to the format as carried, and the decision sets the scale of the layer's *output*
(the dgrad result, quantized at the next layer) before the GEMM computes it:

1'. ``σ_out² = n·E_row[g²]·E[W²]``, the spread of one entry of ``g·Wᵀ`` (a sum of ``n``
    products) in the largest row of the quantized ``g`` (``E_row``: the mean over that row);
2'. the largest scale whose predicted saturated fraction is at most ``T_sat``:
    ``s = u_max / (σ_out·√2·erfinv(1 − T_sat))``, times the lift ``2^k`` (``k`` may be
    negative); no ``max(s, 1)``: the cotangent as carried may have to shrink;
3'. caps against the dtype the backward runs in (``u_c``: fp16's 65504, or bf16's and fp32's
    ~3.4e38): ``s ≤ u_c / max|g|`` and ``s ≤ u_c / (n·max|g|·max|W|)``: the saturating fp8 cast
    may clip, the 16-bit arithmetic between two casts must not overflow; then the bounds
    and the power-of-two floor of step 3.

A narrowing cast in fp8 (the loss cotangent) reads its tensor anyway: its scale is
``u_max / max|g|`` (no entry saturates), bounded and rounded the same way; a merge in fp8
fits the sum of its branches the same way (:func:`fp8_merge_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from adaloss.config import AdaLossConfig

Array = Any  # a 0-d or n-d array of the caller's framework


class TensorStats(NamedTuple):
    """fp32 statistics of a tensor over all entries, zeros included.

    ``mean`` may be ``None`` where the statistical model does not use it (the
    ``product``/``output`` models need only ``E[x²]``), to save a reduction;
    both moments are ``None`` where only the overflow caps are computed. The caps
    need only ``max|x|``: ``min``/``max`` or ``absmax`` (then ``min``/``max`` may be ``None``).
    """

    mean: Array | None
    sq_mean: Array | None  # E[x²] = variance + mean²
    min: Array | None
    max: Array | None
    absmax: Array | None = None  # max|x|, where min and max are not computed (one reduction)


class LogStats(NamedTuple):
    """fp32 statistics of ``ln|x|`` over the non-zero entries of ``x``."""

    mean: Array
    std: Array
    count: Array  # number of non-zero entries (fp32)
    absmax: Array  # max |x|


class LayerScale(NamedTuple):
    """A scale decision: ``scale`` (final), ``model_scale`` (statistical part,
    after ``max(·, 1)``, before the caps), ``sigma`` (the modelled spread) and
    ``unrounded`` (after every bound, before the power-of-two floor)."""

    scale: Array
    model_scale: Array
    sigma: Array
    unrounded: Array


def _f32(x: Array, xp: Any) -> Array:
    return xp.astype(x, xp.float32)


def tensor_stats(x: Array, xp: Any) -> TensorStats:
    """Mean, mean square, min and max of ``x`` in fp32."""
    x = _f32(x, xp)
    return TensorStats(xp.mean(x), xp.mean(x * x), xp.min(x), xp.max(x))


def magnitude_stats(x: Array, xp: Any, with_mean: bool = False, moments: bool = True) -> TensorStats:
    """``E[x²]`` (and ``E[x]`` with ``with_mean``; neither without ``moments``) and ``max|x|``
    in fp32: the fewest reductions the statistical model and the caps need."""
    x = _f32(x, xp)
    mean = xp.mean(x) if moments and with_mean else None
    sq = xp.mean(x * x) if moments else None
    return TensorStats(mean, sq, None, None, xp.max(xp.abs(x)))


def variance(t: TensorStats, xp: Any) -> Array:
    """Population variance ``E[x²] − E[x]²`` (clipped at 0)."""
    return xp.clip(t.sq_mean - t.mean * t.mean, min=0.0)


def log_stats(x: Array, xp: Any) -> LogStats:
    """Mean and std of ``ln|x|`` over the non-zero entries (zero count gives mean 0, std 0).

    One pass (sums of ``ln|x|`` and ``ln²|x|``) so that the reductions fuse.
    """
    a = xp.abs(_f32(x, xp))
    nz = a > 0
    logs = log_magnitudes(a, nz, xp)
    count = xp.sum(xp.astype(nz, xp.float32))
    return log_stats_of_sums(count, xp.sum(logs), xp.sum(logs * logs), xp.max(a), xp)


def log_magnitudes(a: Array, nonzero: Array, xp: Any) -> Array:
    """``ln a`` where ``nonzero``, else 0 (``a = |x|`` in fp32)."""
    return xp.where(nonzero, xp.log(xp.where(nonzero, a, xp.ones_like(a))), xp.zeros_like(a))


def log_stats_of_sums(count: Array, log_sum: Array, log_sq_sum: Array, absmax: Array, xp: Any) -> LogStats:
    """:func:`log_stats` from the sums over the ``count`` non-zero entries of ``ln|x|`` and
    ``ln²|x|``, and ``max|x|``."""
    count = xp.astype(count, xp.float32)
    denom = xp.clip(count, min=1.0)
    mean = log_sum / denom
    var = xp.clip(log_sq_sum / denom - mean * mean, min=0.0)
    return LogStats(mean, xp.sqrt(var), count, absmax)


# exact faster forms of pow2_floor that a front registers for its namespace (``xp.__name__``)
_POW2_FLOOR: dict[str, Callable[[Array], Array]] = {}


def register_pow2_floor(namespace: str, fn: Callable[[Array], Array]) -> None:
    """Use ``fn`` as :func:`pow2_floor` for the array namespace named ``namespace``: it must
    give the same numbers as frexp/ldexp (``jax_adaloss`` registers one from fp32 bits)."""
    _POW2_FLOOR[namespace] = fn


def pow2_floor(x: Array, xp: Any) -> Array:
    """Largest power of two ``<= |x|`` for finite non-zero ``x``, exactly (frexp/ldexp, not
    log2); 0.5 for 0, ±inf and NaN (frexp's exponent 0). A namespace with a registered form
    (:func:`register_pow2_floor`) uses it: in JAX, the exponent bits with the mantissa
    cleared, a few integer ops instead of frexp's and ldexp's dozens, once per decision."""
    fast = _POW2_FLOOR.get(getattr(xp, "__name__", ""))
    if fast is not None:
        return fast(x)
    _, exponent = xp.frexp(x)
    return xp.ldexp(xp.ones_like(x), exponent - 1)


def absmax(t: TensorStats, xp: Any) -> Array:
    """``max|x|``: ``t.absmax``, else from the min and max."""
    if t.absmax is not None:
        return t.absmax
    return xp.maximum(xp.abs(t.min), xp.abs(t.max))


def model_sigma(config: AdaLossConfig, g: TensorStats, w: TensorStats | None,
                fan_in: int, xp: Any) -> Array:
    """σ of the quantity that must not underflow, by ``config.model``."""
    if config.model == "gradient" or w is None:
        return xp.sqrt(variance(g, xp))
    sigma = xp.sqrt(g.sq_mean * w.sq_mean)
    if config.model == "output":
        sigma = sigma * float(config.relu_fraction * fan_in) ** 0.5
    return sigma


#: fp32's largest finite value; a statistical scale beyond it saturates here (the caps decide)
F32_MAX = 3.4028234663852886e38
_LOG_SATURATE = 88.0  # exp(88) ≈ 1.65e38 < F32_MAX: a log-scale above it saturates


def _at_least_one(s: Array, has_spread: Array, xp: Any) -> Array:
    """``max(s, 1)`` of a statistical scale. 1 where there is no spread to model (σ = 0:
    all-zero or constant input; no non-zero entry) or the estimate is NaN (a non-finite
    gradient, whose step is skipped anyway); an estimate beyond fp32 saturates at
    :data:`F32_MAX`, so that the overflow caps and bounds decide, never 1."""
    return xp.where(has_spread & (s == s), xp.clip(s, 1.0, F32_MAX), 1.0)  # NaN -> 1


def saturating_quotient(limit: float, x: Array, xp: Any) -> Array:
    """``limit / x`` for ``x >= 0``, with ``x`` raised to at least ``max(limit / F32_MAX,
    2^-126)`` first: the quotient stays finite (at most F32_MAX; ``2^-126``, fp32's smallest
    normal, because XLA flushes subnormals) and NumPy scalars never warn. Where ``x = 0`` the
    caller decides what the quotient means."""
    floor = max(limit / F32_MAX, 2.0**-126)
    return limit / xp.where(x > floor, x, floor)  # NaN -> floor


def model_scale(config: AdaLossConfig, sigma: Array, xp: Any, backoff: Array | None = None,
                lift: Array | None = None) -> Array:
    """Step 2: ``max(b·l·u_min / (σ·√2·erfinv(T)), 1)``; σ = 0 gives 1, a σ so small that the
    quotient would leave fp32 saturates (:func:`saturating_quotient`). ``b`` is the back-off
    factor (``2^-h``, default 1), ``l`` the lift (``2^k``, :func:`lift_update`, default 1).
    1 without ``config.layer_rule`` (the cast-only ablation)."""
    if not config.layer_rule:
        return xp.ones_like(sigma)
    s = _backed_off(saturating_quotient(config.underflow_limit, sigma * config.z_two_sided, xp), backoff)
    return _at_least_one(_lifted(s, lift, xp), sigma > 0, xp)


def _lifted(s: Array, lift: Array | None, xp: Any) -> Array:
    """``s · lift`` (a power of two ≥ 1), saturating at :data:`F32_MAX`; ``s`` without one."""
    if lift is None:
        return s
    return xp.clip(s * lift, max=F32_MAX)


def _backed_off(x: Array, backoff: Array | None) -> Array:
    """``x · backoff`` (a power of two ≤ 1: exact, never overflows); ``x`` without one."""
    return x if backoff is None else x * backoff


def overflow_cap(config: AdaLossConfig, g: TensorStats, w: TensorStats | None,
                 fan_in: int, xp: Any, backoff: Array | None = None) -> Array:
    """Largest scale that keeps the scaled cotangent ``s·g`` and the layer's output below
    ``b·u_max`` (inf when g = 0)."""
    m = absmax(g, xp)
    cap = _cap(config.overflow_limit, m, xp)  # s·g itself is stored in the gradient format
    if config.model != "gradient" and w is not None:
        # the largest |product| of an entry of g and one of W: max|g|·max|W| (exactly,
        # as rounding is monotonic), summed over at most fan_in terms
        cap = xp.minimum(cap, _cap(config.overflow_limit / fan_in, m * absmax(w, xp), xp))
    return _backed_off(cap, backoff)


def _cap(limit: float, m: Array, xp: Any) -> Array:
    """``limit / m``, finite (inf when ``m = 0``: nothing can overflow)."""
    return xp.where(m > 0, saturating_quotient(limit, m, xp), math.inf)


def amplified_scale(config: AdaLossConfig, g_absmax: Array, factor: Array, xp: Any,
                    backoff: Array | None = None) -> Array:
    """The power of two ``r ≤ 1`` that a 16-bit cotangent ``g`` (and the scale it carries) is
    multiplied by before an op whose backward multiplies it by at most ``factor``: a scalar
    multiplier ``c`` (``|c|``), a scalar divisor (``1/|c|``). 1 where ``factor·max|g|`` stays
    below ``b·u_max`` (``b``: the back-off factor); else the largest power of two that brings it
    there: the decisions before such an op bound ``s·max|g|``, not what the op makes of it."""
    return at_most(_backed_off(_cap(config.overflow_limit, g_absmax * xp.abs(factor), xp), backoff), xp)


def at_most(cap: Array, xp: Any) -> Array:
    """The power of two ``r ≤ 1`` that multiplies a scale held below ``cap`` (a cap on the
    factor applied to what is already scaled): 1 where ``cap ≥ 1``, else ``cap``'s power-of-two
    floor."""
    return xp.where(cap >= 1, 1.0, pow2_floor(cap, xp))


def weight_grad_cap(config: AdaLossConfig, g_col_norm: Array, x_col_norm: Array, rows: int,
                    xp: Any, backoff: Array | None = None, limit: float | None = None,
                    root_rows: Array | None = None) -> Array:
    """Largest scale that keeps a weight gradient computed in the gradient format finite.

    For ``dW = xᵀ·(s·g)`` summed over ``rows`` rows, Cauchy-Schwarz bounds every entry by
    ``s·max_j‖g_:j‖₂·max_i‖x_:i‖₂``, and the bias gradient (a column sum of ``s·g``) by
    ``s·max_j‖g_:j‖₂·√rows``: ``u_max / (max_j‖g_:j‖₂ · max(max_i‖x_:i‖₂, √rows))``. A
    convolution's is the same with channels for columns and batch × positions for rows (each
    ``dW`` entry pairs distinct entries of one input channel with one output channel). Only
    where a framework computes the weight gradient in 16 bits (a PyTorch layer node under
    autocast); JAX computes it in fp32 and needs no such cap. ``limit``: the largest finite value
    of the dtype it is computed in (default ``u_max``; with an fp8 ``grad_format``, the 16-bit
    dtype's). ``root_rows``: ``√rows`` already as a value of ``xp`` (``rows`` is then unread).
    """
    m = g_col_norm * xp.clip(x_col_norm, min=float(rows) ** 0.5 if root_rows is None else root_rows)
    return _backed_off(_cap(config.overflow_limit if limit is None else limit, m, xp), backoff)


def bounded_scale(config: AdaLossConfig, s: Array, cap: Array, incoming: Array,
                  xp: Any, backoff: Array | None = None) -> Array:
    """Step 3 after ``max(s, 1)``, before rounding: overflow cap, accumulated
    bound (times the back-off factor), layer bound (the result may be < 1)."""
    s = xp.minimum(s, cap)
    s = xp.minimum(s, _backed_off(config.accum_limit / incoming, backoff))
    return xp.clip(s, max=config.layer_limit)


def round_scale(config: AdaLossConfig, s: Array, xp: Any) -> Array:
    """The power-of-two floor of step 3 (identity with ``power_of_two=False``)."""
    return pow2_floor(s, xp) if config.power_of_two else s


def _decide(config: AdaLossConfig, s_model: Array, cap: Array, incoming: Array, sigma: Array,
            xp: Any, backoff: Array | None) -> LayerScale:
    raw = bounded_scale(config, s_model, cap, incoming, xp, backoff)
    return LayerScale(round_scale(config, raw, xp), s_model, sigma, raw)


def layer_scale(config: AdaLossConfig, g: TensorStats, w: TensorStats | None,
                fan_in: int, incoming: Array, xp: Any,
                cached_model_scale: Array | None = None,
                cached_sigma: Array | None = None, backoff: Array | None = None,
                extra_cap: Array | None = None, lift: Array | None = None) -> LayerScale:
    """The scale a weighted layer applies to its input cotangent.

    ``cached_model_scale`` replaces the statistical part (``update_every``);
    the overflow caps always come from the current ``g`` and ``w`` (their min
    and max). With ``cached_sigma`` too, σ is not recomputed (``g``/``w`` may
    then lack their moments). ``backoff`` (``2^-h`` after overflowed steps, see
    :func:`backoff_factor`) moves the whole target range [u_min, u_max] down by it.
    ``extra_cap`` is a further overflow cap the caller knows (:func:`weight_grad_cap`).
    ``lift`` (``2^k``, :func:`lift_update`) multiplies the statistical scale only.
    """
    if cached_model_scale is not None and cached_sigma is not None:
        sigma = cached_sigma
    else:
        sigma = model_sigma(config, g, w, fan_in, xp)
    s_model = (model_scale(config, sigma, xp, backoff, lift) if cached_model_scale is None
               else cached_model_scale)
    cap = overflow_cap(config, g, w, fan_in, xp, backoff)
    if extra_cap is not None:
        cap = xp.minimum(cap, extra_cap)
    return _decide(config, s_model, cap, incoming, sigma, xp, backoff)


def output_sigma(g: TensorStats, w: TensorStats, fan_in: int, xp: Any, row_sq: Array | None = None) -> Array:
    """σ of one entry of a layer's output cotangent ``g·Wᵀ``: ``sqrt(n·E[g²]·E[W²])``
    (independent entries); with ``row_sq`` (:func:`worst_row_sq_mean`) ``E[g²]`` of ``g``'s
    largest row instead, so that the spread is the largest row's: a classifier token's or a
    masked loss's cotangent leaves a few rows live, which carry all of it, and rows of unequal
    size (tokens) make the entries a mixture whose tail is its largest component's."""
    sq = g.sq_mean if row_sq is None else row_sq
    return xp.sqrt(sq * w.sq_mean * float(fan_in))


def worst_row_sq_mean(g: Array, feature_axes: tuple[int, ...], xp: Any) -> Array:
    """The largest mean square (fp32) among ``g``'s rows: its entries along ``feature_axes`` (the
    layer's output features) at one position of the others."""
    return xp.max(xp.mean(xp.square(_f32(g, xp)), axis=feature_axes))


def fp8_model_scale(config: AdaLossConfig, sigma: Array, xp: Any, backoff: Array | None = None,
                    lift: Array | None = None) -> Array:
    """Step 2': ``b·l·u_max / (σ·√2·erfinv(1 − T_sat))``, the largest scale that lets at most
    ``T_sat`` of a N(0, σ) quantity exceed the fp8 format's max (``b``: back-off, ``l``: lift
    ``2^k``, ``k`` of either sign). 1 where σ = 0 or the estimate is NaN; saturates at
    :data:`F32_MAX`, so that the caps decide."""
    s = _backed_off(saturating_quotient(config.overflow_limit, sigma * config.z_saturation, xp), backoff)
    s = xp.clip(_lifted(s, lift, xp), max=F32_MAX)
    return xp.where((sigma > 0) & (s == s), s, 1.0)


def fp8_layer_scale(config: AdaLossConfig, g: TensorStats, w: TensorStats, fan_in: int,
                    incoming: Array, carrier_max: float, xp: Any,
                    cached_model_scale: Array | None = None, cached_sigma: Array | None = None,
                    backoff: Array | None = None, lift: Array | None = None,
                    extra_cap: Array | None = None, row_sq: Array | None = None) -> LayerScale:
    """The scale a layer applies to its output cotangent with an fp8 ``grad_format`` (steps
    1'-3'): ``g`` the statistics of its incoming cotangent as quantized, ``w`` its weight's,
    ``row_sq`` the mean square of ``g``'s largest row (:func:`output_sigma`);
    ``carrier_max`` the largest finite value of the dtype the backward computes in. With
    ``cached_model_scale`` and ``cached_sigma`` (``update_every``) σ is not recomputed;
    ``extra_cap`` is a further cap the caller knows (:func:`weight_grad_cap`)."""
    sigma = output_sigma(g, w, fan_in, xp, row_sq) if cached_sigma is None else cached_sigma
    s_model = (fp8_model_scale(config, sigma, xp, backoff, lift) if cached_model_scale is None
               else cached_model_scale)
    m = absmax(g, xp)
    cap = _backed_off(xp.minimum(_cap(carrier_max, m, xp), _cap(carrier_max / fan_in, m * absmax(w, xp), xp)),
                      backoff)
    if extra_cap is not None:
        cap = xp.minimum(cap, extra_cap)
    return _decide(config, s_model, cap, incoming, sigma, xp, backoff)


def fp8_fit_scale(config: AdaLossConfig, g_absmax: Array, incoming: Array, xp: Any,
                  backoff: Array | None = None) -> LayerScale:
    """Per-tensor current scaling of a cotangent about to be quantized to fp8 where no decision
    set its scale (the loss cotangent of a narrowing cast, the first cast after the loss):
    ``b·u_max / max|g|`` (no entry saturates; 1 when ``g = 0``), bounded and rounded as a
    decision is. ``model_scale`` and ``sigma`` in the result are that quotient and
    ``max|g|``."""
    q = _backed_off(_cap(config.overflow_limit, g_absmax, xp), backoff)
    q = xp.where(g_absmax > 0, q, 1.0)
    return _decide(config, q, q, incoming, g_absmax, xp, backoff)


def to_fp8(g: Array, dtype: Any, limit: float, xp: Any) -> Array:
    """``g`` quantized to the fp8 ``dtype``, its finite entries clipped to ``±limit`` (the format's
    max) first, its non-finite ones made NaN: a cast never makes an inf or NaN of a finite value
    (JAX's e4m3fn cast gives NaN beyond ~464, e5m2's inf beyond ~61440) nor a finite value of a
    non-finite one (torch's e4m3fn cast saturates inf to 448), so a non-finite step is skipped."""
    # g - g: 0 where g is finite, NaN where it is not (one elementwise op, no mask and select)
    return xp.astype(xp.clip(g, -limit, limit) + (g - g), dtype)


def operand_scale(config: AdaLossConfig, x_absmax: Array, xp: Any) -> Array:
    """Per-tensor current scaling of a layer's input or weight for ``config.operand_format``:
    the factor that maps ``max|x|`` to the format's max, rounded down to a power of two with
    ``power_of_two``; 1 where ``x`` is all zero or not finite (a non-finite forward is skipped)."""
    s = _cap(config.operand_limit, x_absmax, xp)
    s = round_scale(config, s, xp)
    ok = (x_absmax > 0) & (x_absmax < math.inf)
    return xp.where(ok, s, 1.0)


def _exact_in(value: float, dtype: Any) -> bool:
    """Whether ``value`` is a number of ``dtype`` (a JAX, NumPy or torch float dtype): a
    comparison with it can run in that dtype."""
    name = str(dtype).removeprefix("torch.")
    try:
        np_dtype = np.dtype(getattr(ml_dtypes, name, name))
    except TypeError:
        return False
    return bool(np.asarray(value, np_dtype).astype(np.float64) == value)


def _abs_for(x: Array, limit: float, xp: Any) -> Array:
    """``|x|`` in ``x``'s dtype where ``limit`` is one of its numbers, else in fp32."""
    return xp.abs(x if _exact_in(limit, x.dtype) else _f32(x, xp))


def quantized_fractions(g: Array, q: Array, config: AdaLossConfig, xp: Any) -> tuple[Array, Array, Array]:
    """FP8 telemetry of one cast of ``g`` (as carried) to ``q`` (the fp8 values, in the fp8 dtype
    or any dtype that holds them exactly): the fractions of ``g``'s non-zero entries flushed to
    zero, held below the format's smallest normal (non-zero), and saturated (``|g|`` beyond the
    format's max), in fp32 (0 when ``g`` is all zero).

    Each count reads one tensor alone (a zero of ``g`` casts to a zero of ``q``, a non-zero ``q``
    has a non-zero ``g``): the counts of ``g`` can join the kernel that writes ``g``, those of
    ``q`` the kernel that reads ``q``, and no kernel reads both. Counts are integers and
    comparisons run in the tensors' own dtypes where the limits are exact there (an eager
    framework makes one pass for each op)."""
    size = float(math.prod(g.shape))
    nonzero_q = _count(q, xp)  # NaN is non-zero
    held = _count(_abs_for(q, config.underflow_limit, xp) < config.underflow_limit, xp) - (size - nonzero_q)
    return fractions_of_counts(_count(g, xp), nonzero_q, held, saturated_count(g, config, xp), xp)


def _count(x: Array, xp: Any) -> Array:
    return xp.astype(xp.count_nonzero(x), xp.float32)


def saturated_count(g: Array, config: AdaLossConfig, xp: Any) -> Array:
    """How many entries of ``g`` (as carried, before the cast) lie beyond the fp8 format's max
    (an inf too), fp32."""
    return _count(_abs_for(g, config.overflow_limit, xp) > config.overflow_limit, xp)


def fractions_of_counts(nonzero_g: Array, nonzero_q: Array, held: Array, saturated: Array,
                        xp: Any) -> tuple[Array, Array, Array]:
    """:func:`quantized_fractions` from the counts of one cast of ``g`` to ``q``: non-zero
    entries of each, non-zero entries of ``q`` below the smallest normal, entries of ``g``
    beyond the max (fp32)."""
    denom = xp.clip(nonzero_g, min=1.0)
    return (nonzero_g - nonzero_q) / denom, held / denom, saturated / denom


class Fp8Histogram(NamedTuple):
    """Statistics of an fp8 tensor read from the counts of its 256 codes (:func:`fp8_histogram`),
    fp32; NaN entries make ``absmax``, ``sq_sum``, ``min`` and ``max`` NaN, as a reduction would."""

    nonzero: Array  # entries other than ±0 (NaN included)
    held: Array  # non-zero entries below ``u_min``
    at_max: Array  # entries equal to ±``u_max``
    nan: Array  # NaN entries
    sq_sum: Array  # the sum of the squares (each code's square times its count: exact terms)
    absmax: Array
    min: Array
    max: Array


def fp8_code_table(values: Array, u_min: float, u_max: float, xp: Any) -> Array:
    """``[256, 5]`` fp32: for each fp8 code (``values[b]``: the number code ``b`` stands for, NaN
    for NaN codes) whether it is non-zero, non-zero below ``u_min``, ±``u_max``, NaN, and its
    square (0 for non-finite codes): the histogram of a tensor times it is
    :class:`Fp8Histogram`'s first five fields."""
    finite = xp.isfinite(values)
    v = xp.where(finite, values, xp.zeros_like(values))
    cols = [values != 0, (values != 0) & (xp.abs(values) < u_min), xp.abs(values) == u_max, values != values]
    return xp.stack([xp.astype(c, xp.float32) for c in cols] + [xp.astype(v * v, xp.float32)], axis=1)


def fp8_histogram(counts: Array, values: Array, table: Array, xp: Any) -> Fp8Histogram:
    """An fp8 tensor's statistics from ``counts[b]``, the number of its entries whose bits are
    ``b`` (a histogram of its bytes: one read of a one-byte tensor), ``values`` and ``table``
    (:func:`fp8_code_table`): every statistic a decision reads of it, in one pass instead of one
    per statistic and without widening it (an fp8 tensor's conversion to a wide dtype is slow on
    a CPU)."""
    c = xp.astype(counts, xp.float32)
    sums = c @ table
    nonzero, held, at_max, nan, sq_sum = (sums[k] for k in range(5))
    present = c > 0
    lo = xp.min(xp.where(present, values, xp.full_like(values, math.inf)))  # a present NaN: NaN
    hi = xp.max(xp.where(present, values, xp.full_like(values, -math.inf)))
    sq_sum = xp.where(nan > 0, xp.full_like(sq_sum, math.nan), sq_sum)
    absmax = xp.maximum(xp.maximum(-lo, hi), xp.zeros_like(hi))  # 0 for an empty tensor
    return Fp8Histogram(nonzero, held, at_max, nan, sq_sum, absmax, lo, hi)


def fp8_signal(config: AdaLossConfig, flushed: Array, subnormal: Array, saturated: Array,
               q_absmax: Array, erfinv: Callable[[Array], Array], xp: Any) -> Array:
    """What one fp8 cast reports to the decisions that set its scale (:func:`lift_update`):
    where more than ``T_sat`` of the entries saturated, ``−b`` (negative: lower the lift by
    ``b``), the powers of two by which the normal model says the scale overshot: the measured
    tail puts the format's max at ``z = √2·erfinv(1 − saturated)`` standard deviations, the
    decision meant ``z_sat``, so ``b = ceil(log2(z_sat / z))``, at least 1 and at most
    :data:`MAX_LIFT` (one step, not one power of two per step: a gain no decision models, between
    the decision and the cast, may amplify its output many times). Else the fraction below the
    smallest normal over ``T`` where the quantized tensor has room to double below the max
    (``2·max|q| ≤ u_max``: no entry would saturate), 0 where it has none."""
    sat = saturated / config.saturation
    z = erfinv(1.0 - saturated) * math.sqrt(2.0)
    over = saturating_quotient(config.z_saturation, z, xp)
    drop = xp.clip(xp.ceil(xp.log2(over)), 1.0, float(MAX_LIFT))
    room = q_absmax * 2.0 <= config.overflow_limit
    under = xp.where(room, (flushed + subnormal) / config.threshold, 0.0)
    return xp.where(sat > 1.0, -drop, under)


def combine_signals(config: AdaLossConfig, a: Array, b: Array, xp: Any) -> Array:
    """Two underflow signals of one weight's decisions combined: the larger; with an fp8
    ``grad_format`` a saturation (negative) wins over an underflow."""
    if not config.fp8:
        return xp.maximum(a, b)
    low = xp.minimum(a, b)
    return xp.where(low < 0, low, xp.maximum(a, b))


def cast_model_scale(config: AdaLossConfig, ls: LogStats, xp: Any,
                     backoff: Array | None = None) -> Array:
    """Step 7's statistical scale: ``u_min / exp(μ_ln + z·σ_ln)``, at least 1 (1 if all zero).

    A log-scale beyond fp32 (a confident softmax: σ_ln of 11-22) saturates, so that the
    caps decide."""
    log_s = (xp.log(xp.asarray(config.underflow_limit, dtype=xp.float32))
             - ls.mean - ls.std * config.z_lower)
    if backoff is not None:
        log_s = log_s + xp.log(backoff)
    log_s = xp.clip(log_s, max=_LOG_SATURATE)
    s = xp.where(log_s >= _LOG_SATURATE, F32_MAX, xp.exp(log_s))
    return _at_least_one(s, ls.count > 0, xp)


def cast_scale(config: AdaLossConfig, ls: LogStats, incoming: Array, xp: Any,
               cached_model_scale: Array | None = None, backoff: Array | None = None) -> LayerScale:
    """Scale for a cotangent about to be narrowed to the gradient format (log-normal model).

    ``sigma`` in the result is σ_ln; an all-zero cotangent gives scale 1.
    """
    s_model = (cast_model_scale(config, ls, xp, backoff) if cached_model_scale is None
               else cached_model_scale)
    cap = _backed_off(_cap(config.overflow_limit, ls.absmax, xp), backoff)
    return _decide(config, s_model, cap, incoming, ls.std, xp, backoff)


#: Most back-off steps; the target range may move down by at most 2^-MAX_BACKOFF.
MAX_BACKOFF = 24


def backoff_factor(h: Array, xp: Any) -> Array:
    """``2^-h`` in fp32, exactly, for the back-off exponent ``h`` (int32 or fp32, ≥ 0)."""
    return _pow2(-xp.astype(h, xp.int32), xp)


def _pow2(e: Array, xp: Any) -> Array:
    """``2^e`` in fp32, exactly (ldexp), for an int32 exponent ``e``."""
    return xp.ldexp(xp.ones_like(e, dtype=xp.float32), e)


def backoff_update(config: AdaLossConfig, h: Array, good: Array, finite: Array, xp: Any
                   ) -> tuple[Array, Array]:
    """The back-off exponent ``h`` and its count of finite steps after one step.

    A step with a non-finite gradient raises ``h`` by one (at most :data:`MAX_BACKOFF`) and
    restarts the count: every later decision aims ``2×`` lower in the format's range, so a
    deterministic overflow cannot recur step after step. ``config.backoff_interval``
    finite steps in a row lower ``h`` by one again (not below 0), as a dynamic loss scale
    grows back. On device, with no host sync: ``h`` and ``good`` are int32 0-d arrays.
    """
    zero = xp.zeros_like(h)
    good = xp.where(finite, good + 1, zero)
    recover = good >= config.backoff_interval
    h_up = xp.minimum(h + 1, xp.full_like(h, MAX_BACKOFF))
    h_down = xp.maximum(h - 1, zero)
    h = xp.where(finite, xp.where(recover, h_down, h), h_up)
    return h, xp.where(recover, zero, good)


#: Largest lift exponent; the statistical scales may rise by at most 2^MAX_LIFT.
MAX_LIFT = 10
#: The lift rises while the measured fraction exceeds LIFT_AIM·T (below T, since the fraction
#: varies from batch to batch) and falls when it is below LIFT_AIM·T / LIFT_BAND (hysteresis; one
#: step down at most doubles the fraction, so it cannot cross the aim at once)
LIFT_AIM = 0.5
LIFT_BAND = 16.0


def held_signal(config: AdaLossConfig) -> float:
    """The underflow signal at which :func:`lift_update` keeps ``k``: what a weight none of whose
    decisions ran (its layers in a conditional's branch not taken) reports. Inside the band for
    16-bit formats (between ``LIFT_AIM / LIFT_BAND`` and ``LIFT_AIM``), zero for fp8 ones."""
    return 0.0 if config.fp8 else LIFT_AIM / math.sqrt(LIFT_BAND)


def lift_factor(k: Array, xp: Any) -> Array:
    """``2^k`` in fp32, exactly, for the lift exponent ``k`` (int32, ``|k| ≤ MAX_LIFT``; ``k < 0``
    with fp8 formats only)."""
    return _pow2(xp.astype(k, xp.int32), xp)


def subnormal_fraction(x: Array, config: AdaLossConfig, xp: Any, absmax: Array | None = None,
                       count: Callable[[Array], Array] | None = None) -> Array:
    """Fraction of the non-zero entries of ``x`` (as carried) below ``u_min`` in magnitude, in
    fp32 (0 when all are zero): the underflow ``T`` bounds, counted. Zeros are left out, as
    they may be exact (ReLU, masks). With ``absmax`` (``max|x|``) given: 0 where ``x`` has no
    room to double below ``u_max`` (a larger scale would overflow; no lift can help there).

    Two counts of ``x`` compared in its own dtype (``u_min`` is a power of two, exact in every
    format): the non-zero entries, and those below ``u_min``, zeros included. ``count`` (the
    number of true entries of a boolean array, exactly; default ``xp.count_nonzero``) lets a
    framework count its fastest way."""
    count = xp.count_nonzero if count is None else count
    return subnormal_fraction_of_counts(count(x != 0), count(xp.abs(x) < config.underflow_limit),
                                        math.prod(x.shape), config, xp, absmax)


def subnormal_fraction_of_counts(nonzero: Array, below: Array, size: int, config: AdaLossConfig, xp: Any,
                                 absmax: Array | None = None) -> Array:
    """:func:`subnormal_fraction` from the counts of a tensor of ``size`` entries: ``nonzero``
    entries, ``below`` entries under ``u_min`` in magnitude (zeros included)."""
    below = below - (size - nonzero)
    frac = xp.astype(below, xp.float32) / xp.clip(xp.astype(nonzero, xp.float32), min=1.0)
    if absmax is None:
        return frac
    return xp.where(absmax * 2.0 < config.overflow_limit, frac, 0.0)


def underflow_ratio(fractions: Sequence[Array], limited: Array | None, config: AdaLossConfig,
                    xp: Any) -> Array:
    """What a backward reports to :func:`lift_update` for one decision: the largest
    :func:`subnormal_fraction` among the cotangents carrying its scale into layers, over
    ``T`` (1 means exactly ``T``). Where a cap or bound set the decision below its statistical
    scale (``limited``), a larger lift cannot raise it: the ratio is held at most
    :data:`LIFT_AIM`, so that
    the lift does not climb for nothing (it may still fall)."""
    if config.fp8:  # the fractions are fp8_signal's already
        ratio = fractions[0]
        for f in fractions[1:]:
            ratio = combine_signals(config, ratio, f, xp)
    else:
        ratio = xp.max(xp.stack(list(fractions))) / config.threshold
    if limited is None:
        return ratio
    return xp.where(limited, xp.clip(ratio, max=LIFT_AIM), ratio)


def lift_update(config: AdaLossConfig, k: Array, ratio: Array, finite: Array, xp: Any) -> Array:
    """A decision's lift exponent after one step: ``+1`` (at most :data:`MAX_LIFT`) when
    ``ratio`` (:func:`underflow_ratio`: the largest fraction below u_min over ``T`` among the
    cotangents the decision scaled) exceeds :data:`LIFT_AIM` (``T/2``),
    ``-1`` (not below 0) when it is below ``LIFT_AIM / LIFT_BAND`` (``T/32``); unchanged on a step with a
    non-finite gradient (the back-off answers those) or without ``config.underflow_feedback``.
    With an fp8 ``grad_format`` (``ratio`` from :func:`fp8_signal`): ``ratio`` itself (not below
    ``-MAX_LIFT``) after a saturation (``ratio < 0``: the powers of two it overshot), ``+1``
    above ``LIFT_AIM``, else unchanged.
    On device: ``k`` is an int32 0-d array."""
    if not config.underflow_feedback:
        return k
    up = xp.minimum(k + 1, xp.full_like(k, MAX_LIFT))
    if config.fp8:  # fp8_signal: negative after saturation
        down = xp.maximum(k + xp.astype(xp.minimum(ratio, xp.zeros_like(ratio)), k.dtype),
                          xp.full_like(k, -MAX_LIFT))
        new = xp.where(ratio < 0, down, xp.where(ratio > LIFT_AIM, up, k))
        return xp.where(finite, new, k)
    down = xp.maximum(k - 1, xp.zeros_like(k))
    new = xp.where(ratio > LIFT_AIM, up, xp.where(ratio < LIFT_AIM / LIFT_BAND, down, k))
    return xp.where(finite, new, k)


def merge_scale(scales: Sequence[Array], absmaxes: Sequence[Array], u_max: float,
                xp: Any) -> Array:
    """Common scale for fan-out branches (method.md step 5).

    ``M = max_b(max|g_b| / s_b)``; over the branch scales, largest first, take
    the first ``S`` with ``M·S < u_max``; if none fits, halve the smallest
    scale (down to 1/8 of it) until one does (1/8 of it if none does).

    The candidates are scanned largest first and "fits" is monotone in ``S``,
    so the pick is the largest fitting candidate: a masked max, no sort.
    """
    s = xp.stack([_f32(x, xp) for x in scales])
    m = xp.max(xp.stack([_f32(a, xp) for a in absmaxes]) / s)
    smallest = xp.min(s)
    candidates = xp.concat([s, xp.stack([smallest * 0.5, smallest * 0.25, smallest * 0.125])])
    best = xp.max(xp.where(candidates * m < u_max, candidates, 0.0))
    return xp.where(best > 0, best, smallest * 0.125)


def fp8_merge_scale(config: AdaLossConfig, scales: Sequence[Array], absmaxes: Sequence[Array], xp: Any,
                    backoff: Array | None = None, summed: bool = True) -> Array:
    """With an fp8 ``grad_format``, the common scale of contributions ``g_b`` (carrying ``s_b``)
    about to be summed (``summed``) and cast: :func:`fp8_fit_scale` of
    ``Σ_b max|g_b| / s_b``, the largest their sum can be unscaled, so that no entry of the sum
    saturates (the branch scales themselves are no candidates: a decision's scale fits its own
    branch, not the sum); ``summed=False`` (slices kept apart): of ``max_b``."""
    m = xp.stack([_f32(a, xp) / _f32(s, xp) for a, s in zip(absmaxes, scales)])
    total = xp.sum(m) if summed else xp.max(m)
    return fp8_fit_scale(config, total, xp.ones_like(total), xp, backoff).scale


def predicted_underflow(config: AdaLossConfig, sigma: Array, scale: Array,
                        erf: Callable[[Array], Array], xp: Any) -> Array:
    """Fraction of a N(0, σ) quantity that still falls below u_min after scaling
    by ``scale``: ``erf(u_min / (scale·σ·√2))`` (0 when σ = 0)."""
    denom = scale * sigma * 2.0**0.5
    q = saturating_quotient(config.underflow_limit, denom, xp)
    return xp.where(denom > 0, erf(q), 0.0)


def predicted_underflow_lognormal(config: AdaLossConfig, ls: LogStats, scale: Array,
                                  erf: Callable[[Array], Array], xp: Any) -> Array:
    """Fraction of the non-zero ``|g|`` (log-normal) still below u_min after scaling:
    ``Φ((ln(u_min / scale) − μ_ln) / σ_ln)``."""
    z = xp.log(config.underflow_limit / scale) - ls.mean
    safe = xp.where(ls.std > 1e-30, ls.std, 1.0)
    smooth = 0.5 * (1.0 + erf(z / (safe * 2.0**0.5)))
    step = xp.astype(z > 0, xp.float32)
    out = xp.where(ls.std > 1e-30, smooth, step)
    return xp.where(ls.count > 0, out, 0.0)
