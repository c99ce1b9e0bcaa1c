"""PyTorch's own GradScaler test cases, in our words, run with ``torch.amp.GradScaler("cpu")``
and with ``AdaLossScaler``: a drop-in passes every one.

Each case follows a grad-scaling test of PyTorch's ``test/test_torch.py`` (``TestTorchDeviceType``)
or ``test/test_cuda.py`` (``TestCudaOptims``, there CUDA-only; fused optimizers run on the CPU
too). The loops are PyTorch's: two identical two-layer linear models (one trained through the
scaler, the control without it), four batches, an inf written into the second layer's weight
gradient at the third, a scaler built by one factory. Where a test asserts GradScaler's own
numbers, the drop-in check replaces it, and the case says so (``REPLACES``):

- GradScaler's schedule (``get_scale() == 128 · 2^unskipped · 0.5^skipped``) by: the same steps
  skipped (GradScaler: its schedule still; AdaLossScaler: ``skipped_steps``), and the same
  parameters, gradients and optimizer state as the control loop, which skips the same step;
- its private tensors (``_scale``, ``_growth_tracker``, ``_per_optimizer_states``) by what they
  stand for: ``get_scale()`` finite, ``state_dict()`` equal, the copy training the same model.

Not here: tests of ATen kernels (``_amp_foreach_non_finite_check_and_unscale_``,
``_amp_update_scale_``), of private methods (``_unscale_grads_``), of the deprecated
``step(grad_scaler=...)`` protocol and ``torch.cuda.amp``'s deprecation, of CUDA graphs and of
several GPUs.
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch

from torch_bridge import AdaLossConfig, AdaLossScaler

_MSE = torch.nn.MSELoss()
_SKIP_ITER = 2
KINDS = ("GradScaler", "AdaLossScaler")


def make_scaler(kind: str, model: torch.nn.Module, enabled: bool = True, init_scale: float = 128.0,
                growth_interval: int = 1):
    """The one factory: GradScaler as PyTorch's tests build it, or AdaLossScaler on the model."""
    if kind == "GradScaler":
        return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0,
                                    growth_interval=growth_interval, enabled=enabled)
    config = AdaLossConfig() if init_scale == 128.0 else AdaLossConfig(init_scale=init_scale)
    return AdaLossScaler(model, config, enabled=enabled)


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def _models(opt_ctor=torch.optim.SGD, **opt_kwargs):
    """Two identical ``Linear(8, 8) → Linear(8, 8)`` models and their optimizers (lr 1 unless given)."""
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling = copy.deepcopy(control)
    kwargs = {"lr": 1.0, **opt_kwargs}
    return (control, scaling, opt_ctor(control.parameters(), **kwargs),
            opt_ctor(scaling.parameters(), **kwargs))


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(4)]


def _inject(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model[1].weight.grad.fill_(float("inf"))


def _control_step(loss, model, optimizer, scaler, i, max_norm=None):
    """The control loop's step: the plain backward, the same clipping, and the step skipped where
    the scaled loop writes its inf."""
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not (scaler.is_enabled() and i == _SKIP_ITER):
        optimizer.step()


def _inject_at(model, scaler, i):
    if i == _SKIP_ITER and scaler.is_enabled():
        _inject(model)


def _one_step(loss, model, optimizer, scaler, i, scaled, max_norm=None, after_backward=None,
              before_step=None):
    """One iteration of either loop: the control's (:func:`_control_step`), or the scaled
    backward, ``after_backward()``, the inf written at the skipped iteration, ``before_step()``,
    then the scaler's step and update."""
    if not scaled:
        _control_step(loss, model, optimizer, scaler, i, max_norm)
        return
    scaler.scale(loss).backward()
    if after_backward is not None:
        after_backward()
    _inject_at(model, scaler, i)
    if before_step is not None:
        before_step()
    scaler.step(optimizer)
    scaler.update()


def _skipped(scaler) -> int:
    if isinstance(scaler, AdaLossScaler):
        return scaler.skipped_steps
    return -1  # GradScaler counts no skips: its schedule says them (_check_skips)


def _check_skips(scaler, kind, enabled, unskipped, skipped):
    """REPLACES ``get_scale() == 128·2^unskipped·0.5^skipped``: GradScaler keeps its schedule,
    AdaLossScaler counts the same skipped steps; both give 1.0 when disabled."""
    if not enabled:
        assert scaler.get_scale() == 1.0
    elif kind == "GradScaler":
        assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
    else:
        assert scaler.skipped_steps == skipped and math.isfinite(scaler.get_scale())


def _assert_same(control, scaling, opt_c, opt_s, atol, grads=True):
    for c, s in zip(control.parameters(), scaling.parameters()):
        if grads:
            assert (c.grad is None) == (s.grad is None)
            if c.grad is not None:
                torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=1e-5)
        for k, v in opt_c.state[c].items():
            torch.testing.assert_close(opt_s.state[s][k], v, atol=atol, rtol=1e-5, msg=k)
        torch.testing.assert_close(s, c, atol=atol, rtol=1e-5)


def _run_case(kind, run, unskipped, skipped, atol=1e-7, opt_ctor=torch.optim.SGD, **opt_kwargs):
    """PyTorch's ``_run_scaling_case``: enabled and disabled, the control loop then the scaled
    one with the same scaler, then the drop-in checks."""
    for enabled in (True, False):
        torch.manual_seed(0)
        control, scaling, opt_c, opt_s = _models(opt_ctor, **opt_kwargs)
        data = _data()
        scaler = make_scaler(kind, scaling, enabled)
        run(data, control, opt_c, scaler, False)
        scaler = run(data, scaling, opt_s, scaler, True) or scaler
        _check_skips(scaler, kind, enabled, unskipped, skipped)
        _assert_same(control, scaling, opt_c, opt_s, atol)


# -- test_pickle_gradscaler ---------------------------------------------------------------
@pytest.mark.parametrize("after_scale", [False, True])
def test_pickled_fresh_scaler_trains_the_live_model(kind, after_scale):
    """REPLACES the unpickled ``get_scale() == 3`` and ``_per_optimizer_states`` checks: the copy
    has the same state and trains the live model as the original would."""
    torch.manual_seed(0)
    control, scaling, opt_c, opt_s = _models()
    a, b_ref = make_scaler(kind, scaling), make_scaler(kind, control)
    if after_scale:  # GradScaler creates its scale tensor here; ours prepares a backward
        a.scale(_MSE(scaling(torch.ones(8, 8)), torch.zeros(8, 8)))
    b = pickle.loads(pickle.dumps(a))
    assert b.is_enabled() == a.is_enabled() and b.get_scale() == a.get_scale()
    assert _same_state(b.state_dict(), a.state_dict())
    for x, y in _data():
        for model, opt, scaler in ((scaling, opt_s, b), (control, opt_c, b_ref)):
            opt.zero_grad()
            scaler.scale(_MSE(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
    _assert_same(control, scaling, opt_c, opt_s, 1e-7)
    if kind == "AdaLossScaler":
        assert set(b.grad_scales()) == {n for n, _ in scaling.named_parameters()}


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


# -- test_grad_scaling_unscale: gradients of any layout ----------------------------------
def test_unscale_finds_inf_in_strided_and_sliced_gradients(kind):
    """REPLACES the private ``_unscale_grads_`` call with ``unscale_`` after a real backward whose
    gradients were given non-contiguous layouts (a transposed copy, a slice of a wider tensor):
    unscaled to the control's values, an inf found wherever it is written."""
    torch.manual_seed(0)
    for inject in range(-1, 4):
        control, scaling, opt_c, opt_s = _models()
        scaler = make_scaler(kind, scaling)
        x, y = _data()[0]
        _MSE(control(x), y).backward()
        scaler.scale(_MSE(scaling(x), y)).backward()
        for k, p in enumerate(scaling.parameters()):
            g = p.grad
            wide = torch.zeros(*g.shape[:-1], 2 * g.shape[-1])
            wide[..., : g.shape[-1]] = g
            p.grad = wide[..., : g.shape[-1]] if k % 2 else g.t().contiguous().t()
            assert not p.grad.is_contiguous() or g.dim() == 1
            if k == inject:
                p.grad.view(-1)[0:1].fill_(float("inf")) if p.grad.is_contiguous() else p.grad[0, 0].fill_(
                    float("inf"))
        scaler.unscale_(opt_s)
        if inject < 0:
            for c, s in zip(control.parameters(), scaling.parameters()):
                torch.testing.assert_close(s.grad, c.grad, atol=1e-7, rtol=1e-5)
        scaler.step(opt_s)
        scaler.update()
        assert _skipped_now(scaler, kind) == (inject >= 0)


def _skipped_now(scaler, kind) -> bool:
    if kind == "GradScaler":
        return scaler.get_scale() < 128.0
    return scaler.last_step_skipped


# -- test_grad_scaling_unscale_sparse --------------------------------------------------------
class _Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8, sparse=True)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, idx):
        return self.out(self.emb(idx))


def test_sparse_gradients_are_unscaled_and_checked(kind):
    """REPLACES the private ``_unscale_grads_`` on a hand-made sparse tensor with an
    ``nn.Embedding(sparse=True)`` trained by SGD: the sparse gradient unscaled to the control's,
    an inf or a NaN in its values skips the step; fp16 gradients are refused by both."""
    for bad in ("inf", "nan"):
        torch.manual_seed(0)
        control = _Bag()
        scaling = copy.deepcopy(control)
        opt_c, opt_s = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (control, scaling))
        scaler = make_scaler(kind, scaling)
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            idx, y = torch.randint(0, 16, (8,), generator=g), torch.randn(8, 8, generator=g)
            for model, opt, scaled in ((control, opt_c, False), (scaling, opt_s, True)):
                opt.zero_grad()
                loss = _MSE(model(idx), y)
                if not scaled:
                    loss.backward()
                    if i != _SKIP_ITER:
                        opt.step()
                    continue
                scaler.scale(loss).backward()
                assert model.emb.weight.grad.is_sparse
                if i == _SKIP_ITER:
                    model.emb.weight.grad._values()[0, 0] = float(bad)
                scaler.unscale_(opt)
                if i != _SKIP_ITER:
                    torch.testing.assert_close(model.emb.weight.grad.to_dense(),
                                               control.emb.weight.grad.to_dense(), atol=1e-7, rtol=1e-5)
                scaler.step(opt)
                scaler.update()
        _check_skips(scaler, kind, True, 3, 1)
        for c, s in zip(control.parameters(), scaling.parameters()):
            torch.testing.assert_close(s, c, atol=1e-7, rtol=1e-5)
    half = torch.nn.Embedding(4, 2, sparse=True).half()
    scaler = make_scaler(kind, half)
    scaler.scale(half(torch.tensor([0, 1, 1])).float().sum()).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(torch.optim.SGD(half.parameters(), lr=1.0))


# -- test_grad_scaling_state_dict ------------------------------------------------------------
def test_state_dict_round_trip(kind):
    """REPLACES ``get_growth_factor() == 4`` and ``_init_growth_tracker == 0`` with: the loaded
    scaler gives the same ``get_scale()`` and ``state_dict()``, and trains a copy of the model
    exactly as the one it was saved from. GradScaler's load overwrites the constructor's
    arguments; AdaLossScaler's config is not state, and a state saved with another raises."""
    torch.manual_seed(0)
    control, scaling, opt_c, opt_s = _models(lr=0.1)
    s0 = make_scaler(kind, scaling)
    for i, (x, y) in enumerate(_data()[:3]):
        opt_s.zero_grad()
        s0.scale(_MSE(scaling(x), y)).backward()
        if i == 1:
            _inject(scaling)
        s0.step(opt_s)
        s0.update()
    control.load_state_dict(scaling.state_dict())
    opt_c.load_state_dict(opt_s.state_dict())
    if kind == "GradScaler":  # its hyperparameters are state: the load overwrites them
        s1 = make_scaler(kind, control, init_scale=6.0)
    else:  # a config is the user's: loading a state saved with another one raises, naming it
        with pytest.raises(ValueError, match="init_scale"):
            make_scaler(kind, control, init_scale=6.0).load_state_dict(s0.state_dict())
        s1 = make_scaler(kind, control)
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == s0.get_scale() and _same_state(s1.state_dict(), s0.state_dict())
    x, y = _data()[3]
    for model, opt, scaler in ((scaling, opt_s, s0), (control, opt_c, s1)):
        opt.zero_grad()
        scaler.scale(_MSE(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    _assert_same(control, scaling, opt_c, opt_s, 1e-7)


# -- test_grad_scaling_autocast (pickled mid-training or not) ------------------------------
@pytest.mark.parametrize("impl", ["default", "foreach", "fused"])
@pytest.mark.parametrize("opt_ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW],
                         ids=["SGD", "Adam", "AdamW"])
def test_autocast_training_pickled_after_every_update_or_not(kind, opt_ctor, impl):
    """REPLACES the fp32 control loop (against which PyTorch expects Adam and AdamW at lr 1 to
    diverge, an ``assertRaises(AssertionError)``) with the same loop under the same fp16
    autocast, unscaled: every optimizer must then match it, pickled or not."""
    kwargs = {"foreach": impl == "foreach" or None, "fused": impl == "fused" or None}
    for pickle_it in (False, True):
        def run(data, model, optimizer, scaler, scaled, pickle_it=pickle_it):
            for i, (x, y) in enumerate(data):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = _MSE(model(x), y)
                _one_step(loss, model, optimizer, scaler, i, scaled)
                if scaled and pickle_it:
                    scaler = pickle.loads(pickle.dumps(scaler))
            return scaler

        _run_case(kind, run, 3, 1, atol=1e-3, opt_ctor=opt_ctor, **kwargs)


# -- test_params_invalidated_with_grads_invalidated_between_unscale_and_step ------------------
@pytest.mark.filterwarnings("ignore::adaloss.skips.SkippedStepsWarning")  # (the NaN parameters' loss)
@pytest.mark.parametrize("opt_ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW],
                         ids=["SGD", "Adam", "AdamW"])
def test_gradients_broken_after_unscale_reach_the_parameters(kind, opt_ctor):
    """The inf/NaN check happens in ``unscale_``: gradients made non-finite after it are stepped
    with (no second check), for every implementation, as in PyTorch."""
    for kwargs in ({"foreach": False, "fused": False}, {"foreach": True}, {"fused": True},
                   {"weight_decay": 0.1, "foreach": True}):
        torch.manual_seed(0)
        model, _, optimizer, _ = _models(opt_ctor, **kwargs)
        scaler = make_scaler(kind, model)
        for x, y in _data():
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _MSE(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            for j, p in enumerate(model.parameters()):
                p.grad.copy_(torch.full_like(p.grad, float("inf") if j % 2 else float("nan")))
            scaler.step(optimizer)
            scaler.update()
        assert all(p.isnan().any() or p.isinf().any() for p in model.parameters()), kwargs


# -- test_grad_scale_will_not_overflow ------------------------------------------------------
def test_a_huge_initial_scale_does_not_overflow(kind):
    """REPLACES ``_scale`` neither inf nor NaN with ``get_scale()`` finite, and parameters finite."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = (torch.amp.GradScaler("cpu", growth_interval=1, growth_factor=2**4, init_scale=1e38)
              if kind == "GradScaler" else make_scaler(kind, model, init_scale=1e38))
    optimizer.zero_grad()
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert math.isfinite(scaler.get_scale())
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- test_grad_scaling_clipping (with and without a separate unscale_) -----------------------
def test_clipping_at_max_norm_times_get_scale(kind):
    """Clipping the still-scaled gradients at ``max_norm · get_scale()`` clips as the control's
    ``max_norm``: AdaLossScaler's ``get_scale()`` brings every gradient to carry it first."""
    max_norm = 0.2

    def run(data, model, optimizer, scaler, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = _MSE(model(x), y)
            _one_step(loss, model, optimizer, scaler, i, scaled, max_norm, after_backward=lambda: (
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())))

    _run_case(kind, run, 3, 1, atol=1e-5)


def test_clipping_after_a_separate_unscale(kind):
    max_norm = 0.2

    def run(data, model, optimizer, scaler, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = _MSE(model(x), y)
            def unscale_and_clip():
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            _one_step(loss, model, optimizer, scaler, i, scaled, max_norm, before_step=unscale_and_clip)

    _run_case(kind, run, 3, 1)


# -- test_grad_scaling_penalty ----------------------------------------------------------------
def test_gradient_penalty_through_a_double_backward(kind):
    """``torch.autograd.grad(scaler.scale(loss), params, create_graph=True)`` divided by
    ``get_scale()``, the penalty's norm added to the loss, then its scaled backward: AdaLossScaler
    gives that first backward one global scale (and says so once)."""
    def run(data, model, optimizer, scaler, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = _MSE(model(x), y)
            params = list(model.parameters())
            if scaled:
                grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grads = [g * inv_scale for g in grads]
            else:
                grads = torch.autograd.grad(loss, params, create_graph=True)
            loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            _one_step(loss, model, optimizer, scaler, i, scaled)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_case(kind, run, 3, 1)
    said = [w for w in caught if "one global scale" in str(w.message)]
    assert len(said) == (1 if kind == "AdaLossScaler" else 0)


# -- test_grad_scaling_accumulation -----------------------------------------------------------
def test_accumulation_over_two_backwards(kind):
    def run(data, model, optimizer, scaler, scaled):
        for i, (x, y) in enumerate(data):
            loss = _MSE(model(x), y) / 2
            (scaler.scale(loss) if scaled else loss).backward()
            if (i + 1) % 2 == 0:
                if scaled:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    _run_case(kind, run, 2, 0)


# -- test_grad_scaling_multiple -----------------------------------------------------------------
def test_two_models_two_losses_two_optimizers_one_scaler(kind):
    """Only the optimizer whose gradients hold the inf skips; AdaLossScaler is built on both
    models (a ``ModuleList``)."""
    for enabled in (True, False):
        torch.manual_seed(0)
        c0, s0, oc0, os0 = _models()
        c1, s1, oc1, os1 = _models()
        scaler = make_scaler(kind, torch.nn.ModuleList([s0, s1]), enabled)
        for i, (x, y) in enumerate(_data()):
            for m0, m1, o0, o1, scaled in ((c0, c1, oc0, oc1, False), (s0, s1, os0, os1, True)):
                o0.zero_grad()
                o1.zero_grad()
                out0, out1 = m0(x), m1(x)
                loss0 = _MSE(0.3 * out0 + 0.7 * out1, y)
                loss1 = _MSE(0.6 * out0 - 0.4 * out1, y)
                if not scaled:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    o0.step()
                    if not (enabled and i == _SKIP_ITER):
                        o1.step()
                    continue
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == _SKIP_ITER and enabled:
                    _inject(m1)
                scaler.unscale_(o0)
                scaler.step(o0)
                scaler.step(o1)
                scaler.update()
        if kind == "GradScaler" and enabled:
            assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5
        elif enabled:
            assert scaler.skipped_steps == 1
        for c, s in zip([*c0.parameters(), *c1.parameters()], [*s0.parameters(), *s1.parameters()]):
            torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


# -- test_grad_scaler_pass_itself (the attribute protocol) ------------------------------------
class _AmpAwareSGD(torch.optim.Optimizer):
    """An optimizer with ``_step_supports_amp_scaling``: it unscales by ``self.grad_scale`` and
    skips on ``self.found_inf`` where a scaler sets them (GradScaler), else takes ``.grad`` as
    the true gradient (AdaLossScaler unscales before calling it)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        scale, found = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found is not None and found.item():
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if scale is not None:  # (as a fused kernel does: in place)
                        p.grad.div_(scale)
                    p.sub_(group["lr"] * p.grad)


def test_optimizers_that_support_amp_scaling_step_on_true_gradients(kind):
    """REPLACES ``isinstance(grad_scaler, torch.amp.GradScaler)`` and the attributes' types with:
    the optimizer's update equals the control's, and the skipped step is skipped."""
    def run(data, model, optimizer, scaler, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = _MSE(model(x), y)
            _one_step(loss, model, optimizer, scaler, i, scaled)
            assert not scaled or not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")

    _run_case(kind, run, 3, 1, opt_ctor=_AmpAwareSGD)


# -- test_grad_scaling_autocast_fused_optimizers (test_cuda.py; fused runs on the CPU) ----------
@pytest.mark.parametrize("opt_ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad],
                         ids=["SGD", "Adam", "Adagrad"])
def test_fused_optimizers_match_the_for_loop(kind, opt_ctor):
    """A fused optimizer (which takes ``grad_scale``/``found_inf`` from GradScaler) against its
    for-loop form, each with its own scaler, with and without a separate ``unscale_``."""
    for separate_unscale in (True, False):
        torch.manual_seed(20)
        control, scaling, _, _ = _models()
        opt_c = opt_ctor(control.parameters(), lr=0.1, foreach=False)
        opt_s = opt_ctor(scaling.parameters(), lr=0.1, fused=True)
        scalers = make_scaler(kind, control, growth_interval=2000), make_scaler(kind, scaling,
                                                                                growth_interval=2000)
        for x, y in _data(20):
            for model, opt, scaler, unscale in ((control, opt_c, scalers[0], False),
                                                (scaling, opt_s, scalers[1], separate_unscale)):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = _MSE(model(x), y)
                scaler.scale(loss).backward()
                if unscale:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            _assert_same(control, scaling, opt_c, opt_s, 2e-5)
