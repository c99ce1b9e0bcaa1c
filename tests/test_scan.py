"""Layers stacked with ``scan`` get per-iteration scales, equal to the unrolled model's.

``lax.scan``, Flax linen's ``nn.scan`` (with ``nn.remat``) and nnx's ``nnx.scan`` over
``nnx.vmap``-created blocks (the Flax docs idiom, ``nnx.split_rngs``) run the scale-propagating
backward inside the loop: the carry's cotangent rides in the loop with its scale, each
iteration's layers decide their own scales (stacked in the report), and the gradients are
bitwise those of the same model written as a Python loop.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_adaloss
from adaloss.report import AdaLossCoverageWarning
from jax_adaloss.scaled_grad import unscale_tree

F16 = jnp.float16
L = 3


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        x = nn.Dense(32, dtype=F16)(nn.LayerNorm(dtype=F16)(h))
        return h + nn.Dense(h.shape[-1], dtype=F16)(nn.gelu(x)), None


class _LinenLM(nn.Module):
    scanned: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(16, dtype=F16, name="inp")(x)
        if self.scanned:
            stack = nn.scan(nn.remat(_Block), variable_axes={"params": 0}, split_rngs={"params": True},
                            length=L)
            h, _ = stack(name="blocks")(h, None)
        else:
            for i in range(L):
                h, _ = _Block(name=f"b{i}")(h)
        return nn.Dense(4, dtype=F16, name="out")(h).astype(jnp.float32)


def _x() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=(8, 12)), F16)


def _unstack(params: dict) -> dict:
    p = params["params"]
    return {"params": {"inp": p["inp"], "out": p["out"],
                       **{f"b{i}": jax.tree.map(lambda a, i=i: a[i], p["blocks"]) for i in range(L)}}}


def _stack_blocks(tree: dict) -> dict:
    return jax.tree.map(lambda *a: jnp.stack(a), *[tree["params"][f"b{i}"] for i in range(L)])


def _run(model: nn.Module, params: dict, x: jax.Array, scale: float = 1e-3) -> tuple:
    def loss(p: dict) -> jax.Array:
        return jnp.mean(model.apply(p, x) ** 2) * scale
    return jax.jit(jax_adaloss.value_and_grad(loss, return_report=True))(params)


def test_linen_scan_gives_the_unrolled_scales_and_gradients() -> None:
    x = _x()
    ps = _LinenLM(True).init(jax.random.key(0), x)
    (v_s, g_s), r_s = _run(_LinenLM(True), ps, x)
    (v_u, g_u), r_u = _run(_LinenLM(False), _unstack(ps), x)
    assert float(v_s) == float(v_u)
    for name in ("Dense_0", "Dense_1"):
        stacked = np.asarray(r_s.layers[f"params/blocks/{name}/kernel"].scale)
        unrolled = [float(r_u.layers[f"params/b{i}/{name}/kernel"].scale) for i in range(L)]
        assert stacked.shape == (L,)
        np.testing.assert_array_equal(stacked, unrolled)
    # the casts inside (LayerNorm's fp32 statistics) are per iteration too, named for the scan
    np.testing.assert_array_equal(np.asarray(r_s.layers["scan:0/cast:0"].scale),
                                  [float(r_u.layers[f"cast:{i}"].scale) for i in range(L)])
    assert int(r_s.coverage.layers) >= 2 and int(r_s.coverage.opaque_regions) == 0
    u_s, u_u = unscale_tree(g_s), unscale_tree(g_u)
    jax.tree.map(np.testing.assert_array_equal, u_s["params"]["blocks"], _stack_blocks(u_u))
    jax.tree.map(np.testing.assert_array_equal, u_s["params"]["out"], u_u["params"]["out"])
    jax.tree.map(np.testing.assert_array_equal, u_s["params"]["inp"], u_u["params"]["inp"])


def test_lax_scan_over_stacked_weights_gives_per_iteration_scales() -> None:
    rng = np.random.default_rng(1)
    w_in = jnp.asarray(rng.normal(size=(8, 16)) / 3, jnp.float32)
    stack = jnp.asarray(rng.normal(size=(L, 16, 16)) / 4, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 8)), F16)

    def block(h: jax.Array, w: jax.Array) -> jax.Array:
        return h + jnp.tanh(h @ w.astype(F16))

    def scanned(p: dict) -> jax.Array:
        h, _ = jax.lax.scan(lambda h, w: (block(h, w), None), x @ p["in"].astype(F16), p["stack"])
        return jnp.mean(h.astype(jnp.float32) ** 2) * 1e-6

    def unrolled(p: dict) -> jax.Array:
        h = x @ p["in"].astype(F16)
        for i in range(L):
            h = block(h, p["stack"][i])
        return jnp.mean(h.astype(jnp.float32) ** 2) * 1e-6

    p = {"in": w_in, "stack": stack}
    (_, g_s), r_s = jax.jit(jax_adaloss.value_and_grad(scanned, return_report=True))(p)
    (_, g_u), r_u = jax.jit(jax_adaloss.value_and_grad(unrolled, return_report=True))(p)
    np.testing.assert_array_equal(np.asarray(r_s.layers["stack"].scale),
                                  [float(r_u.layers[n].scale) for n in ("stack", "stack@1", "stack@2")])
    assert len(set(np.asarray(r_s.layers["stack"].scale).tolist())) > 1  # one scale per iteration
    jax.tree.map(np.testing.assert_array_equal, unscale_tree(g_s), unscale_tree(g_u))
    # a weight the loop closes over (a const of the scan) accumulates its per-iteration cotangents
    def shared(p: dict, loop: bool) -> jax.Array:
        h = x @ p["in"].astype(F16)
        if loop:
            h = jax.lax.scan(lambda h, _: (block(h, p["stack"][0]), None), h, None, length=L)[0]
        else:
            for _ in range(L):
                h = block(h, p["stack"][0])
        return jnp.mean(h.astype(jnp.float32) ** 2) * 1e-6

    got, want = (unscale_tree(jax.jit(jax_adaloss.grad(lambda p, m=m: shared(p, m)))(p))
                 for m in (True, False))
    for k in p:  # the loop merges one iteration at a time, the unrolled tie all at once
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want[k]))))
    assert float(jnp.max(jnp.abs(got["stack"]))) > 0


class _NnxBlock(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(dim, dtype=F16, rngs=rngs)
        self.up = nnx.Linear(dim, 2 * dim, dtype=F16, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, dtype=F16, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(nnx.gelu(self.up(self.norm(h))))


class _NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(12, 16, dtype=F16, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> _NnxBlock:
            return _NnxBlock(16, rngs)

        self.blocks = create(rngs)
        self.out = nnx.Linear(16, 4, dtype=F16, rngs=rngs)

    def __call__(self, x: jax.Array, scanned: bool = True) -> jax.Array:
        h = self.inp(x)
        if scanned:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h: jax.Array, block: _NnxBlock) -> jax.Array:
                return block(h)
            h = run(h, self.blocks)
        else:
            graphdef, state = nnx.split(self.blocks)
            for i in range(L):
                h = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(h)
        return self.out(h).astype(jnp.float32)


def test_nnx_scan_over_vmapped_blocks_trains_like_the_loop() -> None:
    x = _x()
    results = {}
    for mode in (True, False):
        model = _NnxLM(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.chain(jax_adaloss.adaloss(), optax.adam(1e-3)), wrt=nnx.Param)

        @nnx.jit
        def step(model: _NnxLM, opt: nnx.Optimizer, mode: bool = mode) -> tuple:
            def loss(m: _NnxLM) -> jax.Array:
                return jnp.mean(m(x, mode) ** 2) * 1e-5
            (value, grads), report = jax_adaloss.value_and_grad(loss, return_report=True)(
                model, adaloss_state=opt.opt_state)
            opt.update(model, grads)
            return value, report

        with warnings.catch_warnings():
            warnings.simplefilter("error", AdaLossCoverageWarning)
            values = [float(step(model, opt)[0]) for _ in range(3)]
        _, report = step(model, opt)
        results[mode] = (values, nnx.state(model, nnx.Param), report)
    (v_s, p_s, r_s), (v_u, p_u, r_u) = results[True], results[False]
    assert v_s == v_u
    jax.tree.map(np.testing.assert_array_equal, p_s, p_u)
    stacked = np.asarray(r_s.layers["blocks/up/kernel"].scale)
    assert stacked.shape == (L,)
    np.testing.assert_array_equal(stacked, [float(r_u.layers[n].scale) for n in
                                            ("blocks/up/kernel", "blocks/up/kernel@1", "blocks/up/kernel@2")])


def test_scan_rejects_what_it_cannot_do_yet() -> None:
    x = _x()
    ps = _LinenLM(True).init(jax.random.key(0), x)

    def loss(p: dict) -> jax.Array:
        return jnp.mean(_LinenLM(True).apply(p, x) ** 2)

    with pytest.raises(ValueError, match="capture_cotangents"):
        jax_adaloss.value_and_grad(loss, return_report=True, capture_cotangents=True)(ps)
