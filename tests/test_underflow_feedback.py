"""Measured feedback (``AdaLossConfig.underflow_feedback``): a layer decision whose cotangent
reaches the next layers with more than T of its entries below u_min is lifted.

The normal model predicts the spread of a layer's input cotangent; an activation's derivative
applied after it (GELU′) leaves more tiny entries than a normal distribution has, so the next
layer receives more than T below u_min although the model predicted less. Each backward
counts, per layer decision, the fraction below u_min of the cotangents it scaled where they
enter layers; the optax state / scaler state keeps a lift exponent per weight that rises by one
while that fraction exceeds T/2 and falls below T/32. The model here puts a GELU between two
layers, with half of the pre-activations where GELU′ is small (about -2.5: |GELU′| ~ 0.03).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jax_adaloss
import torch_bridge
from adaloss import solver
from adaloss.config import AdaLossConfig
from torch_bridge._xp import np_xp
from torch_bridge._xp import xp as torch_xp

T = AdaLossConfig().threshold
NS = {"numpy": (np_xp, lambda v, d=np.int32: np.asarray(v, d)),
      "jax": (jnp, lambda v, d=jnp.int32: jnp.asarray(v, d)),
      "torch": (torch_xp, lambda v, d=torch.int32: torch.tensor(v, dtype=d))}


@pytest.mark.parametrize("path", sorted(NS))
def test_lift_rises_above_half_T_falls_below_T_over_32_and_holds_between(path):
    ns, arr = NS[path]
    f32 = {"numpy": np.float32, "jax": jnp.float32, "torch": torch.float32}[path]
    cfg = AdaLossConfig()
    k, seen = arr(0), []
    for ratio, finite in [(3.0, True), (0.6, True), (0.2, True), (0.02, True), (2.0, False),
                          (0.01, True), (0.01, True), (0.01, True)]:
        k = solver.lift_update(cfg, k, arr(ratio, f32), arr(finite, bool), ns)
        seen.append(int(k))
    # ratio = fraction / T: up (> 1/2), up, hold (T/32 < 0.2 T < T/2), down, unchanged on a
    # skipped step, down to 0, stays 0
    assert seen == [1, 2, 2, 1, 1, 0, 0, 0]
    top = arr(solver.MAX_LIFT)
    assert int(solver.lift_update(cfg, top, arr(9.0, f32), arr(True, bool), ns)) == solver.MAX_LIFT
    off = AdaLossConfig(underflow_feedback=False)
    assert int(solver.lift_update(off, arr(3), arr(9.0, f32), arr(True, bool), ns)) == 3
    assert float(solver.lift_factor(arr(3), ns)) == 8.0


@pytest.mark.parametrize("path", sorted(NS))
def test_fraction_counts_non_zero_entries_below_u_min_where_a_larger_scale_would_fit(path):
    ns, arr = NS[path]
    f16 = {"numpy": np.float16, "jax": jnp.float16, "torch": torch.float16}[path]
    f32 = {"numpy": np.float32, "jax": jnp.float32, "torch": torch.float32}[path]
    cfg = AdaLossConfig()
    x = arr([0.0, 0.0, 2.0**-20, 2.0**-15, 1.0, 4.0], f16)  # zeros left out: 2 of 4 below 2^-14
    assert float(solver.subnormal_fraction(x, cfg, ns)) == 0.5
    assert float(solver.subnormal_fraction(x, cfg, ns, arr(4.0, f32))) == 0.5
    # no room to double below u_max: a larger scale cannot help, nothing to report
    assert float(solver.subnormal_fraction(x, cfg, ns, arr(40000.0, f32))) == 0.0
    assert float(solver.subnormal_fraction(arr([0.0, 0.0], f16), cfg, ns)) == 0.0
    fracs = [arr(3e-3, f32), arr(1e-4, f32)]
    assert float(solver.underflow_ratio(fracs, None, cfg, ns)) == pytest.approx(3.0)
    # a decision a cap held below its statistical scale: the lift would not raise it, so hold
    assert float(solver.underflow_ratio(fracs, arr(True, bool), cfg, ns)) == solver.LIFT_AIM
    low = [arr(1e-5, f32)]
    assert float(solver.underflow_ratio(low, arr(True, bool), cfg, ns)) == pytest.approx(1e-2)


D, H, N = 32, 128, 256


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    w1 = (rng.normal(size=(D, H)) / np.sqrt(D)).astype(np.float32) * 0.3
    b1 = np.where(np.arange(H) < H // 2, -2.5, 0.5).astype(np.float32)
    w2 = (rng.normal(size=(H, D)) / np.sqrt(H)).astype(np.float32)
    w0 = (rng.normal(size=(D, D)) / np.sqrt(D)).astype(np.float32)
    return x, {"w0": w0, "w1": w1, "b1": b1, "w2": w2}


def _jax_loss(p, x, dt=jnp.float16, factor=1e-4):
    h0 = x.astype(dt) @ p["w0"].astype(dt)  # a layer whose input x needs no gradient
    z = h0 @ p["w1"].astype(dt) + p["b1"].astype(dt)
    out = jax.nn.gelu(z, approximate=True) @ p["w2"].astype(dt)
    return factor * jnp.mean(jnp.square(out.astype(jnp.float32)))


def _w1_fraction(grads_fn, p, x, u_min, state=None):
    """Fraction of the non-zero entries of w1's incoming cotangent below u_min, as carried."""
    low = jax_adaloss.layer_cotangents(grads_fn, p, x, state=state)
    g = np.abs(np.asarray(low["w1"][0], np.float32))
    return float(np.mean(g[g > 0] < u_min))


def test_jax_lift_raises_the_decision_before_the_gelu_until_its_consumer_is_within_T():
    x, p = _data()
    cfg = AdaLossConfig()
    tx = jax_adaloss.adaloss(cfg)
    state = tx.init(p)
    vg = jax.jit(jax_adaloss.value_and_grad(_jax_loss, config=cfg))
    before = _w1_fraction(_jax_loss, p, x, cfg.underflow_limit)
    assert before > T  # GELU′ after w2's decision: more tiny entries than the model has
    for _ in range(8):  # the same batch and weights: only the lift changes
        _, grads = vg(p, x, adaloss_state=state)
        assert grads["w2"].underflow is not None
        _, state = tx.update(grads, state, p)
    lifts = optax.tree.get(state, "lift")
    assert int(lifts["w2"]) >= 1  # the decision whose cotangent crosses the GELU
    assert int(lifts["w1"]) == int(lifts["b1"]) == 0  # nothing (a bias) or within T downstream
    after = _w1_fraction(_jax_loss, p, x, cfg.underflow_limit, state=state)
    assert after <= T < before
    # the gradients stay right: within fp16 noise of the fp32 ones
    _, grads = vg(p, x, adaloss_state=state)
    ref = jax.grad(lambda q: _jax_loss(q, x, jnp.float32))(p)
    for k in ("w0", "w1", "w2"):
        got = np.asarray(grads[k].unscale())
        assert np.linalg.norm(got - ref[k]) <= 0.02 * np.linalg.norm(ref[k])


def test_jax_a_state_initialised_with_other_weights_warns_that_feedback_is_off():
    from adaloss.report import AdaLossCoverageWarning

    x, p = _data()
    other = jax_adaloss.adaloss().init({"something": jnp.zeros(3)})
    with pytest.warns(AdaLossCoverageWarning, match="no lift for .*w2.*feedback is off"):
        jax_adaloss.value_and_grad(_jax_loss)(p, x, adaloss_state=other)


def test_jax_no_feedback_without_the_option_or_in_the_authors_preset():
    x, p = _data()
    for cfg in (AdaLossConfig(underflow_feedback=False), AdaLossConfig.authors_preset()):
        tx = jax_adaloss.adaloss(cfg)
        state = tx.init(p)
        _, grads = jax_adaloss.value_and_grad(_jax_loss, config=cfg)(p, x, adaloss_state=state)
        assert all(g.underflow is None for g in grads.values())
        _, state = tx.update(grads, state, p)
        assert all(int(k) == 0 for k in jax.tree.leaves(optax.tree.get(state, "lift")))


class _TorchNet(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.l0 = torch.nn.Linear(D, D, bias=False)
        self.l1 = torch.nn.Linear(D, H)
        self.l2 = torch.nn.Linear(H, D, bias=False)
        with torch.no_grad():
            self.l0.weight.copy_(torch.from_numpy(p["w0"].T))
            self.l1.weight.copy_(torch.from_numpy(p["w1"].T))
            self.l1.bias.copy_(torch.from_numpy(p["b1"]))
            self.l2.weight.copy_(torch.from_numpy(p["w2"].T))

    def forward(self, x):
        return self.l2(torch.nn.functional.gelu(self.l1(self.l0(x)), approximate="tanh"))


def _torch_loss(model, x, factor=1e-4):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return factor * out.float().square().mean()


def test_torch_lift_raises_the_decision_before_the_gelu_and_resumes_from_state_dict():
    x, p = _data()
    xt = torch.from_numpy(x)
    model = _TorchNet(p)
    scaler = torch_bridge.AdaLossScaler(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same weights every step

    def fraction(sc):
        low = torch_bridge.layer_cotangents(model, lambda: _torch_loss(model, xt), scaler=sc)
        g = low["l1.weight"][0].float().abs()
        return float((g[g > 0] < sc.config.underflow_limit).float().mean())

    before = fraction(scaler)
    assert before > T
    for _ in range(8):
        opt.zero_grad()
        scaler.scale(_torch_loss(model, xt)).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.lift.get("l2.weight", 0) >= 1 and "l0.weight" not in scaler.lift
    assert fraction(scaler) <= T < before
    state = scaler.state_dict()
    fresh = torch_bridge.AdaLossScaler(model)
    fresh.load_state_dict(state)
    assert fresh.lift == scaler.lift
    # a checkpoint written before the lift existed: no lift, the same config
    old = {k: v for k, v in state.items() if k != "lift"}
    old["config"] = {k: v for k, v in state["config"].items() if k != "underflow_feedback"}
    older = torch_bridge.AdaLossScaler(model)
    older.load_state_dict(old)
    assert older.lift == {}


def test_nnx_optimizer_state_carries_the_lifts_the_backward_applies():
    import flax.nnx as nnx

    x, p = _data()

    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.l0 = nnx.Linear(D, D, use_bias=False, dtype=jnp.float16, rngs=rngs)
            self.l1 = nnx.Linear(D, H, dtype=jnp.float16, rngs=rngs)
            self.l2 = nnx.Linear(H, D, use_bias=False, dtype=jnp.float16, rngs=rngs)
            for var, key in ((self.l0.kernel, "w0"), (self.l1.kernel, "w1"), (self.l1.bias, "b1"),
                             (self.l2.kernel, "w2")):
                var[...] = jnp.asarray(p[key])

        def __call__(self, x):
            return self.l2(jax.nn.gelu(self.l1(self.l0(x)), approximate=True))

    def loss(m, x):
        return 1e-4 * jnp.mean(jnp.square(m(x).astype(jnp.float32)))

    model = Net()
    opt = nnx.Optimizer(model, jax_adaloss.adaloss(inner=optax.sgd(0.0)), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        _, g = jax_adaloss.value_and_grad(loss)(model, x, adaloss_state=opt.opt_state)
        opt.update(model, g)

    for _ in range(4):
        step(model, opt, x)
    lifts = optax.tree.get(opt.opt_state, "lift")
    assert int(lifts["l2"]["kernel"][...]) >= 1 and int(lifts["l0"]["kernel"][...]) == 0
    vg = jax_adaloss.value_and_grad(loss, return_report=True)
    _, plain = vg(model, x)
    _, lifted = vg(model, x, adaloss_state=opt.opt_state)
    k = int(lifts["l2"]["kernel"][...])
    assert float(lifted.layers["l2/kernel"].model_scale) == pytest.approx(
        2.0**k * float(plain.layers["l2/kernel"].model_scale), rel=1e-6)


def test_jax_backward_counts_exactly_as_count_nonzero(monkeypatch):
    """The JAX backward's fp32 count (below 2^24 entries) and int32 count (above), separate or
    in the one-pass reduction a GPU gets, give the fractions ``count_nonzero`` gives, bit for bit."""
    from jax_adaloss import reductions

    cfg = AdaLossConfig()
    rng = np.random.default_rng(0)
    for dtype in (jnp.float16, jnp.bfloat16):
        x = rng.standard_normal((257, 129)) * 2.0 ** rng.integers(-30, 4, (257, 129))
        x = jnp.asarray(np.where(rng.random(x.shape) < 0.2, 0.0, x), dtype)
        ref = solver.subnormal_fraction(x, cfg, jnp)
        assert 0 < float(ref) < 1
        assert solver.subnormal_fraction(x, cfg, jnp, count=reductions.count) == ref
        assert reductions.count(x != 0).dtype == jnp.float32
        for one_pass in (False, True):
            st = reductions.statistics(x, below=cfg.underflow_limit, one_pass=one_pass)
            assert solver.subnormal_fraction_of_counts(st.nonzero, st.below, st.size, cfg, jnp) == ref
        monkeypatch.setattr(reductions, "EXACT_F32_COUNT", 8)  # the int32 path
        assert reductions.count(x != 0).dtype == jnp.int32
        assert solver.subnormal_fraction(x, cfg, jnp, count=reductions.count) == ref
        st = reductions.statistics(x, below=cfg.underflow_limit, one_pass=True)
        assert st.below.dtype == jnp.int32
        assert solver.subnormal_fraction_of_counts(st.nonzero, st.below, st.size, cfg, jnp) == ref
        monkeypatch.undo()


def test_torch_cpu_counts_and_log_moments_are_the_comparisons_and_the_masked_log():
    """A CPU backward counts with fp32 sums from one widened copy (``host``) and takes ln|g| in
    place: the same counts as ``count_nonzero`` of the comparisons (zeros, subnormals, ±inf, NaN,
    entries at u_min exactly), the same statistics as ``tensor_stats``, and log-moments equal to
    the solver's over the non-zero entries; so do the plain reductions ``fuse_decisions`` compiles
    (:mod:`torch_bridge.kernels`)."""
    from adaloss import decisions
    from torch_bridge import kernels, stats
    from torch_bridge._xp import xp as torch_xp

    cfg = AdaLossConfig()
    lim = cfg.underflow_limit
    rng = np.random.default_rng(1)
    x = rng.standard_normal((129, 65)) * 2.0 ** rng.integers(-30, 4, (129, 65))
    x = np.where(rng.random(x.shape) < 0.2, 0.0, x)
    x.flat[:6] = [lim, -lim, np.nextafter(lim, 0), np.inf, -np.inf, np.nan]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        g = torch.tensor(x, dtype=torch.float32).to(dtype)
        want = (torch.count_nonzero(g), torch.count_nonzero(g.abs() < lim))
        assert 0 < int(want[1]) - (g.numel() - int(want[0])) < int(want[0])
        for with_mean in (False, True):
            sums, counts = stats.cotangent_stats(g, with_mean, lim, host=True)
            got_stats = decisions.normalized(sums, g.numel(), torch_xp)
            ref = stats.tensor_stats(g, with_mean)
            for got, exp in zip((*got_stats, *counts), (*ref, *want)):
                if exp is None:
                    assert got is None
                else:  # bit for bit (NaN where the reference is NaN)
                    torch.testing.assert_close(torch.as_tensor(got).double(), torch.as_tensor(exp).double(),
                                               rtol=0, atol=0, equal_nan=True)
        assert [float(c) for c in stats.subnormal_counts(g, lim, host=True)] == [float(c) for c in want]
        # what fuse_decisions compiles: the same counts (fp32 sums), the same sums to rounding
        assert [float(c) for c in kernels.counts(g, lim)] == [float(c) for c in want]
        fused = kernels.sums(g, True)
        torch.testing.assert_close(torch.stack([*fused[2:]]), torch.stack([*stats.tensor_sums(g)[2:]]),
                                   rtol=0, atol=0, equal_nan=True)  # min, max: NaN
        if dtype != torch.float32:  # (fp32's Σx² overflows to inf at the ±inf entries alike)
            for got, exp in zip(fused[:2], stats.tensor_sums(g)[:2]):
                assert float(got) == pytest.approx(float(exp), rel=1e-5, nan_ok=True)
        finite = torch.where(g.isfinite(), g, torch.zeros((), dtype=dtype)).float()  # a cast's fp32 g
        exp = solver.log_stats(finite.numpy(), np_xp)
        for ls in (stats.log_stats(finite), decisions.log_stats(kernels.log_sums(finite), torch_xp)):
            for got, e in zip(ls, exp):
                assert float(got) == pytest.approx(float(e), rel=1e-5)
