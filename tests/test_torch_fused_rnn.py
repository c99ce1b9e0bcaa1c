"""A fused RNN (an ``nn.LSTM`` run by oneDNN on CPU, cuDNN or MIOpen on GPUs: every time step's
matmuls in one autograd node) is a weighted region: counted in the coverage, said once with the
remedy, and its cotangents get one decision sized for what the node computes, so its weight
gradients, summed over time steps and batch in 16 bits, neither underflow nor overflow."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from adaloss import AdaLossConfig
from adaloss.report import AdaLossCoverageWarning, Coverage
from torch_bridge import AdaLossScaler
from torch_bridge.graph import FUSED_RNN, RNN_GATES, ScalePlan
from torch_bridge.layers import RULES

# bf16 (the CPU's fused RNN) computed with fp16's limits: the decisions are those an fp16 GPU run
# makes, and a carried value outside [u_min, u_max] is one fp16 would flush or overflow
FP16_LIMITS = AdaLossConfig(grad_format="bfloat16", u_min=2.0**-14, u_max=65504.0)


class _LSTMLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.rnn = torch.nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.out = torch.nn.Linear(64, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(x))[0])


def _loss(model, x, y, factor, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 50), y.reshape(-1)) * factor


@pytest.mark.parametrize("factor", [1e-6, 1e4])
def test_fused_lstm_gets_a_decision_and_fp32_gradients(factor):
    torch.manual_seed(0)
    model = _LSTMLM()
    x, y = torch.randint(0, 50, (8, 16)), torch.randint(0, 50, (8, 16))
    _loss(model, x, y, factor, False).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    scaler = AdaLossScaler(model, config=FP16_LIMITS)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        scaler.scale(_loss(model, x, y, factor, True)).backward()
    assert "MkldnnRnnLayerBackward0" in _node_names(model, x), "the CPU no longer fuses the LSTM"
    # two fused layers (one node each) and the Linear: three decisions, two regions
    assert scaler.coverage() == Coverage(weighted_ops=3, layers=3, opaque_regions=2)
    (warning,) = [w for w in said if issubclass(w.category, AdaLossCoverageWarning)]
    said = str(warning.message)
    assert "2 fused RNN node(s)" in said and "mkldnn.flags(enabled=False)" in said
    reps = scaler.layer_reports()
    for layer in ("rnn.weight_ih_l0", "rnn.weight_ih_l1"):
        assert int(reps[layer].fan_in) == 4 * 64  # four gates of 64 units
    scales = scaler.grad_scales()
    u_min, u_max = FP16_LIMITS.underflow_limit, FP16_LIMITS.overflow_limit
    for name, p in model.named_parameters():
        if not name.startswith("rnn."):
            continue
        carried = p.grad.float()
        assert float(carried.abs().max()) < u_max, (name, "overflows fp16")
        live = ref[name] != 0
        low = float((carried.abs()[live] < u_min).float().mean())
        assert low < 0.05, (name, low)  # the decision lifted them out of fp16's subnormals
        got = carried / scales[name]
        err = float((got - ref[name]).norm() / ref[name].norm())
        assert err < 3e-2, (name, err)  # bf16 rounding of the forward and backward
    if factor < 1:  # the region was scaled up: at scale 1 these weight gradients are ~1e-8
        assert float(scales["rnn.weight_hh_l0"]) >= 2.0**10
    # the same structure again: classified once, said once
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        scaler.scale(_loss(model, x, y, factor, True)).backward()
    assert not [w for w in again if issubclass(w.category, AdaLossCoverageWarning)]


def _node_names(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        root = model(x).float().sum().grad_fn
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack += [n for n, _ in node.next_functions]
    return {n.name() for n in seen}


class _Node:
    """A stand-in for an autograd node: what the graph walk reads of one."""

    _seq = 0

    def __init__(self, name, edges=(), shapes=((),), variable=None, **saved):
        self._name, self.next_functions = name, tuple((e, 0) for e in edges)
        self._input_metadata = [types.SimpleNamespace(shape=s, dtype=torch.float16) for s in shapes]
        _Node._seq += 1
        self._seq_nr = _Node._seq
        if variable is not None:
            self.variable = variable
        for k, v in saved.items():
            setattr(self, "_saved_" + k, v)

    def name(self):
        return self._name

    def _sequence_nr(self):
        return self._seq_nr


@pytest.mark.parametrize("kind", sorted(FUSED_RNN))
def test_every_fused_rnn_node_kind_is_a_region_of_its_gates(kind):
    """cuDNN's and MIOpen's nodes (no CI machine has their GPUs) are routed by the same rule table
    as oneDNN's: a bidirectional GRU of 32 units is one region of fan-in 3·32 per direction the
    node runs (cuDNN's and MIOpen's run both; oneDNN has a node per direction)."""
    params = [torch.nn.Parameter(torch.zeros(96, 16)), torch.nn.Parameter(torch.zeros(96, 32))]
    leaves = [_Node("torch::autograd::AccumulateGrad", variable=p, shapes=(p.shape,)) for p in params]
    x = _Node("MulBackward0", shapes=((5, 4, 16),))  # an activation: data upstream
    rnn = _Node(kind, edges=(x, *leaves), shapes=((5, 4, 64), (2, 4, 32)), mode=3, hidden_size=32,
                bidirectional=True)
    plan = ScalePlan(rnn, {id(p): f"gru.w{i}" for i, p in enumerate(params)})
    (region,) = [p for p in plan.order if p.kind == "rnn"]
    both = FUSED_RNN[kind][2]
    assert region.name == "gru.w0" and region.fan_in == RNN_GATES[3] * 32 * (2 if both else 1)
    assert plan.coverage == Coverage(weighted_ops=1, layers=1, opaque_regions=1)
    assert not plan.opaque  # its parameters are the node's edges: no nested backward to hook
    assert "rnn" in RULES
