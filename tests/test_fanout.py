"""Values consumed by several layers: residual stream, q/k/v, tied weights.

Each branch's contribution arrives with its own scale; they are merged by the
authors' rule before summing. The gradients must still match fp32 (tolerance
as in test_gradients_match_fp32) and the branches must really carry different
scales, or the test would not exercise the merge.
"""

import jax
import jax.numpy as jnp
import numpy as np
from models import xent
from test_gradients_match_fp32 import TOL, _rel_err

import jax_adaloss

F16, F32 = jnp.float16, jnp.float32


def _params(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(0, 1 / np.sqrt(s[0]), s), F32) for k, s in shapes.items()}


# The default: the loss cast lifts the cotangents into fp16's normal range, the layers
# still pick scales of their own (the tests assert the branches carry different ones).
CONFIG = jax_adaloss.AdaLossConfig()


def _check(loss, params, *data):
    ref = jax.jit(jax.grad(loss), static_argnums=len(data) + 1)(params, *data, F32)
    grads, report = jax.jit(jax_adaloss.grad(loss, config=CONFIG, return_report=True),
                            static_argnums=len(data) + 1)(params, *data, F16)
    for k in params:
        assert _rel_err(grads[k].unscale(), ref[k]) < TOL, k
    return grads, report


def residual(p, x, y, dt):
    q = {k: v.astype(dt) for k, v in p.items()}
    h = jnp.tanh(x.astype(dt) @ q["Win"])
    h = h + jax.nn.relu(h @ q["W1"]) @ q["W2"]  # skip branch: P; mlp branch: P·s_W1·s_W2
    h = h + jax.nn.relu(h @ q["W3"]) @ q["W4"]
    return 1e-6 * xent(h @ q["Wout"], y)


def test_residual_branches_with_different_scales():
    p = _params({"Win": (16, 32), "W1": (32, 64), "W2": (64, 32), "W3": (32, 64),
                 "W4": (64, 32), "Wout": (32, 10)})
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    grads, report = _check(residual, p, x, y)
    mlp = float(report.layers["W3"].scale * report.layers["W4"].scale)
    assert mlp != 1.0, "the residual branches carried the same scale"
    assert float(grads["Win"].scale) > 1.0


def attention(p, x, y, dt):
    q_ = {k: v.astype(dt) for k, v in p.items()}
    h = jnp.tanh(x.astype(dt) @ q_["Win"])  # [B, T, D], consumed by q, k, v and the residual
    q, k, v = h @ q_["Wq"], h @ q_["Wk"], h @ q_["Wv"]
    att = jax.nn.softmax((q @ jnp.swapaxes(k, 1, 2)) / jnp.sqrt(jnp.asarray(32.0, dt)), axis=-1)
    h = h + (att @ v) @ q_["Wo"]
    return 1e-6 * xent(h @ q_["Wout"], y)


def test_qkv_fanout():
    p = _params({"Win": (8, 32), "Wq": (32, 32), "Wk": (32, 32), "Wv": (32, 32),
                 "Wo": (32, 32), "Wout": (32, 10)}, seed=1)
    x = jax.random.normal(jax.random.key(2), (4, 12, 8))
    y = jax.random.randint(jax.random.key(3), (4, 12), 0, 10)
    grads, report = _check(attention, p, x, y)
    outgoing = {float(report.layers[k].outgoing_scale) for k in ("Wq", "Wk", "Wv", "Wo")}
    assert len(outgoing) > 1, "q/k/v branches carried the same scale"


def tied(p, tokens, y, dt):
    e = p["E"].astype(dt)
    h = jnp.tanh(e[tokens] @ p["W"].astype(dt))
    return 1e-6 * xent(h @ e.T, y)  # E used by the gather and by the output projection


def test_tied_weights():
    p = _params({"E": (24, 16), "W": (16, 16)}, seed=2)
    tokens = jax.random.randint(jax.random.key(4), (32,), 0, 24)
    y = jax.random.randint(jax.random.key(5), (32,), 0, 24)
    grads, report = _check(tied, p, tokens, y)
    # the output projection scales its input cotangent, so the gather's
    # contribution to E carries a different scale from the projection's own
    assert float(report.layers["E"].scale) * float(report.layers["W"].scale) > 1.0
