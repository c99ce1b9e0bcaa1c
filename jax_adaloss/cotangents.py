"""How the sweep (:mod:`jax_adaloss.backward`) holds its values: scales and merged cotangents
materialised so that XLA does not recompute the chain of decisions above each point, the
``max|x|`` reductions its decisions read, and the dtypes and zeros of cotangents."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_adaloss import reductions
from jax_adaloss.trace import CONST
from jax_adaloss.weight_grads import is_float

_F32 = jnp.float32


class ScaleBook:
    """What the sweep knows of each scale it carries, by the scale's identity (a decided scale
    passes through ops unchanged, the same object, and is merged into new ones): the layer
    decisions that set it, whether a decision fitted it to the fp8 format's range (layers, casts,
    merges; a cotangent carrying another, the loss seed's, is fitted at its cast), and its
    inverse where the reduction that settled it computed one (:meth:`settle`)."""

    def __init__(self) -> None:
        self.deciders: dict[int, tuple[Any, frozenset[str]]] = {}  # id(scale) -> (scale, names)
        self.fitted: dict[int, Any] = {}  # id(scale) -> scale
        self.inverses: dict[int, tuple[Any, Any]] = {}  # id(scale) -> (scale, 1 / scale)

    def settle(self, x: Any) -> Any:
        """:func:`_settled`, the inverses of the scales recorded (:meth:`inverse_of`)."""
        return _settled(x, self.inverses)

    def inverse_of(self, scale: Any) -> Any:
        """``1 / scale`` as the reduction that settled ``scale`` computed it, or ``None``."""
        got = self.inverses.get(id(scale))
        return got[1] if got is not None and got[0] is scale else None

    def decided(self, scale: Any, names: frozenset[str]) -> None:
        self.deciders[id(scale)] = (scale, names)

    def decided_by(self, scale: Any) -> frozenset[str]:
        got = self.deciders.get(id(scale))
        return got[1] if got is not None and got[0] is scale else frozenset()

    def fit(self, scale: Any, fitted: bool = True) -> None:
        """Mark ``scale`` fitted to the fp8 format's range (``fitted=False``: leave it)."""
        if fitted:
            self.fitted[id(scale)] = scale

    def is_fitted(self, scale: Any) -> bool:
        got = self.fitted.get(id(scale))
        return got is not None and got is scale

    def unfitted(self, scale: Any) -> Any:
        """``scale`` (the same value, another object) no longer fitted to the fp8 format: what a
        normalization's backward sends may exceed what the decisions behind it modelled, so the
        next cast reads its tensor's max (current scaling); those decisions still hear it."""
        out = scale * jnp.ones((), _F32)
        self.decided(out, self.decided_by(scale))
        return out


def _settled(x: Any, inverses: dict[int, tuple[Any, Any]] | None = None) -> Any:
    """``x`` (non-negative fp32 scalars: scales), unchanged, as the result of a reduction
    (``max(v, v/2)``), which XLA never fuses into its consumers. Without this, every decision's
    chain of scalar ops (and every earlier decision's, through the incoming scale) is duplicated
    into each elementwise fusion that reads a scale: compile and step time grow with the square
    of the depth. (``lax.optimization_barrier`` does not do it: XLA:CPU removes it before
    fusion; a reduction of identical values is simplified away.) Several scales (a decision's
    own and its outgoing one) go through one variadic reduction: one kernel whose results are
    scalars (slices of a stacked result would each be a kernel on a GPU). With ``inverses``,
    the same reduction computes ``1 / v`` too, recorded there under the result's ``id`` (a
    gradient's :class:`~jax_adaloss.scaled_grad.ScaledGrad` check, else a kernel per scale)."""
    leaves, tree = jax.tree.flatten(x)
    halves = jnp.array([1.0, 0.5], _F32)
    leaves = [jnp.asarray(v, _F32) for v in leaves]
    operands = [v * halves for v in leaves]
    if inverses is not None:
        operands += [(1.0 / v) * halves for v in leaves]
    out = jax.lax.reduce(tuple(operands), (_F32(-jnp.inf),) * len(operands),
                         lambda a, b: tuple(jnp.maximum(u, v) for u, v in zip(a, b)), (0,))
    n = len(leaves)
    if inverses is not None:
        for v, inv in zip(out[:n], out[n:]):
            inverses[id(v)] = (v, inv)
    return jax.tree.unflatten(tree, list(out[:n]))


#: the most values :func:`_materialized` computes in one kernel: XLA fuses the formulas of a
#: few into the reduction; of many more (64: the LM's 32 blocks) it keeps each its own kernel
MAX_MATERIALIZED = 16


def _materialized(x: Any) -> Any:
    """``x`` (fp32 scalars of any sign, NaN kept), unchanged, as the results of variadic
    reductions (``max(v, -inf)``) of at most :data:`MAX_MATERIALIZED` each: one kernel computes
    them. Values each read only by the program's outputs (the per-weight underflow signals)
    would otherwise be computed by a scalar kernel each on a GPU."""
    leaves, tree = jax.tree.flatten(x)
    if len(leaves) < 2:
        return x
    low = jnp.array([0.0, -jnp.inf], _F32)
    out: list[Any] = []
    for k in range(0, len(leaves), MAX_MATERIALIZED):
        operands = [jnp.where(low < 0, low, jnp.asarray(v, _F32)) for v in leaves[k:k + MAX_MATERIALIZED]]
        out += jax.lax.reduce(tuple(operands), (_F32(-jnp.inf),) * len(operands),
                              lambda a, b: tuple(jnp.maximum(u, v) for u, v in zip(a, b)), (0,))
    return jax.tree.unflatten(tree, out)


def _stored(x: Any) -> Any:
    """``x`` (a ≤16-bit float tensor; others unchanged) as the result of a reduction, so that
    XLA writes it to memory instead of fusing the elementwise sums that computed it into every
    consumer: the maximum of ``x`` and ``−inf`` over a trailing axis of two, in ``x``'s own
    dtype: bitwise ``x`` (−0 included), but for a negative NaN, which XLA:CPU's maximum may
    turn into ``−inf`` (non-finite either way: the step is skipped).

    A merged cotangent (the residual stream) feeds only fusible consumers (the next merge's
    rescale and max-abs, a cast decision's statistics), so without this XLA recomputes the
    whole chain of merges above each point of the stream: compile and step time grow with
    the square of the depth. A reduction is never fused into its consumers. The two terms
    lie on a trailing axis: XLA:CPU reduces a leading axis of two ~3× slower; in the 16-bit
    dtype with no product, the pass costs about half of a sum in fp32 on XLA:CPU
    (``lax.optimization_barrier`` does not do it: XLA:CPU removes it before fusion)."""
    dtype = jnp.result_type(x)
    if not (is_float(dtype) and dtype.itemsize <= 2):
        return x
    return jnp.max(jnp.stack([x, jnp.full_like(x, -jnp.inf)], axis=-1), axis=-1)


def _absmax(x: Any) -> Any:
    """``max|x|`` in fp32 (:func:`jax_adaloss.reductions.statistics`: one kernel on a GPU)."""
    return _absmaxes([x])[0]


def _absmaxes(xs: list[Any]) -> list[Any]:
    """``max|x|`` of each of ``xs`` in fp32 (:func:`jax_adaloss.reductions.statistics_of`: one
    kernel for those of one shape on a GPU)."""
    if not reductions.fused():
        return [jnp.max(jnp.abs(x)).astype(_F32) for x in xs]  # in x's dtype, widened: exact
    return [s.absmax for s in reductions.statistics_of(xs)]


def _sum(xs: list[Any]) -> Any:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _like(ct: Any, value: Any) -> Any:
    """A float cotangent in its primal's dtype (a widened weight-path cotangent narrowed back
    for a transpose that expects the primal's dtype)."""
    dtype = jnp.result_type(value)
    if is_float(dtype) and jnp.result_type(ct) != dtype:
        return ct.astype(dtype)
    return ct


def _or_zero(got: tuple[Any, Any] | None, value: Any, dtype: Any) -> tuple[Any, Any]:
    """A (cotangent, scale) pair in ``dtype``, or a zero cotangent like ``value`` at scale 1
    (a loop's carry and outputs need a fixed type)."""
    if got is not None:
        return jnp.asarray(got[0]).astype(dtype), got[1]
    return jnp.zeros(np.shape(value), dtype), jnp.ones((), _F32)


def _ct_dtype(value: Any, origin: str | None) -> Any:
    """The dtype a sweep gives the cotangent of ``value``: a 16-bit weight's in fp32."""
    dtype = jnp.result_type(value)
    if origin not in (None, CONST) and jnp.dtype(dtype).itemsize < 4:
        return jnp.promote_types(dtype, _F32)
    return dtype


def _zero_ct(value: Any) -> Any:
    dtype = jnp.result_type(value)
    if is_float(dtype):
        return jnp.zeros(np.shape(value), dtype)
    return np.zeros(np.shape(value), jax.dtypes.float0)
