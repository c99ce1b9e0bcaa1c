"""What ``fuse_decisions`` compiles with inductor decides as the same graphs run op by op."""

import pytest
import torch

from torch_bridge import AdaLossConfig, kernels
from torch_bridge._xp import xp as torch_xp
from torch_bridge.fused import FusedMath


def _spread(shape, dtype, seed, top=2):
    """Normal entries over 2^(top-22)..2^top in magnitude, some zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(top - 22, top + 1, shape, generator=gen)
    return torch.where(torch.rand(shape, generator=gen) < 0.1, 0.0, x).to(dtype)


def test_inductor_compiled_decisions_equal_their_traced_graphs():
    """A layer's, a cast's and a merge's compiled call (statistics, math and rescale fused by
    inductor) gives the scales and the rescaled cotangents of its traced graph run op by op,
    bit for bit (powers of two), and the unrounded statistics to rounding; the weights'
    statistics read through a transposed view, as autograd saves a weight."""
    cfg = AdaLossConfig()
    g, x = _spread((64, 48), torch.float16, 0, top=-8), _spread((64, 32), torch.float16, 1)
    w = (0.05 * torch.randn(48, 32, generator=torch.Generator().manual_seed(2))).half().t()
    incoming, backoff = torch.tensor(2.0**10), torch.tensor(1.0)
    logits = _spread((8, 4, 40), torch.float32, 3, top=-12)
    parts = [_spread((16, 24), torch.float16, 4), _spread((16, 24), torch.float16, 5)]
    out = {}
    for backend in ("eager", "inductor"):
        fm = FusedMath(backend)
        (ws,) = fm.call(kernels.weights, (), [w])
        layer = fm.call(kernels.layer, (cfg, 32, w.numel(), None, False, 1), g, x, ws, incoming, backoff,
                        None, None, None, [])
        cast = fm.call(kernels.cast, (cfg,), [logits], incoming, backoff, None, None, None)
        merge = fm.call(kernels.merge, (cfg, cfg.overflow_limit, True, True), parts,
                        [torch.tensor(2.0**6), torch.tensor(2.0**9)], backoff)
        assert len(fm) == 4
        out[backend] = (layer, cast, merge)
    (layer, cast, merge), (c_layer, c_cast, c_merge) = out["eager"], out["inductor"]
    assert torch.equal(layer[0], c_layer[0]) and torch.equal(cast[0][0], c_cast[0][0])
    assert torch.equal(merge[0], c_merge[0]) and float(merge[1]) == float(c_merge[1])
    for d, c in ((layer[1].d, c_layer[1].d), (cast[1].d, c_cast[1].d)):
        assert float(d.scale) == float(c.scale) != 1.0
        assert float(c.unrounded) == pytest.approx(float(d.unrounded), rel=1e-5)
        assert float(c.sigma) == pytest.approx(float(d.sigma), rel=1e-5)
    assert float(c_layer[1].fraction) == float(layer[1].fraction) > 0
    assert float(c_layer[1].absmax) == float(layer[1].absmax)


def test_a_decision_traced_with_one_tensor_twice_takes_two_apart_later():
    """Two parts that carried one scale object when their merge was traced may carry two
    later: the compiled graph keeps an input per argument, not per tensor object."""
    cfg = AdaLossConfig()
    parts = [_spread((4, 8), torch.float16, 6), _spread((4, 8), torch.float16, 7)]
    one, backoff = torch.tensor(2.0**4), torch.tensor(1.0)
    fm = FusedMath("eager")
    static = (cfg, cfg.overflow_limit, True, True)
    fm.call(kernels.merge, static, parts, [one, one], backoff)
    scales = [one, torch.tensor(2.0**7)]
    total, target = fm.call(kernels.merge, static, parts, scales, backoff)
    want, want_target = kernels.merge(*static, torch_xp, parts, scales, backoff)
    assert len(fm) == 1 and float(target) == float(want_target) == 2.0**7
    assert torch.equal(total, want)
