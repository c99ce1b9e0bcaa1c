"""torch_bridge under the tools PyTorch users wrap around a backward: dispatch modes
(``FlopCounterMode``, ``DebugMode``), the profiler, anomaly mode, ``save_on_cpu``, selective
activation checkpointing, a model built on the meta device, ``FakeTensorMode``. Each gives the
scales and gradients of the same step without it; compiled autograd, which cannot run the
scaler's hooks, is refused with the remedy."""

import contextlib
import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode
from torch_models import MLP, HandAttentionGPT, make_case, xent

import torch_bridge
from adaloss.config import AdaLossConfig


def _step(around=contextlib.nullcontext, forward=contextlib.nullcontext, model=None, fmt="float16",
          factor=1e-6):
    """One scaled fp16 (bf16 for fp8 gradients) backward of the hand-written GPT (its attention
    multiplies by a Python number) under ``around`` (forward and backward) and ``forward``
    (forward only): unscaled gradients and the layers' scales."""
    net, x, y = make_case("gpt")
    if model is not None:
        net = model(net)
    scaler = torch_bridge.AdaLossScaler(net, AdaLossConfig(grad_format=fmt))
    dtype = torch.float16 if fmt == "float16" else torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's own warning
        with around():
            with torch.autocast("cpu", dtype=dtype), forward():
                loss = factor * xent(net(x), y)
            scaler.scale(loss).backward()
    scaler.unscale_(torch.optim.SGD(net.parameters(), lr=0.0))
    return ({n: p.grad.clone() for n, p in net.named_parameters()},
            {k: float(r.scale) for k, r in scaler.layer_reports().items()})


@functools.cache
def _plain(fmt):
    return _step(fmt=fmt)


def _same_as_plain(got, fmt="float16"):
    grads, scales = got
    ref_grads, ref_scales = _plain(fmt)
    assert len(scales) >= 8 and scales == ref_scales
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


@pytest.mark.parametrize("fmt", ["float16", "float8_e5m2"])
def test_flop_counter_mode_around_the_backward_changes_nothing(fmt):
    """And it counts the model's FLOPs: the scaler adds no matmul."""
    counter = FlopCounterMode(display=False)
    _same_as_plain(_step(around=lambda: counter, fmt=fmt), fmt)
    net, x, y = make_case("gpt")
    unscaled = FlopCounterMode(display=False)
    with unscaled:
        with torch.autocast("cpu", dtype=torch.float16 if fmt == "float16" else torch.bfloat16):
            loss = xent(net(x), y)
        loss.backward()
    assert counter.get_total_flops() == unscaled.get_total_flops() > 0


def test_debug_mode_around_the_backward_changes_nothing():
    from torch.utils._debug_mode import DebugMode
    mode = DebugMode()
    _same_as_plain(_step(around=lambda: mode))
    assert "aten::mm" in mode.debug_string() or "aten.mm" in mode.debug_string()


def _selective(net):
    """Selective activation checkpointing: the matmuls' outputs saved, the rest recomputed."""
    def policy(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    forward = net.forward
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    net.forward = lambda t: checkpoint(forward, t, use_reentrant=False, context_fn=context)
    return net


@pytest.mark.parametrize("tool", ["profiler", "anomaly", "save_on_cpu", "selective_checkpoint"])
def test_tools_around_a_step_change_nothing(tool):
    kw = {"profiler": {"around": lambda: torch.profiler.profile(record_shapes=True)},
          "anomaly": {"around": torch.autograd.detect_anomaly},
          "save_on_cpu": {"forward": torch.autograd.graph.save_on_cpu},
          "selective_checkpoint": {"model": _selective}}[tool]
    _same_as_plain(_step(**kw))


def test_save_on_cpu_keeps_the_weight_gradient_bounds():
    """Activations offloaded by ``save_on_cpu`` are read for the layers' weight-gradient bounds
    as if they were saved on the device: where a bound decides the scale, the same one."""
    def run(offload):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        scaler = torch_bridge.AdaLossScaler(net)
        ctx = torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.float16), ctx:
            loss = net(300 * torch.randn(4096, 64)).float().square().mean()
        scaler.scale(loss).backward()
        return {k: float(v) for k, v in scaler.grad_scales().items()}, [p.grad for p in net.parameters()]
    (scales, grads), (ref_scales, ref_grads) = run(True), run(False)
    assert scales == ref_scales and all(torch.isfinite(g).all() for g in grads)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_a_scaler_made_on_the_meta_device_trains_as_one_made_after_to_empty():
    weights = make_case("gpt")[0].state_dict()
    _, x, y = make_case("gpt")

    def train(early):
        with torch.device("meta"):
            net = HandAttentionGPT()
        scaler = torch_bridge.AdaLossScaler(net) if early else None
        net.to_empty(device="cpu")
        net.load_state_dict(weights)
        scaler = scaler or torch_bridge.AdaLossScaler(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        scales = []
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = 1e-6 * xent(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append({k: float(v) for k, v in scaler.grad_scales().items()})
        return scales, net.state_dict()
    (early, p_early), (late, p_late) = train(True), train(False)
    assert early == late and len(early[0]) == len(weights)
    assert all(torch.equal(p_early[k], p_late[k]) for k in p_late)


def test_fake_tensor_mode_runs_the_scaled_backward_as_it_runs_gradscalers():
    """Memory estimation runs a step on fake tensors: the backward runs (its decisions on 0-d
    fake tensors), as GradScaler's does; gradients have the parameters' shapes."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    with FakeTensorMode():
        net = MLP()
        scaler = torch_bridge.AdaLossScaler(net)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = xent(net(torch.randn(8, 16)), torch.arange(8) % 10)
        scaler.scale(loss).backward()
    assert all(isinstance(p.grad, FakeTensor) and p.grad.shape == p.shape for p in net.parameters())
    assert len(scaler.grad_scales()) == len(list(net.parameters()))


def _fp16_loss(net):
    x, y = torch.randn(8, 16), torch.arange(8) % 10
    with torch.autocast("cpu", dtype=torch.float16):
        return xent(net(x), y)


def test_compiled_autograd_is_refused_with_the_remedy():
    """Compiled autograd captures the hooks before the backward runs them: the scaler's
    per-layer scales would stay in the gradients. Refused whether it is on at ``scale()`` or
    only around ``backward()``; the same loss then runs without it."""
    import torch._dynamo.compiled_autograd as ca
    net = MLP()
    scaler = torch_bridge.AdaLossScaler(net)
    with ca._enable(lambda graph: graph):  # noqa: SIM117
        with pytest.raises(RuntimeError, match="compiled autograd.*compiled_autograd False"):
            scaler.scale(_fp16_loss(net))
    loss = scaler.scale(_fp16_loss(net))
    with ca._enable(lambda graph: graph):  # noqa: SIM117
        with pytest.raises(RuntimeError, match="does not support compiled autograd"):
            loss.backward()
    net.zero_grad()
    scaler.scale(_fp16_loss(net)).backward()
    assert len(scaler.grad_scales()) == len(list(net.parameters()))


def _compiled_step(net, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-6 * xent(net(x), y)
    scaler.scale(loss).backward()


def test_a_compiled_training_step_runs_the_scaler_eagerly():
    """``torch.compile`` over the whole step (forward, ``scale``, ``backward``): the model is
    compiled, the scaler's planning and hooks run eagerly (dynamo compiles no frame of ours), and
    the steps are the eager ones."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from torch_bridge.graph import _Walk
    from torch_bridge.hooks import ScaledBackward
    runs = []
    for compiled in (True, False):
        net, x, y = make_case("gpt")
        scaler = torch_bridge.AdaLossScaler(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = torch.compile(_compiled_step, backend="eager") if compiled else _compiled_step
        scales = []
        for _ in range(2):
            opt.zero_grad()
            step(net, scaler, x, y)
            scaler.step(opt)
            scaler.update()
            scales.append({k: float(v) for k, v in scaler.grad_scales().items()})
        runs.append((scales, [p.detach().clone() for p in net.parameters()]))
    (scales, params), (ref_scales, ref_params) = runs
    assert scales == ref_scales and all(torch.equal(p, r) for p, r in zip(params, ref_params))
    for fn in (_Walk.__init__, ScaledBackward.pre, torch_bridge.AdaLossScaler.scale.__wrapped__):
        assert _debug_get_cache_entry_list(fn.__code__) == []


def test_compiled_autograd_from_the_dynamo_config_is_refused():
    net, x, y = make_case("mlp")
    scaler = torch_bridge.AdaLossScaler(net)
    with torch._dynamo.config.patch(compiled_autograd=True):  # read by torch.compile
        step = torch.compile(_compiled_step, backend="eager")
        with pytest.raises(RuntimeError, match="does not support compiled autograd"):
            step(net, scaler, x, y)
