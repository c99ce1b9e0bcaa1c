"""Which values are weights: closed-over and keyword arrays are data, ``weights=`` names the
weight arguments, and every way of getting it wrong is said out loud."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_adaloss
from adaloss.report import AdaLossCoverageWarning

F16 = jnp.float16
X = jax.random.normal(jax.random.key(0), (16, 8))
Y = jnp.arange(16) % 4


def _params():
    rng = np.random.default_rng(0)
    return {"a": jnp.asarray(rng.normal(0, 0.3, (8, 32)), jnp.float32),
            "b": jnp.asarray(rng.normal(0, 0.2, (32, 4)), jnp.float32)}


def _mlp(p, x):
    h = jnp.tanh(x.astype(F16) @ p["a"].astype(F16))
    return (h @ p["b"].astype(F16)).astype(jnp.float32)


def _loss(p, x, y, factor=1e-6):
    return factor * optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x), y).mean()


def _positional():
    (_, g), rep = jax.jit(jax_adaloss.value_and_grad(_loss, return_report=True))(_params(), X, Y)
    return g, rep


def _assert_same(got, want):
    (g1, r1), (g2, r2) = got, want
    assert set(r1.layers) == set(r2.layers) == {"b", "cast:0"}
    for k in r1.layers:
        assert float(r1.layers[k].scale) == float(r2.layers[k].scale), k
    for k in g2:
        # the weight gradients come from fp16 matmuls, which eager and jitted programs (the
        # CPU's codegen) may round apart: they agree to fp16 rounding
        v = np.asarray(g2[k].value)
        np.testing.assert_allclose(g1[k].value, v, rtol=5e-3, atol=5e-3 * np.abs(v).max())
        assert float(g1[k].scale) == float(g2[k].scale)


def test_a_batch_closed_over_in_a_jitted_step_is_data():
    @jax.jit
    def train_step(params, x, y):
        def loss_fn(p):  # the Flax docs' idiom: the batch is a tracer of the outer jit
            return _loss(p, x, y)
        (_, g), rep = jax_adaloss.value_and_grad(loss_fn, return_report=True)(params)
        return g, rep
    _assert_same(train_step(_params(), X, Y), _positional())


def test_a_concrete_batch_closed_over_eagerly_is_data():
    (_, g), rep = jax_adaloss.value_and_grad(lambda p: _loss(p, X, Y), return_report=True)(_params())
    _assert_same((g, rep), _positional())


def test_keyword_arguments_are_data():
    def loss(p, *, x, y):
        return _loss(p, x, y)
    (_, g), rep = jax_adaloss.value_and_grad(loss, return_report=True)(_params(), x=X, y=Y)
    _assert_same((g, rep), _positional())
    assert rep.coverage == (2, 1, 0)  # two matmuls, one layer (the first one's input is data)


def test_differentiated_inputs_are_data_by_default_and_their_gradient_is_exact():
    (_, (gp, gx)), rep = jax_adaloss.value_and_grad(_loss, argnums=(0, 1), return_report=True)(
        _params(), X, Y)
    assert {"arg0/a", "arg0/b"} <= set(rep.layers)  # the first layer scales too: its input needs a grad
    # reference: the same fp16 function at loss ×1 (×1e-6 afterwards), where nothing underflows
    ref = 1e-6 * jax.grad(lambda p, x, y: _loss(p, x, y, 1.0), argnums=1)(_params(), X, Y)
    plain = jax.grad(_loss, argnums=1)(_params(), X, Y)
    assert not jnp.any(plain)  # plain fp16 at ×1e-6 loses the input gradient entirely
    # 3.6% on this MLP with the default config (its numerics at ×1e-6 are a separate matter)
    assert float(jnp.linalg.norm(gx.unscale() - ref) / jnp.linalg.norm(ref)) < 0.1


def test_weights_names_every_argument_holding_weights():
    def two_groups(p, head, x, y):
        return _loss({"a": p["a"], "b": head}, x, y)
    p = _params()
    args = ({"a": p["a"]}, p["b"], X, Y)
    with pytest.warns(AdaLossCoverageWarning, match="no layer found.*pass weights="):
        default = jax_adaloss.value_and_grad(two_groups, argnums=(0, 1), return_report=True)(*args)[1]
    assert "arg1" not in default.layers  # the head is data by default: its input gets no scale
    both = jax_adaloss.value_and_grad(two_groups, argnums=(0, 1), weights=(0, 1),
                                      return_report=True)(*args)[1]
    assert "arg1" in both.layers and both.coverage.layers == 1
    with pytest.raises(ValueError, match="not differentiated"):
        jax_adaloss.value_and_grad(_loss, argnums=0, weights=1)(_params(), X, Y)
    with pytest.raises(TypeError, match="weights must be"):
        jax_adaloss.value_and_grad(_loss, weights="a")(_params(), X, Y)


def test_a_weight_times_a_data_scalar_is_still_a_weight_but_times_a_data_array_is_data():
    def scaled(p, x, y, g):
        q = {"a": p["a"] * g, "b": p["b"] * g}  # g: a traced scalar (a schedule, say)
        return _loss(q, x, y)
    rep = jax_adaloss.value_and_grad(scaled, return_report=True)(_params(), X, Y, jnp.float32(0.5))[1]
    assert "b" in rep.layers

    mask = np.ones((32, 4), np.float32)

    def masked(p, x, y):  # a closed-over non-scalar array: data (documented)
        return _loss({"a": p["a"], "b": p["b"] * mask}, x, y)
    with pytest.warns(AdaLossCoverageWarning, match="no layer found"):
        rep = jax_adaloss.value_and_grad(masked, return_report=True)(_params(), X, Y)[1]
    assert "b" not in rep.layers


def test_matmuls_inside_a_scan_are_counted_and_reported():
    def body(p, x, y):
        h = jnp.tanh(x.astype(F16) @ p["a"].astype(F16))
        w = jnp.stack([p["b"][:, :1].repeat(32, 1).astype(F16)] * 2)
        h, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), h, w)
        return 1e-6 * optax.softmax_cross_entropy_with_integer_labels(
            (h @ p["b"].astype(F16)).astype(jnp.float32), y).mean()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdaLossCoverageWarning)
        rep = jax_adaloss.value_and_grad(body, return_report=True)(_params(), X, Y)[1]
    # the matmul inside is a layer (one scale per iteration), counted once
    assert rep.coverage.opaque_regions == 0 and rep.coverage.layers == 2 and rep.coverage.weighted_ops == 3
    assert rep.layers["b@scan:0"].scale.shape == (2,)  # "b" is also used outside the loop


def test_a_model_that_scales_as_expected_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax_adaloss.value_and_grad(_loss)(_params(), X, Y)


def test_grad_format_must_match_the_cotangents():
    bf16 = jax_adaloss.AdaLossConfig(grad_format="bfloat16")
    with pytest.raises(ValueError, match="grad_format='bfloat16'.*float16"):
        jax_adaloss.value_and_grad(_loss, config=bf16)(_params(), X, Y)

    def bf16_loss(p, x, y):
        h = jnp.tanh(x.astype(jnp.bfloat16) @ p["a"].astype(jnp.bfloat16))
        return optax.softmax_cross_entropy_with_integer_labels(
            (h @ p["b"].astype(jnp.bfloat16)).astype(jnp.float32), y).mean()
    with pytest.raises(ValueError, match="grad_format='float16'.*bfloat16"):
        jax_adaloss.value_and_grad(bf16_loss)(_params(), X, Y)
    _, g = jax_adaloss.value_and_grad(bf16_loss, config=bf16)(_params(), X, Y)
    assert float(jnp.abs(g["b"].unscale()).max()) > 0
    # fp32 cotangents are governed by nothing narrow: any format is accepted
    jax_adaloss.value_and_grad(lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
        jnp.tanh(x @ p["a"]) @ p["b"], y).mean(), config=bf16)(_params(), X, Y)


def test_a_non_array_leaf_in_the_weights_names_the_equinox_remedy():
    params = {"w": jnp.ones((8, 4)), "act": jax.nn.relu}
    with pytest.raises(TypeError, match="eqx.partition"):
        jax_adaloss.grad(lambda p: jnp.sum(p["act"](X @ p["w"])))(params)
