"""The solver's formulas against hand-computed values, under the method's own limits
(``METHOD``: fp16's smallest subnormal u_min = 2^-24, u_max = 65504 as both bounds); the
defaults (u_min = 2^-14, no layer or accumulated bound) are pinned separately.

Constants used below: sqrt(2)·erfinv(1e-3) = 1.25331e-3, so for σ the scale
before bounds is 2^-24 / (σ · 1.25331e-3) = 4.75579e-5 / σ.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import erf

import jax_adaloss  # noqa: F401  (registers solver.pow2_floor's JAX form)
from adaloss import solver
from adaloss.config import UNBOUNDED, AdaLossConfig

F = jnp.float32


def stats(mean, var, lo, hi):
    return solver.TensorStats(F(mean), F(var + mean * mean), F(lo), F(hi))


G = stats(0.0, 1e-12, -1e-5, 1e-5)  # σ_g = 1e-6
W = stats(0.0, 1e-2, -0.3, 0.3)  # σ_W = 0.1
ONE = F(1.0)
METHOD = dict(u_min=2.0**-24, layer_bound=65504.0, accum_bound=65504.0)


def cfg_(**overrides):
    """A config with the method's limits (``METHOD``), then ``overrides``."""
    return AdaLossConfig(**{**METHOD, **overrides})


def scale(cfg, g=G, w=W, n=64, incoming=ONE):
    return float(solver.layer_scale(cfg, g, w, n, incoming, jnp).scale)


def test_erfinv_constants():
    cfg = cfg_()
    assert cfg.z_two_sided == pytest.approx(1.25331e-3, rel=1e-5)
    assert cfg.z_lower == pytest.approx(-3.090232, rel=1e-6)
    assert cfg.underflow_limit == 2.0**-24 and cfg.overflow_limit == 65504.0


def test_default_limits_are_the_normal_range_with_no_bounds():
    cfg = AdaLossConfig()
    assert cfg.underflow_limit == 2.0**-14 and cfg.overflow_limit == 65504.0
    assert cfg.layer_limit == cfg.accum_limit == UNBOUNDED == 2.0**64
    # the same σ needs 2^10 more scale to stay normal than to stay non-zero
    assert scale(AdaLossConfig()) == 1024 * scale(cfg_())


@pytest.mark.parametrize("model, sigma, expected", [
    ("product", 1e-7, 256.0),            # 475.58 -> 256
    ("output", 1e-7 * math.sqrt(32), 64.0),  # 475.58 / 5.657 = 84.07 -> 64
    ("gradient", 1e-6, 32.0),            # 47.558 -> 32
])
def test_each_model_scale(model, sigma, expected):
    cfg = cfg_(model=model)
    assert float(solver.model_sigma(cfg, G, W, 64, jnp)) == pytest.approx(sigma, rel=1e-5)
    assert scale(cfg) == expected


def test_without_power_of_two_the_raw_scale_is_kept():
    assert scale(cfg_(power_of_two=False)) == pytest.approx(475.579, rel=1e-4)


def test_scale_is_at_least_one_before_the_caps():
    big = stats(0.0, 1.0, -1e-3, 1e-3)  # σ_g = 1: raw 4.7e-4 -> 1
    assert scale(cfg_(), g=big) == 1.0


def test_overflow_cap_divides_u_max_by_fan_in_for_product():
    # m = max|g·W| = 0.5 · 2 = 1; cap = 65504 / 4096 / 1 = 15.99 -> 8
    g = stats(0.0, 1e-12, -0.5, 0.5)
    w = stats(0.0, 1e-2, -2.0, 1.0)
    assert scale(cfg_(), g=g, w=w, n=4096) == 8.0


def test_overflow_cap_for_gradient_model_uses_max_abs_g():
    # cap = 65504 / 2^18 = 0.2499 -> 0.125: a scale below one
    g = stats(0.0, 1e-12, -(2.0**18), 1.0)
    assert scale(cfg_(model="gradient"), g=g) == 0.125


def test_accumulated_bound():
    # 65504 / 1024 = 63.97 -> 32 ; authors' accum bound 1024 / 1024 = 1
    assert scale(cfg_(), incoming=F(1024.0)) == 32.0
    assert scale(cfg_(layer_bound=1e6, accum_bound=1024.0), incoming=F(1024.0)) == 1.0


def test_layer_bound():
    assert scale(cfg_(layer_bound=16.0)) == 16.0
    assert scale(AdaLossConfig.authors_preset(model="product")) == 16.0


def test_authors_u_min_changes_the_power_of_two():
    # raw scale u_min/(σ·z) with σ chosen so that 2^-24 gives just below 2 and 6e-8 just above
    sigma = 2.0**-24 / (1.25331e-3 * 1.999)
    g = stats(0.0, sigma**2, -1e-6, 1e-6)
    assert scale(cfg_(model="gradient"), g=g) == 1.0
    assert scale(cfg_(model="gradient", u_min=6.0e-8), g=g) == 2.0


@pytest.mark.parametrize("model", ["product", "output", "gradient"])
def test_all_zero_statistics_give_scale_one(model):
    z = stats(0.0, 0.0, 0.0, 0.0)
    d = solver.layer_scale(cfg_(model=model), z, z, 64, ONE, jnp)
    assert float(d.scale) == 1.0 and np.isfinite(float(d.model_scale))


def test_constant_tensor_gives_scale_one():
    const = stats(1e-3, 0.0, 1e-3, 1e-3)  # gradient model: σ = 0
    assert scale(cfg_(model="gradient"), g=const) == 1.0
    w_const = stats(0.5, 0.0, 0.5, 0.5)
    assert scale(cfg_(), g=stats(1.0, 0.0, 1.0, 1.0), w=w_const) == 1.0


def test_tensor_stats_match_numpy():
    x = np.array([[0.0, 1.0, -2.0], [3.0, 0.0, 0.5]], np.float16)
    s = solver.tensor_stats(jnp.asarray(x), jnp)
    ref = x.astype(np.float64)
    np.testing.assert_allclose([s.mean, s.sq_mean, solver.variance(s, jnp), s.min, s.max],
                               [ref.mean(), (ref**2).mean(), ref.var(), ref.min(), ref.max()], rtol=1e-6)
    assert s.mean.dtype == jnp.float32


def test_log_normal_cast_scale():
    cfg = cfg_()
    x = jnp.full((100,), 1e-9, jnp.float32).at[::2].set(0.0)
    ls = solver.log_stats(x, jnp)
    assert float(ls.count) == 50 and float(ls.std) == pytest.approx(0.0, abs=1e-6)
    # exp(ln 2^-24 - ln 1e-9) = 59.6 -> 32
    assert float(solver.cast_scale(cfg, ls, ONE, jnp).scale) == 32.0
    # σ_ln = 1: 59.6 · exp(3.0902) = 1310 -> 1024
    ls1 = solver.LogStats(F(math.log(1e-9)), F(1.0), F(10.0), F(1e-9))
    assert float(solver.cast_scale(cfg, ls1, ONE, jnp).scale) == 1024.0


def test_log_normal_on_all_zero_gives_one_not_nan():
    ls = solver.log_stats(jnp.zeros((7,)), jnp)
    d = solver.cast_scale(cfg_(), ls, ONE, jnp)
    assert float(d.scale) == 1.0
    assert float(solver.predicted_underflow_lognormal(cfg_(), ls, d.scale, erf, jnp)) == 0


@pytest.mark.parametrize("second_absmax, expected", [
    (64.0 * 1000, 64.0),   # M = 1000: 64 · 1000 < 65504
    (64.0 * 2000, 4.0),    # 64 · 2000 too big, 4 · 2000 fits
    (64.0 * 1e5, 0.5),     # 64, 4, 2, 1 too big; 0.5 · 1e5 fits
    (64.0 * 1e6, 0.5),     # nothing fits down to 4/8: 1/8 of the smallest
])
def test_merge_rule(second_absmax, expected):
    s = solver.merge_scale([F(4.0), F(64.0)], [F(4.0), F(second_absmax)], 65504.0, jnp)
    assert float(s) == expected


def test_pow2_floor_is_exact():
    x = jnp.asarray([1.0, 1.5, 2.0, 3.999, 2.0**-30, 2.0**100, 6e-8], jnp.float32)
    out = np.asarray(solver.pow2_floor(x, jnp))
    np.testing.assert_array_equal(out, [1.0, 1.0, 2.0, 2.0, 2.0**-30, 2.0**100, 2.0**-24])


def test_pow2_floor_from_bits_equals_frexp_ldexp_on_every_kind_of_float():
    # JAX takes the exponent bits; the definition (and torch) is frexp/ldexp: same numbers for
    # normals of either sign, 0, ±inf, NaN and (flushed by XLA) subnormals
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-40, 2.0**-126, 3.4e38, -3.0]
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = jnp.asarray(np.concatenate([np.asarray(special, np.float32), bits]))
    got = jax.jit(lambda v: solver.pow2_floor(v, jnp))(x)
    want = jax.jit(lambda v: jnp.ldexp(jnp.ones_like(v), jnp.frexp(v)[1] - 1))(x)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    # the solver takes the bits form, which jax_adaloss registers for jax.numpy
    text = jax.jit(lambda v: solver.pow2_floor(v, jnp)).lower(x).as_text()
    assert "bitcast_convert" in text and "frexp" not in text


def test_predicted_underflow_matches_threshold_at_the_raw_scale():
    cfg = cfg_(power_of_two=False)
    sigma = F(1e-6)
    s = solver.model_scale(cfg, sigma, jnp)
    assert float(solver.predicted_underflow(cfg, sigma, s, erf, jnp)) == pytest.approx(1e-3, rel=1e-3)


def test_weight_grad_cap_bounds_a_16_bit_weight_and_bias_gradient():
    # Cauchy-Schwarz: u_max / (max‖g_:j‖ · max(max‖x_:i‖, √rows))
    cfg = AdaLossConfig()
    cap = solver.weight_grad_cap(cfg, F(2.0), F(3.0), 4, jnp)
    assert float(cap) == pytest.approx(65504 / 6)
    assert float(solver.weight_grad_cap(cfg, F(2.0), F(1.0), 16, jnp)) == pytest.approx(65504 / 8)
    assert float(solver.weight_grad_cap(cfg, F(2.0), F(3.0), 4, jnp, backoff=F(0.5))) == \
        pytest.approx(65504 / 12)
    # the bound holds on real data: dW = xᵀ(s·g) and the bias column sums stay below u_max
    rng = np.random.default_rng(0)
    g, x = rng.normal(0, 3, (64, 5)), rng.normal(0, 2, (64, 7))
    s = float(solver.weight_grad_cap(cfg, F(np.linalg.norm(g, axis=0).max()),
                                     F(np.linalg.norm(x, axis=0).max()), 64, jnp))
    assert np.abs(x.T @ (s * g)).max() <= 65504 and np.abs((s * g).sum(0)).max() <= 65504
    d = solver.layer_scale(cfg, G, W, 64, ONE, jnp, extra_cap=F(3.0))
    assert float(d.scale) == 2.0


@pytest.mark.parametrize("u_min", [None, 3e-5])  # 3e-5: no bf16 or fp8 number: compared in fp32
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_quantized_fractions_count_what_the_cast_did(u_min, framework):
    """Flushed, held below the smallest normal and saturated, against a count by hand, with
    non-finite and zero entries, in either framework's dtypes (fp8 in JAX, bf16 in torch)."""
    cfg = AdaLossConfig(grad_format="float8_e5m2", u_min=u_min)
    g = np.concatenate([np.logspace(-9, 6, 200), -np.logspace(-8, 5, 100), [0.0, 0.0, np.inf, np.nan]])
    g = np.asarray(jnp.asarray(g, jnp.bfloat16).astype(jnp.float32))
    q = np.clip(g, -cfg.overflow_limit, cfg.overflow_limit).astype(jnp.float8_e5m2).astype(np.float32)
    nz = (g != 0).sum()
    want = [((g != 0) & (q == 0)).sum() / nz, ((q != 0) & (np.abs(q) < cfg.underflow_limit)).sum() / nz,
            (np.abs(g) > cfg.overflow_limit).sum() / nz]
    if framework == "jax":
        got = solver.quantized_fractions(jnp.asarray(g, jnp.bfloat16), jnp.asarray(q, jnp.float8_e5m2),
                                         cfg, jnp)
    else:
        torch = pytest.importorskip("torch")
        from torch_bridge._xp import xp
        got = solver.quantized_fractions(torch.tensor(g).bfloat16(), torch.tensor(q).bfloat16(), cfg, xp)
    assert all(0 < w < 1 for w in want)
    np.testing.assert_allclose([float(x) for x in got], want, rtol=1e-6)
