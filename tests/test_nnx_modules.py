"""Flax nnx Modules passed to ``jax_adaloss.value_and_grad`` behave as with ``nnx.value_and_grad``:
only ``wrt`` is differentiated, BatchNorm statistics and RNG counts are written back, inside
``nnx.jit`` and with ``nnx.Optimizer(..., wrt=nnx.Param)``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_adaloss
from adaloss.report import AdaLossCoverageWarning

X = jax.random.normal(jax.random.key(0), (8, 6))
Y = jnp.arange(8) % 3


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32) -> None:
        self.l1 = nnx.Linear(6, 16, dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(16, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x))))).astype(jnp.float32)


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _values(state):
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = np.asarray(leaf)
    return out


def _grads(g):
    return _values(jax_adaloss.unscale_tree(g))


@pytest.mark.parametrize("jit", [False, True])
def test_module_argument_matches_nnx_value_and_grad(jit):
    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    vg_ours = jax_adaloss.value_and_grad(loss_fn)
    vg_theirs = nnx.value_and_grad(loss_fn)
    if jit:
        vg_ours, vg_theirs = nnx.jit(vg_ours), nnx.jit(vg_theirs)
    for _ in range(2):  # the second call sees the first's BatchNorm statistics and RNG counts
        v1, g1 = vg_ours(ours, X, Y)
        v2, g2 = vg_theirs(theirs, X, Y)
        assert float(v1) == pytest.approx(float(v2), rel=1e-6)
        assert isinstance(g1, nnx.State)
        a, b = _grads(g1), _grads(g2)
        assert a.keys() == b.keys() == {"bn/bias/value", "bn/scale/value", "l1/bias/value",
                                        "l1/kernel/value", "l2/bias/value", "l2/kernel/value"}
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)
        rest1 = _values(nnx.state(ours, nnx.Not(nnx.Param)))
        rest2 = _values(nnx.state(theirs, nnx.Not(nnx.Param)))
        assert rest1.keys() == rest2.keys()
        for k in rest1:
            np.testing.assert_allclose(rest1[k], rest2[k], rtol=1e-6, err_msg=k)
    assert int(ours.drop.rngs.count[...]) == 2  # the dropout stream advanced once per call


def test_optimizer_step_in_nnx_jit_trains_and_updates_batch_stats():
    model = Net(nnx.Rngs(1), dtype=jnp.float16)
    optimizer = nnx.Optimizer(model, jax_adaloss.adaloss(inner=optax.adam(1e-2)), wrt=nnx.Param)
    mean0 = np.array(model.bn.mean[...])
    kernel0 = np.array(model.l1.kernel[...])

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss(model):  # the batch closed over, as nnx users write it
            return 1e-6 * loss_fn(model, x, y)
        value, grads = jax_adaloss.value_and_grad(loss)(model, adaloss_state=optimizer.opt_state)
        optimizer.update(model, grads)
        return value

    losses = [float(train_step(model, optimizer, X, Y)) for _ in range(5)]
    assert all(np.isfinite(losses))
    assert int(optax.tree.get(optimizer.opt_state, "skipped")) == 0
    assert not np.allclose(model.bn.mean[...], mean0)
    assert not np.allclose(model.l1.kernel[...], kernel0)
    assert int(model.drop.rngs.count[...]) == 5


def test_wrt_filter_and_diffstate_choose_the_differentiated_variables():
    model = Net(nnx.Rngs(0))
    g = jax_adaloss.grad(loss_fn, wrt=nnx.PathContains("l2"))(model, X, Y)
    assert set(_grads(g)) == {"l2/bias/value", "l2/kernel/value"}
    # l2 is frozen here: its weight is data, so its matmul is no layer, and that is said
    with pytest.warns(AdaLossCoverageWarning, match="no layer found"):
        g2 = jax_adaloss.grad(loss_fn, argnums=nnx.DiffState(0, nnx.PathContains("l1")))(model, X, Y)
    assert set(_grads(g2)) == {"l1/bias/value", "l1/kernel/value"}


def test_layers_are_named_after_the_module_path():
    model = Net(nnx.Rngs(0), dtype=jnp.float16)
    _, report = jax_adaloss.value_and_grad(lambda m: 1e-6 * loss_fn(m, X, Y), return_report=True)(model)
    assert "l2/kernel" in report.layers  # l1's input is the data: nothing to scale
    assert float(report.layers["l2/kernel"].outgoing_scale) > 1


def test_the_same_module_twice_is_refused():
    model = Net(nnx.Rngs(0))
    with pytest.raises(ValueError, match="passed twice"):
        jax_adaloss.grad(lambda a, b: loss_fn(a, X, Y) + loss_fn(b, X, Y))(model, model)


def test_a_split_state_with_rng_counts_names_the_module_remedy():
    _, state = nnx.split(Net(nnx.Rngs(0)))  # the whole state: RNG counts and keys too
    with pytest.raises(TypeError, match="Pass the nnx Module itself"):
        jax_adaloss.grad(lambda s: jnp.sum(s["l1"]["kernel"][...]))(state)
