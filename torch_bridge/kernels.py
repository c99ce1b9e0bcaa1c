"""A decision's whole work as one pure function of its tensors, for ``fuse_decisions``.

Each function reads the statistics of its tensors, makes the decision
(:mod:`adaloss.decisions`, the solver's formulas) and returns the rescaled cotangents with
it: :class:`torch_bridge.fused.FusedMath` traces it once per signature and shape and inductor
fuses the whole into a few loops over the tensors (one call from the hook, instead of a dozen
reductions, the copies a CPU's eager statistics make, the math, and the rescale). The
statistics are written as plain reductions, what the op-by-op helpers of
``torch_bridge/hooks.py`` compute (those take faster routes per device: a dot product of an fp32
copy, ``_foreach`` norms; the tests pin them equal). The arguments after ``xp`` are tensors (or
``None``, in lists and NamedTuples); everything before ``xp`` is static.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from adaloss import decisions, solver
from adaloss.config import AdaLossConfig

_F32 = torch.float32


def scaled(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t · factor`` (a 0-d fp32 scale) computed in fp32 (fp64 for fp64 ``t``), in ``t``'s dtype:
    a 16-bit ``t`` times a scale beyond its range (2^20 in fp16) stays finite where it fits."""
    if t.dtype == torch.float64:
        return t * factor.to(torch.float64)
    return t * factor if t.dtype == _F32 else (t.to(_F32) * factor).to(t.dtype)


def sums(x: torch.Tensor, with_mean: bool) -> decisions.Sums:
    """``x``'s :class:`~adaloss.decisions.Sums` (``Σx`` only ``with_mean``)."""
    w = x.to(_F32)
    lo, hi = torch.aminmax(x)
    return decisions.Sums(w.sum() if with_mean else None, w.square().sum(), lo, hi)


def extremes(x: torch.Tensor) -> decisions.Sums:
    """Only ``x``'s min and max (what the overflow caps read)."""
    return decisions.Sums(None, None, *torch.aminmax(x))


#: an fp32 sum of 0/1 entries is an exact count below this many entries
EXACT_COUNT = 2**24


def counts(x: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s non-zero entries and those below ``limit`` in magnitude (zeros included; NaN:
    non-zero, not below), as :func:`adaloss.solver.subnormal_fraction_of_counts` takes them:
    sums of fp32 0/1 values below :data:`EXACT_COUNT` entries (exact, and vector code on a CPU,
    where an int64 count is ~3x slower), int64 counts beyond."""
    nonzero, below = x != 0, x.abs() < limit
    if x.numel() < EXACT_COUNT:
        return nonzero.to(_F32).sum(), below.to(_F32).sum()
    return torch.count_nonzero(nonzero), torch.count_nonzero(below)


def log_sums(x: torch.Tensor) -> decisions.LogSums:
    """``x``'s :class:`~adaloss.decisions.LogSums`: the logs of its non-zero magnitudes
    (zeros and NaN contribute 0, +inf the dtype's largest float, as ``nan_to_num`` maps them:
    written as a ``where``, which compiles to vector code where ``isnan`` does not)."""
    a = x.abs()
    logs = torch.where(a > 0, a.log(), 0.0).clamp_max(torch.finfo(a.dtype).max)
    nonzero = a != 0
    count = nonzero.to(_F32).sum() if x.numel() < EXACT_COUNT else torch.count_nonzero(nonzero)
    return decisions.LogSums(count, logs.sum(dtype=_F32),
                             torch.linalg.vector_norm(logs, dtype=_F32), a.amax())


def weight_sums(w: torch.Tensor) -> decisions.Sums:
    """A weight's :class:`~adaloss.decisions.Sums`: ``Σ W²``, min, max (no ``Σ W``)."""
    return decisions.Sums(None, w.to(_F32).square().sum(), *torch.aminmax(w))


def wgrad_columns(g: torch.Tensor, x: torch.Tensor, conv: bool, weight_side: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` and ``x`` as [rows, columns] matrices whose column norms bound a weight gradient's
    entries (:func:`adaloss.solver.weight_grad_cap`): a convolution's channels are columns (every
    entry of ``dW[o, c, k…]`` sums, over batch and positions, products of ``g[:, o]`` with
    distinct entries of ``x[:, c]``: a strided or padded one reads a subset of each input
    channel, whose norm the whole channel's bounds); for ``W @ x`` (``weight_side`` 0) rows are the
    last dimension, else every dimension but the last."""
    if conv:  # [N, C, spatial...] -> [N·positions, C]
        return g.transpose(0, 1).flatten(1).t(), x.transpose(0, 1).flatten(1).t()
    if weight_side == 0:  # dW = g·xᵀ
        return g.transpose(-1, -2).reshape(-1, g.shape[-2]), x.transpose(-1, -2).reshape(-1, x.shape[-2])
    return g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])


def column_sq_max(m: torch.Tensor) -> torch.Tensor:
    """The largest squared column norm of the matrix ``m``, in fp32."""
    return m.to(_F32).square().sum(0).amax()


def weights(xp: Any, ws: Sequence[torch.Tensor]) -> list[decisions.Sums]:
    """Every weight's :func:`weight_sums`, in one call (read for all the layers at the first one a
    backward reaches: a stream over them all, where a layer's own call would wait on its weight)."""
    return [weight_sums(w) for w in ws]


def layer(config: AdaLossConfig, fan_in: int, w_size: int, wgrad_limit: float | None, conv: bool,
          weight_side: int, xp: Any, g: torch.Tensor, x: torch.Tensor | None, w: decisions.Sums | None,
          incoming: torch.Tensor, backoff: Any, lift: Any, cached_scale: Any, cached_sigma: Any,
          behind: Sequence[Any]) -> tuple[torch.Tensor, decisions.LayerDecision]:
    """A weighted layer's cotangent ``g`` times its decision (:func:`adaloss.decisions.layer`)
    and the decision, from the statistics of ``g``, its weight's (``w``, of ``w_size`` entries:
    :func:`weights`; None: the ``"gradient"`` model) and of its saved activation ``x`` (None: no
    16-bit weight gradient to cap; :func:`wgrad_columns`); without a cached σ the cotangent's full
    statistics, else its extremes only."""
    fresh = cached_sigma is None
    gs = sums(g, config.model == "gradient") if fresh else extremes(g)
    n = None if not config.underflow_feedback else counts(g, config.underflow_limit)
    norms, rows = None, 0
    if x is not None:
        gm, xm = wgrad_columns(g, x, conv, weight_side)
        norms, rows = (column_sq_max(gm), column_sq_max(xm)), gm.shape[0]
    dec = decisions.layer(config, fan_in, w_size, wgrad_limit, xp, g.numel(), gs, w, norms,
                          float(rows) ** 0.5, incoming, backoff, lift, cached_scale, cached_sigma, n, behind)
    return scaled(g, dec.d.scale), dec


def cast(config: AdaLossConfig, xp: Any, gs: Sequence[torch.Tensor], incoming: torch.Tensor, backoff: Any,
         cached_scale: Any, cached_logs: solver.LogStats | None, region: Any
         ) -> tuple[list[torch.Tensor], decisions.CastDecision]:
    """A narrowing cast's (or an opaque region's) cotangents ``gs`` times its decision
    (:func:`adaloss.decisions.cast`, from the first one's :func:`log_sums`, or from ``cached_logs``
    and its current ``max|g|``) and the decision."""
    g = gs[0]
    if region is not None or cached_logs is None:
        s, logs = log_sums(g), None
    else:
        s, logs = None, cached_logs._replace(absmax=g.abs().amax())
    dec = decisions.cast(config, xp, s, logs, incoming, backoff, cached_scale, region)
    return [scaled(t, dec.d.scale) for t in gs], dec


def merge(config: AdaLossConfig, limit: float, backed_off: bool, summed: bool, xp: Any,
          parts: Sequence[torch.Tensor], scales: Sequence[Any], backoff: Any) -> tuple[Any, Any]:
    """Contributions ``parts`` (carrying ``scales``) brought to their common scale
    (:func:`adaloss.decisions.merge_of_extremes`): summed into one tensor (``summed``) or each
    rescaled, and the common scale."""
    target, factors = decisions.merge_of_extremes(config, limit, backed_off, xp, scales,
                                                  [extremes(t) for t in parts], backoff)
    out = [scaled(t, f) for t, f in zip(parts, factors)]
    return (sum(out[1:], out[0]) if summed else out), target  # (summed in order)
