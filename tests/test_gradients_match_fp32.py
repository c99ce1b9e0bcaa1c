"""Adaptive scaling recovers fp32 gradients where plain fp16 loses them.

The loss is multiplied by 1e-6, so plain fp16 backprop flushes most gradient
entries to zero. Tolerance: fp16 has a unit roundoff of 2^-11 ≈ 4.9e-4; the
forward pass of these models rounds each activation ~10 times in fp16, and
the backward as many again, so the fp16-vs-fp32 gradient error (max abs error
over the leaf, relative to the leaf's max abs fp32 gradient) is expected at a
few 1e-3; we allow 3e-2. Plain fp16 misses by ~1 (gradients zero).
"""

import jax
import jax.numpy as jnp
import pytest
from models import make_case, xent

import jax_adaloss

LOSS_FACTOR = 1e-6
TOL = 3e-2


def _loss(cls, dtype):
    def loss(params, x, y):
        logits = cls(dtype=dtype).apply(params, x if x.dtype == jnp.int32 else x.astype(dtype))
        return LOSS_FACTOR * xent(logits, y)
    return loss


def _rel_err(got, ref):
    scale = jnp.max(jnp.abs(ref))
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / scale)


@pytest.mark.parametrize("name", ["mlp", "residual", "cnn", "gpt"])
def test_unscaled_fp16_gradients_match_fp32(name):
    cls, params, x, y = make_case(name, jax.random.key(0))
    ref = jax.jit(jax.grad(_loss(cls, jnp.float32)))(params, x, y)
    plain = jax.jit(jax.grad(_loss(cls, jnp.float16)))(params, x, y)
    scaled = jax.jit(jax_adaloss.grad(_loss(cls, jnp.float16)))(params, x, y)
    unscaled = jax_adaloss.unscale_tree(scaled)

    leaves_ref = jax.tree.leaves(ref)
    errs = [_rel_err(g, r) for g, r in zip(jax.tree.leaves(unscaled), leaves_ref)]
    plain_errs = [_rel_err(g, r) for g, r in zip(jax.tree.leaves(plain), leaves_ref)]
    assert max(errs) < TOL, errs
    # plain fp16 loses most of the gradient: its worst leaf is off by > 50 %
    assert max(plain_errs) > 0.5, plain_errs
    assert jax.tree.structure(unscaled) == jax.tree.structure(ref)


def test_pure_fp16_params_and_compute():
    cls, params, x, y = make_case("mlp", jax.random.key(1))
    params16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    ref = jax.jit(jax.grad(_loss(cls, jnp.float32)))(jax.tree.map(lambda p: p.astype(jnp.float32),
                                                          params16), x, y)
    scaled = jax.jit(jax_adaloss.grad(_loss(cls, jnp.float16)))(params16, x, y)
    for g, r in zip(jax.tree.leaves(scaled, is_leaf=jax_adaloss.is_scaled_grad),
                    jax.tree.leaves(ref)):
        assert g.value.dtype == jnp.float16 and g.scale.dtype == jnp.float32
        assert _rel_err(g.unscale(), r) < TOL
