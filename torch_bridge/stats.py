"""A cotangent's, a weight's and an fp8 cast's statistics in eager torch, as the backward's
hooks read them (the traced forms the compiled decisions read are :mod:`torch_bridge.kernels`'s;
tests pin the two equal).

Each reduction accumulates in fp32 and is written for the device it runs on: on a CPU the
fastest form of the same sum (a BLAS dot of an fp32 copy, counts from a copy modified in
place: a boolean mask costs more than the arithmetic there), elsewhere one fused reduction
reading the tensor in its own dtype. The results are :mod:`adaloss.decisions`' containers
(:class:`~adaloss.decisions.Sums`, :class:`~adaloss.decisions.LogSums`) or
:mod:`adaloss.solver`'s.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from adaloss import decisions, solver
from adaloss.config import AdaLossConfig
from torch_bridge import kernels
from torch_bridge._xp import ON_HOST, ScalarMath, xp

_F32 = torch.float32


def sum_of_squares(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``Σ x²`` in fp32, over ``dim`` (2-d ``x``) or all entries. On a CPU from an fp32 copy (a
    BLAS dot product, or an in-place square summed over the rows: 2-4x faster than
    ``vector_norm``'s reduction of 16-bit values, ~3x for a strided column reduction); elsewhere
    one fused ``vector_norm`` reading ``x`` in its own dtype."""
    if x.device.type != "cpu":
        return torch.linalg.vector_norm(x, dim=dim, dtype=_F32).square()
    w = x.to(_F32)
    if dim is None:
        w = w.reshape(-1)
        return torch.dot(w, w)
    w = w.square_() if w is not x else w.square()  # never in place on x itself
    return w.sum(dim)


def tensor_stats(x: torch.Tensor, with_mean: bool = True) -> solver.TensorStats:
    """fp32 (mean,) mean square, min and max of ``x``, as :func:`adaloss.solver.tensor_stats`.

    Reductions over ``x`` accumulating in fp32 (:func:`sum_of_squares`; ``torch.var_mean`` on
    an fp32 copy is ~7x slower on CPU). The mean is
    skipped (``None``) when the statistical model does not use it.
    """
    return decisions.normalized(tensor_sums(x, with_mean), x.numel(), xp)


def tensor_sums(x: torch.Tensor, with_mean: bool = True) -> decisions.Sums:
    """The :class:`~adaloss.decisions.Sums` of ``x`` (:func:`tensor_stats` before the
    divisions and conversions, which a decision makes)."""
    lo, hi = torch.aminmax(x)
    return decisions.Sums(torch.sum(x, dtype=_F32) if with_mean else None, sum_of_squares(x), lo, hi)


def weight_stats(weights: Sequence[torch.Tensor]) -> list[decisions.Sums]:
    """Each weight's :class:`~adaloss.decisions.Sums` (no ``Σ W``): on an accelerator three
    ``_foreach`` calls for all the weights of one device and dtype (``‖W‖₂``, its square,
    ``max|W|``); on a CPU, where ``_foreach_norm`` is a loop of 16-bit norms (~4x slower than
    a dot of an fp32 copy), :func:`sum_of_squares` and ``aminmax`` of each."""
    out: list[decisions.Sums | None] = [None] * len(weights)
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for k, w in enumerate(weights):
        groups[(w.device, w.dtype)].append(k)
    for (device, _), members in groups.items():
        ws = [weights[k] for k in members]
        if device.type == "cpu":
            stats = [decisions.Sums(None, sum_of_squares(w), *torch.aminmax(w)) for w in ws]
        else:
            norms = torch._foreach_norm(ws, 2, dtype=_F32)
            maxima = torch._foreach_norm(ws, math.inf)
            squares = torch._foreach_mul(norms, norms)
            stats = [decisions.Sums(None, sq, m, m) for sq, m in zip(squares, maxima)]
        for k, st in zip(members, stats):
            out[k] = st
    return out  # type: ignore[return-value]


_CODE_TABLES: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def fp8_histogram(q: torch.Tensor, u_min: float, u_max: float, sm: ScalarMath) -> solver.Fp8Histogram:
    """:func:`adaloss.solver.fp8_histogram` of the fp8 tensor ``q``, in ``sm``'s namespace: one
    ``bincount`` of its bytes (widening an fp8 tensor on a CPU costs ~10x a read of it)."""
    key = (q.dtype, q.device, u_min, u_max, sm.xp is xp)
    codes = _CODE_TABLES.get(key)
    if codes is None:  # the number each byte stands for, and what the statistics count of it
        values = torch.arange(256, dtype=torch.uint8, device=q.device).view(q.dtype).to(_F32)
        values = sm.to_xp(values)
        codes = _CODE_TABLES[key] = (values, solver.fp8_code_table(values, u_min, u_max, sm.xp))
    counts = torch.bincount(q.reshape(-1).view(torch.uint8), minlength=256)
    return solver.fp8_histogram(sm.to_xp(counts), *codes, sm.xp)


def fp8_cast_counts(g: torch.Tensor, q: torch.Tensor, config: AdaLossConfig, sm: ScalarMath
                    ) -> tuple[solver.Fp8Histogram, tuple[Any, Any, Any]]:
    """The histogram of ``q``, ``g`` cast to fp8, and the cast's fractions
    (:func:`adaloss.solver.quantized_fractions`), in ``sm``'s namespace: a histogram of ``q`` and
    a count of ``g``'s non-zero entries; ``g``'s saturated entries are counted only where ``q``
    holds the format's max or a NaN (the casts of any there were), or on a device (no host read)."""
    hist = fp8_histogram(q, config.underflow_limit, config.overflow_limit, sm)
    nonzero = sm.to_xp(torch.count_nonzero(g).to(_F32))
    if sm is ON_HOST and not (hist.at_max > 0 or hist.nan > 0):
        saturated = sm.xp.zeros_like(nonzero)
    else:
        saturated = sm.to_xp(solver.saturated_count(g, config, xp))
    return hist, solver.fractions_of_counts(nonzero, hist.nonzero, hist.held, saturated, sm.xp)


def min_max(x: torch.Tensor) -> solver.TensorStats:
    """Only the min and max (enough for the overflow caps)."""
    lo, hi = torch.aminmax(x)
    return solver.TensorStats(None, None, lo.to(_F32), hi.to(_F32))


def log_sums(x: torch.Tensor) -> decisions.LogSums:
    """The :class:`~adaloss.decisions.LogSums` of ``x`` (what
    :func:`adaloss.solver.log_stats_of_sums` takes, before conversions): torch's fused kernels
    (~3x faster on CPU than the solver's ops). One temporary (``|x|``, its log taken in place):
    on a CPU each fresh tensor of a cotangent's size costs its page faults (~0.5 ms for 2 MB),
    more than the arithmetic."""
    a = x.abs()
    absmax, count = a.amax(), torch.count_nonzero(a)
    logs = torch.nan_to_num_(a.log_(), neginf=0.0)  # zeros contribute nothing
    return decisions.LogSums(count, logs.sum(dtype=_F32), torch.linalg.vector_norm(logs, dtype=_F32), absmax)


def log_stats(x: torch.Tensor) -> solver.LogStats:
    """Mean and std of ``ln|x|`` over the non-zero entries, as :func:`adaloss.solver.log_stats`
    (one-pass sums, :func:`log_sums`), 0-d fp32 tensors."""
    return decisions.log_stats(log_sums(x), xp)


def _counts_in_place(x: torch.Tensor, limit: float, host: bool) -> bool:
    """Whether :func:`subnormal_counts` counts from an fp32 copy of ``|x|``: a CPU backward
    (``host``), fewer than 2^24 entries (an exact fp32 sum), ``limit`` a power of two."""
    return host and x.device.type == "cpu" and x.numel() < kernels.EXACT_COUNT and math.frexp(limit)[0] == 0.5


def _counts_of_copy(w: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`subnormal_counts` from ``w``, an fp32 copy of ``x`` it may overwrite."""
    nonzero = torch.count_nonzero(w)
    at_least = w.abs_().mul_(1.0 / limit).clamp_(max=1.0).floor_().nan_to_num_(nan=1.0).sum(dtype=_F32)
    return nonzero, w.numel() - at_least


def subnormal_counts(x: torch.Tensor, limit: float, host: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The counts :func:`adaloss.solver.subnormal_fraction_of_counts` takes: ``x``'s non-zero
    entries and those below the power of two ``limit`` in magnitude (zeros included).

    On a CPU backward (``host``, :func:`_counts_in_place`): from one fp32 copy of ``x`` (exact),
    the entries at or above ``limit`` summed as ``floor(min(|x| / limit, 1))`` (exact: the
    division is by a power of two) in place: on a CPU a comparison's boolean mask costs 3-10x an
    fp32 elementwise op and its sum (0.3 ms against 0.03 ms for 512K entries). NaN entries count
    as non-zero and not below, as the comparisons count them."""
    if not _counts_in_place(x, limit, host):
        return torch.count_nonzero(x), torch.count_nonzero(x.abs() < limit)
    return _counts_of_copy(x.to(_F32, copy=True), limit)


def cotangent_stats(g: torch.Tensor, with_mean: bool, limit: float | None, host: bool = False
                    ) -> tuple[decisions.Sums, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`tensor_sums` of ``g`` and, with ``limit``, its :func:`subnormal_counts`; a 16-bit
    ``g`` on a CPU backward widened once for both (the same values as computed apart)."""
    if limit is None or g.dtype == _F32 or not _counts_in_place(g, limit, host):
        return (tensor_sums(g, with_mean),
                None if limit is None else subnormal_counts(g, limit, host))
    w = g.to(_F32).reshape(-1)  # what sum_of_squares reduces
    lo, hi = torch.aminmax(g)
    sums = decisions.Sums(torch.sum(g, dtype=_F32) if with_mean else None, torch.dot(w, w), lo, hi)
    return sums, _counts_of_copy(w, limit)
