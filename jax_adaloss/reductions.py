"""A tensor's statistics in as few GPU kernels as XLA allows: one pass, one kernel.

A decision reads up to four reductions of a cotangent (``max|g|``, ``Σg²``, the non-zero
entries, those below ``u_min``). Written as separate reductions, XLA:GPU compiles each
full reduction of more than :data:`GPU_ROW_LIMIT` entries into two kernels (a tree: partial
results, then their reduction), and keeps the second stages apart: five kernels and more per
decision, each a launch. On a GPU target this module computes them as one variadic
``lax.reduce`` that keeps (a part of) the first axis, whose rows of at most
:data:`GPU_ROW_LIMIT` entries are one kernel (every statistic at once), and combines the
``R`` partial results elementwise (slices: they fuse into the decision's kernel, no second
reduction); a tensor whose rows are longer gets one variadic reduction of everything (XLA's
two kernels, for all its statistics). Elsewhere (XLA:CPU, whose variadic reductions are one
sequential loop that loses fp32 accuracy on large tensors) the statistics are the separate
reductions they always were, bitwise.

>>> s = statistics(g, sq_mean=True, below=2.0**-14)  # doctest: +SKIP
>>> s.absmax, s.sq_mean, s.nonzero, s.below            # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from adaloss import solver
from jax_adaloss.weight_grads import target_platform

_F32 = jnp.float32

#: XLA:GPU reduces a row of at most this many entries in one kernel (its race-free bound for
#: row reductions); a longer one it splits into two
GPU_ROW_LIMIT = 16384
#: at most this many partial results are combined elementwise (in the consumer's kernel); a
#: tensor that would need more is reduced whole (XLA's two kernels)
MAX_PARTIALS = 64
#: below this many entries, a sum of fp32 0/1 values is exact in any order
EXACT_F32_COUNT = 2**24


class Statistics(NamedTuple):
    """Reductions of one tensor (``None``: not asked for), in fp32 but for the counts.

    Attributes:
      absmax: ``max|x|``.
      sq_mean: ``E[x²]``.
      mean: ``E[x]``.
      nonzero: entries ``≠ 0`` (exact: fp32 below :data:`EXACT_F32_COUNT` entries, else int32).
      below: entries with ``|x| < below`` in ``x``'s own dtype, zeros included (exact, the same).
      above: entries with ``|x| > above`` (an inf too; in fp32: exact for a 16-bit ``x``).
      size: the number of entries (a Python int).
      logs: :func:`adaloss.solver.log_stats` (its ``absmax`` too).
    """

    absmax: Any
    sq_mean: Any
    mean: Any
    nonzero: Any
    below: Any
    size: int
    logs: solver.LogStats | None = None
    above: Any = None

    def magnitude(self) -> solver.TensorStats:
        """The :class:`adaloss.solver.TensorStats` of :func:`adaloss.solver.magnitude_stats`."""
        return solver.TensorStats(self.mean, self.sq_mean, None, None, self.absmax)


def count(mask: Any) -> Any:
    """The number of true entries of ``mask``, exactly: a sum of fp32 0/1 values below
    :data:`EXACT_F32_COUNT` entries (about twice as fast as an integer count on XLA:CPU),
    an int32 count above."""
    return jnp.sum(mask, dtype=_count_dtype(math.prod(np.shape(mask))))


def _count_dtype(size: int) -> Any:
    return _F32 if size < EXACT_F32_COUNT else jnp.int32


def fused() -> bool:
    """Whether this trace targets a GPU (:func:`statistics` then reduces in one kernel)."""
    return target_platform() in ("cuda", "rocm", "gpu")


def statistics(x: Any, *, absmax: bool = True, sq_mean: bool = False, mean: bool = False,
               nonzero: bool = False, below: float | None = None, logs: bool = False,
               above: float | None = None, one_pass: bool | None = None) -> Statistics:
    """The asked-for reductions of ``x`` (``below``: count ``|x| < below``; ``logs``: the
    statistics of ``ln|x|``).

    ``one_pass`` (default: :func:`fused`): one variadic reduction (see the module docstring);
    else separate ones, as :func:`adaloss.solver.magnitude_stats` and
    :func:`adaloss.solver.subnormal_fraction` compute them."""
    return statistics_of([x], absmax=absmax, sq_mean=sq_mean, mean=mean, nonzero=nonzero, below=below,
                         logs=logs, above=above, one_pass=one_pass)[0]


def statistics_of(xs: Sequence[Any], *, absmax: bool = True, sq_mean: bool = False, mean: bool = False,
                  nonzero: bool = False, below: float | None = None, logs: bool = False,
                  above: float | None = None, one_pass: bool | None = None) -> list[Statistics]:
    """:func:`statistics` of each of ``xs``; in one pass, the tensors of one shape share one
    variadic reduction (at most :data:`MAX_TENSORS` each): one kernel for all the parts of a
    merge, or for the weights of like layers."""
    nonzero = nonzero or below is not None
    kw = {"absmax": absmax or logs, "sq_mean": sq_mean, "mean": mean, "nonzero": nonzero, "below": below,
          "logs": logs, "above": above}
    if not (one_pass if one_pass is not None else fused()):
        return [_separate(x, **kw) for x in xs]
    out: list[Statistics | None] = [None] * len(xs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(xs):
        if math.prod(np.shape(x)) == 0:
            out[i] = _separate(x, **kw)
        else:
            groups.setdefault(tuple(np.shape(x)), []).append(i)
    for shape, members in groups.items():
        for k in range(0, len(members), MAX_TENSORS):
            chunk = members[k:k + MAX_TENSORS]
            parts = [_operands(xs[i], **kw) for i in chunk]
            results = _reduce([o for p in parts for o in p[1]], [v for p in parts for v in p[2]],
                              [c for p in parts for c in p[3]], shape)
            for i, (names, *_) in zip(chunk, parts):
                out[i], results = _finish(dict(zip(names, results)), math.prod(shape)), results[len(names):]
    return out  # type: ignore[return-value]


#: the most tensors one variadic reduction reads (a kernel's parameters are finite)
MAX_TENSORS = 32


def _separate(x: Any, absmax: bool, sq_mean: bool, mean: bool, nonzero: bool, below: float | None,
              logs: bool, above: float | None) -> Statistics:
    m = solver.magnitude_stats(x, jnp, with_mean=mean, moments=sq_mean or mean)  # the solver's own
    return Statistics(m.absmax if absmax else None, m.sq_mean if sq_mean else None,
                      m.mean if mean else None, count(x != 0) if nonzero else None,
                      count(jnp.abs(x) < below) if below is not None else None, math.prod(np.shape(x)),
                      solver.log_stats(x, jnp) if logs else None,
                      count(jnp.abs(x.astype(_F32)) > above) if above is not None else None)


def _operands(x: Any, absmax: bool, sq_mean: bool, mean: bool, nonzero: bool, below: float | None,
              logs: bool, above: float | None) -> tuple[list[str], list[Any], list[Any], list[Any]]:
    """The names, operands, initial values and combining ops of ``x``'s reductions."""
    f = x.astype(_F32)
    cdt = _count_dtype(math.prod(np.shape(x)))
    names: list[str] = []
    operands: list[Any] = []
    inits: list[Any] = []
    combine: list[Any] = []

    def add(name: str, operand: Any, init: Any, op: Any) -> None:
        names.append(name)
        operands.append(operand)
        inits.append(init)
        combine.append(op)

    if absmax:
        add("absmax", jnp.abs(f), _F32(0), jnp.maximum)
    if sq_mean:
        add("sq_mean", f * f, _F32(0), jnp.add)
    if mean:
        add("mean", f, _F32(0), jnp.add)
    if nonzero:
        add("nonzero", (x != 0).astype(cdt), cdt(0), jnp.add)
    if below is not None:
        add("below", (jnp.abs(x) < below).astype(cdt), cdt(0), jnp.add)
    if above is not None:
        add("above", (jnp.abs(f) > above).astype(cdt), cdt(0), jnp.add)
    if logs:  # as solver.log_stats counts them: |x| > 0 in fp32
        a = jnp.abs(f)
        ln = solver.log_magnitudes(a, a > 0, jnp)
        add("log_count", (a > 0).astype(cdt), cdt(0), jnp.add)
        add("log_sum", ln, _F32(0), jnp.add)
        add("log_sq_sum", ln * ln, _F32(0), jnp.add)
    return names, operands, inits, combine


def _reduce(operands: list[Any], inits: list[Any], combine: list[Any], shape: tuple[int, ...]) -> list[Any]:
    """Every operand (of ``shape``) reduced to a scalar by its combining op, in one variadic
    reduction."""
    if not operands:
        return []

    def reducer(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(op(u, v) for op, u, v in zip(combine, a, b))

    view = _rows(shape)
    if view is None:  # one variadic reduction of everything: XLA splits it in two kernels
        return list(lax.reduce(tuple(operands), tuple(inits), reducer, tuple(range(len(shape)))))
    # the partial results combined elementwise: they fuse into whatever reads them
    flat = [jnp.reshape(o, view) for o in operands]
    partials = lax.reduce(tuple(flat), tuple(inits), reducer, tuple(range(1, len(view))))
    out = []
    for op, p in zip(combine, partials):
        acc = p[0]
        for i in range(1, view[0]):
            acc = op(acc, p[i])
        out.append(acc)
    return out


def _finish(got: dict[str, Any], size: int) -> Statistics:
    for name in ("sq_mean", "mean"):  # sums to means, as jnp.mean divides
        if name in got:
            got[name] = got[name] / _F32(size)
    ls = None
    if "log_sum" in got:
        ls = solver.log_stats_of_sums(got["log_count"], got["log_sum"], got["log_sq_sum"], got["absmax"], jnp)
    return Statistics(got.get("absmax"), got.get("sq_mean"), got.get("mean"), got.get("nonzero"),
                      got.get("below"), size, ls, got.get("above"))


def _rows(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The one-pass view of ``shape``: ``(R, c) + shape[1:]`` (``R·c = shape[0]``), reduced over
    all but its first axis, ``c`` the largest divisor of ``shape[0]`` that keeps the rows within
    :data:`GPU_ROW_LIMIT`; ``None`` where no such view has at most :data:`MAX_PARTIALS` rows.
    Only the first axis is split (a reshape without a copy where it is the major one, as a
    batch's is); the others are reduced in whatever layout XLA gives them (a GEMM's output may
    be transposed: merging two of its axes would copy it)."""
    size = math.prod(shape)
    if size <= GPU_ROW_LIMIT:
        return (1, size)
    tail = math.prod(shape[1:])
    if tail > GPU_ROW_LIMIT:
        return None
    c = max(d for d in _divisors(shape[0]) if d * tail <= GPU_ROW_LIMIT)
    return None if shape[0] // c > MAX_PARTIALS else (shape[0] // c, c) + tuple(shape[1:])


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]
