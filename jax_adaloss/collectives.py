"""Reducing ``ScaledGrad`` trees: across devices (``pmean``/``psum``) and across micro-batches
(``tree_add``/``tree_scale``).

Each gradient carries its own scale, and two backwards (two devices, two micro-batches) may
choose different scales for the same parameter. Their values cannot be added as they are, and
``jax.lax.pmean`` / ``jax.tree.map(jnp.add, ...)`` would also add the scales. Here every
``ScaledGrad`` is first brought to the smallest of the scales being combined (a power-of-two
ratio ≤ 1, applied in fp32: exact, and nothing can overflow), then the values are reduced and
the result carries that common scale. Plain array leaves are reduced as ``jax.lax`` would.

Cost against ``jax.lax.pmean`` on the unscaled gradients: one extra all-reduce (``pmin``) of a
vector of six fp32 scalars per ``ScaledGrad`` leaf (common scale, underflow signal, consistency,
the three parts of its skip trace), and one multiply per gradient entry; the values travel in
their own dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_adaloss.scaled_grad import (
    ScaledGrad,
    combine_traces,
    encode_trace,
    is_scaled_grad,
    kind_of,
    rescale,
    trace_parts,
)

_F32 = jnp.float32


def _rescaled(g: ScaledGrad, target: jax.Array) -> jax.Array:
    """``g.value`` brought from ``g.scale`` to ``target`` (fp32 arithmetic, ``g.value``'s dtype)."""
    return rescale(g.value, target / jnp.asarray(g.scale, _F32))


def _collective(op: Callable[..., Any], grads: Any, axis_name: Any) -> Any:
    leaves, treedef = jax.tree.flatten(grads, is_leaf=is_scaled_grad)
    scaled = [i for i, g in enumerate(leaves) if isinstance(g, ScaledGrad)]
    out = list(leaves)
    plain = [i for i, g in enumerate(leaves)
             if not isinstance(g, ScaledGrad) and jnp.result_type(g) != jax.dtypes.float0]
    for i, v in zip(plain, op([leaves[i] for i in plain], axis_name)):
        out[i] = v
    if scaled:
        gs = [leaves[i] for i in scaled]
        has_signal = [g.underflow is not None for g in gs]
        traced = [g.trace is not None for g in gs]
        # one all-reduce for every scalar: pmin of (scale, −underflow, −mismatch, the trace's
        # parts: the earliest non-finite layer and any non-finite value on any device)
        local = jnp.stack([jnp.concatenate([
            jnp.stack([jnp.asarray(g.scale, _F32),
                       -(jnp.asarray(g.underflow, _F32) if s else jnp.zeros((), _F32)), -g.mismatch()]),
            trace_parts(g.trace if t else encode_trace(0, 1, 1))])
            for g, s, t in zip(gs, has_signal, traced)])
        agreed = jax.lax.pmin(local, axis_name)
        values = op([_rescaled(g, agreed[k, 0]) for k, g in enumerate(gs)], axis_name)
        for k, (i, v, s, t) in enumerate(zip(scaled, values, has_signal, traced)):
            out[i] = kind_of(gs[k]).of(v, agreed[k, 0], -agreed[k, 1] if s else None, -agreed[k, 2],
                                       trace=encode_trace(*agreed[k, 3:]) if t else None)
    return jax.tree.unflatten(treedef, out)


def pmean(grads: Any, axis_name: Any) -> Any:
    """``jax.lax.pmean`` for a tree holding :class:`ScaledGrad` leaves (use it inside
    ``shard_map``/``pmap`` where one would ``pmean`` plain gradients): every device ends with
    the mean gradient, at the smallest scale any device chose for that leaf. The underflow
    signal is the largest any device reported."""
    return _collective(jax.lax.pmean, grads, axis_name)


def psum(grads: Any, axis_name: Any) -> Any:
    """``jax.lax.psum`` for a tree holding :class:`ScaledGrad` leaves (see :func:`pmean`)."""
    return _collective(jax.lax.psum, grads, axis_name)


def tree_add(*trees: Any) -> Any:
    """The sum of gradient trees of the same structure (micro-batch accumulation): each
    ``ScaledGrad`` leaf at the smallest of its scales, plain leaves added."""
    if not trees:
        raise TypeError("tree_add needs at least one tree")

    def add(*gs: Any) -> Any:
        kinds = {isinstance(g, ScaledGrad) for g in gs}
        if len(kinds) > 1:
            raise TypeError("tree_add: a leaf is a ScaledGrad in one tree and a plain array in another")
        if not isinstance(gs[0], ScaledGrad):
            return sum(gs[1:], gs[0])
        common = _min([jnp.asarray(g.scale, _F32) for g in gs])
        value = sum((_rescaled(g, common) for g in gs[1:]), _rescaled(gs[0], common))
        signals = [g.underflow for g in gs if g.underflow is not None]
        underflow = None if not signals else _max(signals)
        return kind_of(*gs).of(value, common, underflow, _max([g.mismatch() for g in gs]),
                               trace=combine_traces([g.trace for g in gs]))
    return jax.tree.map(add, *trees, is_leaf=is_scaled_grad)


def tree_scale(factor: Any, tree: Any) -> Any:
    """Multiply every gradient by ``factor`` (e.g. ``1 / micro_batches`` after :func:`tree_add`):
    the values of ``ScaledGrad`` leaves (in fp32, their scale unchanged), plain leaves as they are."""
    def scale(g: Any) -> Any:
        if isinstance(g, ScaledGrad):
            return g._replace(value=rescale(g.value, factor))
        return g * factor
    return jax.tree.map(scale, tree, is_leaf=is_scaled_grad)


def _min(xs: Sequence[jax.Array]) -> jax.Array:
    return jnp.min(jnp.stack(xs))


def _max(xs: Sequence[jax.Array]) -> jax.Array:
    return jnp.max(jnp.stack(xs))
