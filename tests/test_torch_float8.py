"""torch_bridge's FP8 layers: every GEMM of a converted ``nn.Linear`` / HF ``Conv1D`` is one
``torch._scaled_mm``, under the scaler (adaloss's decided cotangent scales) and without it
(current scaling); wrong use is refused."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_bridge
from adaloss import AdaLossConfig
from adaloss_zoo import torch_zoo as tz
from torch_bridge.float8 import Float8Linear

pytest.importorskip("transformers")

CONFIG = AdaLossConfig(grad_format="float8_e5m2", operand_format="float8_e4m3fn")


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step(case, model, batch, scaler=None):
    loss = tz._forward(case, model, batch, 1.0, 0, torch.bfloat16)  # seeded: the reference's dropout
    (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None:
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["hf-gpt2", "hf-llama"])  # HF Conv1D; nn.Linear
def test_every_gemm_of_a_converted_layer_is_one_scaled_mm(case):
    case = tz.CASES[case]
    model, batch = case.build(0)
    ref = _step(case, copy.deepcopy(model), batch)  # the same bf16 forward, its GEMMs in bf16
    torch_bridge.convert_to_float8_training(model, CONFIG)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    scaler = torch_bridge.AdaLossScaler(model, CONFIG)
    with _Ops() as counted:
        grads = _step(case, model, batch, scaler)
    # forward, input gradient, weight gradient: every converted layer's input needs a gradient
    assert counted.ops["_scaled_mm"] == 3 * len(layers) > 0
    assert counted.ops["mm"] == counted.ops["addmm"] == 0  # no 16-bit GEMM of a layer is left
    assert scaler.coverage().layers == len(layers) and scaler.coverage().opaque_regions == 0
    reports = scaler.layer_reports()
    assert {n for n in reports if not n.startswith("cast:")} <= {n for n, _ in model.named_parameters()}
    assert any(float(r.scale) != 1.0 for n, r in reports.items() if not n.startswith("cast:"))
    errors = [float((grads[n] - g).norm() / g.norm()) for n, g in ref.items() if g.norm() > 0]
    assert np.median(errors) < 0.15, sorted(errors)  # e4m3 operands, e5m2 gradients: a few %
    assert all(np.isfinite(errors))


def test_without_a_scaler_the_layers_cast_gradients_at_their_current_scale():
    """The same values as under the scaler where no cast flushes or saturates (a power-of-two
    scale only moves exponents), and the same ``_scaled_mm`` count."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(16, 32)

    def grads(model, scaler=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        with _Ops() as counted:
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
        return [p.grad.clone() for p in model.parameters()], counted.ops["_scaled_mm"]

    alone, n_alone = grads(torch_bridge.convert_to_float8_training(copy.deepcopy(base), CONFIG))
    scaled = torch_bridge.convert_to_float8_training(copy.deepcopy(base), CONFIG)
    under, n_under = grads(scaled, torch_bridge.AdaLossScaler(scaled, CONFIG))
    assert n_alone == n_under == 3  # the first layer's input needs no gradient
    for a, b in zip(alone, under):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_non_finite_gradient_skips_the_step_and_leaves_the_weights():
    model = torch_bridge.convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), CONFIG)
    scaler = torch_bridge.AdaLossScaler(model, CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 16)).float().sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_wrong_use_is_refused_with_the_remedy():
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="convert_to_float8_training"):
        torch_bridge.AdaLossScaler(plain, CONFIG)  # operand_format on an unconverted model
    converted = torch_bridge.convert_to_float8_training(copy.deepcopy(plain), CONFIG)
    with pytest.raises(ValueError, match="same AdaLossConfig"):
        torch_bridge.AdaLossScaler(converted, AdaLossConfig(grad_format="float8_e4m3fn",
                                                            operand_format="float8_e4m3fn"))
    with pytest.raises(ValueError, match="operand_format"):
        torch_bridge.convert_to_float8_training(plain, AdaLossConfig(grad_format="float8_e5m2"))
    with pytest.raises(ValueError, match="no nn.Linear"):
        torch_bridge.convert_to_float8_training(torch.nn.Sequential(torch.nn.ReLU()), CONFIG)
    kept = torch_bridge.convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)), CONFIG,
        module_filter_fn=lambda m, fqn: fqn != "1")
    assert isinstance(kept[0], Float8Linear) and type(kept[1]) is torch.nn.Linear


@pytest.mark.parametrize("fmt", ["float8_e5m2", "float8_e4m3fn"])
def test_fp8_histogram_and_counts_equal_reductions_of_the_tensor(fmt):
    """The histogram's statistics (what decisions read of an fp8 cotangent or weight) and the
    cast's fractions equal reductions of the tensor itself, on the host and on tensors, with
    zeros, subnormals, entries at and beyond the format's max and a NaN."""
    from adaloss import solver
    from torch_bridge._xp import ON_HOST, ON_TENSORS, xp
    from torch_bridge.stats import fp8_cast_counts, fp8_histogram
    cfg = AdaLossConfig(grad_format=fmt)
    limit, u_min = cfg.overflow_limit, cfg.underflow_limit
    rng = np.random.default_rng(0)
    mags = np.exp2(rng.uniform(np.log2(u_min) - 5, np.log2(limit) - 2, 500))  # flushed to below the max
    base = np.concatenate([rng.choice([-1.0, 1.0], 500) * mags, np.zeros(20)])
    for extra in ([], [3 * limit, -limit]):  # none at the max (the counts' shortcut), then saturated
        g = torch.tensor(np.concatenate([base, extra])).bfloat16()
        q = solver.to_fp8(g, getattr(torch, fmt), limit, xp)
        v = q.double()
        want = dict(nonzero=(v != 0).sum(), held=((v != 0) & (v.abs() < u_min)).sum(),
                    at_max=(v.abs() == limit).sum(), absmax=v.abs().max(), sq_sum=(v * v).sum(),
                    min=v.min(), max=v.max())
        fr = solver.quantized_fractions(g, q.to(g.dtype), cfg, xp)
        assert 0 < float(want["held"]) and (float(want["at_max"]) > 0) == bool(extra)
        for sm in (ON_HOST, ON_TENSORS):
            h = fp8_histogram(q, u_min, limit, sm)
            for k, w in want.items():
                np.testing.assert_allclose(float(getattr(h, k)), float(w), rtol=1e-6, err_msg=k)
            assert float(h.nan) == 0
            _, got = fp8_cast_counts(g, q, cfg, sm)
            assert [float(x) for x in got] == [float(x) for x in fr], (sm is ON_HOST, extra)
    g = torch.tensor([1.0, float("nan"), 0.0]).bfloat16()  # a NaN makes every statistic NaN
    h = fp8_histogram(solver.to_fp8(g, getattr(torch, fmt), limit, xp), u_min, limit, ON_HOST)
    assert float(h.nan) == 1 and all(np.isnan(float(x)) for x in (h.absmax, h.sq_sum, h.min, h.max))
