"""Checkpoint -> restore -> N more steps is bitwise the same run: torch (state_dict through
torch.save / torch.load, with a back-off in progress; the lift's own round trip is in
test_underflow_feedback) and JAX (orbax with an abstract target; back-off and lifts non-zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
import torch.nn.functional as F
from models import make_case
from torch_models import Residual

import jax_adaloss
import torch_bridge
from adaloss.config import AdaLossConfig

BEFORE, AFTER = 4, 5
# a step whose loss is not finite: it is skipped and raises the back-off exponent
POISONED = 2
CONFIG = AdaLossConfig(underflow_feedback=True)


def _torch_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)


def _torch_steps(model, opt, scaler, steps: range) -> list[dict[str, float]]:
    scales = []
    for step in steps:
        x, y = _torch_batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y) * (float("inf") if step == POISONED else 1e-4)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append({k: float(r.scale) for k, r in scaler.layer_reports().items()})
    return scales


def _torch_fresh():
    torch.manual_seed(0)
    model = Residual()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, torch_bridge.AdaLossScaler(model, CONFIG)


def test_torch_resume_from_state_dicts_is_bitwise(tmp_path):
    model, opt, scaler = _torch_fresh()
    _torch_steps(model, opt, scaler, range(BEFORE))
    assert scaler.backoff == 1 and scaler.skipped_steps == 1
    lift = scaler.lift
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()},
               tmp_path / "ckpt.pt")
    straight = _torch_steps(model, opt, scaler, range(BEFORE, BEFORE + AFTER))

    model2, opt2, scaler2 = _torch_fresh()
    ckpt = torch.load(tmp_path / "ckpt.pt")  # weights_only=True: the scaler's state is plain data
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    scaler2.load_state_dict(ckpt["scaler"])
    assert (scaler2.backoff, scaler2.lift, scaler2.iteration) == (1, lift, BEFORE)
    resumed = _torch_steps(model2, opt2, scaler2, range(BEFORE, BEFORE + AFTER))
    assert resumed == straight
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
    assert scaler2.state_dict().keys() == scaler.state_dict().keys()
    assert (scaler2.backoff, scaler2.skipped_steps) == (scaler.backoff, scaler.skipped_steps)


def _jax_problem():
    cls, params, x, y = make_case("residual", jax.random.key(0))
    model = cls(dtype=jnp.float16)

    def loss(p, x, y, factor):
        logits = model.apply(p, x.astype(jnp.float16)).astype(jnp.float32)
        return factor * -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1))

    tx = jax_adaloss.adaloss(CONFIG, inner=optax.adam(1e-3))
    vg = jax_adaloss.value_and_grad(loss, config=CONFIG)

    @jax.jit
    def step(p, s, x, y, factor):
        _, g = vg(p, x, y, factor, adaloss_state=s)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def run(p, s, steps):
        for k in steps:
            xs = jnp.roll(x, k, axis=0)
            p, s = step(p, s, xs, y, jnp.float32(jnp.inf if k == POISONED else 1e-4))
        return p, s
    return params, tx.init(params), run


def _bitwise(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_jax_orbax_restore_with_an_abstract_target_is_bitwise(tmp_path):
    params, state, run = _jax_problem()
    params, state = run(params, state, range(BEFORE))
    assert int(optax.tree.get(state, "backoff")) == 1 and int(optax.tree.get(state, "skipped")) == 1
    assert max(int(k) for k in jax.tree.leaves(optax.tree.get(state, "lift"))) > 0
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    ckptr.wait_until_finished()
    straight = run(params, state, range(BEFORE, BEFORE + AFTER))

    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
    restored = ckptr.restore(tmp_path / "ckpt", target)
    _bitwise(restored, {"params": params, "opt_state": state})
    _bitwise(run(restored["params"], restored["opt_state"], range(BEFORE, BEFORE + AFTER)), straight)


def test_jax_state_restored_without_a_target_is_refused_with_the_remedy(tmp_path):
    params, state, _ = _jax_problem()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})  # the docs' layout
    ckptr.wait_until_finished()
    as_dicts = ckptr.restore(tmp_path / "ckpt")
    tx = jax_adaloss.adaloss(CONFIG, inner=optax.adam(1e-3))
    grads = jax.tree.map(jnp.zeros_like, params)
    with pytest.raises(TypeError, match="abstract target") as refused:
        tx.update(grads, as_dicts["opt_state"], params)
    # the target it suggests is that layout, and restoring with it gives the state back
    assert "{'params': params, 'opt_state': tx.init(params)}" in str(refused.value)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"params": params, "opt_state": tx.init(params)})
    _bitwise(ckptr.restore(tmp_path / "ckpt", target)["opt_state"], state)
