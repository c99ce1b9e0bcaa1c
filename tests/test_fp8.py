"""FP8 cotangents (``grad_format="float8_e5m2"`` / ``"float8_e4m3fn"``), JAX.

Every layer quantizes its incoming cotangent to the format once, saturating, at the scale it
carries; both backward GEMMs read that tensor. The layer decisions set the scale of the next
cast before the GEMM produces its tensor, so only the first cast after the loss reads its
tensor's max (per-tensor current scaling reads it at every cast). The models compute in bf16
(FP8 training's dtype on Hopper) or fp16; the gradients are compared with the fp32 model's.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from models import make_case, xent

import jax_adaloss
from adaloss import AdaLossConfig, format_limits, solver
from adaloss_tools.audit import fp8_casts
from adaloss_zoo.fp8_delayed import placed

FORMATS = ("float8_e5m2", "float8_e4m3fn")


def _loss(cls, dtype, factor=1.0):
    def loss(p, x, y):
        return xent(cls(dtype=dtype).apply(p, x), y) * factor
    return loss


def _median_error(got, ref):
    return float(np.median([np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r, np.float64))
                            / np.linalg.norm(np.asarray(r, np.float64))
                            for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]))


@functools.cache
def _case(name):
    return make_case(name, jax.random.PRNGKey(0))


def _fp8_grads(name, config, factor, dtype=jnp.bfloat16):
    cls, params, x, y = _case(name)
    vg = jax_adaloss.value_and_grad(_loss(cls, dtype, factor), config=config, return_report=True)
    (_, g), rep = jax.jit(lambda p: vg(p, x, y, adaloss_state=None))(params)
    return jax.tree.map(lambda a: a / factor, jax_adaloss.unscale_tree(g)), rep


@pytest.mark.parametrize("fmt", FORMATS)
def test_limits_come_from_the_fp8_format(fmt):
    info = ml_dtypes.finfo(getattr(ml_dtypes, fmt))
    cfg = AdaLossConfig(grad_format=fmt)
    assert cfg.fp8 and not AdaLossConfig().fp8
    assert (cfg.underflow_limit, cfg.overflow_limit) == (float(info.smallest_normal), float(info.max))
    assert format_limits(fmt).subnormal == float(info.smallest_subnormal)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_cast_never_makes_inf_or_nan_and_keeps_them(fmt):
    torch = pytest.importorskip("torch")
    from torch_bridge._xp import xp as torch_xp
    limit = format_limits(fmt).u_max
    values = [1e6, -1e6, 500.0, -70000.0, 1.0, 0.0, np.inf, -np.inf, np.nan]
    got = {"jax": np.asarray(solver.to_fp8(jnp.array(values, jnp.float32), jnp.dtype(getattr(ml_dtypes, fmt)),
                                           limit, jnp).astype(jnp.float32)),
           # torch's e4m3fn cast saturates inf to 448: a skipped step must not become a finite one
           "torch": solver.to_fp8(torch.tensor(values, dtype=torch.bfloat16), getattr(torch, fmt), limit,
                                  torch_xp).float().numpy()}
    for q in got.values():
        assert q[0] == limit and q[1] == -limit and np.all(np.abs(q[2:4]) <= limit) and q[4] == 1.0
        assert np.isfinite(q[:6]).all() and not np.isfinite(q[6:]).any()


def test_the_decision_is_the_largest_power_of_two_within_the_saturation_budget():
    cfg = AdaLossConfig(grad_format="float8_e4m3fn", saturation=1e-3)
    g = solver.TensorStats(None, np.float32(4e-6), None, None, np.float32(9e-3))
    w = solver.TensorStats(None, np.float32(1 / 64), None, None, np.float32(0.5))
    d = solver.fp8_layer_scale(cfg, g, w, 64, np.float32(1.0), 3.0e38, np)
    sigma = np.sqrt(4e-6 * 64 / 64)
    want = 2.0 ** np.floor(np.log2(448.0 / (sigma * cfg.z_saturation)))
    assert float(d.scale) == want
    # fp16 arithmetic between two casts must not overflow: the cap on 64 terms of 9e-3·0.5
    d16 = solver.fp8_layer_scale(cfg, g, w, 64, np.float32(1.0), 65504.0, np)
    assert float(d16.scale) * 64 * 9e-3 * 0.5 <= 65504.0 and float(d16.scale) == want
    tight = solver.fp8_layer_scale(cfg, g, w, 64, np.float32(1.0), 1000.0, np)
    assert float(tight.scale) * 64 * 9e-3 * 0.5 <= 1000.0 < float(tight.scale) * 2 * 64 * 9e-3 * 0.5


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_one_fp8_cast_per_layer_and_only_the_first_reads_its_own_max(name):
    cls, params, x, y = _case(name)
    cfg = AdaLossConfig(grad_format="float8_e5m2")
    _, rep = _fp8_grads(name, cfg, 1.0)
    layers = [n for n in rep.layers if not n.startswith("cast:")]
    vg = jax_adaloss.value_and_grad(_loss(cls, jnp.bfloat16), config=cfg)
    casts = fp8_casts(lambda p: vg(p, x, y, adaloss_state=None), params)
    assert len(casts) == len(layers) and all(c.dtype == "float8_e5m2" for c in casts)
    own = [c for c in casts if c.reads_own_max]
    if name == "mlp":  # the head's, whose scale the loss cotangent's cast read
        assert len(own) == 1 and own[0].shape == (32, 10)
    else:  # and those after a merge (q/k/v, the residual stream): a max over the branches
        assert 1 <= len(own) < len(casts)
    current = AdaLossConfig(grad_format="float8_e5m2", fp8_rule="current")
    vg = jax_adaloss.value_and_grad(_loss(cls, jnp.bfloat16), config=current)
    assert all(c.reads_own_max for c in fp8_casts(lambda p: vg(p, x, y, adaloss_state=None), params))


@pytest.mark.parametrize("fmt, bound", [("float8_e5m2", 0.12), ("float8_e4m3fn", 0.06)])
def test_fp8_gradients_track_fp32_as_current_scaling_does(fmt, bound):
    name = "gpt"
    cls, params, x, y = _case(name)
    ref = jax.jit(jax.grad(_loss(cls, jnp.float32)))(params, x, y)
    for factor in (1e-6,):  # the benchmark covers ×1 and ×1e-3 on the zoo
        g, rep = _fp8_grads(name, AdaLossConfig(grad_format=fmt), factor)
        cur, _ = _fp8_grads(name, AdaLossConfig(grad_format=fmt, fp8_rule="current"), factor)
        err, err_cur = _median_error(g, ref), _median_error(cur, ref)
        assert np.isfinite(err) and err < bound, (factor, err)
        assert err <= err_cur * 1.05 + 1e-3, (factor, err, err_cur)
        sat = [float(r.saturated) for r in rep.layers.values() if r.saturated is not None]
        assert len(sat) > 2 and max(sat) < 0.01


def test_an_fp16_model_with_fp8_gradients_stays_finite_at_extreme_factors():
    for factor in (1e3, 1e-8):
        g, rep = _fp8_grads("mlp", AdaLossConfig(grad_format="float8_e5m2"), factor, dtype=jnp.float16)
        assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(g))
        flushed = [float(r.flushed) for r in rep.layers.values() if r.flushed is not None]
        assert len(flushed) == 3 and max(flushed) < 0.01


@pytest.mark.parametrize("saturated", [2e-4, 0.2, 0.5])
def test_a_saturation_lowers_the_lift_by_its_overshoot_in_one_step(saturated):
    """A norm's backward may amplify a decision's output many times before the next cast: the
    lift drops by the powers of two the saturated fraction puts between the format's max and the
    tail the decision aimed at (normal model), in one step, in both frameworks."""
    torch = pytest.importorskip("torch")
    from statistics import NormalDist

    from torch_bridge._xp import xp as torch_xp
    cfg = AdaLossConfig(grad_format="float8_e4m3fn")
    want = max(1, math.ceil(math.log2(cfg.z_saturation / NormalDist().inv_cdf(1 - saturated / 2))))
    for ns, erfinv, arr in ((jnp, jax.scipy.special.erfinv, jnp.asarray),
                            (torch_xp, torch.special.erfinv, torch.tensor)):
        zero = arr(0.0)
        signal = solver.fp8_signal(cfg, zero, zero, arr(saturated), arr(100.0), erfinv, ns)
        k = solver.lift_update(cfg, arr(2, dtype=ns.int32), signal, arr(True), ns)
        assert float(signal) == -want and int(k) == 2 - want


class _Gained(nn.Module):
    """An MLP whose hidden features are multiplied by a data tensor (a per-feature gain, not a
    scalar): no decision models it."""

    @nn.compact
    def __call__(self, x, gain):
        h = nn.relu(nn.Dense(64, dtype=jnp.bfloat16)(x))
        h = nn.Dense(64, dtype=jnp.bfloat16)(h) * gain
        return nn.Dense(10, dtype=jnp.bfloat16)(nn.gelu(h))


def test_saturation_lowers_the_lift_and_training_skips_nothing():
    """A gain of 64 between the head's decision and the next cast: step 0 saturates far beyond
    ``T_sat``; the lift of the decision behind that cast drops by the overshoot at once (one
    power of two a step would take six), so that from step 2 the casts saturate within the
    budget; nothing is skipped, the loss falls."""
    _, _, x, y = _case("mlp")
    gain = jnp.full((64,), 64.0, jnp.bfloat16)
    params = _Gained().init(jax.random.PRNGKey(1), x, gain)
    cfg = AdaLossConfig(grad_format="float8_e4m3fn")
    tx = jax_adaloss.adaloss(cfg, inner=optax.adam(1e-3))
    vg = jax_adaloss.value_and_grad(lambda p: xent(_Gained().apply(p, x, gain), y), config=cfg,
                                    return_report=True)

    @jax.jit
    def step(p, s):
        (loss, g), rep = vg(p, adaloss_state=s)
        u, s = tx.update(g, s, p)
        sat = jnp.max(jnp.stack([r.saturated for r in rep.layers.values() if r.saturated is not None]))
        return optax.apply_updates(p, u), s, loss, sat

    s = tx.init(params)
    sats, losses, lifts = [], [], []
    for _ in range(4):
        params, s, loss, sat = step(params, s)
        sats.append(float(sat))
        losses.append(float(loss))
        lifts.append(min(int(k) for k in jax.tree.leaves(optax.tree.get(s, "lift"))))
    # the normal model reads 5 of the gain's 6 powers of two off the clipped tensor at once
    assert sats[0] > 0.5 and lifts[0] <= -5 and sats[1] < sats[0] / 100
    assert max(sats[2:]) <= 2 * cfg.saturation
    assert int(optax.tree.get(s, "skipped")) == 0 and losses[-1] < losses[0]


class _Normed(nn.Module):
    """Dense → GELU → a normalization in bf16 (``rsqrt``, no fp32 upcast; its statistics held
    fixed, as running statistics are, so the cotangent has one path through it) → Dense: the first
    Dense's small weights give the norm a small-variance input to amplify."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(64, dtype=jnp.bfloat16, kernel_init=nn.initializers.normal(0.01))(x))
        stats = jax.lax.stop_gradient(h)
        mu = jnp.mean(stats, -1, keepdims=True)
        h = (h - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(stats - mu), -1, keepdims=True) + 1e-6)
        return nn.Dense(10, dtype=jnp.bfloat16)(nn.Dense(64, dtype=jnp.bfloat16)(x) + h)


def test_a_cast_after_a_16_bit_normalization_reads_its_own_max():
    """A normalization's backward multiplies by 1/σ of its input, which no decision sees: the
    layer before a 16-bit norm (JAX: times ``rsqrt`` of data; torch: ``nn.LayerNorm`` under bf16
    autocast) casts at its own max, and nothing saturates; elsewhere the decisions hold. (Where
    the cotangent also flows back through the norm's statistics, the paths merge at its input,
    and the merge fits their sum.)"""
    torch = pytest.importorskip("torch")
    import torch_bridge
    _, _, x, y = _case("mlp")
    params = _Normed().init(jax.random.PRNGKey(0), x)
    cfg = AdaLossConfig(grad_format="float8_e4m3fn")
    vg = jax_adaloss.value_and_grad(lambda p: xent(_Normed().apply(p, x), y), config=cfg, return_report=True)
    _, rep = jax.jit(lambda p: vg(p, adaloss_state=None))(params)
    current = {k.split("/")[1]: bool(r.current) for k, r in rep.layers.items() if r.current is not None}
    assert current == {"Dense_0": True, "Dense_1": False, "Dense_2": False}
    assert max(float(r.saturated) for r in rep.layers.values() if r.saturated is not None) <= cfg.saturation

    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64)
            self.head = torch.nn.Linear(64, 10)
            self.ln = torch.nn.LayerNorm(64, elementwise_affine=False)
            torch.nn.init.normal_(self.a.weight, std=0.01)

        def forward(self, x):
            return self.head(self.b(x) + self.ln(torch.nn.functional.gelu(self.a(x))))
    torch.manual_seed(0)
    model = Normed()
    scaler = torch_bridge.AdaLossScaler(model, cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(torch.tensor(np.asarray(x))).float(),
                                                 torch.tensor(np.asarray(y), dtype=torch.long))
    scaler.scale(loss).backward()
    reports = scaler.layer_reports()
    assert {k: bool(r.current) for k, r in reports.items() if r.current is not None} == {
        "a.weight": True, "b.weight": False, "head.weight": False}
    assert max(float(r.saturated) for r in reports.values() if r.saturated is not None) <= cfg.saturation


def test_operands_are_read_in_fp8_by_every_gemm_forward_and_backward():
    """``operand_format``: each layer's input and weight quantized to e4m3 at their own power of
    two, read by the forward GEMM and both backward GEMMs, the gradient passed straight through:
    the same loss and gradients, bitwise, as the model with a quantize-dequantize written by
    hand (log2, a straight-through ``custom_vjp``) on each layer's operands."""
    cls, params, x, y = _case("mlp")

    def q(v):
        a = jnp.max(jnp.abs(v.astype(jnp.float32)))
        s = jnp.exp2(jnp.floor(jnp.log2(448.0 / a)))
        q8 = jnp.clip(v.astype(jnp.float32) * s, -448, 448).astype(jnp.float8_e4m3fn)
        return (q8.astype(jnp.float32) / s).astype(v.dtype)

    @jax.custom_vjp
    def ste(v):
        return q(v)
    ste.defvjp(lambda v: (q(v), None), lambda _, g: (g,))
    loss = _loss(cls, jnp.bfloat16)

    def by_hand(p, x, y):
        return placed(lambda p: loss(p, x, y), p, lambda role, v: v if role == "output_grad" else ste(v))

    def run(f, cfg):
        vg = jax_adaloss.value_and_grad(f, config=cfg)
        value, g = jax.jit(lambda p: vg(p, x, y, adaloss_state=None))(params)
        # the hand-written rule's transpose narrows the fp32 weight gradients to bf16
        return value, jax.tree.map(lambda a: a.astype(jnp.bfloat16), jax_adaloss.unscale_tree(g))
    got = run(loss, AdaLossConfig(grad_format="float8_e5m2", operand_format="float8_e4m3fn"))
    want = run(by_hand, AdaLossConfig(grad_format="float8_e5m2"))
    plain = run(loss, AdaLossConfig(grad_format="float8_e5m2"))
    assert float(got[0]) != float(plain[0])
    jax.tree.map(np.testing.assert_array_equal, got, want)
    casts = fp8_casts(lambda p: jax_adaloss.value_and_grad(loss, config=AdaLossConfig(
        grad_format="float8_e5m2", operand_format="float8_e4m3fn"))(p, x, y, adaloss_state=None), params)
    assert [c.dtype for c in casts].count("float8_e4m3fn") == 6  # one per operand, not again backward


def test_torch_nodes_receive_fp8_values_at_the_decided_scale():
    """The bridge's pre-hook hands each Linear node its fp8-quantized cotangent times the
    decision's scale (a later pre-hook on the node sees it): every entry has at most the format's
    mantissa bits (bf16's 8 would fail); the gradients are finite at extreme loss factors."""
    torch = pytest.importorskip("torch")
    import torch_bridge
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 10))
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    for fmt in FORMATS:
        for factor in (1.0, 1e-8):
            scaler = torch_bridge.AdaLossScaler(model, AdaLossConfig(grad_format=fmt))
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y) * factor
            scaled = scaler.scale(loss)
            seen = []
            node = scaled.grad_fn
            todo, nodes = [node], []
            while todo:  # the Linear nodes of the graph
                n = todo.pop()
                if n is None or n in nodes:
                    continue
                nodes.append(n)
                todo += [f for f, _ in n.next_functions]
            for n in nodes:
                if type(n).__name__ == "AddmmBackward0":
                    n.register_prehook(lambda go, n=n, seen=seen: seen.append((n, go[0].detach().clone())))
            scaled.backward()
            reports = scaler.layer_reports()
            assert len(seen) == 3 and all(r.flushed is not None for k, r in reports.items()
                                          if not k.startswith("cast:"))
            for _, go in seen:  # fp8 values times a power of two: at most the format's mantissa bits
                m, _ = torch.frexp(go.float()[go != 0])
                bits = 3 if fmt == "float8_e4m3fn" else 2
                assert torch.equal(m * 2 ** (bits + 1), torch.round(m * 2 ** (bits + 1)))
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_scanned_stack_quantizes_as_the_unrolled_one():
    """``nn.scan`` over remat blocks: the per-iteration fp8 decisions and the gradients are
    bitwise those of the unrolled loop (the carry's scale stays fitted across iterations), with
    the layers' operands quantized too (the scan's and the remat region's forward included)."""
    import test_scan as ts

    from jax_adaloss.scaled_grad import unscale_tree

    cfg = AdaLossConfig(grad_format="float8_e5m2", operand_format="float8_e4m3fn")

    def run(model, params, x):
        def loss(p):
            return jnp.mean(model.apply(p, x) ** 2) * 1e-3
        return jax.jit(jax_adaloss.value_and_grad(loss, return_report=True, config=cfg))(params,
                                                                                       adaloss_state=None)
    x = ts._x()
    ps = ts._LinenLM(True).init(jax.random.key(0), x)
    (l_s, g_s), r_s = run(ts._LinenLM(True), ps, x)
    (l_u, g_u), r_u = run(ts._LinenLM(False), ts._unstack(ps), x)
    assert float(l_s) == float(l_u)
    for name in ("Dense_0", "Dense_1"):
        stacked = r_s.layers[f"params/blocks/{name}/kernel"]
        unrolled = [r_u.layers[f"params/b{i}/{name}/kernel"] for i in range(ts.L)]
        np.testing.assert_array_equal(np.asarray(stacked.scale), [float(r.scale) for r in unrolled])
        np.testing.assert_array_equal(np.asarray(stacked.saturated), [float(r.saturated) for r in unrolled])
        assert not np.asarray(stacked.current).any()
    jax.tree.map(np.testing.assert_array_equal, unscale_tree(g_s)["params"]["blocks"],
                 ts._stack_blocks(unscale_tree(g_u)))
