"""FP8 operand GEMMs (``config.operand_format``): a layer's input and weight quantized at
their own per-tensor scales, and the ``dot_general`` of two fp8 operands that XLA:GPU makes
an FP8 GEMM of."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from adaloss import solver
from adaloss.config import AdaLossConfig
from jax_adaloss.weight_grads import is_float

_F32 = jnp.float32

def fp8_operand(x: Any, config: AdaLossConfig, dtype: Any) -> tuple[Any, Any]:
    """A layer's input or weight in fp8 (``dtype``, ``config.operand_format``) at its own
    per-tensor scale (:func:`adaloss.solver.operand_scale`, saturating), and that scale: ``x ≈
    q / s``."""
    s = solver.operand_scale(config, jnp.max(jnp.abs(x)).astype(_F32), jnp)
    return solver.to_fp8(x.astype(_F32) * s, dtype, config.operand_limit, jnp), s


def dequantized(q: Any, s: Any, dtype: Any) -> Any:
    """``q / s`` in ``dtype``: exact (a power-of-two scale; every fp8 value is a 16-bit one)."""
    return (q.astype(_F32) / s).astype(dtype)


def gemm_out(dtype: Any, power_of_two: bool) -> Any:
    """What an FP8 GEMM returns before its scales are divided out: bf16 for a bf16 result with
    power-of-two scales (exact: bf16 has fp32's range, so the scaled sums cannot overflow, and
    a power of two leaves the rounding as it is); fp32 otherwise (an fp16 result: the scaled
    sums may exceed 65504; other scales: divided in fp32, rounded once)."""
    return dtype if power_of_two and jnp.dtype(dtype) == jnp.bfloat16 else _F32


def fp8_dot(operands: tuple[tuple[Any, Any], ...], params: dict[str, Any], dtype: Any,
            power_of_two: bool = True) -> Any:
    """``dot_general`` of two fp8 operands ``((q, s), (q, s))`` with ``params``' dimensions:
    accumulated in fp32, divided by both scales, in ``dtype`` (see ``gemm_out``). XLA:GPU
    makes it an FP8 GEMM (cuBLASLt f8, or a GEMM fusion whose dot takes the fp8 values);
    XLA:CPU computes the products exactly, as the 16-bit dot of the dequantized values does."""
    (a, sa), (b, sb) = operands
    acc = gemm_out(dtype, power_of_two)
    out = jax.lax.dot_general(a, b, params["dimension_numbers"], precision=params.get("precision"),
                              preferred_element_type=acc, out_sharding=params.get("out_sharding"))
    return (out / (sa * sb).astype(acc)).astype(dtype)


def quantized_operand(x: Any, config: AdaLossConfig, dtype: Any) -> Any:
    """A layer's input or weight as a layer other than a ``dot_general`` (a convolution, a
    ragged dot) reads it, in 16 bits on fp8 values: quantized to ``dtype``
    (``config.operand_format``) at its own per-tensor scale (:func:`adaloss.solver.operand_scale`,
    saturating) and converted back to ``x``'s dtype, exactly. Other inputs (integers: a ragged
    dot's group sizes) are returned unchanged."""
    if not is_float(jnp.result_type(x)):
        return x
    q, s = fp8_operand(x, config, dtype)
    # the barrier keeps XLA:GPU from folding the round trip away (see ``_quantize``)
    return dequantized(jax.lax.optimization_barrier(q), s, jnp.result_type(x))
