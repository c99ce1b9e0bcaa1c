"""AdaLossScaler's GradScaler/Apex-style interface: loop, order errors, skipping,
checkpointing, telemetry, host synchronisation."""

import copy
import gc
import logging
import pickle
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch_models import MLP, make_case, xent

from adaloss import decisions
from torch_bridge import AdaLossConfig, AdaLossScaler, _xp
from torch_bridge import fused as fused_module
from torch_bridge import scaler as scaler_module
from torch_bridge.fused import FusedMath


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g)


def _loss(model, x, y, factor=1e-4):
    with torch.autocast("cpu", dtype=torch.float16):
        return factor * xent(model(x), y)


def _train(model, scaler, opt, steps):
    losses = []
    for i in range(steps):
        x, y = _batch(i % 4)
        opt.zero_grad()
        loss = _loss(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses


def test_import_does_not_import_jax():
    code = ("import sys, torch_bridge; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'jax_adaloss')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_drop_in_for_gradscaler_trains_like_it():
    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    ours = _train(model, AdaLossScaler(model), torch.optim.Adam(model.parameters(), 1e-2), 30)
    theirs = _train(ref, torch.amp.GradScaler("cpu"), torch.optim.Adam(ref.parameters(), 1e-2), 30)
    assert ours[-1] < 0.7 * ours[0]
    assert abs(ours[-1] - theirs[-1]) < 0.05 * theirs[-1]


def test_grad_scales_and_layer_reports():
    torch.manual_seed(0)
    model = MLP()
    scaler = AdaLossScaler(model)
    x, y = _batch()
    scaler.scale(_loss(model, x, y, 1e-6)).backward()
    scales = scaler.grad_scales()
    assert set(scales) == {n for n, _ in model.named_parameters()}
    for s in scales.values():
        assert s.dtype == torch.float32 and s.dim() == 0 and s > 0
        assert torch.frexp(s).mantissa == 0.5  # a power of two
    reps = scaler.layer_reports()
    assert list(reps) == ["net.2.weight", "net.4.weight", "cast:0"]  # forward order
    (site,) = scaler.cast_sites().items()  # what the cast casts: the logits, widened by the loss
    assert site[0] == "cast:0" and re.fullmatch(r"float16 → float32 \(\d+, 10\) at \w+Backward\d*", site[1])
    assert int(reps["net.2.weight"].fan_in) == 64 and int(reps["net.4.weight"].fan_in) == 10
    for r in reps.values():
        assert 0.0 <= float(r.predicted_underflow) <= 1.0
        assert float(r.outgoing_scale) == float(r.incoming_scale * r.scale)
        assert float(r.scale) <= float(r.unrounded_scale) < 2 * float(r.scale)
    # the node computes the output layer's weight gradient from s·g in fp16: it carries the
    # scale leaving that layer, P·s, and is never rescaled in fp16 (unscaled once, in fp32)
    assert float(scales["net.4.weight"]) == float(reps["net.4.weight"].outgoing_scale)
    assert float(scales["net.4.weight"]) > float(reps["net.4.weight"].incoming_scale)


def test_calls_in_the_wrong_order_raise():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = AdaLossScaler(model)
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        scaler.update()
    with pytest.raises(RuntimeError, match="none of its parameters has a gradient"):
        scaler.step(opt)
    x, y = _batch()
    scaler.scale(_loss(model, x, y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: None)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="being called after step"):
        scaler.unscale_(opt)
    scaler.update()


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="nn.Module"):
        AdaLossScaler("model")
    with pytest.raises(TypeError, match="fuse_decisions"):
        AdaLossScaler(MLP(), fuse_decisions=1)
    with pytest.raises(ValueError, match="auto.*backend.*tvm"):
        AdaLossScaler(MLP(), fuse_decisions="tvm")
    fused = FusedMath("eager")
    with pytest.raises(TypeError, match="0-d tensors"):  # a decision reads statistics, not tensors
        fused(decisions.cast, (AdaLossConfig(),), None, None, torch.ones(3), None, None, None)
    with pytest.raises(TypeError, match="tensors, got float"):  # a number would be baked in
        fused.call(decisions.cast, (AdaLossConfig(),), None, None, 1.0, None, None, None)
    with pytest.raises(ValueError, match="max_shapes"):
        FusedMath(max_shapes=0)
    with pytest.raises(TypeError, match="AdaLossConfig"):
        AdaLossScaler(MLP(), {"threshold": 1e-3})
    scaler = AdaLossScaler(MLP())
    with pytest.raises(TypeError, match="expects a tensor"):
        scaler.scale(1.0)
    with pytest.raises(RuntimeError, match="no autograd graph"):
        with torch.no_grad():
            scaler.scale(xent(scaler._model(_batch()[0]), _batch()[1]))


def test_unscale_before_clipping_then_step_does_not_unscale_again():
    torch.manual_seed(0)
    model = MLP()
    x, y = _batch()
    ref = torch.autograd.grad(1e-4 * xent(model(x), y), list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), 0.0)
    scaler = AdaLossScaler(model)
    scaler.scale(_loss(model, x, y)).backward()
    scaler.unscale_(opt)
    _assert_grads_near(model, ref, 0.1)
    before = [p.grad.clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    scaler.step(opt)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_non_finite_gradient_skips_the_step_and_keeps_state():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    scaler = AdaLossScaler(model)
    _train(model, scaler, opt, 2)
    assert not scaler.last_step_skipped
    params = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    x, y = _batch()
    x[0, 0] = float("nan")
    opt.zero_grad()
    scaler.scale(_loss(model, x, y)).backward()
    assert scaler.step(opt) is None
    scaler.update()
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments))
    _train(model, scaler, opt, 1)  # and training goes on
    assert scaler.skipped_steps == 1 and not scaler.last_step_skipped
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


class _SyncCounter:
    """Counts tensor -> Python conversions (the host synchronisations of an accelerator step)."""

    def __init__(self, monkeypatch, names):
        self.count = 0
        for name in names:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, **k):
                # a Python number autograd saved (a 0-d float64/int64 CPU tensor on every
                # device) is read without touching the device: not a synchronisation; nor is
                # CPU host math's view of a 0-d CPU tensor as a NumPy scalar (torch_bridge._xp)
                saved = t.device.type == "cpu" and t.dim() == 0 and t.dtype in (torch.float64, torch.int64)
                if not saved and sys._getframe(1).f_code is not _xp._torch_to_np.__code__:
                    self.count += 1
                return _orig(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, wrapped)


SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__")


@pytest.mark.parametrize("host_math", [False, True])
def test_one_host_sync_per_step(monkeypatch, host_math):
    """With ``host_math=False`` (what accelerator gradients always use) the decisions stay on
    device tensors: no conversion to Python at all. With CPU host math, 0-d CPU tensors are
    viewed as NumPy scalars (no synchronisation: the device is the host) but never read elsewhere."""
    torch.manual_seed(0)
    model, x, y = make_case("gpt")
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = AdaLossScaler(model, host_math=host_math)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-4 * xent(model(x), y)
    counter = _SyncCounter(monkeypatch, SYNCS if host_math else (*SYNCS, "numpy"))
    scaler.scale(loss).backward()
    assert counter.count == 0, "the backward synchronised with the host"
    scaler.step(opt)
    scaler.update()
    assert counter.count == 1


@pytest.mark.parametrize("name", ["residual", "gpt"])
def test_host_math_and_device_math_decide_identically(name):
    """The same decisions from NumPy scalars, from 0-d tensors, and from the decisions' traced
    graphs (``fuse_decisions``, run op by op: the same ops as the tensors', bit for bit)."""
    scales = []
    for kw in ({"host_math": False}, {"host_math": True}, {"host_math": False, "fuse_decisions": "eager"}):
        model, x, y = make_case(name)
        scaler = AdaLossScaler(model, AdaLossConfig(accum_bound=2.0**24), **kw)
        with torch.autocast("cpu", dtype=torch.float16):
            scaler.scale(1e-6 * xent(model(x), y)).backward()
        reps = scaler.layer_reports()
        scales.append({k: (float(r.scale), float(r.unrounded_scale)) for k, r in reps.items()})
    device, host, traced = scales
    assert traced == device
    assert device.keys() == host.keys()
    for k in device:
        # the same formulas on 0-d tensors and on NumPy scalars: libm's exp/log/sqrt may differ
        # in the last bit between the two libraries (and between CPUs), the decisions may not
        assert device[k][1] == pytest.approx(host[k][1], rel=1e-6), k
        assert device[k][0] == host[k][0], k
    assert any(s != 1.0 for s, _ in device.values())


class _SolverOps(TorchDispatchMode):
    """Counts the aten ops dispatched from the decisions' code (a frame of ``adaloss/solver.py``,
    ``adaloss/decisions.py`` or ``torch_bridge/kernels.py`` on the stack) and all of them."""

    FILES = ("adaloss/solver.py", "adaloss/decisions.py", "torch_bridge/kernels.py")

    def __init__(self):
        super().__init__()
        self.count = self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_filename.endswith(self.FILES):
                self.count += 1
                break
            f = f.f_back
        return func(*args, **(kwargs or {}))


def _fused_steps(fuse, batches, case="gpt"):
    """Train ``case`` one step per row count in ``batches`` with ``fuse_decisions=fuse``
    (decisions on tensors); per step: the decisions' ops, all ops of the backward, the graphs
    compiled after it; and the first step's gradients."""
    model, x, y = make_case(case)
    scaler = AdaLossScaler(model, host_math=False, fuse_decisions=fuse)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    steps, grads = [], None
    for rows in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = scaler.scale(1e-4 * xent(model(x[:rows]), y[:rows]))
        mode = _SolverOps()
        with mode:
            loss.backward()
        steps.append((mode.count, mode.total, len(scaler._schedule.fused) if fuse else 0))
        if grads is None:
            grads = [p.grad.clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return steps, grads


def test_fused_decisions_run_each_decision_as_one_compiled_call():
    """With ``fuse_decisions`` each decision (its statistics, math and rescale) runs as its
    compiled graph: once traced, the backward dispatches no op of the decisions' code; a batch
    of a new size compiles its shapes once; the
    gradients are those of device math op by op (the same scales: powers of two)."""
    torch.manual_seed(0)
    batches = (8, 8, 8, 5, 5)  # the first two trace (the second has the scaler's state)
    fused, fused_grads = _fused_steps("eager", batches)
    plain, plain_grads = _fused_steps(False, batches)
    assert fused[2][0] == fused[4][0] == 0, fused  # nothing of the decisions' code ran op by op
    assert all(c > 0 for c, _, _ in plain)
    assert fused[3][2] > fused[2][2] == fused[1][2]  # a new batch size: its shapes compiled
    assert fused[4][2] == fused[3][2]  # once
    assert 3 <= fused[2][2] <= 24  # layers of two fan-ins, casts, merges, the update's signals
    for a, b in zip(fused_grads, plain_grads):
        assert torch.equal(a, b)


def test_fused_decisions_beyond_max_shapes_warn_and_run_op_by_op():
    """A decision compiled for ``max_shapes`` shapes already warns (once, with the remedy) and
    runs op by op for the next shape: the scales and gradients stay those of an unfused scaler
    trained alongside; a :class:`~torch_bridge.fused.FusedMath` given to ``fuse_decisions`` is
    the scaler's."""
    fused = FusedMath("eager", max_shapes=1)
    runs = []
    for fuse in (fused, False):
        model, x, y = make_case("gpt")
        runs.append((model, AdaLossScaler(model, host_math=False, fuse_decisions=fuse),
                     torch.optim.SGD(model.parameters(), 0.1)))
    assert runs[0][1]._schedule.fused is fused
    for step, rows in enumerate((8, 8, 5, 3)):  # (the second step has the scaler's state: traced)
        seen = []
        for model, scaler, opt in runs:
            x, y = make_case("gpt")[1:]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = scaler.scale(1e-4 * xent(model(x[:rows]), y[:rows]))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss.backward()
            said = [str(w.message) for w in caught if "fuse_decisions" in str(w.message)]
            if scaler is runs[0][1]:
                assert len(said) == (step == 2), said  # once, at the first decision past its limit
                assert step != 2 or "Pad batches" in said[0]
            seen.append(({k: float(r.scale) for k, r in scaler.layer_reports().items()},
                         [p.grad.clone() for p in model.parameters()]))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        (scales, grads), (plain_scales, plain_grads) = seen
        assert scales == plain_scales and any(v != 1.0 for v in scales.values())
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def _steps_beside_unfused(fused, batches):
    """Train ``make_case("gpt")`` one step per row count in ``batches`` with
    ``fuse_decisions=fused`` and, alongside, an unfused scaler (device math op by op); per step:
    whether the fused scaler's backward ran its decisions compiled, and the warnings it gave.
    Asserts that both decided the same scales and gradients at every step."""
    runs = []
    for fuse in (fused, False):
        model, x, y = make_case("gpt")
        runs.append((model, AdaLossScaler(model, host_math=False, fuse_decisions=fuse),
                     torch.optim.SGD(model.parameters(), 0.1)))
    fusing, said = [], []
    for rows in batches:
        seen = []
        for model, scaler, opt in runs:
            x, y = make_case("gpt")[1:]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = scaler.scale(1e-4 * xent(model(x[:rows]), y[:rows]))
                loss.backward()
                scaler.step(opt)
                scaler.update()
            if scaler is runs[0][1]:
                fusing.append(scaler._schedule.active)
                said.append([str(w.message) for w in caught if "fuse_decisions" in str(w.message)])
            seen.append(({k: float(r.scale) for k, r in scaler.layer_reports().items()},
                         [p.grad.clone() for p in model.parameters()]))
            opt.zero_grad()
        (scales, grads), (plain_scales, plain_grads) = seen
        assert scales == plain_scales and any(v != 1.0 for v in scales.values())
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    return fusing, said


def test_default_fusion_waits_for_backwards_whose_shapes_hold():
    """``fuse_decisions="auto"`` (the default): decisions run op by op until
    ``steady_after`` backwards in a row met them with the same shapes, then compiled; a change
    of shapes goes back to op by op until they hold again; the scales and gradients are those
    of an unfused scaler trained alongside at every step."""
    default = AdaLossScaler(MLP())._schedule.fused
    assert (default.backend, default.steady_after) == ("inductor", scaler_module.STEADY_AFTER)
    assert scaler_module.STEADY_AFTER >= 10  # a test or a short run never compiles
    fused = FusedMath("eager", steady_after=2)
    fusing, said = _steps_beside_unfused(fused, (8, 8, 8, 5, 8, 8, 8))
    assert fusing == [False, False, True, True, False, False, True]
    assert len(fused) > 0 and not any(said)


def test_fused_decisions_where_the_backend_cannot_compile_warn_once_and_run_op_by_op(monkeypatch):
    """Where inductor raises (no C++ compiler, a device it has no code generator for), the
    scaler warns once, naming the error and the remedy, and decides op by op from then on:
    the same scales and gradients as an unfused scaler."""
    from torch import _inductor

    def cannot(*args, **kwargs):
        raise RuntimeError("Compiler: cc is not found.\nmore")
    monkeypatch.setattr(_inductor, "compile", cannot)
    monkeypatch.setattr(fused_module, "_PROCESS_CACHE", {})  # nothing compiled by earlier tests
    fused = FusedMath("inductor")
    fusing, said = _steps_beside_unfused(fused, (8, 8, 8))
    assert fusing == [True, False, False]
    assert [len(s) for s in said] == [1, 0, 0]
    assert "could not compile" in said[0][0] and "cc is not found" in said[0][0]
    assert "fuse_decisions=False" in said[0][0] and "more" not in said[0][0]
    assert fused.failed is not None and len(fused) == 0


def test_a_compiling_backward_says_how_long_it_took_and_a_resumed_scaler_reuses_it(monkeypatch):
    """The backward that compiles its decisions says so once, with the time and the remedy; a
    scaler made anew in the same process (a resume from its state_dict) compiles nothing."""
    monkeypatch.setattr(fused_module, "_PROCESS_CACHE", {})
    monkeypatch.setattr(fused_module, "SAY_COMPILE_AFTER", 0.0)  # (eager "compiles" in ms)

    def backward(scaler, model, x, y):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.float16):
                scaler.scale(1e-4 * xent(model(x), y)).backward()
            model.zero_grad()
        return [str(w.message) for w in caught if issubclass(w.category, fused_module.CompileNotice)]

    model, x, y = make_case("gpt")
    first = AdaLossScaler(model, fuse_decisions=FusedMath("eager"))
    said = backward(first, model, x, y)
    assert len(said) == 1, said
    assert re.search(r"compiled \d+ of its scale decisions with eager in \d+\.\d s.*"
                     r"fuse_decisions=False never compiles", said[0])
    assert backward(first, model, x, y) == []  # compiled already
    resumed = AdaLossScaler(model, fuse_decisions=FusedMath("eager"))
    resumed.load_state_dict(first.state_dict())
    assert backward(resumed, model, x, y) == []
    assert len(resumed._schedule.fused) == len(first._schedule.fused) > 0
    # torch's misleading CPU note during inductor's toolchain lookup is dropped, nothing else
    note = fused_module._NoCudaHomeNote()
    assert not note.filter(logging.makeLogRecord(
        {"msg": "No CUDA runtime is found, using CUDA_HOME='%s'", "args": ("/usr/local",)}))
    assert note.filter(logging.makeLogRecord({"msg": "something else"}))


def test_fused_update_moves_the_backoff_and_lifts_as_the_op_by_op_one():
    """The scaler's ``update()`` as one compiled call (``fuse_decisions``) leaves the back-off
    and every lift where device math op by op does, after a skipped (non-finite) step and
    steps whose underflow raises lifts."""
    states = []
    for fuse in (False, "eager"):
        model, x, y = make_case("gpt")
        scaler = AdaLossScaler(model, host_math=False, fuse_decisions=fuse)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = scaler.scale((float("inf") if step == 1 else 1e-4) * xent(model(x), y))
            loss.backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        states.append((scaler.backoff, scaler.lift))
    assert states[0] == states[1]
    assert states[0][0] == 1 and states[0][1], states  # the skipped step backed off; lifts moved


def test_enabled_false_is_a_pass_through():
    torch.manual_seed(0)
    model = MLP()
    x, y = _batch()
    ref = torch.autograd.grad(xent(model(x), y), list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = AdaLossScaler(model, enabled=False)
    assert not scaler.is_enabled()
    loss = xent(model(x), y)
    assert scaler.scale(loss) is loss
    loss.backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.state_dict() == {} and scaler.grad_scales() == {}


def _trained_state(steps):
    """An MLP, its config (``update_every=3``), its scaler after ``steps`` steps and the state."""
    torch.manual_seed(0)
    model = MLP()
    cfg = AdaLossConfig(update_every=3)
    scaler = AdaLossScaler(model, cfg)
    _train(model, scaler, torch.optim.SGD(model.parameters(), 0.1), steps)
    return model, cfg, scaler, scaler.state_dict()


def test_state_dict_round_trip_and_config_check():
    model, cfg, scaler, state = _trained_state(2)
    assert state["iteration"] == 2 and set(state["model_scales"]) == set(scaler.layer_reports())
    other = AdaLossScaler(model, cfg)
    other.load_state_dict(state)
    assert other.iteration == 2 and other.state_dict()["model_scales"].keys() == state["model_scales"].keys()
    with pytest.raises(ValueError, match="update_every"):
        AdaLossScaler(model).load_state_dict(state)
    with pytest.raises(RuntimeError, match="empty"):
        AdaLossScaler(model).load_state_dict({})


class _Renamed(torch.nn.Module):
    """MLP's layers under other names: ``net.0``, ``net.2``, ``net.4`` are ``first``, ``mid``, ``last``."""

    def __init__(self, mlp):
        super().__init__()
        self.first, self.mid, self.last = mlp.net[0], mlp.net[2], mlp.net[4]

    def forward(self, x):
        return self.last(torch.nn.functional.gelu(self.mid(torch.relu(self.first(x)))))


def test_load_state_dict_is_strict_about_the_model_it_was_saved_for():
    model, cfg, _, state = _trained_state(1)
    conv = make_case("conv")[0]
    with pytest.raises(RuntimeError, match=r"another model.*no entry for: c1\.weight.*lacks: net\.0\.weight"):
        AdaLossScaler(conv, cfg).load_state_dict(state)
    renamed = AdaLossScaler(_Renamed(model), cfg)
    with pytest.raises(RuntimeError, match=r"no entry for: first\.weight"):
        renamed.load_state_dict(state)
    wrapped = torch.nn.Sequential()
    wrapped.add_module("module", model)  # DDP's names: the prefix is named in the error
    with pytest.raises(RuntimeError, match="extra prefix 'module.'"):
        AdaLossScaler(wrapped, cfg).load_state_dict(state)
    # strict=False keeps what matches and names the rest, as nn.Module does
    partial = torch.nn.Sequential()
    partial.add_module("net", torch.nn.Sequential(*model.net[:3]))  # net.4 gone
    loose = AdaLossScaler(partial, cfg)
    result = loose.load_state_dict(state, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["net.4.weight", "net.4.bias"]
    kept = loose.state_dict()["model_scales"]
    assert kept.keys() == {k for k in state["model_scales"] if not k.startswith("net.4")} and kept
    assert loose.iteration == 1
    same = AdaLossScaler(model, cfg).load_state_dict(state)
    assert same.missing_keys == same.unexpected_keys == []


def test_update_every_reuses_the_statistical_scales():
    torch.manual_seed(0)
    model = MLP()
    scaler = AdaLossScaler(model, AdaLossConfig(update_every=3, accum_bound=2.0**24))
    opt = torch.optim.SGD(model.parameters(), 0.5)
    seen = []
    for i in range(4):
        _train(model, scaler, opt, 1)
        seen.append({k: float(r.model_scale) for k, r in scaler.layer_reports().items()})
        assert scaler.iteration == i + 1
    assert seen[1] == seen[0] and seen[2] == seen[0]
    fresh = AdaLossScaler(model, AdaLossConfig(accum_bound=2.0**24))
    x, y = _batch(3)
    fresh.scale(_loss(model, x, y)).backward()
    # iteration 3 recomputed: the statistics of the moved weights
    assert seen[3] != seen[0]


def test_apex_scale_loss_context():
    torch.manual_seed(0)
    model = MLP()
    x, y = _batch()
    ref = torch.autograd.grad(1e-4 * xent(model(x), y), list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = AdaLossScaler(model)
    with scaler.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    _assert_grads_near(model, ref, 0.1)  # unscaled on exit
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # a non-finite gradient: the next optimizer.step() is skipped, the one after runs
    bad = x.clone()
    bad[0, 0] = float("inf")
    opt.zero_grad()
    with scaler.scale_loss(_loss(model, bad, y), opt) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()
    with scaler.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_gradient_accumulation_merges_scales_across_backward_calls():
    torch.manual_seed(0)
    model = MLP()
    batches = [(*_batch(1), 1e-6), (*_batch(2), 1e-3)]  # very different loss magnitudes

    def alone(x, y, factor):
        model.zero_grad()
        scaler = AdaLossScaler(model)
        scaler.scale(_loss(model, x, y, factor)).backward()
        scales = scaler.grad_scales()
        return [p.grad / scales[n] for n, p in model.named_parameters()], scales

    (g1, s1), (g2, s2) = (alone(*b) for b in batches)
    assert any(float(s1[n]) != float(s2[n]) for n in s1)
    model.zero_grad()
    scaler = AdaLossScaler(model)
    for x, y, factor in batches:
        scaler.scale(_loss(model, x, y, factor)).backward()
    carried = scaler.grad_scales()  # what .grad carries now
    for (n, p), a, b in zip(model.named_parameters(), g1, g2):
        assert float((p.grad / carried[n] - (a + b)).abs().max() / (a + b).abs().max()) < 1e-3
    scaler.unscale_(torch.optim.SGD(model.parameters(), 0.0))
    for p, a, b in zip(model.parameters(), g1, g2):
        assert float((p.grad - (a + b)).abs().max() / (a + b).abs().max()) < 1e-3


def test_graph_and_hooks_are_freed():
    torch.manual_seed(0)
    model = MLP()
    scaler = AdaLossScaler(model)
    x, y = _batch()
    loss = _loss(model, x, y)
    scaler.scale(loss)
    ref = loss.grad_fn.metadata["adaloss"]
    loss.backward()
    assert scaler.layer_reports()  # the record outlives the graph
    del loss
    gc.collect()
    assert ref() is None  # and with it the plan's references to the graph


def test_torch_example_runs():
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import torch_char_gpt

    out = torch_char_gpt.train("fp16+adaloss", steps=3, lr=3e-3, loss_factor=1e-4)
    assert len(out["losses"]) == 3 and out["skipped"] == 0 and out["scales"]


def _assert_grads_near(model, ref, tol):
    """Each parameter's ``.grad`` within ``tol`` of ``ref`` (max error relative to max |ref|)."""
    for p, r in zip(model.parameters(), ref):
        assert float((p.grad - r).abs().max() / r.abs().max()) < tol


def test_retained_graph_backward_twice_accumulates():
    torch.manual_seed(0)
    model = MLP()
    x, y = _batch()
    ref = torch.autograd.grad(2e-4 * xent(model(x), y), list(model.parameters()))
    scaler = AdaLossScaler(model, AdaLossConfig(u_min=2.0**-14))
    loss = _loss(model, x, y)
    scaler.scale(loss).backward(retain_graph=True)
    loss.backward()  # the hooks are still on the retained graph
    scaler.unscale_(torch.optim.SGD(model.parameters(), 0.0))
    _assert_grads_near(model, ref, 5e-3)


def test_init_scale_seeds_the_backward():
    torch.manual_seed(0)
    model = MLP()
    x, y = _batch()
    ref = torch.autograd.grad(1e-4 * xent(model(x), y), list(model.parameters()))
    scaler = AdaLossScaler(model, AdaLossConfig(init_scale=1024.0, u_min=2.0**-14))
    scaler.scale(_loss(model, x, y)).backward()
    assert float(scaler.layer_reports()["cast:0"].incoming_scale) == 1024.0
    scaler.unscale_(torch.optim.SGD(model.parameters(), 0.0))
    _assert_grads_near(model, ref, 5e-3)


def test_parameters_outside_the_model_are_weights_too():
    torch.manual_seed(0)
    model = MLP()
    head = torch.nn.Linear(10, 10)  # trained, but not part of the scaler's model
    x, y = _batch()
    scaler = AdaLossScaler(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-4 * xent(head(model(x)), y)
    scaler.scale(loss).backward()
    names = list(scaler.layer_reports())
    assert any(n.startswith("<parameter (10, 10)") for n in names), names
    assert "net.4.weight" in names
    assert head.weight.grad is not None
    assert set(scaler.grad_scales()) == {n for n, _ in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_autograd_grad_and_create_graph_get_one_global_scale_and_say_so():
    torch.manual_seed(0)
    model = MLP()
    scaler = AdaLossScaler(model, init_scale=4.0)  # GradScaler's argument: the global backward's scale
    assert scaler.get_scale() == 1.0  # no global backward yet: the per-layer decisions need none
    x, y = _batch()
    params = list(model.parameters())
    truth = torch.autograd.grad(_loss(model, x, y, 1.0), params)
    with pytest.warns(UserWarning, match="one global scale"):
        got = torch.autograd.grad(scaler.scale(_loss(model, x, y, 1.0)), params, create_graph=True)
    assert scaler.get_scale() == 4.0 and all(p.grad is None for p in params)
    for g, t in zip(got, truth):  # GradScaler's recipe: divide by get_scale()
        torch.testing.assert_close(g / scaler.get_scale(), t, rtol=1e-3, atol=1e-5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*one global scale")  # said once per scaler
        got = torch.autograd.grad(scaler.scale(_loss(model, x, y, 1.0)), params)
        scaler.scale(_loss(model, x, y, 1.0)).backward(create_graph=True)
    assert {float(s) for s in scaler.grad_scales().values()} == {4.0}
    opt = torch.optim.SGD(params, 0.0)
    scaler.unscale_(opt)
    for p, t in zip(params, truth):
        torch.testing.assert_close(p.grad, t, rtol=1e-3, atol=1e-5)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale(_loss(model, x, y, 1.0)).backward()  # and the next backward has per-layer scales again
    assert len({float(s) for s in scaler.grad_scales().values()}) > 1


def test_gradscaler_schedule_arguments_getters_and_state():
    model = MLP()
    scaler = AdaLossScaler(model, init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25,
                           growth_interval=3)
    assert (scaler.get_init_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (2.0**10, 4.0, 0.25, 3)
    scaler.set_growth_interval(5)
    scaler.set_backoff_factor(0.5)
    twin = AdaLossScaler(MLP())
    twin.load_state_dict(scaler.state_dict())
    assert (twin.get_growth_interval(), twin.get_backoff_factor()) == (5, 0.5)
    for bad, match in (({"growth_factor": 1.0}, "growth factor"), ({"backoff_factor": 1.5}, "backoff factor"),
                       ({"growth_interval": 0}, "growth_interval"), ({"init_scale": -1.0}, "init_scale")):
        with pytest.raises(ValueError, match=match):
            AdaLossScaler(model, **bad)
    # GradScaler's device: accepted by keyword, said once (and where it is not the model's)
    from torch_bridge import scaler as scaler_module
    scaler_module._SAID_DEVICE.clear()
    with pytest.warns(UserWarning, match=r"device='cuda'.*not used.*on cpu.*Move the model"):
        AdaLossScaler(model, device="cuda", enabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaLossScaler(model, device="cuda")  # once
    with pytest.raises(TypeError, match="device='cpu'"):
        AdaLossScaler(model, "cpu")


def test_a_gradscaler_state_dict_is_adopted_or_refused_by_name():
    """A job switched from GradScaler: its scale and schedule start the global backward's scale."""
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    model = MLP()
    scaler = AdaLossScaler(model)
    with pytest.warns(UserWarning, match="GradScaler state: its scale 1024"):
        assert scaler.load_state_dict(gs.state_dict()) == ([], [])
    assert (scaler.get_init_scale(), scaler.get_growth_interval()) == (2.0**10, 7)
    x, y = _batch()
    with pytest.warns(UserWarning, match="one global scale"):
        torch.autograd.grad(scaler.scale(_loss(model, x, y)), list(model.parameters()))
    assert scaler.get_scale() == 2.0**10  # the global backward's scale starts from GradScaler's
    with pytest.raises(ValueError, match="GradScaler.state_dict"):
        scaler.load_state_dict({"scale": 2.0})


def _penalty_step(model, scaler, opt, x, y, factor):
    """The AMP docs' gradient penalty: ``autograd.grad`` of the scaled loss (``create_graph``),
    divided by ``get_scale()``, the penalty's norm added, the sum's scaled backward, then
    ``unscale_``. Returns (the first backward's gradients, the final ones), each over ``factor``."""
    params = list(model.parameters())
    opt.zero_grad()  # the loop's first line: no gradient left from before
    loss = _loss(model, x, y, factor) if scaler is not None else factor * xent(model(x), y)
    if scaler is None:
        grads = torch.autograd.grad(loss, params, create_graph=True)
    else:
        grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        grads = [g * (1.0 / scaler.get_scale()) for g in grads]
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
        loss = loss + torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
    first = [g.detach().clone() / factor for g in grads]
    if scaler is None:
        loss.backward()
        return first, [p.grad.clone() / factor for p in params]
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    final = [p.grad.clone() / factor for p in params]
    scaler.step(opt)
    scaler.update()
    return first, final


def _worst_error(got, ref):
    return max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref) if r.norm() > 0)


@pytest.mark.filterwarnings("ignore:AdaLossScaler. a scaled backward ran as")
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
@pytest.mark.parametrize("factor", [1.0, 1e-6])
def test_gradient_penalty_recipe_is_within_fp16_noise_of_gradscaler(factor):
    """The penalty's first backward (one global scale: GradScaler's, from 2^16) and the penalized
    loss's backward (through the first one's recorded graph: the same global scale), at the first
    step and two steps on (learning rate 0: the same weights, the scalers' state moving), against
    fp32 and as close as ``torch.amp.GradScaler`` gets."""
    torch.manual_seed(0)
    model = MLP()
    x, y = _batch()
    ref = _penalty_step(model, None, torch.optim.SGD(model.parameters(), lr=0.0), x, y, factor)
    runs = {}
    for make in (lambda m: AdaLossScaler(m), lambda m: torch.amp.GradScaler("cpu")):
        m = copy.deepcopy(model)
        scaler, opt = make(m), torch.optim.SGD(m.parameters(), lr=0.0)
        runs[type(scaler).__name__] = [_penalty_step(m, scaler, opt, x, y, factor) for _ in range(3)]
    for step in (0, 2):
        for k in (0, 1):  # the first backward's gradients, the final ones
            ours = _worst_error(runs["AdaLossScaler"][step][k], ref[k])
            theirs = _worst_error(runs["GradScaler"][step][k], ref[k])
            assert ours <= 1.5 * theirs + 2e-3, (step, k, ours, theirs)


def test_pickle_and_deepcopy_between_backward_and_step_go_on_with_the_live_model():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(twin.parameters(), 1e-2)
    scaler, twin_scaler = AdaLossScaler(model), AdaLossScaler(twin)
    _train(model, scaler, opt, 2)
    _train(twin, twin_scaler, twin_opt, 2)
    x, y = _batch(5)
    for m, o, s in ((model, opt, scaler), (twin, twin_opt, twin_scaler)):
        o.zero_grad()
        s.scale(_loss(m, x, y)).backward()
    for fresh in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert fresh.grad_scales() == {} and fresh._model is model  # the live model, no copy
        f = fresh._schedule.fused  # the default's compiled decisions: the same policy, compiled anew
        assert (f.backend, f.steady_after, len(f)) == ("inductor", scaler._schedule.fused.steady_after, 0)
    scaler = copy.deepcopy(pickle.loads(pickle.dumps(scaler)))  # mid-iteration: pending scales kept
    scaler.step(opt)
    scaler.update()
    twin_scaler.step(twin_opt)
    twin_scaler.update()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    _train(model, scaler, opt, 2)
    _train(twin, twin_scaler, twin_opt, 2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert scaler.state_dict()["lift"] == twin_scaler.state_dict()["lift"]
    both = copy.deepcopy((model, scaler))  # copied together: the copy goes with the model's copy
    assert both[1]._model is both[0]


def test_a_scaler_without_its_model_says_so():
    with pytest.raises(ValueError, match="has no parameters"):
        AdaLossScaler(torch.nn.ReLU())
    torch.manual_seed(0)
    model = MLP()
    scaler = AdaLossScaler(model)
    blob = pickle.dumps(scaler)
    state = scaler.state_dict()
    del scaler, model
    gc.collect()
    orphan = pickle.loads(blob)  # as in another process: its model is not here
    assert orphan.state_dict()["parameters"] == state["parameters"]
    other = MLP()
    with pytest.raises(RuntimeError, match="load_state_dict"):
        orphan.scale(_loss(other, *_batch()))
    fresh = AdaLossScaler(other)
    fresh.load_state_dict(orphan.state_dict())
    stranger = AdaLossScaler(MLP())  # built on another module than the loss's
    with pytest.warns(UserWarning, match="none of them a parameter of the scaler's model"):
        stranger.scale(_loss(other, *_batch())).backward()


def test_get_scale_falls_after_a_skipped_step_as_gradscalers_does():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = AdaLossScaler(model, AdaLossConfig(backoff_interval=2))
    stepped = []
    for i in range(5):
        x, y = _batch(i)
        if i == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        before = scaler.get_scale()  # the LR-scheduler idiom of GradScaler users
        scaler.step(opt)
        scaler.update()
        stepped.append(scaler.get_scale() >= before)
    assert stepped == [True, False, True, True, True] and scaler.skipped_steps == 1
    assert scaler.get_scale() == 1.0 and scaler.backoff == 0  # recovered after 2 finite steps
    assert AdaLossScaler(model, enabled=False).get_scale() == 1.0


def test_get_scale_then_unscale_leaves_uncoalesced_sparse_gradients_true():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8, sparse=True), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    idx = torch.tensor([1, 3, 1, 5, 3, 3])  # repeated rows: an uncoalesced sparse gradient
    (1e-6 * torch.nn.functional.mse_loss(ref(idx), torch.ones(6, 4))).backward()
    scaler = AdaLossScaler(model, AdaLossConfig(init_scale=8.0))
    scaler.scale(1e-6 * torch.nn.functional.mse_loss(model(idx), torch.ones(6, 4))).backward()
    assert not model[0].weight.grad.is_coalesced() and float(scaler.grad_scales()["0.weight"]) != 8.0
    assert scaler.get_scale() == 8.0  # brings every gradient to carry 8 ...
    scaler.unscale_(torch.optim.SGD(model.parameters(), 0.1))  # ... and divides them by it
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), rtol=1e-6, atol=1e-8)
