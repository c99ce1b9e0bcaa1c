"""torch_bridge recovers fp32 gradients on unmodified nn.Modules where plain fp16 loses them.

The loss is multiplied by 1e-6: plain fp16 backprop flushes the gradients to
zero (relative error ~1). The reference for precision is fp16 itself at a loss
scale where nothing underflows (the loss ×1, no scaling): its error against
fp32 ("inherent") is 1e-3..5e-2 on these models (BatchNorm and the encoder in
``.half()`` are the worst).

- With ``u_min`` = the smallest *normal* fp16 number (2^-14) the scales keep
  cotangents out of the subnormal range, and the unscaled gradients must be as
  accurate as fp16 at loss ×1: error ≤ 1.5·inherent + 1e-3.
- The default (the same u_min, no bounds) is held to inherent + 0.1, a loose bound.

In ``.half()`` mode the parameters' own gradients are fp16 and carry the scale of
the cotangent they were computed from: with no accumulated bound one backward can
overflow them (over steps, the back-off would lower the scales). Those runs use
``accum_bound = u_max``, as a pure-fp16 model must (``unscale_`` refuses fp16
gradients for the same reason).
"""

import copy
import dataclasses

import pytest
import torch
from torch_models import NAMES, make_case, xent

import torch_bridge

LOSS_FACTOR = 1e-6


def _loss(model, x, y, mode, factor=LOSS_FACTOR):
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.float16):
            return factor * xent(model(x), y)
    if mode == "half":
        return factor * xent(model(x.half() if x.is_floating_point() else x), y)
    return factor * xent(model(x), y)


def _rel_err(got, ref):
    return float((got.float() - ref).abs().max() / ref.abs().max())


def _worst(grads, ref):
    return max(_rel_err(g, r) if g is not None else 1.0 for g, r in zip(grads, ref))


def _errors(name, mode, config):
    model, x, y = make_case(name)
    ref = torch.autograd.grad(_loss(model, x, y, "fp32"), list(model.parameters()))
    low = copy.deepcopy(model)
    if mode == "half":
        low.half()
    inherent = _worst(torch.autograd.grad(_loss(low, x, y, mode, 1.0), list(low.parameters())),
                      torch.autograd.grad(_loss(model, x, y, "fp32", 1.0), list(model.parameters())))
    plain = _worst(torch.autograd.grad(_loss(low, x, y, mode), list(low.parameters()),
                                       allow_unused=True), ref)
    if mode == "half":
        config = dataclasses.replace(config, accum_bound=65504.0)
    scaler = torch_bridge.AdaLossScaler(low, config)
    scaler.scale(_loss(low, x, y, mode)).backward()
    scales = scaler.grad_scales()
    unscaled = [p.grad.float() / scales[n] for n, p in low.named_parameters()]
    return _worst(unscaled, ref), inherent, plain


@pytest.mark.parametrize("mode", ["autocast", "half"])
@pytest.mark.parametrize("name", NAMES)
def test_normal_range_u_min_matches_unscaled_fp16_precision(name, mode):
    err, inherent, plain = _errors(name, mode, torch_bridge.AdaLossConfig(u_min=2.0**-14))
    assert plain > 0.5
    assert err <= 1.5 * inherent + 1e-3, (err, inherent)


@pytest.mark.parametrize("mode", ["autocast", "half"])
@pytest.mark.parametrize("name", NAMES)
def test_default_config_recovers_underflowing_gradients(name, mode):
    err, inherent, plain = _errors(name, mode, torch_bridge.AdaLossConfig())
    assert plain > 0.5
    assert err <= inherent + 0.1, (err, inherent)
