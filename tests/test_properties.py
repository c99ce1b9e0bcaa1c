"""Property tests over shapes and magnitudes (zeros, subnormals, near 65504, mixed signs)."""

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_adaloss
from adaloss import solver
from jax_adaloss import AdaLossConfig

F16_SPECIAL = [0.0, -0.0, 2.0**-24, -(2.0**-24), 6.1e-5, 65504.0, -65504.0, 60000.0, 1.0]
finite_f16 = st.one_of(st.sampled_from(F16_SPECIAL),
                       st.floats(-65504, 65504, width=16, allow_nan=False))


@st.composite
def layer(draw):
    """(g, W) for y = x·Wᵀ: g is [batch, out], W is [out, in]."""
    b, o, i = (draw(st.integers(1, 6)) for _ in range(3))
    g = draw(hnp.arrays(np.float16, (b, o), elements=finite_f16))
    w = draw(hnp.arrays(np.float16, (o, i), elements=finite_f16))
    return g, w

CONFIGS = st.builds(AdaLossConfig, model=st.sampled_from(["product", "output", "gradient"]),
                    layer_bound=st.sampled_from([None, 16.0, 1024.0]),
                    accum_bound=st.sampled_from([None, 1024.0]))


def _is_pow2_within(s, cfg, incoming=1.0):
    m, e = math.frexp(s)
    return m == 0.5 and 0 < s <= cfg.layer_limit and s * incoming <= cfg.accum_limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gw=layer(), cfg=CONFIGS)
def test_scaled_layer_output_stays_finite_and_scales_are_bounded_powers_of_two(gw, cfg):
    g, w = gw
    gs, ws = solver.tensor_stats(jnp.asarray(g), jnp), solver.tensor_stats(jnp.asarray(w), jnp)
    n = w.shape[0]
    d = solver.layer_scale(cfg, gs, ws, n, jnp.float32(1.0), jnp)
    s = float(d.scale)
    assert _is_pow2_within(s, cfg)
    # the input gradient s·g·Wᵀ, in fp16 with fp32 accumulation, never becomes inf/NaN
    gw = (g.astype(np.float32) * s).astype(np.float16)
    assert np.isfinite(gw).all()
    if cfg.model != "gradient":
        out = (gw.astype(np.float32) @ w.astype(np.float32)).astype(np.float16)
        assert np.isfinite(out).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=hnp.arrays(np.float32, st.integers(1, 20),
                    elements=st.one_of(st.just(0.0), st.floats(-1e4, 1e4, width=32),
                                       st.floats(2.0**-100, 2.0**-20, width=32))),
       incoming=st.sampled_from([1.0, 64.0, 2.0**14]))
def test_cast_scale_never_overflows_fp16(x, incoming):
    cfg = AdaLossConfig()
    d = solver.cast_scale(cfg, solver.log_stats(jnp.asarray(x), jnp), jnp.float32(incoming), jnp)
    s = float(d.scale)
    assert _is_pow2_within(s, cfg, incoming)
    assert np.isfinite((x * s).astype(np.float16)).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scale=st.sampled_from([1e-8, 1e-4, 1.0, 1e3]), seed=st.integers(0, 2**16),
       cfg=CONFIGS, width=st.sampled_from([4, 8, 16]))
def test_backward_gradients_finite_and_scales_pow2(scale, seed, cfg, width):
    rng = np.random.default_rng(seed)
    p = {"a": rng.normal(0, 1, (8, width)), "b": rng.normal(0, 1, (width, width)),
         "c": rng.normal(0, 1, (width, 3))}
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    x = jnp.asarray(rng.normal(0, 1, (5, 8)), jnp.float16)

    def loss(p, x):
        q = jax.tree.map(lambda a: a.astype(jnp.float16), p)
        h = jax.nn.relu(jax.nn.relu(x @ q["a"]) @ q["b"])
        return jnp.mean((h @ q["c"]).astype(jnp.float32) ** 2) * scale

    grads, report = jax_adaloss.grad(loss, config=cfg, return_report=True)(p, x)
    plain = jax.grad(loss)(p, x)
    for g, ref in zip(jax.tree.leaves(grads, is_leaf=jax_adaloss.is_scaled_grad),
                      jax.tree.leaves(plain)):
        if np.isfinite(np.asarray(ref)).all():  # scaling must not create an overflow
            assert np.isfinite(np.asarray(g.value)).all()
        assert math.frexp(float(g.scale))[0] == 0.5
    for layer in report.layers.values():
        assert _is_pow2_within(float(layer.scale), cfg, float(layer.incoming_scale))


def _authors_merge(scales, absmaxes, u_max):
    """method.md step 5 as a loop: largest scale first, then halve the smallest."""
    m = max(a / s for a, s in zip(absmaxes, scales))
    for s in sorted(scales, reverse=True):
        if m * s < u_max:
            return s
    smallest = min(scales)
    for k in (0.5, 0.25, 0.125):
        if m * smallest * k < u_max:
            return smallest * k
    return smallest * 0.125


pow2 = st.integers(-30, 30).map(lambda e: np.float32(2.0**e))
absmax = st.sampled_from([0.0, 2.0**-24, 1.0, 3.0, 6e4, 65504.0, 1e9]) | st.floats(0, 2.0**40, width=32)


@settings(max_examples=200, deadline=None)
@given(branches=st.lists(st.tuples(pow2, absmax), min_size=2, max_size=5))
def test_merge_scale_is_the_authors_scan(branches):
    scales = [np.float32(s) for s, _ in branches]
    absmaxes = [np.float32(a) for _, a in branches]
    got = solver.merge_scale(scales, absmaxes, 65504.0, np)
    assert float(got) == float(_authors_merge(scales, absmaxes, 65504.0))
