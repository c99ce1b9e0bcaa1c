"""Nested jit, custom_jvp/custom_vjp, checkpoint, scan and switch regions, Flax nnx, errors."""

import functools
import re
import warnings

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import xent
from test_gradients_match_fp32 import TOL, _rel_err

import jax_adaloss
from adaloss import decisions, solver
from adaloss.report import AdaLossCoverageWarning

F16, F32 = jnp.float16, jnp.float32
KEY = jax.random.key(0)
X = jax.random.normal(KEY, (32, 16))
Y = jax.random.randint(jax.random.key(1), (32,), 0, 10)


def _p(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": jnp.asarray(rng.normal(0, 0.25, (16, 32)), F32),
            "b": jnp.asarray(rng.normal(0, 0.2, (32, 32)), F32),
            "c": jnp.asarray(rng.normal(0, 0.2, (32, 10)), F32)}


@jax.custom_vjp
def double_grad_tanh(x):
    return jnp.tanh(x)


double_grad_tanh.defvjp(lambda x: (jnp.tanh(x), x),
                        lambda x, g: (2 * g * (1 - jnp.tanh(x) ** 2),))


def _compare(body, params=None):
    params = _p() if params is None else params

    def loss(p, x, y, dt):
        q = jax.tree.map(lambda a: a.astype(dt), p)
        return 1e-6 * xent(body(q, x.astype(dt)), y)

    ref = jax.jit(jax.grad(loss), static_argnums=3)(params, X, Y, F32)
    grads, report = jax.jit(jax_adaloss.grad(loss, return_report=True),
                            static_argnums=3)(params, X, Y, F16)
    for k in ref:
        assert _rel_err(grads[k].unscale(), ref[k]) < TOL, k
    return grads, report


def test_nested_jit_custom_jvp_and_custom_vjp():
    @jax.jit
    def inner(q, h):
        return jax.nn.relu(h @ q["b"])  # relu is a custom_jvp function

    _, report = _compare(lambda q, x: double_grad_tanh(inner(q, x @ q["a"])) @ q["c"])
    assert {"b", "c"} <= set(report.layers)  # the dot inside the nested jit is a layer


def test_custom_vjp_rule_is_respected():
    def f(x):
        return jnp.sum(double_grad_tanh(x))
    x = jnp.linspace(-1, 1, 5)
    g = jax_adaloss.grad(f, config=jax_adaloss.AdaLossConfig(cast_rule=False))(x)
    np.testing.assert_allclose(g.unscale(), 2 * (1 - jnp.tanh(x) ** 2), rtol=1e-6)


def test_checkpoint_is_differentiated_through():
    body = jax.checkpoint(lambda q, h: jax.nn.gelu(h @ q["b"]))
    _, report = _compare(lambda q, x: body(q, jnp.tanh(x @ q["a"])) @ q["c"])
    assert "b" in report.layers


def test_checkpoint_regions_are_recomputed_in_the_backward():
    """``jax.checkpoint`` keeps rematerialising: the region's forward runs again in the backward
    (one more exp in the compiled program, as under ``jax.grad``), with the same decisions."""
    def f(p, checkpoint):
        block = lambda w, h: jnp.exp(0.1 * (h @ w))  # noqa: E731 - its backward needs its output
        block = jax.checkpoint(block) if checkpoint else block
        h = block(p["b"], jnp.tanh(X.astype(F16) @ p["a"]))
        return 1e-6 * xent(h @ p["c"], Y)

    params = jax.tree.map(lambda a: a.astype(F16), _p())
    runs = {}
    for checkpoint in (False, True):
        fn = jax.jit(jax_adaloss.grad(lambda p, c=checkpoint: f(p, c), return_report=True))
        exps = len(re.findall(r"= \S+ exponential\(", fn.lower(params).compile().as_text()))
        runs[checkpoint] = exps, *fn(params)
    (exps, grads, report), (exps_ck, grads_ck, report_ck) = runs[False], runs[True]
    assert exps_ck == exps + 1
    assert sorted(report.layers) == sorted(report_ck.layers) and "b" in report_ck.layers
    jax.tree.map(np.testing.assert_array_equal, grads, grads_ck)


def test_scan_body_layers_get_a_scale_per_iteration():
    def body(q, x):
        h = jnp.tanh(x @ q["a"])
        h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ q["b"]), None), h, None, length=2)
        return h @ q["c"]

    with warnings.catch_warnings():
        warnings.simplefilter("error", AdaLossCoverageWarning)  # nothing opaque any more
        grads, report = _compare(body)
    assert {"b", "c"} <= set(report.layers) and report.layers["b"].scale.shape == (2,)
    assert int(report.coverage.opaque_regions) == 0
    # the weight the loop closes over carries the scale its iterations' cotangents were merged to
    assert float(grads["b"].scale) >= float(report.layers["c"].outgoing_scale)


def test_switch_branches_decide_their_layers_scales():
    """Each lax.switch branch's layers get their own decisions (the backward is a cond on the same
    traced index); a layer of a branch not taken reports an idle decision (scale 1, no data)."""
    params = {**_p(), "d": jnp.asarray(np.random.default_rng(3).normal(0, 0.2, (32, 32)), F32)}
    branches = [lambda q, h: jnp.tanh(h @ q["b"]), lambda q, h: h,
                lambda q, h: jax.nn.gelu(h @ q["d"]) @ q["b"]]

    def loss(p, i, dt):
        q = jax.tree.map(lambda a: a.astype(dt), p)
        h = jnp.tanh(X.astype(dt) @ q["a"])
        h = jax.lax.switch(i, [functools.partial(b, q) for b in branches], h)
        return 1e-6 * xent(h @ q["c"], Y)

    ref = jax.jit(jax.grad(loss), static_argnums=2)
    fn = jax.jit(jax_adaloss.grad(loss, return_report=True), static_argnums=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdaLossCoverageWarning)  # nothing opaque any more
        runs = [(ref(params, i, F32), *fn(params, i, F16)) for i in range(3)]
    used = [{"a", "b", "c"}, {"a", "c"}, {"a", "b", "c", "d"}]
    for (r, grads, report), keys in zip(runs, used):
        for k in params:
            g = np.asarray(grads[k].unscale())
            assert _rel_err(g, r[k]) < TOL if k in keys else not g.any(), k
        assert {"b", "c", "d"} <= set(report.layers) and not any("cond" in k for k in report.layers)
        cov = report.coverage
        assert (int(cov.weighted_ops), int(cov.layers), int(cov.opaque_regions)) == (5, 4, 0)
    b_taken, b_idle, b_again = (run[2].layers["b"] for run in runs)
    assert all(float(b.grad_absmax) > 0 and float(b.sigma) > 0 for b in (b_taken, b_again))
    assert (float(b_idle.scale), float(b_idle.grad_absmax), float(b_idle.sigma)) == (1, 0, 0)
    assert int(b_idle.fan_in) == 32 and float(b_idle.outgoing_scale) == float(b_idle.incoming_scale)
    d_idle, d_taken = runs[0][2].layers["d"], runs[2][2].layers["d"]
    assert float(d_idle.grad_absmax) == 0 and float(d_taken.grad_absmax) > 0


def test_branch_signals_count_only_where_the_branch_ran():
    """A weight's underflow signal combines the branches taken; one with no decision run holds."""
    cfg = jax_adaloss.AdaLossConfig()
    a, b, c = decisions.signals(cfg, ("a",), np, [[np.float32(0.0)]], [None], (),
                                [("a", 5.0, False), ("b", 5.0, False), ("b", 0.2, True),
                                 ("c", 3.0, False)])
    assert (float(a), float(b), float(c)) == (0.0, 0.2, solver.held_signal(cfg))
    k = np.int32(2)
    assert solver.lift_update(cfg, k, np.float32(solver.held_signal(cfg)), True, np) == k


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, dtype=F16, rngs=rngs)
        self.norm = nnx.LayerNorm(32, dtype=F16, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, dtype=F16, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.norm(self.l1(x))))


def test_flax_nnx_model():
    model = NnxMLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, x, y, dt):
        m = nnx.merge(graphdef, params)
        if dt == F32:
            m.l1.dtype = m.norm.dtype = m.l2.dtype = F32
        return 1e-6 * xent(m(x.astype(dt)), y)

    ref = jax.grad(loss)(params, X, Y, F32)
    grads, report = jax.jit(jax_adaloss.grad(loss, return_report=True), static_argnums=3)(
        params, X, Y, F16)
    assert any("l2" in k for k in report.layers)
    flat_ref = jax.tree.leaves(ref)
    flat = jax.tree.leaves(grads, is_leaf=jax_adaloss.is_scaled_grad)
    assert len(flat) == len(flat_ref)
    for g, r in zip(flat, flat_ref):
        assert _rel_err(g.unscale(), r) < TOL


def test_argnums_tuple_has_aux_and_structure():
    p = _p()

    def loss(p, w, x):
        return jnp.sum(jnp.tanh(x @ p["a"]) @ w), {"n": 3}

    w = jnp.ones((32, 1))
    (v, aux), (gp, gw) = jax_adaloss.value_and_grad(loss, argnums=(0, 1), has_aux=True,
                                                    weights=(0, 1))(p, w, X)
    rv, (rp, rw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, w, X)
    assert aux == {"n": 3} and float(v) == pytest.approx(float(rv[0]), rel=1e-6)
    assert jax.tree.structure(jax_adaloss.unscale_tree(gp)) == jax.tree.structure(rp)
    np.testing.assert_allclose(gw.unscale(), rw, rtol=1e-5)
    assert isinstance(gp["b"], jax_adaloss.ScaledGrad) and float(jnp.abs(gp["b"].value).sum()) == 0


def test_integer_inputs_and_bad_outputs_raise_like_jax():
    with pytest.raises(TypeError, match="allow_int"):
        jax_adaloss.grad(lambda i: jnp.sum(i * 1.0))(jnp.arange(3))
    g = jax_adaloss.grad(lambda i, x: jnp.sum(i * x), argnums=(0, 1), allow_int=True)(
        jnp.arange(3), jnp.ones(3))
    assert g[0].dtype == jax.dtypes.float0
    with pytest.raises(TypeError, match="scalar-output"):
        jax_adaloss.grad(lambda x: x * 2)(jnp.ones(3))


def test_update_every_is_refused_in_jax_with_the_reason():
    """Reusing a statistical scale saves nothing under ``jit`` (the statistics run anyway):
    ``jax_adaloss`` decides every scale at every call and says so; the PyTorch scaler keeps it."""
    with pytest.raises(ValueError, match="update_every=3: jax_adaloss decides every scale"):
        jax_adaloss.grad(lambda x: jnp.sum(x), config=jax_adaloss.AdaLossConfig(update_every=3))
    with pytest.raises(TypeError, match="adaloss_cache= is gone"):
        jax_adaloss.grad(lambda x: jnp.sum(x))(jnp.ones(3), adaloss_cache=None)


def test_a_value_cast_twice_is_one_cast_decision():
    import flax.linen as nn

    ln = nn.LayerNorm(dtype=F16)  # upcasts its fp16 input twice (mean and centring)
    lp = ln.init(KEY, jnp.ones((2, 32), F16))

    def loss(p, x):
        h = jnp.tanh(x.astype(F16) @ p["a"].astype(F16))
        h = ln.apply(p["ln"], h)
        return jnp.mean((h @ p["b"].astype(F16)).astype(F32) ** 2)

    p = {**_p(), "ln": lp}
    _, report = jax_adaloss.grad(loss, return_report=True)(p, X)
    casts = [k for k in report.layers if k.startswith("cast")]
    assert len(casts) == 2, casts  # the loss cast and one for the LayerNorm input


def test_example_trains_a_few_steps():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import char_gpt

    out = char_gpt.train("fp16+adaloss", steps=3, lr=3e-3, loss_factor=1e-4)
    assert len(out["losses"]) == 3 and all(np.isfinite(out["losses"]))
    assert out["skipped"] == 0 and out["scales"]
