"""torch_bridge on the patterns real PyTorch code uses: activation checkpointing (both kinds,
through HF's ``activation_checkpointing_enable``), ``torch.compile``, ``model.half()``, bf16
autocast. Each works, or refuses with a clear error; none returns wrong or zero gradients."""

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torch_models import MLP

import torch_bridge
from adaloss.report import AdaLossCoverageWarning
from adaloss_zoo import torch_zoo as tz
from adaloss_zoo.metrics import grad_error


@pytest.fixture(scope="module")
def gpt2():
    case = tz.CASES["hf-gpt2"]
    model, batch = case.build(0)
    return case, model, batch, tz.reference_grads(case, model, batch)


@pytest.mark.parametrize("factor", [1.0, 1e-6])
def test_non_reentrant_checkpointing_gives_the_same_scales_and_gradients(gpt2, factor):
    case, model, batch, ref = gpt2
    plain = tz.run_adaloss(case, model, batch, factor)
    model.activation_checkpointing_enable({"use_reentrant": False})  # was gradient_checkpointing_enable
    try:
        ckpt = tz.run_adaloss(case, model, batch, factor)
    finally:
        model.activation_checkpointing_disable()
    assert not ckpt.warnings
    assert {k: float(r.scale) for k, r in ckpt.layers.items()} == \
        {k: float(r.scale) for k, r in plain.layers.items()}
    assert grad_error(ckpt.grads, plain.grads).worst < 1e-6


@pytest.mark.parametrize("factor", [1.0, 1e-6])
def test_reentrant_checkpointing_scales_its_hidden_parameters(gpt2, factor):
    case, model, batch, ref = gpt2
    plain = tz.run_adaloss(case, model, batch, factor)
    model.activation_checkpointing_enable({"use_reentrant": True})
    try:
        ckpt = tz.run_adaloss(case, model, batch, factor)
    finally:
        model.activation_checkpointing_disable()
    assert ckpt.coverage.opaque_regions == 2  # one per block
    assert any("opaque region" in w for w in ckpt.warnings)
    err, base = grad_error(ckpt.grads, ref), grad_error(plain.grads, ref)
    assert not err.zero
    # one scale per block instead of per layer: close to the per-layer result, never ×8 or ×2^15
    assert err.median < 2 * base.median + 1e-3 and err.worst < 2 * base.worst + 1e-3


def _seeded(make=MLP):
    """A model made after ``torch.manual_seed(0)``, and a batch of 32 (x: [32, 16], 10 classes)."""
    torch.manual_seed(0)
    model = make()
    return model, torch.randn(32, 16), torch.arange(32) % 10


def _mlp_case():
    model, x, y = _seeded()
    with torch.autocast("cpu", dtype=torch.float16):
        ref = torch.nn.functional.cross_entropy(model(x).float(), y)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    return model, x, y, {n: g.numpy() for (n, _), g in zip(model.named_parameters(), ref_grads)}


@pytest.mark.parametrize("backend", ["aot_eager"])  # inductor makes the same node (25 s more)
def test_a_compiled_model_gets_a_dynamic_scale_at_its_boundary(backend):
    model, x, y, ref = _mlp_case()
    compiled = torch.compile(model, backend=backend)
    scaler = torch_bridge.AdaLossScaler(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.warns(AdaLossCoverageWarning, match="opaque region"):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = 1e-6 * torch.nn.functional.cross_entropy(compiled(x).float(), y)
        scaler.scale(loss).backward()
    assert scaler.coverage().opaque_regions == 1
    scaler.unscale_(opt)
    err = grad_error({n: p.grad.numpy() / 1e-6 for n, p in model.named_parameters()}, ref)
    assert "region:0" in scaler.state_dict()["region_scales"]
    # the same model uncompiled, with a scale per layer: the compiled one is no less accurate
    # (plain fp16 loses every gradient here: error 1)
    model.zero_grad()
    uncompiled = torch_bridge.AdaLossScaler(model)
    with torch.autocast("cpu", dtype=torch.float16):
        uncompiled.scale(1e-6 * torch.nn.functional.cross_entropy(model(x).float(), y)).backward()
    uncompiled.unscale_(opt)
    base = grad_error({n: p.grad.numpy() / 1e-6 for n, p in model.named_parameters()}, ref)
    assert not err.zero and err.worst <= 1.5 * base.worst + 1e-3 and err.median <= 1.5 * base.median + 1e-3


def test_region_scale_backs_off_after_an_overflow_and_is_checkpointed():
    model, x, y, _ = _mlp_case()

    @torch.compile(backend="aot_eager")
    def compiled_loss(x, y, factor):  # the fp32 loss and its cast to fp16 inside the region
        return factor * torch.nn.functional.cross_entropy(model(x).float(), y)

    scaler = torch_bridge.AdaLossScaler(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    for factor in (1.0, 1e30, 1.0):  # the middle step overflows inside the region
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdaLossCoverageWarning)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = compiled_loss(x, y, torch.tensor(factor))
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.state_dict()["region_scales"]["region:0"][0])
    assert scaler.skipped_steps == 1
    assert scales == [2.0**16, 2.0**15, 2.0**15]
    other = torch_bridge.AdaLossScaler(model)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict()["region_scales"] == scaler.state_dict()["region_scales"]


def test_unscaling_fp16_gradients_is_refused_as_by_gradscaler():
    model, x, y = _seeded()
    model, x = model.half(), x.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch_bridge.AdaLossScaler(model)
    scaler.scale(1e-6 * torch.nn.functional.cross_entropy(model(x).float(), y)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients.*autocast"):
        scaler.unscale_(opt)
    gs = torch.amp.GradScaler("cpu")
    gs.scale(torch.nn.functional.cross_entropy(model(x).float(), y)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        gs.unscale_(opt)


def test_grad_format_must_match_the_autocast_dtype():
    model, x, y = _seeded()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    with pytest.raises(ValueError, match="grad_format='float16'.*bfloat16"):
        torch_bridge.AdaLossScaler(model).scale(loss)
    scaler = torch_bridge.AdaLossScaler(model, torch_bridge.AdaLossConfig(grad_format="bfloat16"))
    scaler.scale(loss).backward()
    assert scaler.coverage().layers == 2


def test_frozen_weights_leave_no_layer_and_say_so():
    torch.manual_seed(0)
    model = MLP()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(32, 16, requires_grad=True)
    scaler = torch_bridge.AdaLossScaler(model)
    with pytest.warns(AdaLossCoverageWarning, match="no layer found among 3"):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), torch.arange(32) % 10)
        scaler.scale(loss).backward()
    assert scaler.coverage() == (3, 0, 0)


class _ScaledLinear(torch.nn.Module):
    """A weight with a scalar factor and a cast, as muP/scaled init code writes it."""

    def __init__(self, n_in, n_out, factor):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.factor = factor

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.factor)


class _Net(torch.nn.Module):
    def __init__(self, weight_op="scalar", use_checkpoint=False):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.mid = _ScaledLinear(32, 32, 0.5)
        self.out = torch.nn.Linear(32, 10)
        self.weight_op, self.use_checkpoint = weight_op, use_checkpoint

    def block(self, h):
        if self.weight_op == "norm":  # weight normalisation: not a cast, move or scalar factor
            w = self.mid.weight / self.mid.weight.norm(dim=1, keepdim=True)
            return torch.tanh(torch.nn.functional.linear(h, w))
        return torch.tanh(self.mid(h))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.block, h, use_reentrant=False) if self.use_checkpoint else self.block(h)
        return self.out(h)


def _scales_and_grads(net, x, y):
    scaler = torch_bridge.AdaLossScaler(net)
    net.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-6 * torch.nn.functional.cross_entropy(net(x).float(), y)
    scaler.scale(loss).backward()
    scales = {k: float(r.scale) for k, r in scaler.layer_reports().items()}
    return scales, {n: p.grad.clone() for n, p in net.named_parameters()}


def test_checkpointed_weight_with_a_scalar_factor_is_rebuilt_exactly():
    net, x, y = _seeded(_Net)
    plain_scales, plain_grads = _scales_and_grads(net, x, y)
    net.use_checkpoint = True
    scales, grads = _scales_and_grads(net, x, y)
    assert "mid.weight" in scales and scales == plain_scales
    for n in grads:
        torch.testing.assert_close(grads[n], plain_grads[n], rtol=0, atol=0)


def test_checkpointed_weight_from_other_ops_raises_with_the_remedy():
    net, x, y = _seeded(lambda: _Net(weight_op="norm", use_checkpoint=True))
    with pytest.raises(RuntimeError, match="model='gradient'"):
        _scales_and_grads(net, x, y)
    scaler = torch_bridge.AdaLossScaler(net, torch_bridge.AdaLossConfig(model="gradient"))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-6 * torch.nn.functional.cross_entropy(net(x).float(), y)
    scaler.scale(loss).backward()
    assert net.mid.weight.grad is not None and net.mid.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm", "eager"])
def test_moe_expert_weights_are_layers_in_every_experts_implementation(experts):
    """transformers' MoE experts: ``torch._grouped_mm`` over 3-D expert weights (the default),
    ``bmm`` over weights gathered per token (``batched_mm``), a loop of ``F.linear`` (``eager``):
    every expert weight tensor gets a layer decision, and the gradients stay those of fp16."""
    case = tz.CASES["hf-qwen3-moe"]
    model, batch = case.build(0)
    model.config._experts_implementation = experts
    ref = tz.reference_grads(case, model, batch)
    run = tz.run_adaloss(case, model, batch, 1e-6)
    experts_found = {k.split("@")[0] for k in run.layers if ".experts." in k}
    assert experts_found == {f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1)
                             for w in ("gate_up_proj", "down_proj")}
    assert run.coverage.layers == run.coverage.weighted_ops and not run.warnings
    err = grad_error(run.grads, ref, case.exclude)
    assert not err.zero and err.worst < 2e-3, (err.worst, err.zero)
