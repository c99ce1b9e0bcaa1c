"""Never stuck: after a step with a non-finite gradient the decisions back off.

A deterministic overflow (the same batch, the same weights: a skipped step changes
nothing) would recur on every step if the decisions did not change. The back-off
exponent ``h`` (optax state / scaler state) rises by one per skipped step and lowers
every decision's target range by ``2^-h``; it falls again after
``config.backoff_interval`` finite steps. The models here overflow for sure: an LM head
over a large summed batch with a per-class gain ×30 (a tensor: a scalar factor would be
bounded ahead) applied to the fp16 logits after the loss cast decided. The head's own weight
gradient, a sum of thousands of fp16 products, overflows a global scale but not adaloss: torch
caps the scale of the node that computes it in fp16, JAX fits an fp16 parameter's gradient
(computed in fp32) into fp16 with a scale of its own. The global
dynamic scales people use (``jmp.DynamicLossScale``, ``torch.amp.GradScaler``) are run
on the same work: adaloss must not skip more steps in a row than they do.
"""

import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
import torch

import jax_adaloss
import torch_bridge
from adaloss import solver
from adaloss.config import AdaLossConfig
from adaloss.report import AdaLossCoverageWarning
from adaloss.skips import SkippedStepsWarning
from torch_bridge._xp import np_xp
from torch_bridge._xp import xp as torch_xp

V, D = 64, 32
STEPS = 10


def _run_lengths(finite):
    """Longest run of skipped (not finite) steps, and whether the last step was finite."""
    longest = run = 0
    for f in finite:
        run = 0 if f else run + 1
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("path", ["numpy", "jax", "torch"])
def test_backoff_rises_per_skip_and_recovers_after_the_interval(path):
    ns, arr = {"numpy": (np_xp, lambda v: np.asarray(v, np.int32)),
               "jax": (jnp, lambda v: jnp.asarray(v, jnp.int32)),
               "torch": (torch_xp, lambda v: torch.tensor(v, dtype=torch.int32))}[path]
    boolean = {"numpy": np.asarray, "jax": jnp.asarray, "torch": torch.tensor}[path]
    cfg = AdaLossConfig(backoff_interval=3)
    h, good = arr(0), arr(0)
    seen = []
    for finite in [False, False, True, True, True, True, True, True, True, False]:
        h, good = solver.backoff_update(cfg, h, good, boolean(finite), ns)
        seen.append((int(h), int(good)))
    assert seen == [(1, 0), (2, 0), (2, 1), (2, 2), (1, 0), (1, 1), (1, 2), (0, 0), (0, 1), (1, 0)]
    assert float(solver.backoff_factor(arr(3), ns)) == 0.125
    h = arr(solver.MAX_BACKOFF)
    assert int(solver.backoff_update(cfg, h, arr(0), boolean(False), ns)[0]) == solver.MAX_BACKOFF


def test_backoff_lowers_every_target_by_its_factor():
    cfg = AdaLossConfig(model="gradient")
    g = solver.TensorStats(jnp.float32(0.0), jnp.float32(1e-12), jnp.float32(-1e-5), jnp.float32(1e-5))
    free = solver.layer_scale(cfg, g, None, 8, jnp.float32(1.0), jnp)
    half = solver.layer_scale(cfg, g, None, 8, jnp.float32(1.0), jnp, backoff=jnp.float32(0.25))
    assert float(half.scale) == float(free.scale) / 4
    capped = solver.TensorStats(jnp.float32(0.0), jnp.float32(1e-12), jnp.float32(-8.0), jnp.float32(8.0))
    assert float(solver.layer_scale(cfg, capped, None, 8, jnp.float32(1.0), jnp,
                                    backoff=jnp.float32(0.5)).unrounded) == pytest.approx(65504 / 8 / 2)
    ls = solver.LogStats(jnp.float32(-20.0), jnp.float32(1.0), jnp.float32(100.0), jnp.float32(1e-3))
    free_c = solver.cast_scale(cfg, ls, jnp.float32(1.0), jnp)
    half_c = solver.cast_scale(cfg, ls, jnp.float32(1.0), jnp, backoff=jnp.float32(0.5))
    assert float(half_c.scale) == float(free_c.scale) / 2


# -- JAX: fp16 parameters, so the head's weight gradient is stored in fp16 -------------------
def _jax_lm(batch=1024, seed=0, gain=1.0):
    rng = np.random.default_rng(seed)
    params = {k: jnp.asarray(rng.normal(0, 1, s), jnp.float16)
              for k, s in (("emb", (V, D)), ("W", (D, D)), ("head", (D, V)))}
    tok = jnp.asarray(rng.integers(0, V, (batch,)))
    y = jnp.asarray(rng.integers(0, V, (batch,)))
    gains = jnp.full((V,), gain, jnp.float16)  # data: a tensor factor no decision bounds ahead

    def loss(p, tok, y):
        h = jnp.tanh(p["emb"][tok] @ p["W"])
        return optax.softmax_cross_entropy_with_integer_labels(((h @ p["head"]) * gains).astype(jnp.float32),
                                                               y).sum()
    return params, tok, y, loss


def _jmp_run(gain=1.0):
    params, tok, y, loss = _jax_lm(gain=gain)
    ls = jmp.DynamicLossScale(jnp.float32(2.0**15))
    finite = []
    for _ in range(STEPS):
        g = jax.grad(lambda p, ls=ls: ls.scale(loss(p, tok, y)))(params)
        ok = jmp.all_finite(ls.unscale(g))
        ls = ls.adjust(ok)
        finite.append(bool(ok))
    return finite


def _jax_adaloss_run(state_arg="state", gain=30.0):
    """``state_arg``: pass the optimizer state ("state"), ``adaloss_state=None`` ("none"), or
    leave the keyword out ("omitted")."""
    params, tok, y, loss = _jax_lm(gain=gain)
    tx = jax_adaloss.adaloss(inner=optax.sgd(1e-6))
    state = tx.init(params)

    @jax.jit
    def step(p, st):
        extra = {"state": {"adaloss_state": st}, "none": {"adaloss_state": None}, "omitted": {}}[state_arg]
        _, g = jax_adaloss.value_and_grad(loss)(p, tok, y, **extra)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    finite = []
    for _ in range(STEPS):
        params, state = step(params, state)
        finite.append(bool(state.last_finite))
    return finite, state


def test_jax_fp16_weight_gradient_is_fitted_where_jmp_overflows():
    # the head's weight gradient, a sum over 1024 rows beyond fp16's range, is computed in fp32
    # and narrowed into its fp16 leaf by a cast decision (a scale below 1): no step is skipped
    finite, state = _jax_adaloss_run(gain=1.0)
    assert all(finite) and int(optax.tree.get(state, "backoff")) == 0, finite
    jmp_finite = _jmp_run()
    assert _run_lengths(jmp_finite) >= 5, jmp_finite  # jmp halves 2^15 until it fits


@pytest.mark.filterwarnings("ignore::adaloss.skips.SkippedStepsWarning")
def test_jax_overflow_backs_off_and_trains_no_later_than_a_dynamic_scale():
    jmp_finite = _jmp_run(gain=30.0)
    finite, state = _jax_adaloss_run()
    assert not finite[0], "the model must overflow at first, or the test shows nothing"
    assert finite[-1] and all(finite[finite.index(True):]), finite  # once it trains, it keeps training
    assert _run_lengths(finite) <= _run_lengths(jmp_finite), (finite, jmp_finite)
    assert int(optax.tree.get(state, "backoff")) == finite.index(True)  # one per skipped step
    # told that there is no state (adaloss_state=None), the same run never recovers: what the
    # refusal of gradients made with the keyword left out prevents
    stuck, state = _jax_adaloss_run("none")
    assert not any(stuck) and int(state.backoff) == STEPS
    with pytest.raises(ValueError, match="adaloss_state=opt_state"):
        _jax_adaloss_run("omitted")


def test_gradients_from_a_backward_without_the_state_are_refused_in_every_idiom():
    from flax import nnx
    from flax.training.train_state import TrainState

    params, tok, y, loss = _jax_lm(batch=8)
    tx = jax_adaloss.adaloss(inner=optax.adam(1e-3))
    remedy = "adaloss_state=opt_state"
    grads = jax.jit(jax_adaloss.grad(loss))(params, tok, y)
    assert all(isinstance(g, jax_adaloss.StatelessScaledGrad) for g in grads.values())
    with pytest.raises(ValueError, match=remedy):  # the optax idiom, under jit
        jax.jit(tx.update)(grads, tx.init(params), params)
    with pytest.raises(ValueError, match=remedy):  # adaloss as a link of a chain
        chain = optax.chain(jax_adaloss.adaloss(), optax.adam(1e-3))
        chain.update(grads, chain.init(params), params)
    with pytest.raises(ValueError, match=remedy):  # accumulated micro-batches keep the mark
        tx.update(jax_adaloss.tree_add(grads, jax_adaloss.grad(loss)(params, tok, y, adaloss_state=None)),
                  tx.init(params), params)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(ValueError, match=remedy):
        state.apply_gradients(grads=grads)
    told = jax_adaloss.grad(loss)(params, tok, y, adaloss_state=state.opt_state)
    assert int(optax.tree.get(state.apply_gradients(grads=told).opt_state, "skipped")) == 0

    model = nnx.Linear(D, V, dtype=jnp.float16, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.ones((8, D), jnp.float16)

    def nnx_loss(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x).astype(jnp.float32), y).mean()
    with pytest.raises(ValueError, match=remedy):
        optimizer.update(model, jax_adaloss.grad(nnx_loss)(model))
    optimizer.update(model, jax_adaloss.grad(nnx_loss)(model, adaloss_state=optimizer.opt_state))


def test_adaloss_state_keyword_must_hold_the_transformation_state():
    params, tok, y, loss = _jax_lm(batch=8)
    with pytest.raises(TypeError, match="adaloss_state"):
        jax_adaloss.value_and_grad(loss)(params, tok, y, adaloss_state={"not": jnp.zeros(())})
    inner = optax.chain(optax.clip(1.0), jax_adaloss.adaloss(inner=optax.adam(1e-3)))
    value, _ = jax_adaloss.value_and_grad(loss)(params, tok, y, adaloss_state=inner.init(params))
    assert np.isfinite(float(value))


# -- torch: fp32 parameters under autocast; the node computes the head's weight gradient in fp16
class _LM(torch.nn.Module):
    """An LM head; a per-class gain of ``temperature`` multiplies the fp16 logits (after the
    head, before the fp32 loss), an amplifying op between the loss cast's decision and the head
    that no cap sees (a tensor, not a scalar factor)."""

    def __init__(self, temperature=1.0):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.W = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V)
        torch.nn.init.normal_(self.head.weight, 0, 1)
        self.register_buffer("gain", torch.full((V,), float(temperature)))

    def forward(self, t):
        return self.head(torch.tanh(self.W(self.emb(t)))) * self.gain


def _torch_run(make_scaler, batch=8192, temperature=1.0):
    torch.manual_seed(0)
    model = _LM(temperature)
    tok, y = torch.randint(0, V, (batch,)), torch.randint(0, V, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = make_scaler(model)
    finite = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tok)
        loss = torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        found = sum(v.item() for v in scaler._per_optimizer[id(opt)]["found_inf"].values()) \
            if isinstance(scaler, torch_bridge.AdaLossScaler) else \
            sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        finite.append(found == 0)
        scaler.step(opt)
        scaler.update()
    return finite, scaler


def test_torch_linear_weight_gradient_is_capped_where_gradscaler_overflows():
    # the head's weight gradient, a sum over 8192 rows computed by the node in fp16, is
    # capped (adaloss.solver.weight_grad_cap): no step is skipped; without the cap 4 were
    ada, scaler = _torch_run(torch_bridge.AdaLossScaler)
    gs, _ = _torch_run(lambda m: torch.amp.GradScaler("cpu"))
    assert all(ada) and scaler.backoff == 0, ada
    assert not any(gs), gs  # GradScaler skips all 10 (2^16 → 64)


def test_torch_overflow_no_cap_sees_backs_off_no_slower_than_gradscaler():
    # the gain between the loss's cast and the head: said, and where
    said = "reaches layer 'head.weight', and the one that reached 'cast:0'"
    with pytest.warns(SkippedStepsWarning, match=said):
        ada, scaler = _torch_run(torch_bridge.AdaLossScaler, temperature=30.0)
    gs, _ = _torch_run(lambda m: torch.amp.GradScaler("cpu"), temperature=30.0)
    assert not ada[0], "the fp16 gain must overflow the capped cotangent at first"
    assert ada[-1] and all(ada[ada.index(True):]), ada
    assert _run_lengths(ada) <= _run_lengths(gs), (ada, gs)
    assert scaler.backoff == ada.index(True) and scaler.skipped_steps == ada.index(True)
    # the back-off exponent is checkpointed with the rest
    state = scaler.state_dict()
    fresh = torch_bridge.AdaLossScaler(_LM(30.0))
    fresh.load_state_dict(state)
    assert fresh.backoff == scaler.backoff and fresh.state_dict()["backoff"] == state["backoff"]


class _ConvLM(torch.nn.Module):
    """A tied-embedding LM with a Conv1d: the convolution's node computes its weight gradient in
    fp16 from the scaled cotangent, a sum over every batch row and position."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.conv = torch.nn.Conv1d(D, D, 3, padding=1)

    def forward(self, t):
        h = self.conv(self.emb(t).transpose(1, 2)).transpose(1, 2)
        return h @ self.emb.weight.t()


def test_torch_conv_weight_gradient_is_capped_where_it_would_overflow():
    # 32 x 256 positions at loss x1e-6: uncapped, the fp16 conv.weight gradient is inf on the
    # first pass (one skipped step); the Cauchy-Schwarz cap over channels keeps it finite
    def run(make_scaler):
        torch.manual_seed(0)
        model = _ConvLM()
        g = torch.Generator().manual_seed(1)
        tok, y = torch.randint(0, V, (32, 256), generator=g), torch.randint(0, V, (32, 256), generator=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = make_scaler(model)
        finite = []
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tok)
            loss = 1e-6 * torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1),
                                                            reduction="sum")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            finite.append(all(torch.isfinite(p.grad).all() for p in model.parameters()))
            scaler.step(opt)
            scaler.update()
        return finite, scaler

    ada, scaler = run(torch_bridge.AdaLossScaler)
    gs, _ = run(lambda m: torch.amp.GradScaler("cpu"))
    assert all(ada) and scaler.skipped_steps == 0, ada
    assert ada.count(False) <= gs.count(False)
    conv = next(r for k, r in scaler.layer_reports().items() if k.startswith("conv.weight"))
    assert float(conv.unrounded_scale) < float(conv.model_scale), "the cap must be what holds the scale"


def _finite_steps(model, x, y, make_scaler, loss_fn, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler, finite = make_scaler(model), []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(loss_fn(out.float(), y)).backward()
        scaler.unscale_(opt)
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        scaler.step(opt)
        scaler.update()
    return finite


class _Stem(torch.nn.Module):
    """A strided convolution on images, summed into logits: a first layer (its input needs no
    gradient, so no decision) whose fp16 weight and bias gradients sum 64 × 64 positions."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 10, 4, stride=4)

    def forward(self, x):
        return self.proj(x).sum((2, 3))


def test_torch_first_layer_weight_gradient_is_capped():
    # confident logits (×30, in fp32): the loss cast lifts the cotangent to the overflow cap,
    # and the first layer's bias gradient sums it over every row and position. Unguarded it was
    # inf at every step; GradScaler from 2^16 skips its first steps
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)

    def xent(z, y):
        return torch.nn.functional.cross_entropy(30.0 * z, y, reduction="sum")

    torch.manual_seed(0)
    model = _Stem()
    with warnings.catch_warnings():  # a first layer alone is not a missed layer: no warning
        warnings.simplefilter("error", AdaLossCoverageWarning)
        ada = _finite_steps(model, x, y, torch_bridge.AdaLossScaler, xent)
    gs = _finite_steps(model, x, y, lambda m: torch.amp.GradScaler("cpu"), xent)
    assert all(ada), ada
    assert not gs[0]


class _SplitBias(torch.nn.Module):
    """A linear head on a non-contiguous 3-D input: PyTorch adds its bias apart from the matmul
    (an ``AddBackward0`` whose bias gradient is a fp16 sum over 32 × 256 rows), after per-position
    gains that spread the cotangent over five decades."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 32, 4, stride=4)
        self.head = torch.nn.Linear(32, 10)
        self.register_buffer("gain", torch.logspace(-5, 0, 256).reshape(1, 1, 16, 16))

    def forward(self, x):
        return self.head((self.proj(x) * self.gain).flatten(2).transpose(1, 2)).sum(1)


def test_torch_bias_added_apart_from_its_matmul_is_capped():
    # unguarded, head.bias's gradient was inf at every step (the back-off halved the scales
    # each time); GradScaler's is finite here
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 10, (32,), generator=g)

    def xent(z, y):
        return 1e-6 * torch.nn.functional.cross_entropy(z, y, reduction="sum")

    torch.manual_seed(0)
    model = _SplitBias()
    assert all(_finite_steps(model, x, y, torch_bridge.AdaLossScaler, xent))
    assert all(_finite_steps(model, x, y, lambda m: torch.amp.GradScaler("cpu"), xent))
