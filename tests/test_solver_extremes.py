"""The solver at extreme statistics, on every path it runs on (JAX, torch 0-d tensors, NumPy
scalars for CPU host math): a statistical scale that leaves fp32 saturates and the caps decide;
only "no spread to model" gives 1; nothing warns, nothing is NaN or inf."""

import math
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaloss import solver
from adaloss.config import AdaLossConfig
from torch_bridge import stats
from torch_bridge._xp import np_xp, xp

PATHS = {
    "jax": (jnp, lambda v: jnp.asarray(v, jnp.float32), float),
    "torch": (xp, lambda v: torch.tensor(v, dtype=torch.float32), lambda t: float(t)),
    "numpy": (np_xp, np.float32, float),
}
CFG = AdaLossConfig()
LOOSE = AdaLossConfig(layer_bound=1e30, accum_bound=1e30)
# σ is 0 or a normal fp32 number: XLA on CPU flushes fp32 subnormals (a subnormal σ is 0
# there), and no fp16 tensor has one (σ of a single 2^-24 entry among 10^8 is 6e-12)
sigmas = st.one_of(st.sampled_from([0.0, 2.0**-126, 1e-30, 1e-12, 1.0, 1e30]),
                   st.floats(2.0**-126, 2.0**100, width=32))


def _pow2(x):
    return math.frexp(x)[0] == 0.5


@pytest.mark.parametrize("path", sorted(PATHS))
@settings(max_examples=80, deadline=None)
@given(sigma=sigmas, cfg=st.sampled_from([CFG, LOOSE]))
def test_layer_model_scale_saturates_and_only_no_spread_gives_one(path, sigma, cfg):
    ns, arr, out = PATHS[path]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = out(solver.model_scale(cfg, arr(sigma), ns))
    assert math.isfinite(s) and s >= 1.0
    sigma32 = float(np.float32(sigma))
    if sigma32 == 0.0:
        assert s == 1.0
        return
    wanted = cfg.underflow_limit / (sigma32 * cfg.z_two_sided)
    saturated = float(solver.saturating_quotient(cfg.underflow_limit, np.float32(0.0), np_xp))
    assert saturated > 2.0**100
    assert s >= min(wanted, saturated) * (1 - 1e-5)  # never 1 for lack of range


log_stats = st.builds(
    solver.LogStats,
    mean=st.floats(-100.0, 20.0, width=32), std=st.floats(0.0, 60.0, width=32),
    count=st.sampled_from([0.0, 1.0, 1e6]),
    absmax=st.sampled_from([1e-40, 1e-8, 1.0, 1e30]))


@pytest.mark.parametrize("path", sorted(PATHS))
@settings(max_examples=80, deadline=None)
@given(ls=log_stats, cfg=st.sampled_from([CFG, LOOSE]), incoming=st.sampled_from([1.0, 2.0**10]))
def test_cast_scale_saturates_and_the_caps_decide(path, ls, cfg, incoming):
    ns, arr, out = PATHS[path]
    stats = solver.LogStats(*(arr(v) for v in ls))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = solver.cast_scale(cfg, stats, arr(incoming), ns)
        pred = solver.predicted_underflow_lognormal(cfg, stats, d.scale, _erf(path), ns)
    s, model = out(d.scale), out(d.model_scale)
    assert math.isfinite(s) and s > 0 and _pow2(s) and math.isfinite(out(pred))
    bound = min(cfg.overflow_limit / float(np.float32(ls.absmax)), cfg.layer_limit,
                cfg.accum_limit / incoming)
    assert s <= bound * (1 + 1e-6)
    if ls.count == 0:
        assert model == 1.0
        return
    log_wanted = math.log(cfg.underflow_limit) - float(np.float32(ls.mean)) \
        - float(np.float32(ls.std)) * cfg.z_lower
    if log_wanted > math.log(bound) + 1e-3:  # the statistics ask for more than the caps allow
        assert s == 2.0 ** math.floor(math.log2(bound * (1 + 1e-7)))


def _erf(path):
    return {"jax": __import__("jax").scipy.special.erf, "torch": torch.special.erf,
            "numpy": lambda x: np.float32(math.erf(float(x)))}[path]


def test_a_confident_softmax_cast_gets_the_cap_not_one():
    # probabilities down to 1e-28: σ_ln of |g| ≈ 20 (issue: exp(log_s) overflowed and gave 1)
    ls = solver.LogStats(jnp.float32(-50.0), jnp.float32(20.0), jnp.float32(1e4), jnp.float32(1e-6))
    d = solver.cast_scale(CFG, ls, jnp.float32(1.0), jnp)
    assert float(d.model_scale) == pytest.approx(solver.F32_MAX, rel=1e-6)
    # the overflow cap decides, as it should: u_max / max|g| = 6.55e10 -> 2^35
    assert float(d.scale) == 2.0**35


TENSORS = {
    "all zero": np.zeros((4, 8), np.float16),
    "one non-zero": np.eye(1, 32, 5, dtype=np.float16).reshape(4, 8) * np.float16(2.0**-24),
    "subnormal only": (2.0**-20 * np.sign(np.arange(32) - 15.5)).astype(np.float16).reshape(4, 8),
    "all equal": np.full((4, 8), 0.25, np.float16),
    "huge": np.full((4, 8), 60000.0, np.float16),
}


def _stats(path, g):
    if path == "torch":
        t = torch.from_numpy(g)
        return stats.tensor_stats(t), stats.log_stats(t)
    ns = jnp if path == "jax" else np_xp
    a = jnp.asarray(g) if path == "jax" else g
    return solver.tensor_stats(a, ns), solver.log_stats(a, ns)


@pytest.mark.parametrize("path", ["jax", "torch"])
@pytest.mark.parametrize("name", sorted(TENSORS))
def test_extreme_tensors_decide_finite_scales_without_warnings(path, name):
    ns = PATHS[path][0]
    g = TENSORS[name]
    w = np.full((8, 8), 0.5, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gs, _ = _stats(path, g)
        ws, _ = _stats(path, w)
        _, ls = _stats(path, g.astype(np.float32) / 4)  # the fp32 cotangent before a cast to fp16
        one = PATHS[path][1](1.0)
        for model in ("product", "output", "gradient"):
            cfg = AdaLossConfig(model=model)
            d = solver.layer_scale(cfg, gs, ws, 8, one, ns)
            assert math.isfinite(float(d.scale)) and float(d.scale) > 0
        c = solver.cast_scale(CFG, ls, one, ns)
    assert math.isfinite(float(c.scale)) and float(c.scale) > 0
    if name == "all zero":
        assert float(c.scale) == 1.0 and float(d.model_scale) == 1.0
    if name == "one non-zero":  # 2^-26 is subnormal in fp16: lifted to u_min = 2^-14
        assert float(c.model_scale) == pytest.approx(4096.0, rel=1e-5)
