"""adaloss(): unscaling, skipping non-finite steps, state, MultiSteps, chains."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jax_adaloss
from jax_adaloss import ScaledGrad, adaloss


def _params():
    return {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((3,)), "step": jnp.asarray(3)}


def _grads(value=1.0, scale=8.0):
    return {"w": ScaledGrad(jnp.full((2, 3), value * scale), jnp.float32(scale)),
            "b": jnp.full((3,), value),  # a plain array (from jax.grad) passes through
            "step": jnp.asarray(0)}  # a non-float leaf is left untouched


def test_unscales_each_leaf_by_its_own_scale_in_fp32():
    tx = adaloss()
    state = tx.init(_params())
    g = {"w": ScaledGrad(jnp.full((2, 3), 2.0**-20, jnp.float16), jnp.float32(2.0**-4)),
         "b": ScaledGrad(jnp.full((3,), 6.0, jnp.float16), jnp.float32(2.0)), "step": jnp.asarray(0)}
    upd, state = jax.jit(tx.update)(g, state)
    assert upd["w"].dtype == jnp.float32
    chex.assert_trees_all_close(upd["w"], jnp.full((2, 3), 2.0**-16))
    chex.assert_trees_all_close(upd["b"], jnp.full((3,), 3.0))
    assert float(optax.tree.get(state, "scales")["w"]) == 2.0**-4


def test_plain_arrays_pass_through_unchanged():
    tx = adaloss()
    g = _grads()
    upd, _ = tx.update(g, tx.init(_params()))
    chex.assert_trees_all_equal(upd["b"], g["b"])
    assert upd["step"] is g["step"]


def _run(tx, grads_seq):
    params = _params()
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    for g in grads_seq:
        upd, state = step(g, state, params)
        params = optax.apply_updates(params, upd)
    return params, state


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_non_finite_step_is_skipped_and_changes_nothing(bad):
    tx = adaloss(inner=optax.adam(0.1))
    p_good, s_good = _run(tx, [_grads(), _grads(0.5)])
    p_bad, s_bad = _run(tx, [_grads(), _grads(bad), _grads(0.5)])
    # the skipped step left params and adam's state exactly as if it never happened
    chex.assert_trees_all_equal(p_good, p_bad)
    chex.assert_trees_all_equal(s_good.inner_state, s_bad.inner_state)
    assert int(optax.tree.get(s_bad, "skipped")) == 1
    assert int(optax.tree.get(s_good, "skipped")) == 0
    assert int(s_bad.count) == 3 and bool(s_bad.last_finite)


def test_skipped_step_in_plain_chain_emits_zero_updates():
    tx = optax.chain(adaloss(), optax.sgd(0.1))
    params = _params()
    state = tx.init(params)
    upd, state = tx.update(_grads(jnp.nan), state, params)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(upd))
    assert int(optax.tree.get(state, "skipped")) == 1
    assert int(optax.tree.get(state, "consecutive_skipped")) == 1


def test_non_finite_scale_is_caught():
    tx = adaloss(inner=optax.sgd(1.0))
    g = _grads()
    g["w"] = ScaledGrad(g["w"].value, jnp.float32(0.0))  # x / 0 = inf
    upd, state = tx.update(g, tx.init(_params()), _params())
    assert int(state.skipped) == 1 and float(jnp.abs(upd["w"]).sum()) == 0


def test_with_multisteps_inner():
    tx = adaloss(inner=optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2))
    params, state = _run(tx, [_grads(1.0), _grads(3.0)])
    # mean of the two unscaled gradients (1 and 3) applied once
    chex.assert_trees_all_close(params["w"], _params()["w"] - 2.0)
    params, state = _run(tx, [_grads(1.0), _grads(jnp.nan), _grads(3.0)])
    chex.assert_trees_all_close(params["w"], _params()["w"] - 2.0)
    assert int(state.skipped) == 1


def test_end_to_end_with_value_and_grad_under_jit():
    params = {"w": jnp.full((4, 4), 0.1), "v": jnp.full((4, 2), 0.1)}
    x = jnp.ones((8, 4), jnp.float16)

    def loss(p, x):
        h = jax.nn.relu(x @ p["w"].astype(jnp.float16))
        return jnp.mean((h @ p["v"].astype(jnp.float16)).astype(jnp.float32) ** 2)

    tx = adaloss(inner=optax.sgd(0.1))
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        value, g = jax_adaloss.value_and_grad(loss)(p, x, adaloss_state=s)
        upd, s = tx.update(g, s, p)
        return optax.apply_updates(p, upd), s, value

    ref_p = params
    p, state, _ = step(params, state)
    ref_g = jax.grad(loss)(ref_p, x)
    chex.assert_trees_all_close(p, jax.tree.map(lambda a, b: a - 0.1 * b, ref_p, ref_g),
                                rtol=2e-2)


def test_bad_inner_and_config_types_raise():
    with pytest.raises(TypeError, match="inner"):
        adaloss(inner=object())
    with pytest.raises(TypeError, match="AdaLossConfig"):
        adaloss(config={"threshold": 1e-3})


def _misplaced_step(tx, reduce=lambda g: g):
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    x = jnp.ones((8, 4))

    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)

    @jax.jit
    def step(p, s):
        g = reduce(jax_adaloss.grad(loss)(p, adaloss_state=None))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step(params, tx.init(params))


@pytest.mark.parametrize("place, error, match", [
    # a value transformation in front of adaloss would rescale the scales it carries (clipping:
    # its global norm squares every leaf, the boolean marker too)
    ("scale first", ValueError, "adaloss first"),
    ("divide the tree", ValueError, "tree_scale"),
    ("cast the tree", ValueError, "unscale_tree"),
    ("clip first", ValueError, "clip_by_global_norm"),
    # JAX's own error, at trace time: the tree's structure is not the parameters'
    ("MultiSteps outside", ValueError, "pytree structure"),
])
def test_transformations_placed_before_adaloss_fail_at_trace_time_under_jit(place, error, match):
    inner = adaloss(inner=optax.adam(1e-2))
    tx, reduce = {
        "scale first": (optax.chain(optax.scale(0.5), inner), None),
        "divide the tree": (inner, lambda g: jax.tree.map(lambda a: a / 4, g)),
        "cast the tree": (inner, lambda g: jax.tree.map(lambda a: a.astype(jnp.float32), g)),
        "clip first": (optax.chain(optax.clip_by_global_norm(1.0), inner), None),
        "MultiSteps outside": (optax.MultiSteps(inner, 2), None),
    }[place]
    with pytest.raises(error, match=match):
        _misplaced_step(tx, reduce or (lambda g: g))


def test_the_placements_the_errors_name_train():
    tx = adaloss(inner=optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 2))
    params, state = _misplaced_step(tx, lambda g: jax_adaloss.tree_scale(0.25, g))
    assert int(optax.tree.get(state, "skipped")) == 0
    assert int(optax.tree.get(state, "mini_step")) == 1


def test_a_jitted_step_may_donate_the_state():
    """Every array of a fresh state is its own buffer (XLA refuses a buffer donated twice)."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    tx = adaloss(inner=optax.adam(1e-2))

    def loss(p, x):
        return jnp.sum((x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"]).astype(jnp.float32) ** 2)

    @jax.jit
    def step(p, s, x):
        _, g = jax_adaloss.value_and_grad(loss)(p, x, adaloss_state=s)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    donating = jax.jit(step, donate_argnums=(0, 1))
    state = tx.init(params)
    for _ in range(2):
        params, state = donating(params, state, jnp.ones((5, 4)))
    assert int(state.count) == 2 and int(state.skipped) == 0


def test_plain_gradients_from_jax_value_and_grad_are_named_with_the_remedy():
    # the README's two changes half-applied: adaloss() swapped in, jax.value_and_grad kept. At
    # loss x1e-6 in fp16 that backward has no scale at all and its weight gradients are all zero.
    import warnings

    from models import MLP, make_case, xent

    from adaloss.report import AdaLossCoverageWarning
    _, params, x, y = make_case("mlp", jax.random.key(0))
    model = MLP(dtype=jnp.float16)

    def loss(p):
        return 1e-6 * xent(model.apply(p, x.astype(jnp.float16)), y)

    tx = adaloss(inner=optax.adam(1e-3))
    state = tx.init(params)
    _, plain = jax.value_and_grad(loss)(params)
    kernels = [g for path, g in jax.tree_util.tree_leaves_with_path(plain) if "kernel" in str(path)]
    assert kernels and all(not bool(jnp.any(g != 0)) for g in kernels[:-1])  # the first layers' are
    with pytest.warns(AdaLossCoverageWarning, match=r"none of these gradients is a ScaledGrad.*"
                      r"jax_adaloss\.value_and_grad"):
        jax.jit(tx.update)(plain, state, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdaLossCoverageWarning)  # the strict form: it raises
        with pytest.raises(AdaLossCoverageWarning):
            tx.update(plain, state, params)
        _, scaled = jax_adaloss.value_and_grad(loss)(params, adaloss_state=state)
        upd, _ = tx.update(scaled, state, params)  # the full change: no word
    assert all(bool(jnp.any(u != 0)) for u in jax.tree.leaves(upd))


def test_the_chain_form_says_once_that_later_links_run_on_skipped_steps(monkeypatch):
    from jax_adaloss import transform
    monkeypatch.setattr(transform, "_said", set())
    with pytest.warns(UserWarning, match=r"chained after it still run.*adaloss\(inner="):
        optax.chain(adaloss(), optax.adam(1e-3)).init(_params())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optax.chain(adaloss(), optax.adam(1e-3)).init(_params())  # once
        adaloss(inner=optax.adam(1e-3)).init(_params())  # the guaranteed skip: nothing to say


def test_an_optimizer_in_the_config_place_or_after_the_gradients_is_named():
    with pytest.raises(TypeError, match=r"adaloss\(inner=optax\.adam"):
        adaloss(optax.adam(1e-3))
    params = {"w": jnp.ones((4, 3))}

    def loss(p):
        return jnp.sum((jnp.ones((2, 4), jnp.float16) @ p["w"].astype(jnp.float16)) ** 2)
    _, grads = jax_adaloss.value_and_grad(loss)(params, adaloss_state=None)
    adam = optax.adam(1e-3)  # scaled gradients straight into optax: JAX's structure error says
    with pytest.raises(ValueError, match=r"ScaledGrad.*jax_adaloss\.adaloss\(inner=optax\.adam"):
        adam.update(grads, adam.init(params), params)
