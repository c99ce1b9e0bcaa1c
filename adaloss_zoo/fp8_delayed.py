"""Delayed FP8 scaling of every layer's output cotangent, by flax's own implementation.

``flax.linen.fp8_ops.out_qdq`` is what ``Fp8DotGeneralOp`` applies to a matmul's output: the
identity forward, and in the backward the output cotangent quantized and dequantized to e5m2
at a scale from an amax *history* of past steps (Transformer Engine's delayed scaling; the
current step's amax is only recorded). The new scale and history come back as the gradient of
the scale and history arguments (flax's ``_overwrite_with_gradient`` collection).

:func:`delayed_value_and_grad` applies it to any JAX loss without changing the model: the
loss's jaxpr is evaluated with ``out_qdq`` after every matmul or convolution whose one operand
is computed from the differentiated parameters alone (a layer; attention's activation
products are left in the model's dtype), each with its own scale and history. The
quantization, the scale and the history update are flax's code; only the placement is ours.
Loops and conditionals are evaluated as they are (their layers are not quantized).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from jax.extend import core as jcore

_GEMMS = ("dot_general", "conv_general_dilated")
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


class Metas(NamedTuple):
    """Per layer, in program order: flax's delayed-scaling scale (``1/s``, shape ``(1,)``) and
    amax history."""

    scales: tuple[jax.Array, ...]
    histories: tuple[jax.Array, ...]


def init_metas(layers: int, history: int) -> Metas:
    """Fresh metas as ``Fp8DotGeneralBase.setup`` makes them: scale 1, history zeros."""
    return Metas(tuple(jnp.ones((1,), jnp.float32) for _ in range(layers)),
                 tuple(jnp.zeros((history,), jnp.float32) for _ in range(layers)))


def _evaluate(jaxpr: jcore.Jaxpr, consts: list[Any], args: list[Any], weight: list[bool | None],
              qdq: Callable[[Any], Any], const_flag: bool | None = None
              ) -> tuple[list[Any], list[bool | None]]:
    env: dict[Any, Any] = {}
    flag: dict[Any, bool | None] = {}  # True: from parameters only; None: constant; False: data
    for v, x in zip(jaxpr.constvars, consts):
        env[v], flag[v] = x, const_flag
    for v, x, f in zip(jaxpr.invars, args, weight):
        env[v], flag[v] = x, f

    def read(a: Any) -> tuple[Any, bool | None]:
        if isinstance(a, jcore.Literal):
            return a.val, None
        return env[a], flag[a]

    for eqn in jaxpr.eqns:
        vals, flags = zip(*[read(a) for a in eqn.invars]) if eqn.invars else ((), ())
        prim = eqn.primitive
        key = _CALLS.get(prim.name)
        if key is not None:
            sub = eqn.params[key]
            closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, [])
            outs, out_flags = _evaluate(closed.jaxpr, list(closed.consts), list(vals), list(flags), qdq)
        else:
            out = prim.bind(*vals, **prim.get_bind_params(eqn.params))
            outs = list(out) if prim.multiple_results else [out]
            known = [f for f in flags if f is not None]
            f_out = None if not known else all(known)
            if prim.name in _GEMMS and len(vals) == 2 and set(flags) == {True, False}:
                outs = [qdq(outs[0])]  # a layer: weight · data
                f_out = False
            out_flags = [f_out] * len(outs)
        for v, x, f in zip(eqn.outvars, outs, out_flags):
            env[v], flag[v] = x, f
    results = [read(a) for a in jaxpr.outvars]
    return [r[0] for r in results], [r[1] for r in results]


def count_layers(loss: Callable[[Any], Any], x: Any) -> int:
    """How many layers :func:`delayed_value_and_grad` quantizes in ``loss(x)``."""
    n = [0]

    def qdq(y: Any) -> Any:
        n[0] += 1
        return y
    _pure(loss, x, qdq, None)
    return n[0]


def _pure(loss: Callable[[Any], Any], x: Any, qdq: Callable[[Any], Any], metas: Any) -> Any:
    leaves, tree = jax.tree.flatten(x)
    closed = jax.make_jaxpr(lambda *ls: loss(jax.tree.unflatten(tree, list(ls))))(*leaves)
    # the top level's constants are what the loss closed over (the batch): data
    outs, _ = _evaluate(closed.jaxpr, list(closed.consts), leaves, [True] * len(leaves), qdq, False)
    return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(
        lambda *ls: loss(jax.tree.unflatten(tree, list(ls))), *leaves)), outs)


def pure(loss: Callable[[Any], Any], x: Any) -> tuple[Callable[[Any], Any], Any]:
    """``(loss of a parameter tree, that tree)`` for ``loss(x)``: ``x`` itself, or for an nnx
    Module its ``nnx.Param`` state (what ``nnx.value_and_grad`` differentiates)."""
    if isinstance(x, nnx.Module):
        graphdef, params, rest = nnx.split(x, nnx.Param, ...)
        # copies of the Variables inside the trace: BatchNorm may update its statistics there
        return (lambda p: loss(nnx.merge(graphdef, p, rest, copy=True))), params
    return loss, x


def delayed_value_and_grad(loss: Callable[[Any], tuple[Any, Any]], q_dtype: Any = jnp.float8_e5m2
                           ) -> Callable[[Any, Metas], Any]:
    """``run(params, metas) -> ((loss, aux), grads, new metas)`` for ``loss(params) -> (scalar,
    aux)``: the backward with every layer's output cotangent through ``fp8_ops.out_qdq``
    (``q_dtype``) at its delayed scale (see :func:`pure` for an nnx Module)."""
    def run(x: Any, metas: Metas) -> Any:
        def scaled(p: Any, m: Metas) -> Any:
            k = iter(range(len(m.scales)))

            def qdq(y: Any) -> Any:
                i = next(k)
                return fp8_ops.out_qdq(y.dtype, q_dtype, y, m.scales[i], m.histories[i])
            return _pure(loss, p, qdq, m)
        (value, aux), (grads, new) = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)(x, metas)
        return (value, aux), grads, new
    return run
