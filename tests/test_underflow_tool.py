"""The underflow measurement tool (JAX and torch): per layer, entries non-zero in an fp32
backward at the same weights whose value times the carried scale is below u_min (``measured``),
that the low-precision backward holds below u_min (``carried``) or at zero (``flushed``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from models import make_case, xent
from torch_models import make_case as torch_case
from torch_models import xent as torch_xent

import jax_adaloss
import torch_bridge


def _jax_loss(cls, dtype, factor=1e-6):
    return lambda p, x, y: factor * xent(cls(dtype=dtype).apply(p, x), y)


def test_jax_scaling_methods_rank_as_expected():
    cls, params, x, y = make_case("mlp", jax.random.key(0))
    low, ref = _jax_loss(cls, jnp.float16), _jax_loss(cls, jnp.float32)
    none = jax_adaloss.measure_underflow(low, ref, params, x, y, loss_scale=1.0)
    static = jax_adaloss.measure_underflow(low, ref, params, x, y, loss_scale=2.0**15)
    ada = jax_adaloss.measure_underflow(low, ref, params, x, y)
    assert set(none) == set(static) == set(ada) == {"params/Dense_1/kernel", "params/Dense_2/kernel"}
    for k in none:
        assert none[k].flushed > 0.5 and none[k].predicted > 0.1  # flushed to zero
        # 2^15 keeps them from zero but leaves most in the subnormal range: below u_min
        assert static[k].flushed < 0.05 and static[k].measured > 0.1 and static[k].carried > 0.1
        assert ada[k].measured < 0.05 and ada[k].flushed <= ada[k].carried < 0.05
        assert 0.0 <= ada[k].reference_zero < 1.0 and ada[k].size > 0


def test_jax_measurement_by_hand():
    # one layer whose incoming cotangent is known: d(loss)/d(a·w) = [1, 2^-26, 2^-20, 0]
    c = jnp.asarray([1.0, 2.0**-26, 2.0**-20, 0.0])

    def loss(w, v, data, dt):
        a = data * v  # an activation (depends on data) that needs a cotangent (v is differentiated)
        return jnp.sum((a.astype(dt) @ w.astype(dt)).astype(jnp.float32) * c)

    args = (jnp.ones((3, 4)), jnp.ones((1, 3)), jnp.ones((1, 3)))
    got = jax_adaloss.measure_underflow(lambda *a: loss(*a, jnp.float16), lambda *a: loss(*a, jnp.float32),
                                        *args, argnums=(0, 1), loss_scale=1.0)
    (name,) = got
    # 2^-26 flushes to zero in fp16 (below 2^-24); 2^-20 is a subnormal (below u_min = 2^-14);
    # the 0 is zero in both
    assert got[name].measured == got[name].carried == pytest.approx(0.5)
    assert got[name].flushed == pytest.approx(0.25)
    assert got[name].reference_zero == pytest.approx(0.25)
    # with the authors' u_min (the smallest subnormal) only the flushed entry counts
    authors = jax_adaloss.measure_underflow(
        lambda *a: loss(*a, jnp.float16), lambda *a: loss(*a, jnp.float32), *args, argnums=(0, 1),
        loss_scale=1.0, config=jax_adaloss.AdaLossConfig(u_min=2.0**-24))
    assert authors[name].measured == authors[name].carried == pytest.approx(0.25)
    # scaled by 2^10: 2^-26 -> 2^-16 (below u_min, a subnormal, not zero), 2^-20 -> 2^-10
    scaled = jax_adaloss.measure_underflow(lambda *a: loss(*a, jnp.float16),
                                           lambda *a: loss(*a, jnp.float32), *args, argnums=(0, 1),
                                           loss_scale=2.0**10)
    assert scaled[name].measured == scaled[name].carried == pytest.approx(0.25)
    assert scaled[name].flushed == 0.0


def test_jax_measured_leaves_out_what_fp16_arithmetic_loses_at_any_scale():
    # tanh-approximated GELU: fp16's tanh rounds to -1 below x ~ -4.3, so its derivative is
    # exactly 0 in fp16 at x = -4.5 (-3.1e-5 in fp32): lost whatever the scale, not an underflow
    # of the scale. Half the pre-activations of the first layer sit there.
    shift = jnp.concatenate([jnp.full((1, 8), -4.5), jnp.linspace(0.5, 2.0, 8)[None]], axis=1)

    def loss(w, v, data, dt):
        x = (data * v).astype(dt)  # an activation that needs a cotangent (v is differentiated)
        z = x @ w["w1"].astype(dt) + shift.astype(dt)
        return 1e-3 * jnp.sum((jax.nn.gelu(z, approximate=True) @ w["w2"].astype(dt)).astype(jnp.float32))

    w = {"w1": jnp.full((16, 16), 1e-3), "w2": jnp.ones((16, 4))}
    args = (w, jnp.ones((1, 16)), jnp.ones((1, 16)))
    low, ref = (lambda *a: loss(*a, jnp.float16)), (lambda *a: loss(*a, jnp.float32))
    for scale in (1.0, 2.0**10):
        got = jax_adaloss.measure_underflow(low, ref, *args, argnums=(0, 1), loss_scale=scale)
        (first,) = [u for k, u in got.items() if "w1" in k]
        assert first.flushed == pytest.approx(0.5)  # the saturated half, at both scales
        assert first.carried == pytest.approx(0.5)
        # their true values, 4e-3 · 3.1e-5 = 1.25e-7, are below u_min = 6.1e-5 unscaled (an
        # underflow of the scale) and above it at 2^10 (none)
        assert first.measured == (0.5 if scale == 1.0 else 0.0)


def _torch_losses(name, factor=1e-6):
    model, x, y = torch_case(name)

    def low():
        with torch.autocast("cpu", dtype=torch.float16):
            return factor * torch_xent(model(x), y)
    return model, low, lambda: factor * torch_xent(model(x), y)


def test_torch_scaling_methods_rank_as_expected_and_grads_are_kept():
    model, low, ref = _torch_losses("residual")
    low().backward()
    before = [p.grad.clone() for p in model.parameters()]
    none = torch_bridge.measure_underflow(model, low, ref, loss_scale=1.0)
    ada = torch_bridge.measure_underflow(model, low, ref)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert set(none) == set(ada) and "out.weight" in none
    assert all(none[k].flushed > 0.3 for k in none)
    assert all(ada[k].measured < 0.05 for k in ada)
    with pytest.raises(ValueError, match="loss_scale"):
        torch_bridge.measure_underflow(model, low, ref, loss_scale=0.0)


def test_torch_measurement_by_hand():
    c = torch.tensor([1.0, 2.0**-26, 2.0**-20, 0.0])
    lin = torch.nn.Linear(3, 4, bias=False)
    torch.nn.init.ones_(lin.weight)
    x = torch.ones(1, 3, requires_grad=True)  # an activation that needs a gradient

    def loss(low):
        with torch.autocast("cpu", dtype=torch.float16, enabled=low):
            return (lin(x).float() * c).sum()
    got = torch_bridge.measure_underflow(lin, lambda: loss(True), lambda: loss(False), loss_scale=1.0)
    assert got["weight"].measured == got["weight"].carried == pytest.approx(0.5)
    assert got["weight"].flushed == pytest.approx(0.25)
    assert got["weight"].reference_zero == pytest.approx(0.25)
    assert np.isclose(got["weight"].size, 4)
