"""``ScaledGrad``: a gradient that carries the loss scale it was computed under."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class ScaledGrad(NamedTuple):
    """A scaled gradient: the true gradient is ``value / scale``.

    Attributes:
      value: the scaled gradient, in the dtype of the parameter it belongs to.
      scale: fp32 scalar, the product of every scale applied downstream of it.
      underflow: fp32 scalar or ``None``: the largest fraction of non-zero entries below
        ``u_min`` among the cotangents entering the layers of the backward that produced it
        (:func:`adaloss.solver.subnormal_fraction`), divided by ``T``; :func:`jax_adaloss.adaloss`
        feeds it to its lift (``AdaLossConfig.underflow_feedback``). The same on every leaf of
        one backward.
      inverse: fp32 scalar ``1 / scale`` (or ``None``: unchecked), set by the backward and kept
        by :func:`jax_adaloss.pmean` / :func:`jax_adaloss.psum` / :func:`jax_adaloss.tree_add`.
        A tree operation that combines scales as if they were values (``jax.lax.pmean``/``psum``
        over devices whose scales differ, ``jax.tree.map(jnp.add, ...)`` over micro-batches,
        dividing the tree by their number) breaks ``scale · inverse = 1``, and
        :func:`jax_adaloss.adaloss` skips and counts that step (``mixed_scales``) instead of
        applying a wrong gradient.
    """

    value: jax.Array
    scale: jax.Array
    underflow: jax.Array | None = None
    inverse: jax.Array | None = None

    @classmethod
    def of(cls, value: jax.Array, scale: jax.Array, underflow: jax.Array | None = None,
           mismatch: jax.Array | None = None) -> ScaledGrad:
        """A checked ``ScaledGrad`` (``inverse = 1 / scale``); ``mismatch`` (``|scale · inverse − 1|``
        of the gradients it was reduced from) carries their inconsistency over."""
        scale = jnp.asarray(scale, jnp.float32)
        inverse = 1.0 / scale if mismatch is None else (1.0 + mismatch) / scale
        return cls(value, scale, underflow, inverse)

    def mismatch(self) -> jax.Array:
        """``|scale · inverse − 1|``: 0 for a gradient as the backward made it (0 if unchecked)."""
        if self.inverse is None:
            return jnp.zeros((), jnp.float32)
        return jnp.abs(jnp.asarray(self.scale, jnp.float32) * self.inverse - 1.0)

    def unscale(self, dtype: Any = None) -> jax.Array:
        """``value / scale`` computed in fp32 (or wider if ``value`` is wider), cast to ``dtype``."""
        wide = jnp.promote_types(self.value.dtype, jnp.float32)
        out = self.value.astype(wide) / self.scale.astype(wide)
        return out if dtype is None else out.astype(dtype)


class StatelessScaledGrad(ScaledGrad):
    """A :class:`ScaledGrad` from a backward given no ``adaloss_state``: its decisions could not
    see :func:`jax_adaloss.adaloss`'s back-off, so an overflow that repeats would skip every step.
    :func:`jax_adaloss.adaloss` refuses it at trace time, with the remedy; pass
    ``adaloss_state=opt_state`` to the backward (or ``adaloss_state=None`` to say that training
    runs without back-off). Tree operations and :func:`jax_adaloss.tree_add` /
    :func:`jax_adaloss.pmean` keep the type."""

    __slots__ = ()


def kind_of(*grads: ScaledGrad) -> type[ScaledGrad]:
    """The type a combination of ``grads`` keeps: stateless if any of them is."""
    return StatelessScaledGrad if any(isinstance(g, StatelessScaledGrad) for g in grads) else ScaledGrad


def mark_stateless(tree: Any) -> Any:
    """``tree`` with every :class:`ScaledGrad` made a :class:`StatelessScaledGrad`."""
    return jax.tree.map(lambda g: StatelessScaledGrad(*g) if isinstance(g, ScaledGrad) else g, tree,
                        is_leaf=is_scaled_grad)


def rescale(x: Any, factor: Any) -> Any:
    """``x · factor`` computed in (at least) fp32, returned in ``x``'s dtype (non-float ``x``
    unchanged)."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return x
    wide = jnp.promote_types(dtype, jnp.float32)
    return (x.astype(wide) * jnp.asarray(factor).astype(wide)).astype(dtype)


def is_scaled_grad(x: Any) -> bool:
    """``is_leaf`` predicate that stops tree traversal at ``ScaledGrad`` nodes."""
    return isinstance(x, ScaledGrad)


def unscale_tree(grads: Any) -> Any:
    """Replace every ``ScaledGrad`` in ``grads`` by its fp32 unscaled value; other leaves pass through."""
    return jax.tree.map(lambda g: g.unscale() if isinstance(g, ScaledGrad) else g,
                        grads, is_leaf=is_scaled_grad)
