"""Fan-outs in torch: contributions with different scales are merged (method.md step 5)
before autograd sums them, and the gradients still match fp32.

Autograd sums a value's contributions before any tensor hook sees them, so the
bridge stashes each consumer's contribution in a node post-hook and merges in
the producer's pre-hook. Threading one scale in execution order instead gives
wrong gradients as soon as a residual branch carries another scale; the
residual model below makes the branches differ.
"""

import torch
from torch_models import make_case, xent

import torch_bridge

# the default; the tests assert that branches carry different scales
CONFIG = torch_bridge.AdaLossConfig()
TOL = 3e-2  # as in the JAX fan-out tests


def _run(name):
    model, x, y = make_case(name)
    ref = torch.autograd.grad(1e-6 * xent(model(x), y), list(model.parameters()))
    scaler = torch_bridge.AdaLossScaler(model, CONFIG)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-6 * xent(model(x), y)
    scaler.scale(loss)
    sb = loss.grad_fn.metadata["adaloss"]()
    plan = sb.plan
    merges = [(p, plan.nodes[p.index], plan.params[p.index]) for p in plan.order
              if p.merges or p.cross_merge]
    loss.backward()
    scales = scaler.grad_scales()
    for (n, p), r in zip(model.named_parameters(), ref):
        err = float((p.grad / scales[n] - r).abs().max() / r.abs().max())
        assert err < TOL, (n, err)
    return scaler, merges


def test_residual_branches_with_different_scales():
    scaler, merges = _run("residual")
    reps = scaler.layer_reports()
    branch = [float(reps[f"blocks.{i}.0.weight"].scale * reps[f"blocks.{i}.2.weight"].scale) for i in (0, 1)]
    assert any(s != 1.0 for s in branch), "the residual branches carried the same scale"
    assert any(node.name() == "AddBackward0" for _, node, _ in merges)


def test_tied_embedding_merges_at_the_parameter():
    scaler, merges = _run("gpt")
    assert [param for p, _, param in merges if p.leaf] == [scaler._model.tok.weight]


def test_multihead_attention_and_encoder_layer():
    scaler, merges = _run("encoder")
    reps = scaler.layer_reports()
    assert {"enc.self_attn.in_proj_weight", "enc.linear1.weight", "mha.in_proj_weight",
            "emb.weight"} <= set(reps)
    assert merges
