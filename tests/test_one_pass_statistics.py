"""A GPU trace computes every statistic of a tensor in one variadic reduction
(:mod:`jax_adaloss.reductions`), a CPU trace in separate ones: both decide the same scales
and count the same underflow, here on the CPU (the GPU trace forced with ``compiling_for``).
Sums may round differently (their order differs): the statistics agree to their rounding, the
power-of-two scales and every count exactly. The batch is large enough (65536-entry
cotangents) that the one-pass view splits its rows and combines partial results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import TinyGPT, xent

import jax_adaloss
from adaloss.config import AdaLossConfig
from jax_adaloss import reductions
from jax_adaloss.weight_grads import compiling_for

CONFIGS = {"fp16": AdaLossConfig(), "e5m2": AdaLossConfig(grad_format="float8_e5m2")}


def _reports(config):
    model = TinyGPT(dim=64, max_len=64)
    x = jax.random.randint(jax.random.key(1), (16, 64), 0, 32)
    y = jax.random.randint(jax.random.key(2), (16, 64), 0, 32)
    params = model.init(jax.random.key(0), x)

    def loss(p, x, y):
        return 1e-4 * xent(model.apply(p, x), y)

    def run(platform):
        with compiling_for(platform):
            vg = jax_adaloss.value_and_grad(loss, config=config, return_report=True)
            (_, grads), report = jax.jit(lambda p: vg(p, x, y, adaloss_state=None))(params)
        return jax.tree.leaves(jax_adaloss.unscale_tree(grads)), report
    return run("cpu"), run("cuda")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_pass_statistics_decide_as_separate_reductions(name):
    (cpu_grads, cpu), (gpu_grads, gpu) = _reports(CONFIGS[name])
    assert cpu.layers.keys() == gpu.layers.keys() and len(cpu.layers) >= 6
    for layer, a in cpu.layers.items():
        b = gpu.layers[layer]
        for field in ("scale", "incoming_scale", "outgoing_scale"):
            assert float(getattr(a, field)) == float(getattr(b, field)), (layer, field)
        assert float(a.grad_absmax) == float(b.grad_absmax), layer
        # on XLA:CPU a variadic reduction sums in one sequential loop (a GPU's is a tree): the
        # log-moments of a cast's 2^17 entries move by up to ~0.2% here
        for field in ("sigma", "model_scale"):
            np.testing.assert_allclose(float(getattr(a, field)), float(getattr(b, field)), rtol=1e-2,
                                       err_msg=f"{layer} {field}")
        for field in ("flushed", "subnormal", "saturated"):
            if getattr(a, field) is not None:
                assert float(getattr(a, field)) == float(getattr(b, field)), (layer, field)
    for g, h in zip(cpu_grads, gpu_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(h, np.float32), rtol=1e-3, atol=1e-9)


def test_a_cotangent_longer_than_a_gpu_row_is_viewed_in_partial_rows():
    """The one-pass view splits the first axis into rows of at most GPU_ROW_LIMIT entries; a
    tensor whose trailing axes alone are longer, or that would need more than MAX_PARTIALS rows,
    is reduced whole (XLA's two kernels); either way the statistics are those of the tensor."""
    assert reductions._rows((16, 64, 64)) == (4, 4, 64, 64)
    assert reductions._rows((8, 64, 512)) is None  # 32768 entries after the first axis
    assert reductions._rows((100003,)) is None
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 64, 64)) * 1e-4, jnp.float16)
    for shape in ((16, 64, 64), (8, 64, 512)):
        x = jnp.resize(x, shape)
        one = reductions.statistics(x, sq_mean=True, below=2.0**-14, above=1e-4, one_pass=True)
        ref = reductions.statistics(x, sq_mean=True, below=2.0**-14, above=1e-4, one_pass=False)
        assert float(one.absmax) == float(ref.absmax)
        assert (float(one.nonzero), float(one.below), float(one.above)) == \
            (float(ref.nonzero), float(ref.below), float(ref.above))
        # XLA:CPU sums a variadic reduction in one sequential loop: fp32 rounding of 2^18 terms
        np.testing.assert_allclose(float(one.sq_mean), float(ref.sq_mean), rtol=2e-4)
