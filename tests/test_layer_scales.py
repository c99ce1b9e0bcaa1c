"""Per-layer scales of a 2-layer network, computed by hand (numpy) for each model.

Network: tokens -> embedding E (gather) -> Dense W1 -> relu -> Dense W2 -> y;
loss = sum(y * r) in fp16, so the cotangent reaching W2 is exactly r (scale 1).
"""

import math
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_adaloss
from jax_adaloss import AdaLossConfig

U_MAX = 65504.0
Z = NormalDist().inv_cdf(0.5 + 1e-3 / 2)  # sqrt(2)·erfinv(T)


def expected_scale(model, g, w, n, incoming, cfg):
    """The decision by hand, with ``cfg``'s resolved u_min and bounds."""
    g = g.astype(np.float64)
    w = w.astype(np.float64)
    if model == "gradient":
        sigma = g.std()
        m, limit = np.abs(g).max(), U_MAX
    else:
        sigma = math.sqrt((g**2).mean() * (w**2).mean())
        if model == "output":
            sigma *= math.sqrt(0.5 * n)
        m = max(abs(a * b) for a in (g.min(), g.max()) for b in (w.min(), w.max()))
        limit = U_MAX / n
    s = max(cfg.underflow_limit / (sigma * Z), 1.0)
    # s·g itself must fit too (and, product/output, the layer's output)
    s = min(s, U_MAX / np.abs(g).max(), limit / m, cfg.accum_limit / incoming, cfg.layer_limit)
    return 2.0 ** math.floor(math.log2(s))


def setup():
    rng = np.random.default_rng(0)
    params = {"E": rng.normal(0, 1, (11, 16)).astype(np.float16),
              "W1": rng.normal(0, 0.3, (16, 32)).astype(np.float16),
              "W2": rng.normal(0, 0.2, (32, 8)).astype(np.float16)}
    tokens = rng.integers(0, 11, (6,))
    r = (rng.normal(0, 1e-6, (6, 8))).astype(np.float16)
    return params, tokens, r


def loss(p, tokens, r):
    h0 = p["E"][tokens]
    h1 = jax.nn.relu(h0 @ p["W1"])
    return jnp.sum(h1 @ p["W2"] * r)


@pytest.mark.parametrize("model", ["product", "output", "gradient"])
@pytest.mark.parametrize("bounds", [{}, {"layer_bound": 16.0, "accum_bound": 1024.0},
                                    {"u_min": 2.0**-24, "layer_bound": U_MAX, "accum_bound": U_MAX}])
def test_two_layer_scales_by_hand(model, bounds):
    params, tokens, r = setup()
    cfg = AdaLossConfig(model=model, **bounds)
    grads, report = jax.jit(jax_adaloss.grad(loss, config=cfg, return_report=True))(
        params, tokens, r)
    s2 = expected_scale(model, r, params["W2"], 8, 1.0, cfg)
    h1 = np.maximum(params["E"][tokens].astype(np.float32) @ params["W1"].astype(np.float32), 0)
    h1 = h1.astype(np.float16)
    g1 = ((r.astype(np.float32) * s2).astype(np.float16).astype(np.float32)
          @ params["W2"].astype(np.float32).T).astype(np.float16) * (h1 > 0)
    s1 = expected_scale(model, g1, params["W1"], 32, s2, cfg)

    # jnp.sum accumulates fp16 in fp32: its cast narrows the widened fp16 cotangent back,
    # exactly, with no decision
    assert set(report.layers) == {"W1", "W2"}
    assert float(report.layers["W2"].scale) == s2
    assert float(report.layers["W1"].scale) == s1
    assert float(report.layers["W1"].incoming_scale) == s2
    assert float(report.layers["W1"].outgoing_scale) == s1 * s2
    assert int(report.layers["W1"].fan_in) == 32
    # each gradient carries the scale of the cotangent it was computed from, times the power of
    # two of the cast decision that narrows it (computed in fp32) into its fp16 leaf: W2's,
    # ~1e-6 at scale 1, would lose bits in fp16 and is raised
    for name, carried in (("W2", 1.0), ("W1", s2), ("E", s1 * s2)):
        extra = float(grads[name].scale) / carried
        assert extra == 2.0 ** round(math.log2(extra)), (name, extra)
    assert float(grads["W2"].scale) > 1.0
    fp32 = jax.grad(lambda p: loss({k: v.astype(jnp.float32) for k, v in p.items()}, tokens,
                                   r.astype(np.float32)))(params)
    for name in params:
        ours, ref = np.asarray(grads[name].unscale()), np.asarray(fp32[name])
        assert np.abs(ours - ref).max() <= 5e-2 * np.abs(ref).max(), name  # (the fp16 forward)
    # at least one scale is non-trivial, so the test means something
    assert max(s1, s2) > 1.0


def test_grouped_matmul_experts_are_a_layer():
    """``jax.lax.ragged_dot`` (MoE experts as one grouped matmul over 3-D weights) is a layer:
    its expert weights get a decision, and the gradients are fp32's."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"up": jax.random.normal(k1, (16, 16)) * 0.25,
              "experts": jax.random.normal(k2, (4, 16, 32)) * 0.25,
              "down": jax.random.normal(k3, (32, 4)) * 0.2}
    x = jax.random.normal(k4, (64, 16))
    groups = jnp.array([10, 20, 30, 4], jnp.int32)

    def loss(p, x, dtype):
        h = jax.nn.relu(x.astype(dtype) @ p["up"].astype(dtype))
        h = jax.nn.relu(jax.lax.ragged_dot(h, p["experts"].astype(dtype), groups))
        return 1e-6 * jnp.mean(jnp.square((h @ p["down"].astype(dtype)).astype(jnp.float32)))

    ref = jax.jit(jax.grad(loss), static_argnums=2)(params, x, jnp.float32)
    vg = jax_adaloss.value_and_grad(loss, return_report=True)
    (_, grads), rep = jax.jit(lambda p, x: vg(p, x, jnp.float16, adaloss_state=None))(params, x)
    # the first matmul reads the batch (no gradient to send): the other two are layers
    assert "experts" in rep.layers and rep.coverage.layers == 2 and rep.coverage.weighted_ops == 3
    assert rep.layers["experts"].fan_in == 32
    for name, g in jax_adaloss.unscale_tree(grads).items():
        err = float(jnp.linalg.norm(g - ref[name]) / jnp.linalg.norm(ref[name]))
        assert err < 5e-3, (name, err)
