"""Adaptive scaling recovers fp32 gradients where plain fp16 loses them.

The loss is multiplied by 1e-6, so plain fp16 backprop flushes most gradient
entries to zero. Tolerance: fp16 has a unit roundoff of 2^-11 ≈ 4.9e-4; the
forward pass of these models rounds each activation ~10 times in fp16, and
the backward as many again, so the fp16-vs-fp32 gradient error (max abs error
over the leaf, relative to the leaf's max abs fp32 gradient) is expected at a
few 1e-3; we allow 3e-2. Plain fp16 misses by ~1 (gradients zero).
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
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


class _PeakedAttention(nn.Module):
    """Causal self-attention in fp16, its queries' kernel multiplied by ``temperature`` (peaked
    softmax rows: most probabilities far below fp16's normal range), and a head."""

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(x[..., 0])
        h = nn.MultiHeadDotProductAttention(num_heads=2, dtype=jnp.float16, deterministic=True)(x, mask=mask)
        return nn.Dense(16, dtype=jnp.float16)(h)


def test_peaked_fp16_attention_keeps_its_query_and_key_gradients_with_no_decision_at_the_softmax_sum():
    """``jax.nn.softmax`` sums its fp16 exponentials in fp32 and narrows the sum back: the
    backward's cast there narrows widened fp16 values exactly and makes no decision, so the
    attention scores' cotangent keeps the scale the out-projection's decision gave it. Where
    plain fp16 loses a fifth of the query and key gradients inside the softmax backward (loss
    × 1e-4, peaked rows), adaloss's stay within 1% of the 16-bit forward's exact gradient."""
    from jax_adaloss.api import _value_and_grad
    model = _PeakedAttention()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (4, 32, 32)), jnp.float16)
    y = jnp.asarray(rng.integers(0, 16, (4, 32)))
    params = model.init(jax.random.key(0), x)
    attn = params["params"]["MultiHeadDotProductAttention_0"]
    attn["query"]["kernel"] = attn["query"]["kernel"] * 30.0

    def loss(p, x, y):
        logits = model.apply(p, x).astype(jnp.float32)
        return 1e-4 * xent(logits, y)
    exact = jax_adaloss.unscale_tree(jax.jit(_value_and_grad(loss, reference="fp32"))(params, x, y)[1])
    scaled, report = jax.jit(jax_adaloss.grad(loss, return_report=True))(params, x, y)
    plain = jax.jit(jax.grad(loss))(params, x, y)

    def err(tree, name):
        got = tree["params"]["MultiHeadDotProductAttention_0"][name]["kernel"]
        ref = exact["params"]["MultiHeadDotProductAttention_0"][name]["kernel"]
        return float(jnp.linalg.norm((got.astype(jnp.float32) - ref).ravel()) / jnp.linalg.norm(ref.ravel()))
    for name in ("query", "key"):
        assert err(plain, name) > 0.2 and err(jax_adaloss.unscale_tree(scaled), name) < 0.01, name
    # one cast decides: the logits' (the loss's fp32 math); the softmax sum's narrows exactly
    assert [k for k in report.layers if k.startswith("cast:")] == ["cast:1"], list(report.layers)
    # and the report says what it casts: the logits, widened on the loss function's line
    assert re.fullmatch(r"float16 → float32 \(4, 32, 16\) at .*test_gradients_match_fp32\.py:\d+:\d+ "
                        r"\(.*loss\)", report.casts.as_dict()["cast:1"]), report.casts


def test_a_take_along_axis_cotangent_is_jax_grads_with_indices_out_of_range_dropped():
    """The cotangent of ``jnp.take_along_axis`` with one index per row (a cross-entropy's label
    logit) is computed as a dense select, not a scatter-add: the same gradient as
    ``jax.grad``'s, a negative index taken from the end, one out of range dropped."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, 1, (16, 7)), jnp.float32)
    x = jnp.asarray(rng.normal(0, 1, (2, 5, 16)), jnp.float32)
    r = jnp.asarray(rng.normal(0, 1, (2, 5)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 7, (2, 5)), jnp.int32).at[0, 0].set(7).at[1, 2].set(-9).at[1, 3].set(-1)

    def loss(w, x):
        logits = x @ w
        picked = jnp.take_along_axis(logits, idx[..., None], axis=-1, fill_value=0.0)[..., 0]
        return jnp.sum(picked * r) + 1e-2 * jnp.sum(jnp.exp(logits))
    got = jax_adaloss.unscale_tree(jax.jit(jax_adaloss.grad(loss))(w, x))
    ref = jax.jit(jax.grad(loss))(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
