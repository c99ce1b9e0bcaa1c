"""Gradients that overflow fp16 at scale 1, which no global loss scale can fix: both fronts train
through them, as the PyTorch bridge does.

- An activation written as JAX ops (``jax.nn.gelu``'s tanh form) differentiated one equation at a
  time in fp16: ``3x²`` overflows beyond ``|x| ≈ 148`` and ``0·inf`` makes NaN at any scale, and
  ``g·x`` overflows for large ``x`` although ``g·Φ'(x)·x`` is small. PyTorch's GELU computes in
  fp32 inside one kernel; adaloss's JAX backward takes such a chain's fp32 backward where its
  16-bit one is not finite, and ``jax.grad``'s arithmetic everywhere else.
- A weight gradient beyond 65504 (a sum over a batch of large inputs) stored in an fp16
  parameter: its fp32 value is narrowed into the leaf with a scale below 1 (a cast decision).
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jax_adaloss
import torch_bridge

STEPS = 30


def _data():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = 2000 * (1 + jnp.clip(jax.random.normal(k1, (256, 32)), -1, 1))
    y = jax.random.randint(k2, (256,), 0, 10)
    params = {i: jax.random.uniform(k, (a, b), minval=-1, maxval=1) / a**0.5
              for i, (k, a, b) in enumerate(zip(jax.random.split(k3, 3), (32, 128, 128), (128, 128, 10)))}
    return x, y, params


def _mlp(p, x, y, dtype=jnp.float16):
    h = x.astype(dtype)
    h = jax.nn.gelu(h @ p[0].astype(dtype))
    h = jax.nn.gelu(h @ p[1].astype(dtype))
    logits = (h @ p[2].astype(dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()


def test_jax_trains_through_an_activation_that_overflows_in_fp16_at_scale_1():
    x, y, params = _data()
    plain = jax.grad(_mlp)(params, x, y)  # the premise: fp16 jax.grad is NaN at scale 1
    assert not all(bool(jnp.isfinite(g).all()) for g in plain.values())

    def train(grad_step, state):
        p = params
        for _ in range(STEPS):
            p, state = grad_step(p, state)
        return float(_mlp(p, x, y, jnp.float32)), state

    adam = optax.adam(1e-3)
    ref, _ = train(jax.jit(lambda p, s: (optax.apply_updates(p, (u := adam.update(
        jax.grad(_mlp)(p, x, y, jnp.float32), s, p))[0]), u[1])), adam.init(params))
    tx = jax_adaloss.adaloss(inner=optax.adam(1e-3))

    @jax.jit
    def step(p, s):
        _, g = jax_adaloss.value_and_grad(_mlp)(p, x, y, adaloss_state=s)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    ours, state = train(step, tx.init(params))
    assert int(optax.tree.get(state, "skipped")) == 0
    start = float(_mlp(params, x, y, jnp.float32))
    assert ours < 0.25 * start and abs(ours - ref) < 0.25 * ref, (start, ours, ref)


def test_an_activation_chain_keeps_jax_grads_arithmetic_where_it_is_finite():
    h = jnp.array([[-3.0, 0.5, 2.0, 7.5], [150.0, 300.0, -400.0, 1e-3]], jnp.float16)
    r = jnp.array([[1.0, -2.0, 0.5, 3.0], [1.0, 1.0, -1.0, 2.0]], jnp.float32)
    w = jnp.ones((4, 4), jnp.float32)

    def f(w, h):  # h is data; w makes the argument list a model's
        return jnp.sum(jax.nn.gelu(h).astype(jnp.float32) * r) + 0.0 * jnp.sum(w)

    (_, g), rep = jax_adaloss.value_and_grad(f, argnums=(0, 1), weights=0, return_report=True)(
        w, h, adaloss_state=None)
    scale = g[1].scale
    ours = np.asarray(g[1].value, np.float32)
    theirs = np.asarray(jax.grad(lambda h: f(w, h) * scale, argnums=0)(h), np.float32)
    finite = np.isfinite(theirs)
    assert not finite.all(), "jax.grad's fp16 backward must overflow somewhere, or this shows nothing"
    assert np.array_equal(ours[finite], theirs[finite])  # bitwise where 16 bits are finite
    exact = jax.grad(lambda h: jnp.sum(jax.nn.gelu(h.astype(jnp.float32)) * r))(h)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours[~finite] / float(scale), np.asarray(exact)[~finite], rtol=2e-3)


def test_an_fp16_weight_gradient_beyond_65504_gets_a_scale_below_1():
    x, y, params = _data()

    def relu(p, x, y):
        h = jax.nn.relu(jax.nn.relu(x.astype(p[0].dtype) @ p[0]) @ p[1])
        return optax.softmax_cross_entropy_with_integer_labels((h @ p[2]).astype(jnp.float32), y).sum()

    p16 = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    exact = jax.grad(lambda p: relu(p, x, y))(jax.tree.map(lambda a: a.astype(jnp.float32), p16))
    assert float(jnp.abs(exact[2]).max()) > 65504  # at scale 1 the fp16 leaf overflows
    g = jax_adaloss.grad(relu)(p16, x, y, adaloss_state=None)
    assert float(g[2].scale) < 1.0 and g[2].value.dtype == jnp.float16
    for k in g:
        ours, ref = np.asarray(g[k].unscale(), np.float64), np.asarray(exact[k], np.float64)
        assert np.isfinite(ours).all()
        assert np.linalg.norm(ours - ref) <= 1e-2 * np.linalg.norm(ref), k


def test_torch_trains_through_the_same_gelu_mlp_without_skipping():
    torch.manual_seed(0)
    x, y, params = _data()
    model = torch.nn.Sequential(torch.nn.Linear(32, 128, bias=False), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(128, 128, bias=False), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(128, 10, bias=False))
    with torch.no_grad():
        for layer, k in zip(model[::2], range(3)):
            layer.weight.copy_(torch.from_numpy(np.asarray(params[k]).T.copy()))
    xt, yt = torch.tensor(np.asarray(x)), torch.tensor(np.asarray(y)).long()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch_bridge.AdaLossScaler(model)
    for _ in range(10):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(xt)
        scaler.scale(torch.nn.functional.cross_entropy(logits.float(), yt, reduction="sum")).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.skipped_steps == 0


def test_importing_the_fronts_runs_no_computation():
    """A deviceless GPU compile (adaloss_tools.gpu_program) sets the environment before JAX starts
    a backend: importing must not start one."""
    code = ("import jax._src.xla_bridge as xb, jax_adaloss, torch_bridge, adaloss.skips; "
            "print(xb.backends_are_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
