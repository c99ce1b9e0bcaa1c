"""Delayed FP8 scaling at every layer, by flax's own implementation.

``flax.linen.fp8_ops.out_qdq`` is what ``Fp8DotGeneralOp`` applies to a matmul's output: the
identity forward, and in the backward the output cotangent quantized and dequantized to e5m2
at a scale from an amax *history* of past steps (Transformer Engine's delayed scaling; the
current step's amax is only recorded). ``in_qdq`` is what it applies to the matmul's input and
kernel: each quantized to e4m3 at its own delayed scale in the forward, the gradient passed
straight through. The new scales and histories come back as the gradient of the scale and
history arguments (flax's ``_overwrite_with_gradient`` collection).

:func:`delayed_value_and_grad` applies them to any JAX loss without changing the model: the
loss's jaxpr is evaluated (:func:`adaloss_tools.jaxpr_walk.walk`) with ``out_qdq`` after every
matmul or convolution whose one operand is computed from the differentiated parameters alone
(a layer; attention's activation products are left in the model's dtype), and with
``operands=True`` ``in_qdq`` on both of its operands too (``Fp8DotGeneralOp`` end to end),
each with its own scale and history. The quantization, the scales and the history updates
are flax's code; only the placement is ours. Loops and conditionals are evaluated as they are
(their layers are not quantized).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from jax.extend import core as jcore

from adaloss_tools.jaxpr_walk import PLAIN_CALLS, walk

_GEMMS = ("dot_general", "conv_general_dilated")
#: the casts each layer makes: its output's cotangent; with operands, first its two operands (in
#: the GEMM's operand order), as ``Fp8DotGeneralOp``'s ``input``, ``kernel`` and ``output_grad`` metas
ROLES = ("output_grad",)
OPERAND_ROLES = ("input", "kernel", "output_grad")


class Metas(NamedTuple):
    """Per cast (each layer's :data:`ROLES` or :data:`OPERAND_ROLES`, layers in program order):
    flax's delayed-scaling scale (``1/s``, shape ``(1,)``) and amax history."""

    scales: tuple[jax.Array, ...]
    histories: tuple[jax.Array, ...]


def init_metas(layers: int, history: int, operands: bool = False) -> Metas:
    """Fresh metas as ``Fp8DotGeneralBase.setup`` makes them: scale 1, history zeros."""
    casts = layers * len(OPERAND_ROLES if operands else ROLES)
    return Metas(tuple(jnp.ones((1,), jnp.float32) for _ in range(casts)),
                 tuple(jnp.zeros((history,), jnp.float32) for _ in range(casts)))


Place = Callable[[str, Any], Any]  # (role, value) -> the value a layer's GEMM reads or returns


def _evaluate(closed: jcore.ClosedJaxpr, leaves: list[Any], place: Place) -> list[Any]:
    """``closed``'s outputs with ``place`` at every layer: ``place("input"|"kernel", operand)``
    before it, ``place("output_grad", result)`` after it."""
    def visit(eqn: jcore.JaxprEqn, ins: list[tuple[Any, bool | None]]) -> list[tuple[Any, bool | None]]:
        vals = [v for v, _ in ins]
        flags = [f for _, f in ins]  # True: from parameters only; None: constant; False: data
        known = [f for f in flags if f is not None]
        f_out = None if not known else all(known)
        layer = eqn.primitive.name in _GEMMS and len(vals) == 2 and set(flags) == {True, False}
        if layer:  # weight · data
            vals = [place("kernel" if f else "input", v) for v, f in zip(vals, flags)]
            f_out = False
        out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
        outs = list(out) if eqn.primitive.multiple_results else [out]
        if layer:
            outs = [place("output_grad", outs[0])]
        return [(o, f_out) for o in outs]

    # the top level's constants are what the loss closed over (the batch): data
    jaxpr = closed.jaxpr
    outs = walk(jaxpr, [(c, False) for c in closed.consts], [(x, True) for x in leaves], visit,
                literal=lambda v: (v, None), const=lambda c: (c, None), inline=PLAIN_CALLS)
    return [v for v, _ in outs]


def count_layers(loss: Callable[[Any], Any], x: Any) -> int:
    """How many layers :func:`delayed_value_and_grad` quantizes in ``loss(x)``."""
    n = [0]

    def place(role: str, y: Any) -> Any:
        n[0] += role == "output_grad"
        return y
    placed(loss, x, place)
    return n[0]


def placed(loss: Callable[[Any], Any], x: Any, place: Place) -> Any:
    """``loss(x)`` evaluated with ``place`` at every layer (see :func:`_evaluate`)."""
    leaves, tree = jax.tree.flatten(x)
    closed = jax.make_jaxpr(lambda *ls: loss(jax.tree.unflatten(tree, list(ls))))(*leaves)
    outs = _evaluate(closed, leaves, place)
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


def delayed_value_and_grad(loss: Callable[[Any], tuple[Any, Any]], q_dtype: Any = jnp.float8_e5m2,
                           operands: bool = False, operand_dtype: Any = jnp.float8_e4m3fn
                           ) -> Callable[[Any, Metas], Any]:
    """``run(params, metas) -> ((loss, aux), grads, new metas)`` for ``loss(params) -> (scalar,
    aux)``: the backward with every layer's output cotangent through ``fp8_ops.out_qdq``
    (``q_dtype``) at its delayed scale, and with ``operands`` its input and kernel through
    ``fp8_ops.in_qdq`` (``operand_dtype``) in the forward: ``Fp8DotGeneralOp`` at every layer
    (:func:`init_metas` with the same ``operands``; see :func:`pure` for an nnx Module)."""
    def run(x: Any, metas: Metas) -> Any:
        def scaled(p: Any, m: Metas) -> Any:
            k = iter(range(len(m.scales)))

            def place(role: str, y: Any) -> Any:
                if role != "output_grad" and not operands:
                    return y
                i = next(k)
                if role == "output_grad":
                    return fp8_ops.out_qdq(y.dtype, q_dtype, y, m.scales[i], m.histories[i])
                return fp8_ops.in_qdq(y.dtype, operand_dtype, y, m.scales[i], m.histories[i])
            return placed(loss, p, place)
        (value, aux), (grads, new) = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)(x, metas)
        return (value, aux), grads, new
    return run
