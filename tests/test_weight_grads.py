"""Weight gradients in fp32 (JAX): they never pass through fp16, so they cannot overflow it.

An LM head over a summed batch, under the scale its loss cast picks (2^15), has a scaled
weight gradient far above fp16's 65504 while every activation cotangent fits; computed in
fp16 (``jax.grad`` of the scaled fp16 forward, as a global loss scale does) it is inf.
With fp32 master weights adaloss produces it in fp32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jax_adaloss
from jax_adaloss.weight_grads import dot_operand_grad

DOTS = [  # (lhs shape, rhs shape, dimension numbers)
    ((3, 4), (4, 5), (((1,), (0,)), ((), ()))),  # x @ W
    ((2, 3, 4), (5, 4), (((2,), (1,)), ((), ()))),  # x @ W.T, a leading batch of tokens
    ((2, 6, 3, 4), (2, 4, 7, 6), (((1, 3), (3, 1)), ((0,), (0,)))),  # two contractions, a batch
    ((8, 16), (2, 4, 16), (((1,), (2,)), ((), ()))),  # an einsum-style projection to heads
]


@pytest.mark.parametrize("w", [0, 1])
@pytest.mark.parametrize("lhs, rhs, dims", DOTS)
def test_dot_operand_grad_is_the_transpose_in_fp32(lhs, rhs, dims, w):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=lhs), jnp.float16)
    b = jnp.asarray(rng.normal(size=rhs), jnp.float16)
    out, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), a.astype(jnp.float32),
                       b.astype(jnp.float32))
    g = jnp.asarray(rng.normal(size=out.shape), jnp.float16)
    got = dot_operand_grad(g, b if w == 0 else a, a if w == 0 else b, dims, w)
    assert got.dtype == jnp.float32
    # the same products summed in fp32; an rhs weight's dot takes its operands in the other
    # order (act first: XLA:CPU's fast matmul), so the sums may round differently
    np.testing.assert_allclose(np.asarray(got), np.asarray(vjp(g.astype(jnp.float32))[w]),
                               rtol=1e-6, atol=1e-6)


def _lm(batch=256):
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(0, 1, s), jnp.float32)
              for k, s in (("emb", (64, 32)), ("W", (32, 32)), ("head", (32, 64)))}
    tok, y = jnp.asarray(rng.integers(0, 64, (batch,))), jnp.asarray(rng.integers(0, 64, (batch,)))

    def loss(p, dtype):
        q = jax.tree.map(lambda a: a.astype(dtype), p)
        h = jnp.tanh(q["emb"][tok] @ q["W"])
        return optax.softmax_cross_entropy_with_integer_labels((h @ q["head"]).astype(jnp.float32),
                                                               y).sum()
    return params, loss


def test_a_weight_gradient_beyond_fp16_is_finite_and_accurate():
    params, loss = _lm()
    # a global scale of 2^15 (what the cast picks here) overflows the fp16 weight gradient
    fp16 = jax.grad(lambda p: 2.0**15 * loss(p, jnp.float16))(params)
    assert not bool(jnp.all(jnp.isfinite(fp16["head"]))), "the fp16 weight gradient must overflow"
    ref = jax.grad(loss)(params, jnp.float32)
    grads = jax.jit(jax_adaloss.grad(loss), static_argnums=1)(params, jnp.float16)
    for k, g in grads.items():
        assert g.value.dtype == jnp.float32
        got = g.unscale()
        assert bool(jnp.all(jnp.isfinite(got))), k
        err = float(jnp.linalg.norm(got - ref[k]) / jnp.linalg.norm(ref[k]))
        assert err < 0.02, (k, err)  # the fp16 forward's own error against fp32
    assert float(jnp.max(jnp.abs(grads["head"].value))) > 65504  # it really is beyond fp16


def test_fp32_backward_reference_keeps_every_cotangent_in_fp32():
    from jax_adaloss.api import _value_and_grad
    params, loss = _lm(batch=16)
    vg = _value_and_grad(lambda p: loss(p, jnp.float16), reference="fp32")
    _, grads = vg(params)
    # fp16 forward, fp32 backward: closer to fp32 than the fp16 backward is
    ref = jax.grad(loss)(params, jnp.float32)
    plain = jax.grad(loss)(params, jnp.float16)
    for k in params:
        exact = float(jnp.linalg.norm(grads[k].unscale() - ref[k]))
        rounded = float(jnp.linalg.norm(plain[k].astype(jnp.float32) - ref[k]))
        assert exact <= rounded, k
    with pytest.raises(ValueError, match="reference must be None"):
        _value_and_grad(lambda p: loss(p, jnp.float16), reference="fp16")


@pytest.mark.parametrize("name, grad_format", [("mlp", "float16"), ("gpt", "float16"),
                                               ("gpt", "float8_e5m2")])
def test_input_cotangent_scaled_after_its_dot_is_the_rescaled_cotangents(name, grad_format):
    """A layer sends ``s·vjp_x(g)`` (the dot in fp32, then ``s``, one rounding) instead of
    ``vjp_x(s·g)``: with power-of-two scales the same scales and gradients, bitwise."""
    from unittest import mock

    from models import make_case, xent

    from jax_adaloss import layers
    from jax_adaloss.scaled_grad import rescale

    cls, params, x, y = make_case(name, jax.random.key(0))
    dtype = jnp.bfloat16 if grad_format.startswith("float8") else jnp.float16
    model = cls(dtype=dtype)
    cfg = jax_adaloss.AdaLossConfig(grad_format=grad_format)

    def loss(p):
        return xent(model.apply(p, x).astype(jnp.float32), y) * 1e-3

    def run():
        vg = jax.jit(jax_adaloss.value_and_grad(loss, config=cfg, return_report=True))
        return vg(params, adaloss_state=None)

    (_, grads), rep = run()
    with mock.patch.object(layers, "input_grad",
                           lambda sw, node, g, s, q=None: node.vjp([rescale(g, s)])[node.act]):
        (_, old), old_rep = run()
    assert set(rep.layers) == set(old_rep.layers)
    for n in rep.layers:
        assert float(rep.layers[n].scale) == float(old_rep.layers[n].scale), n
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(old)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
