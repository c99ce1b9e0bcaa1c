"""Reducing ScaledGrad trees across micro-batches and devices: jax_adaloss.tree_add / tree_scale /
pmean equal the full batch; plain tree maps and jax.lax.pmean, which would add the scales, are
refused (skipped and counted under jit, an error outside)."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models import make_case

import jax_adaloss
from jax_adaloss import ScaledGrad

MICRO = 4


def weighted_loss(cls):
    """Sum of per-row cross-entropies times a per-row weight (0 = padding), times 1e-4: with
    weights summing to 1 over the full batch, micro-batch and device losses add up to it."""
    def loss(p, x, y, w):
        logits = cls(dtype=jnp.float16).apply(p, x.astype(jnp.float16)).astype(jnp.float32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1)[:, 0]
        return -1e-4 * jnp.sum(w * logp)
    return loss


def uneven_batch(rows: int = 64):
    """The mlp case with ``rows`` rows; the last quarter is padding but for one row, and the
    second quarter's inputs are 4x larger: each quarter's backward chooses other scales."""
    cls, params, x, y = make_case("mlp", jax.random.key(0))
    reps = rows // x.shape[0]
    x, y = jnp.tile(x, (reps, 1)), jnp.tile(y, reps)
    q = rows // 4
    x = x.at[q:2 * q].multiply(4.0)
    w = jnp.ones(rows).at[3 * q + 1:].set(0.0)
    return cls, params, x, y, w / w.sum()


def _unscaled(grads):
    return [np.asarray(g, np.float64) for g in jax.tree.leaves(jax_adaloss.unscale_tree(grads))]


def _scales(grads):
    return [float(g.scale) for g in jax.tree.leaves(grads, is_leaf=jax_adaloss.is_scaled_grad)]


def _close(a, b, rtol=5e-3, atol=1e-30):
    for u, v in zip(a, b):
        assert np.abs(u - v).max() <= rtol * np.abs(v).max() + atol, (np.abs(u - v).max(), np.abs(v).max())


@pytest.fixture(scope="module")
def micro():
    cls, params, x, y, w = uneven_batch()
    g = jax.jit(functools.partial(jax_adaloss.grad(weighted_loss(cls)), adaloss_state=None))
    full = g(params, x, y, w)
    parts = [g(params, *(a.reshape(MICRO, -1, *a.shape[1:])[k] for a in (x, y, w))) for k in range(MICRO)]
    return params, full, parts


def test_micro_batch_accumulation_equals_the_full_batch(micro):
    params, full, parts = micro
    assert len({tuple(_scales(p)) for p in parts}) > 1, "the micro-batches should choose different scales"
    acc = jax.jit(jax_adaloss.tree_add)(*parts)
    _close(_unscaled(acc), _unscaled(full))
    tx = jax_adaloss.adaloss(inner=optax.sgd(1.0))
    upd, state = tx.update(acc, tx.init(params), params)
    assert int(optax.tree.get(state, "mixed_scales")) == 0
    _close([np.asarray(u) for u in jax.tree.leaves(upd)], [-u for u in _unscaled(full)])
    # a running accumulation (as in a scan over micro-batches), then the mean
    run = parts[0]
    for p in parts[1:]:
        run = jax_adaloss.tree_add(run, p)
    mean = jax_adaloss.tree_scale(1.0 / MICRO, run)
    _close(_unscaled(mean), [u / MICRO for u in _unscaled(full)])


def test_plain_tree_map_accumulation_is_refused(micro):
    params, _, parts = micro
    summed = jax.tree.map(jnp.add, *parts[:2])  # adds the scales too
    tx = jax_adaloss.adaloss(inner=optax.adam(1e-3))
    state = tx.init(params)
    with pytest.raises(ValueError, match="jax_adaloss.tree_add"):
        tx.update(summed, state, params)
    upd, new = jax.jit(tx.update)(summed, state, params)
    assert int(optax.tree.get(new, "mixed_scales")) == 1 and int(optax.tree.get(new, "skipped")) == 1
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(upd))
    chex_equal = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new.inner_state, state.inner_state)
    assert all(jax.tree.leaves(chex_equal)), "a refused step must leave the optimizer state as it was"
    # dividing a (correctly accumulated) tree with a plain map would divide the scales as well:
    # refused where it is written, at trace time, with the remedy
    for run in (lambda f, *a: f(*a), lambda f, *a: jax.jit(f)(*a)):
        with pytest.raises(ValueError, match="tree_scale"):
            run(lambda t: jax.tree.map(lambda a: a / 2, t), jax_adaloss.tree_add(*parts[:2]))
    # a laundering attempt: a plain sum, then tree_add, stays refused
    _, new = jax.jit(tx.update)(jax_adaloss.tree_add(summed, parts[2]), state, params)
    assert int(optax.tree.get(new, "mixed_scales")) == 1


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32).filter(lambda v: v == 0 or abs(v) > 1e-4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, finite, st.integers(-24, 24)), min_size=1, max_size=4))
def test_tree_add_is_the_sum_of_the_unscaled_gradients_exactly(terms):
    """Power-of-two rescaling commutes with fp32 rounding: adding at a common scale and then
    unscaling is bitwise the sum of the unscaled gradients (in any order of the scales)."""
    trees = [{"w": ScaledGrad.of(jnp.asarray([a, b], jnp.float32) * 2.0**e, jnp.float32(2.0**e))}
             for a, b, e in terms]
    total = jax_adaloss.tree_add(*trees)["w"]
    expected = sum((t["w"].unscale() for t in trees[1:]), trees[0]["w"].unscale())
    np.testing.assert_array_equal(total.unscale(), expected)
    assert float(total.scale) == min(2.0**e for *_, e in terms)
    assert float(total.mismatch()) == 0.0


def test_mixing_scaled_and_plain_leaves_is_an_error():
    a = {"w": ScaledGrad.of(jnp.ones(2), jnp.float32(2.0))}
    with pytest.raises(TypeError, match="plain array"):
        jax_adaloss.tree_add(a, {"w": jnp.ones(2)})


SHARD_MAP = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from test_collectives import uneven_batch, weighted_loss, _unscaled, _close, _scales
    import jax_adaloss
    assert jax.device_count() == 4
    cls, params, x, y, w = uneven_batch()
    loss = weighted_loss(cls)
    tx = jax_adaloss.adaloss(inner=optax.sgd(0.1))
    state = tx.init(params)

    def step(p, s, x, y, w, reduce):
        g = reduce(jax_adaloss.grad(loss)(p, x, y, w, adaloss_state=s))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    p1, s1, g1 = jax.jit(lambda p, s, x, y, w: step(p, s, x, y, w, lambda g: g))(params, state, x, y, w)
    mesh = jax.make_mesh((4,), ("data",))
    shard = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    xs, ys, ws = shard(x), shard(y), shard(w)
    batch = (P("data"), P("data"), P("data"))

    def data_parallel(reduce, check_vma, weight):
        body = lambda p, s, x, y, w: step(p, s, x, y, weight * w, reduce)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), *batch), out_specs=(P(), P(), P()),
                                     check_vma=check_vma))(params, state, xs, ys, ws)

    def same_as_one_device(p4, s4, g4):
        _close(_unscaled(g4), _unscaled(g1))
        step = lambda q: [np.asarray(a, np.float64) - np.asarray(b, np.float64)
                          for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(params))]
        # a step of ~1e-6 on fp32 parameters up to ~0.5 is resolved to their spacing (~3e-8): the
        # two steps may round apart by one unit of it
        ulp = max(float(np.spacing(np.abs(np.asarray(a, np.float32)).max())) for a in jax.tree.leaves(params))
        _close(step(p4), step(p1), atol=ulp)
        assert int(optax.tree.get(s4, "skipped")) == 0

    # check_vma (the default): the transpose of the replicated parameters' pvary sums the devices'
    # gradients inside the backward, at one scale; each device's loss is its share of the batch's
    same_as_one_device(*data_parallel(lambda g: g, True, 1.0))
    # without it (pmap-style code), each device keeps its own scales; the mean over 4 devices
    scales = lambda g: jax.tree.map(lambda l: l.scale[None], g, is_leaf=jax_adaloss.is_scaled_grad)
    local = jax.jit(jax.shard_map(lambda p, x, y, w: scales(jax_adaloss.grad(loss)(p, x, y, 4.0 * w)),
        mesh=mesh, in_specs=(P(), *batch), out_specs=P("data"), check_vma=False))(params, xs, ys, ws)
    differ = sum(len(set(np.asarray(v).tolist())) > 1 for v in jax.tree.leaves(local))
    assert differ > 0, "devices should choose different scales"
    same_as_one_device(*data_parallel(lambda g: jax_adaloss.pmean(g, "data"), False, 4.0))
    # the plain collective would average the scales too: refused at trace time, with the remedy
    try:
        data_parallel(lambda g: jax.lax.pmean(g, "data"), False, 4.0)
        raise AssertionError("jax.lax.pmean over ScaledGrad trees should be refused")
    except ValueError as e:
        assert "jax_adaloss.pmean" in str(e), e
    # and a plain psum would add them: refused at trace time too (psum turns the bool marker to int)
    try:
        data_parallel(lambda g: jax.lax.psum(g, "data"), False, 1.0)
        raise AssertionError("jax.lax.psum over ScaledGrad trees should be refused")
    except ValueError as e:
        assert "jax_adaloss.psum" in str(e), e

    # 16-bit cotangents crossing devices: one scale, low enough that their sum cannot overflow
    from jax_adaloss.backward import agree_across
    def agreed_sum(ct, s):
        (c,), t = agree_across([ct[0]], s[0], ("data",), 65504.0)
        return jax.lax.psum(c, "data"), t, jax.lax.psum(ct[0], "data")  # the last: as they came
    f = jax.jit(jax.shard_map(agreed_sum, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(),
                              check_vma=False))
    def agree(values, scales):
        ct = jnp.asarray(values, jnp.float16)[:, None] * jnp.ones((4, 8), jnp.float16)
        total, target, naive = f(shard(ct), shard(jnp.asarray(scales, jnp.float32)))
        true = sum(v / s for v, s in zip(values, scales))
        assert bool(jnp.all(jnp.isfinite(total))), (total, target)
        np.testing.assert_allclose(np.asarray(total, np.float64) / float(target), true, rtol=2e-3)
        return float(target), naive
    target, naive = agree([3e4] * 4, [2.0**10] * 4)
    assert target == 2.0**9 and not bool(jnp.all(jnp.isfinite(naive))), (target, naive)  # 2^10: inf
    target, _ = agree([1e3, -2e3, 3e3, 4e3], [2.0**13, 2.0**12, 2.0**11, 2.0**10])
    assert target == 2.0**10  # the smallest scale, no lower: the sum fits

    # flax BatchNorm with axis_name (batch statistics pmean'd across the devices): its transposed
    # collectives agree on one scale too
    import flax.linen as nn
    class BN(nn.Module):
        axis: str | None = None
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False, axis_name=self.axis, dtype=jnp.float16)(
                nn.Dense(64, dtype=jnp.float16)(x))
            return nn.Dense(10, dtype=jnp.float16)(nn.relu(x))
    v = BN().init(jax.random.key(2), x)
    def bn_loss(axis):
        def loss(p, x, y, w):
            variables = {{"params": p, "batch_stats": v["batch_stats"]}}
            logits, _ = BN(axis).apply(variables, x.astype(jnp.float16), mutable=["batch_stats"])
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), y[:, None], -1)[:, 0]
            return -1e-4 * jnp.sum(w * logp)
        return loss
    bn1 = _unscaled(jax.jit(jax_adaloss.grad(bn_loss(None)))(v["params"], x, y, w))
    bn4 = jax.jit(jax.shard_map(lambda p, x, y, w: jax_adaloss.grad(bn_loss("data"))(p, x, y, w), mesh=mesh,
                                in_specs=(P(), *batch), out_specs=P()))(v["params"], xs, ys, ws)
    # Dense_0's bias is left out: BatchNorm cancels it, its gradient is rounding noise
    keep = [i for i, (k, _) in enumerate(jax.tree_util.tree_leaves_with_path(v["params"]))
            if "Dense_0" not in str(k) or "kernel" in str(k)]
    _close([_unscaled(bn4)[i] for i in keep], [bn1[i] for i in keep])
    print("OK", differ)
""")


def test_shard_map_data_parallel_step_equals_the_one_device_step():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARD_MAP.format(tests=os.path.dirname(__file__))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout
