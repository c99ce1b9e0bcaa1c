"""The backward's decisions, one pure function per kind of decision, for both fronts.

Each takes its static arguments (hashable: the config, a fan-in, a size), an array namespace
``xp`` and the statistics the front read (0-d values of ``xp``, or ``None``), and returns the
decision. A front finds the layers, reads the statistics and applies the scales; what it
decides from them is here: a weighted layer (:func:`layer_of_stats`; with an fp8 gradient
format :func:`fp8_layer`), a narrowing cast
(:func:`cast_of_logs`), a merge of contributions carrying different scales (:func:`merge`),
the overflow limit of a dtype (:func:`overflow_limit`), the per-weight underflow signals of
the feedback (:func:`signals`) and the state after a step (:func:`levels`).

In JAX they are traced into the step. In PyTorch the same functions run on NumPy scalars
(CPU host math), on 0-d device tensors, or traced and compiled into one kernel
(:class:`torch_bridge.fused.FusedMath`); :class:`Sums` (a cotangent's, or a weight's without
its ``Σx``) and :class:`LogSums` are the reductions as torch's kernels give them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

from adaloss import solver
from adaloss.config import AdaLossConfig


def overflow_limit(config: AdaLossConfig, itemsize: int, finfo_max: float, backoff: Any = None) -> Any:
    """The largest magnitude a cotangent stored in a float dtype of ``itemsize`` bytes (its
    largest finite value ``finfo_max``) may reach: with an fp8 ``grad_format`` the format's
    (whatever the dtype: the next layer quantizes what it receives), fp32's or wider's own
    ``finfo_max``, else (fp16, bf16) the config's ``overflow_limit``; the config's limit times
    ``backoff`` (a 0-d value; None: no back-off)."""
    if not config.fp8 and itemsize > 2:
        return finfo_max
    limit = config.overflow_limit
    return limit if backoff is None else limit * backoff


class Sums(NamedTuple):
    """A tensor's sums and extremes as reductions give them: ``Σx`` (or None), ``Σx²`` (fp32),
    and the min and max in the tensor's dtype (:func:`normalized` makes the statistics)."""

    total: Any
    sq_total: Any
    lo: Any
    hi: Any


def normalized(s: Sums, size: int, xp: Any) -> solver.TensorStats:
    """The fp32 :class:`adaloss.solver.TensorStats` of a tensor of ``size`` entries from its
    :class:`Sums` (mean and mean square None where the sums are)."""
    mean = None if s.total is None else xp.astype(s.total, xp.float32) / size
    sq = None if s.sq_total is None else s.sq_total / size
    return solver.TensorStats(mean, sq, xp.astype(s.lo, xp.float32), xp.astype(s.hi, xp.float32))


class LogSums(NamedTuple):
    """What :func:`adaloss.solver.log_stats_of_sums` takes, as reductions give them: the
    non-zero entries (any dtype), ``Σ ln|x|`` over them, ``‖ln|x|‖₂`` (fp32) and ``max|x|``
    (the tensor's dtype)."""

    count: Any
    log_sum: Any
    log_norm: Any
    absmax: Any


def log_stats(s: LogSums, xp: Any) -> solver.LogStats:
    """The :class:`adaloss.solver.LogStats` of :class:`LogSums`."""
    return solver.log_stats_of_sums(s.count, s.log_sum, s.log_norm * s.log_norm,
                                    xp.astype(s.absmax, xp.float32), xp)


def weight_grad_cap(config: AdaLossConfig, limit: float | None, xp: Any, sq_norms: tuple[Any, Any],
                    root_rows: Any, backoff: Any) -> Any:
    """:func:`adaloss.solver.weight_grad_cap` from the largest squared column norms of ``g`` and
    ``x`` over ``root_rows²`` rows, for a 16-bit weight gradient that must stay below ``limit``."""
    return solver.weight_grad_cap(config, xp.sqrt(sq_norms[0]), xp.sqrt(sq_norms[1]), 0, xp, backoff, limit,
                                  root_rows=root_rows)


class LayerDecision(NamedTuple):
    """What a weighted layer's hook needs of its decision."""

    d: solver.LayerScale
    outgoing: Any  # the scale the layer's input cotangent carries: ``incoming · d.scale``
    limited: Any  # a cap or bound set the scale below the statistical one
    held: Any  # a decision behind ``incoming`` was limited (None: none is behind it)
    absmax: Any  # max|g|
    fraction: Any  # the incoming cotangent's subnormal fraction (None without counts)


def layer(config: AdaLossConfig, fan_in: int, w_size: int, wgrad_limit: float | None, xp: Any,
          size: Any, sums: Sums, w: Sums | None, sq_norms: tuple[Any, Any] | None, root_rows: Any,
          incoming: Any, backoff: Any, lift: Any, cached_scale: Any, cached_sigma: Any,
          counts: tuple[Any, Any] | None, behind: Sequence[Any]) -> LayerDecision:
    """:func:`layer_of_stats` from the reductions torch's kernels give: the cotangent's ``sums``
    (``size`` entries: a number, or an integer value of ``xp``), its weight's ``w`` (``Σ W²``
    and its extremes, or ``max|W|`` twice; ``w_size`` entries), and the largest squared column
    norms ``sq_norms`` of ``g`` and ``x`` for the 16-bit weight gradient it computes over
    ``root_rows²`` rows (:func:`adaloss.solver.weight_grad_cap`). The sizes are arguments, not static: a
    cotangent's size follows the batch."""
    g = normalized(sums, size, xp)
    cap = None if sq_norms is None else weight_grad_cap(config, wgrad_limit, xp, sq_norms, root_rows, backoff)
    w = None if w is None else normalized(w, w_size, xp)
    return layer_of_stats(config, fan_in, xp, size, g, w, cap, incoming, backoff, lift, cached_scale,
                          cached_sigma, counts, behind)


def layer_of_stats(config: AdaLossConfig, fan_in: int, xp: Any, size: Any, g: solver.TensorStats,
                   w: solver.TensorStats | None, cap: Any, incoming: Any, backoff: Any, lift: Any,
                   cached_scale: Any, cached_sigma: Any, counts: tuple[Any, Any] | None,
                   behind: Sequence[Any]) -> LayerDecision:
    """A weighted layer's decision (:func:`adaloss.solver.layer_scale`) from the statistics of
    its incoming cotangent ``g`` (``size`` entries) and of its weight ``w`` (None: the
    ``"gradient"`` model), an extra cap (None: none), the scale it receives, the back-off and
    the lift, and a cached statistical scale and spread (None: computed here); with ``counts``
    (non-zero entries, entries below ``u_min``) the cotangent's subnormal fraction;
    ``behind``: the ``limited`` flags of the decisions that set ``incoming``."""
    d = solver.layer_scale(config, g, w, fan_in, incoming, xp, cached_model_scale=cached_scale,
                           cached_sigma=cached_sigma, backoff=backoff, extra_cap=cap, lift=lift)
    absmax = solver.absmax(g, xp)
    fraction = (None if counts is None
                else solver.subnormal_fraction_of_counts(*counts, size, config, xp, absmax))
    return LayerDecision(d, incoming * d.scale, d.unrounded < d.model_scale, any_of(behind), absmax, fraction)


def fp8_layer(config: AdaLossConfig, fan_in: int, carrier_max: float, xp: Any, g: solver.TensorStats,
              w: solver.TensorStats, cap: Any, incoming: Any, backoff: Any, lift: Any, cached_scale: Any,
              cached_sigma: Any, row_sq: Any, behind: Sequence[Any]) -> LayerDecision:
    """A layer's decision with an fp8 ``grad_format`` (:func:`adaloss.solver.fp8_layer_scale`):
    the scale of the output it sends on, from the statistics of its quantized incoming
    cotangent ``g`` (``row_sq``: its largest row's mean square, read for a fresh σ) and of its
    weight ``w``, ``carrier_max`` the largest value of the dtype the backward computes in,
    ``cap`` a further cap (None: none). With ``fp8_rule="current"`` (the next cast fits its own
    tensor) or without ``layer_rule`` (one scale, the loss cotangent's) the statistical scale is
    1 and only the caps hold. ``behind``: the ``limited`` flags of the decisions that set
    ``incoming``."""
    if config.fp8_rule == "current" or not config.layer_rule:
        cached_scale, cached_sigma = xp.ones_like(incoming), xp.zeros_like(incoming)
    d = solver.fp8_layer_scale(config, g, w, fan_in, incoming, carrier_max, xp,
                               cached_model_scale=cached_scale, cached_sigma=cached_sigma, backoff=backoff,
                               lift=lift, extra_cap=cap, row_sq=row_sq)
    return LayerDecision(d, incoming * d.scale, d.unrounded < d.model_scale, any_of(behind),
                         solver.absmax(g, xp), None)


def any_of(flags: Sequence[Any]) -> Any:
    """The logical or of ``flags`` (None for none)."""
    held = flags[0] if flags else None
    for flag in flags[1:]:
        held = held | flag
    return held


class CastDecision(NamedTuple):
    """What a narrowing cast's (or an opaque region's) hook needs of its decision."""

    d: solver.LayerScale
    logs: solver.LogStats
    outgoing: Any


def cast(config: AdaLossConfig, xp: Any, sums: LogSums | None, cached_logs: solver.LogStats | None,
         incoming: Any, backoff: Any, cached_scale: Any, region: Any) -> CastDecision:
    """:func:`cast_of_logs` from the :class:`LogSums` of ``g`` or cached log-statistics (their
    ``absmax`` current, in ``g``'s dtype)."""
    if sums is None:
        ls = cached_logs._replace(absmax=xp.astype(cached_logs.absmax, xp.float32))
    else:
        ls = log_stats(sums, xp)
    return cast_of_logs(config, xp, ls, incoming, backoff, cached_scale, region)


def cast_of_logs(config: AdaLossConfig, xp: Any, ls: solver.LogStats, incoming: Any, backoff: Any,
                 cached_scale: Any, region: Any = None) -> CastDecision:
    """A narrowing cast's decision (:func:`adaloss.solver.cast_scale`) from the log-statistics
    of its cotangent (``ls.absmax``: the current ``max|g|``, fp32) and a cached statistical
    scale (None: computed here); with ``region`` (an opaque region's dynamic scale) at least
    ``region / incoming``."""
    if region is not None:
        cached_scale = xp.maximum(solver.cast_model_scale(config, ls, xp, backoff), region / incoming)
    d = solver.cast_scale(config, ls, incoming, xp, cached_model_scale=cached_scale, backoff=backoff)
    return CastDecision(d, ls, incoming * d.scale)


def merge(config: AdaLossConfig, limit: float, backed_off: bool, xp: Any, scales: Sequence[Any],
          absmaxes: Sequence[Any], backoff: Any) -> tuple[Any, list[Any]]:
    """The common scale of contributions carrying ``scales`` whose ``max|x|`` (fp32) are
    ``absmaxes`` (:func:`adaloss.solver.merge_scale`, below ``limit``, times ``backoff`` if
    ``backed_off``; :func:`adaloss.solver.fp8_merge_scale` with an fp8 format), and each part's
    factor to it."""
    if config.fp8:  # the sum goes to an fp8 cast: fitted to it
        target = solver.fp8_merge_scale(config, scales, absmaxes, xp, backoff)
    else:
        target = solver.merge_scale(scales, absmaxes, limit * backoff if backed_off else limit, xp)
    return target, [target / s for s in scales]


def wide_merge(scales: Sequence[Any], xp: Any) -> Any:
    """The common scale of fp32 (or wider) contributions summed in their dtype: the largest,
    :func:`adaloss.solver.merge_scale`'s pick wherever the sum is finite (a sum beyond fp32's
    range skips the step, as any non-finite gradient does), with no pass over a part for its
    max."""
    return functools.reduce(xp.maximum, scales)


def merge_of_extremes(config: AdaLossConfig, limit: float, backed_off: bool, xp: Any,
                      scales: Sequence[Any], parts: Sequence[Sums], backoff: Any) -> tuple[Any, list[Any]]:
    """:func:`merge` of parts whose min and max are ``parts``'s (:class:`Sums`)."""
    absmaxes = [solver.absmax(normalized(t, 1, xp), xp) for t in parts]
    return merge(config, limit, backed_off, xp, scales, absmaxes, backoff)


def signals(config: AdaLossConfig, weights: tuple[str, ...], xp: Any,
            fractions: Sequence[Sequence[Any]], limited: Sequence[Any],
            ratios: Sequence[tuple[str, Any]] = (),
            branches: Sequence[tuple[str, Any, Any]] = ()) -> list[Any]:
    """Per decision (``weights[i]`` its weight), :func:`adaloss.solver.underflow_ratio` of its
    ``fractions`` held by its ``limited`` flag, then ``ratios`` (``(weight, ratio)`` pairs
    measured elsewhere: an opaque region's), then ``branches`` (``(weight, ratio, ran)``: a
    conditional's, where ``ran`` says whether the branch taken holds decisions of that weight);
    a weight's combined (:func:`adaloss.solver.combine_signals`) over those that ran, and
    :func:`adaloss.solver.held_signal` for a weight none of whose decisions ran: one value per
    distinct weight, in first-seen order."""
    out: dict[str, Any] = {}
    pairs = [(w, solver.underflow_ratio(fracs, lim, config, xp))
             for w, fracs, lim in zip(weights, fractions, limited)]
    for w, r in [*pairs, *ratios]:
        out[w] = r if w not in out else solver.combine_signals(config, out[w], r, xp)
    ran: dict[str, Any] = dict.fromkeys(out, True)
    for w, r, now in branches:
        if w not in out:
            out[w], ran[w] = r, now
            continue
        both = solver.combine_signals(config, out[w], r, xp)
        out[w] = xp.where(now, both if ran[w] is True else xp.where(ran[w], both, r), out[w])
        ran[w] = True if ran[w] is True else xp.logical_or(ran[w], now)
    held = solver.held_signal(config)
    return [r if ran[w] is True else xp.where(ran[w], r, xp.asarray(held, dtype=xp.float32))
            for w, r in out.items()]


def levels(config: AdaLossConfig, xp: Any, h: Any, good: Any, lifts: Sequence[Any], ratios: Sequence[Any],
           found: Any) -> tuple[Any, Any, list[Any]]:
    """The scaler's state after a step (``found``: its count of non-finite gradients): the
    back-off exponent and its count of finite steps (:func:`adaloss.solver.backoff_update`;
    ``h`` None: no back-off), and each lift exponent after its decisions' underflow ratio
    (:func:`adaloss.solver.lift_update`)."""
    finite = found == 0
    if h is not None:
        h, good = solver.backoff_update(config, h, good, finite, xp)
    return h, good, [solver.lift_update(config, k, r, finite, xp) for k, r in zip(lifts, ratios)]
