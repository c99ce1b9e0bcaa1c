"""The power-of-two floor of an fp32 JAX array from its bits, registered as
:func:`adaloss.solver.pow2_floor`'s form for ``jax.numpy`` when ``jax_adaloss`` is imported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from adaloss import solver


def pow2_floor_bits(x: jax.Array) -> jax.Array:
    """:func:`adaloss.solver.pow2_floor` of an fp32 array: its exponent bits with the mantissa
    cleared; 0.5 for 0, ±inf and NaN, as frexp/ldexp give (a subnormal, which XLA flushes,
    gives 0 either way)."""
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
    exponent = bits & jnp.int32(0x7F800000)
    special = ((bits & jnp.int32(0x7FFFFFFF)) == 0) | (exponent == jnp.int32(0x7F800000))
    return jnp.where(special, jnp.float32(0.5), lax.bitcast_convert_type(exponent, jnp.float32))


solver.register_pow2_floor(jnp.__name__, pow2_floor_bits)
