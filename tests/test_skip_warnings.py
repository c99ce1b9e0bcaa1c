"""Skipped steps are never silent: after a few in a row both fronts warn once per run, naming
the cause (adaloss.skips): a forward overflow, or the layer whose backward made the inf/NaN."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
import torch

import jax_adaloss
from adaloss.skips import (
    RATE_WINDOW,
    LayerCheck,
    SkipCause,
    SkipDiagnosis,
    SkippedStepsWarning,
    SkipRate,
    diagnose,
)
from torch_bridge import AdaLossScaler

STEPS = 5


# -- the diagnosis, on hand-made facts ---------------------------------------------------------
@pytest.mark.parametrize("loss_finite, layers, grads, expected", [
    (False, [LayerCheck("a", "a", False)], {"a": False}, SkipDiagnosis(SkipCause.LOSS)),
    (True, [LayerCheck("cast:0", None, True), LayerCheck("b", "b", True), LayerCheck("a", "a", False)],
     {"a": False, "b": True}, SkipDiagnosis(SkipCause.COTANGENT, "a", "b")),
    (True, [LayerCheck("b", "b", True), LayerCheck("a", "a", False)], {"a": False, "b": False},
     SkipDiagnosis(SkipCause.WEIGHT_GRADIENT, "b")),
    (True, [LayerCheck("b", "b", False)], {"b": False}, SkipDiagnosis(SkipCause.COTANGENT, "b", None)),
    (True, [LayerCheck("b", "b", True), LayerCheck("a@1", "a", True)], {"a": False, "b": True},
     SkipDiagnosis(SkipCause.WEIGHT_GRADIENT, "a@1")),
    (True, [LayerCheck("b", "b", True)], {"bias": False, "b": True},
     SkipDiagnosis(SkipCause.GRADIENT, "bias")),
    (True, [LayerCheck("b", "b", True)], {"b": True}, SkipDiagnosis(SkipCause.UNKNOWN)),
])
def test_diagnosis_names_the_first_non_finite_value_from_the_loss(loss_finite, layers, grads, expected):
    got = diagnose(loss_finite, layers, grads)
    assert got == expected
    assert got.describe()  # every cause has its sentence
    if got.where is not None:
        assert repr(got.where) in got.describe()


def test_skip_rate_says_frequent_skips_once_and_again_after_they_fell():
    rate = SkipRate()
    said = [i for i in range(3 * RATE_WINDOW) if rate.note(i % 3 == 0)]  # one in three
    assert said == [RATE_WINDOW - 1]  # once the window is full, then not again
    quiet = [i for i in range(RATE_WINDOW) if rate.note(False)]  # the share falls to 0
    again = [i for i in range(RATE_WINDOW) if rate.note(i % 2 == 0)]
    assert quiet == [] and len(again) == 1
    assert "of the last 100 optimizer steps were skipped" in rate.text(SkipDiagnosis(SkipCause.LOSS), 7, 9)


# -- PyTorch ---------------------------------------------------------------------------------
class _InfInBackward(torch.autograd.Function):
    """Identity whose backward makes every cotangent inf: an overflow inside the backward of
    the ops between two layers."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


class _Net(torch.nn.Module):
    def __init__(self, fault=None):
        super().__init__()
        self.inp, self.hidden, self.out = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                           torch.nn.Linear(16, 4))
        self.fault = fault

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = self.hidden(h)
        if self.fault == "backward":
            h = _InfInBackward.apply(h)
        return self.out(torch.relu(h))


def _torch_run(fault, steps=STEPS):
    torch.manual_seed(0)
    model = _Net(fault)
    if fault == "forward":  # a layer whose output leaves fp16's range: the loss is inf
        with torch.no_grad():
            model.hidden.weight.mul_(1e5)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = AdaLossScaler(model)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return scaler, [w for w in caught if issubclass(w.category, SkippedStepsWarning)]


@pytest.mark.parametrize("fault, cause, where, after", [
    ("forward", SkipCause.LOSS, None, None),
    ("backward", SkipCause.COTANGENT, "hidden.weight", "out.weight"),
])
def test_torch_warns_once_with_the_cause(fault, cause, where, after):
    scaler, said = _torch_run(fault)
    assert scaler.skipped_steps == STEPS and scaler.consecutive_skipped == STEPS
    assert len(said) == 1 and "3 optimizer steps skipped in a row" in str(said[0].message)
    assert scaler.last_skip == SkipDiagnosis(cause, where, after)
    assert scaler.skip_causes == {cause.value: STEPS}
    assert scaler.last_skip.describe() in str(said[0].message)
    assert said[0].filename == __file__  # it points at the training loop


def test_torch_frequent_skips_never_three_in_a_row_are_said():
    """A forward that overflows on every third batch skips a third of the steps, never three in
    a row: said once, with the cause, when the last 100 steps hold more than 20 skipped."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    scaler = AdaLossScaler(model, fuse_decisions=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(RATE_WINDOW):
            x = torch.randn(16, 8) * (1e6 if i % 3 == 2 else 1.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), torch.zeros(16, 4))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    said = [str(w.message) for w in caught if issubclass(w.category, SkippedStepsWarning)]
    assert scaler.skipped_steps == RATE_WINDOW // 3 and scaler.skip_causes == {"loss": RATE_WINDOW // 3}
    assert len(said) == 1 and "33 of the last 100 optimizer steps were skipped" in said[0]
    assert SkipDiagnosis(SkipCause.LOSS).describe() in said[0]


def test_torch_isolated_skips_are_counted_not_warned():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = AdaLossScaler(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedStepsWarning)
        for i in range(6):
            x = torch.randn(16, 8)
            if i in (1, 2, 4):  # two runs, of two and one
                x[0, 0] = float("nan")
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), torch.zeros(16, 4))).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.skipped_steps == 3 and scaler.consecutive_skipped == 0
    assert scaler.skip_causes == {"loss": 3}
    assert scaler.state_dict()["skips"] == {"in_a_row": 0, "iterations": 3, "causes": {"loss": 3}}


# -- JAX ---------------------------------------------------------------------------------------
@jax.custom_vjp
def _inf_in_backward(x):
    return x


_inf_in_backward.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.inf,))


def _jax_params(forward_overflow):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {name: jax.random.normal(k, shape) / shape[0] ** 0.5
         for name, k, shape in zip(("inp", "hidden", "out"), ks, ((8, 16), (16, 16), (16, 4)))}
    if forward_overflow:
        p["hidden"] = p["hidden"] * 1e5
    return p


def _jax_run(fault, monitor):
    params = _jax_params(fault == "forward")
    x, y = jax.random.normal(jax.random.PRNGKey(1), (16, 8)), jnp.zeros((16, 4))

    def loss_fn(p, x, y):
        h = jax.nn.relu(x.astype(jnp.float16) @ p["inp"].astype(jnp.float16))
        h = h @ p["hidden"].astype(jnp.float16)
        if fault == "backward":
            h = _inf_in_backward(h)
        out = jax.nn.relu(h) @ p["out"].astype(jnp.float16)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    tx = jax_adaloss.adaloss(inner=optax.sgd(0.1))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        _, grads = jax_adaloss.value_and_grad(loss_fn)(params, x, y, adaloss_state=opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            params, opt_state = step(params, opt_state)
            monitor(opt_state)
        monitor.flush(opt_state)
    return opt_state, [w for w in caught if issubclass(w.category, SkippedStepsWarning)]


@pytest.mark.parametrize("fault, cause, where, after", [
    ("forward", SkipCause.LOSS, None, None),
    ("backward", SkipCause.COTANGENT, "hidden", "out"),
])
def test_jax_monitor_warns_once_with_the_cause(fault, cause, where, after):
    opt_state, said = _jax_run(fault, jax_adaloss.SkipMonitor())
    assert int(optax.tree.get(opt_state, "skipped")) == STEPS
    assert len(said) == 1 and "3 optimizer steps skipped in a row" in str(said[0].message)
    assert jax_adaloss.skip_diagnosis(opt_state) == SkipDiagnosis(cause, where, after)
    assert int(optax.tree.get(opt_state, "skip_step")) == STEPS - 1
    _, quiet = _jax_run(fault, jax_adaloss.SkipMonitor(after=None))
    assert quiet == []


def test_jax_monitor_says_frequent_skips_never_three_in_a_row():
    params = _jax_params(False)

    def loss_fn(p, x):
        h = jax.nn.relu(x.astype(jnp.float16) @ p["inp"].astype(jnp.float16))
        out = jax.nn.relu(h @ p["hidden"].astype(jnp.float16)) @ p["out"].astype(jnp.float16)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    tx = jax_adaloss.adaloss(inner=optax.sgd(0.01))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x):
        _, grads = jax_adaloss.value_and_grad(loss_fn)(params, x, adaloss_state=opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    monitor = jax_adaloss.SkipMonitor()
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(RATE_WINDOW):
            params, opt_state = step(params, opt_state, x * (1e6 if i % 3 == 2 else 1.0))
            monitor(opt_state)
        monitor.flush(opt_state)
    said = [str(w.message) for w in caught if issubclass(w.category, SkippedStepsWarning)]
    assert int(optax.tree.get(opt_state, "skipped")) == RATE_WINDOW // 3
    assert len(said) == 1 and "33 of the last 100 optimizer steps were skipped" in said[0]
    assert SkipDiagnosis(SkipCause.LOSS).describe() in said[0]


def test_jax_state_records_no_skip_on_clean_steps():
    params = _jax_params(False)
    tx = jax_adaloss.adaloss(inner=optax.sgd(0.1))
    opt_state = tx.init(params)
    grads = jax_adaloss.grad(lambda p: jnp.sum(p["inp"] ** 2) + jnp.sum(p["out"]))(
        params, adaloss_state=opt_state)
    _, opt_state = tx.update(grads, opt_state, params)
    assert jax_adaloss.skip_diagnosis(opt_state) is None
    with pytest.raises(ValueError, match="after must be"):
        jax_adaloss.SkipMonitor(after=0)
