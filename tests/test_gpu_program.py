"""The GPU program, compiled for an H100 without a GPU (:mod:`adaloss_tools.gpu_program`): every
fp8 cast of the step is in it, in both GEMM pipelines, and with e4m3 operands every GEMM of a
quantized layer is an FP8 GEMM, at least as many as flax's ``Fp8DotGeneralOp`` gets. XLA:GPU
folds a cast to fp8 and back to 16 bits away where it may (``xla_allow_excess_precision``):
the first test shows the reader sees it."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.linen import fp8_ops

import jax_adaloss
from adaloss.config import AdaLossConfig
from adaloss_tools import gpu_program as gp
from adaloss_tools.audit import fp8_casts

pytestmark = [pytest.mark.skipif(not gp.available(), reason="needs the gpu-program extra (CUDA plugin)"),
              pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")]

LAYERS, DIM, BATCH = 3, 64, 32  # 3 hidden layers and a head: 4 quantized layers


class _MLP(nn.Module):
    fp8: bool = False

    @nn.compact
    def __call__(self, x):
        kw = {"dot_general_cls": fp8_ops.Fp8DotGeneralOp} if self.fp8 else {}
        for _ in range(LAYERS):
            x = nn.relu(nn.Dense(DIM, dtype=jnp.bfloat16, **kw)(x))
        return nn.Dense(16, dtype=jnp.bfloat16, **kw)(x)


@functools.cache
def _compiled(config=None, fp8=False, pipeline="triton"):
    """The program of :func:`_step` (compiled once per arguments: tests share them)."""
    fun, args = _step(config, fp8)
    return gp.compile_for(fun, *args, pipeline=pipeline)


def _step(config=None, fp8=False):
    """A gradient step and its arguments: jax.value_and_grad (flax's FP8 dots with ``fp8``) or
    adaloss's with ``config``."""
    model = _MLP(fp8=fp8)
    x, y = jnp.ones((BATCH, DIM), jnp.float32), jnp.ones((BATCH, 16), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss(p, x, y):
        return jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)
    if config is None:
        return jax.value_and_grad(loss), (params, x, y)
    vg = jax_adaloss.value_and_grad(loss, config=config)
    return (lambda *a: vg(*a, adaloss_state=None)), (params, x, y)


def test_the_reader_sees_a_cast_the_gpu_compiler_folds_away():
    def folded(x, w):  # a scaled quantize-dequantize round trip before a bf16 GEMM
        q = jnp.clip(x.astype(jnp.float32) * 2.0, -448, 448).astype(jnp.float8_e4m3fn)
        return jnp.dot((q.astype(jnp.float32) / 2.0).astype(jnp.bfloat16), w)

    def kept(x, w):  # the fp8 values in the GEMM itself
        q = jnp.clip(x.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn)
        return jax.lax.dot_general(q, w.astype(jnp.float8_e4m3fn), (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    a = jnp.ones((64, 64), jnp.bfloat16)
    assert gp.read_hlo(jax.jit(folded).lower(a, a).compile().as_text())["converts"]["f8e4m3fn"] == 1
    for pipeline in gp.PIPELINES:
        gone = gp.compile_for(folded, a, a, pipeline=pipeline)
        assert gone.converts["f8e4m3fn"] == 0 and gone.fp8_gemms == 0
        fp8 = gp.compile_for(kept, a, a, pipeline=pipeline)
        assert fp8.converts["f8e4m3fn"] == 2 and fp8.gemms == fp8.fp8_gemms == 1
        assert fp8.bytes_accessed > 0 and fp8.temp_bytes >= 0 and fp8.kernels >= 1


@pytest.mark.parametrize("pipeline", gp.PIPELINES)
def test_every_fp8_cast_survives_and_every_gemm_of_a_quantized_layer_is_an_fp8_gemm(pipeline):
    layers = LAYERS + 1
    grads = _compiled(AdaLossConfig(grad_format="float8_e5m2"), pipeline=pipeline)
    # one cast per layer's incoming cotangent; bf16 operands: no FP8 GEMM (by design)
    # (a fusion may duplicate a convert: at least, never fewer)
    assert grads.converts["f8e4m3fn"] == 0 and grads.converts["f8e5m2"] >= layers, grads.converts
    both = _compiled(AdaLossConfig(grad_format="float8_e5m2", operand_format="float8_e4m3fn"),
                     pipeline=pipeline)
    assert both.converts["f8e4m3fn"] >= 2 * layers and both.converts["f8e5m2"] >= layers, both.converts
    # forward, input-gradient (not the first layer's) and weight-gradient GEMMs
    assert both.fp8_gemms == both.gemms == 3 * layers - 1
    if pipeline == "cublas":  # where flax's FP8 dots become cuBLASLt f8 GEMMs
        flax = _compiled(fp8=True, pipeline=pipeline)
        assert both.fp8_gemms >= flax.fp8_gemms == 3 * layers - 1
    else:
        assert grads.gemms_reading_fp8 == 2 * layers - 1  # the Triton GEMM fusions read the e5m2 values


class _Linear(nn.Module):
    """Dense layers with no activation between them: each layer's cotangent is a GEMM's output,
    where a reduction of it cannot join the kernel that writes it."""

    @nn.compact
    def __call__(self, x):
        for _ in range(LAYERS):
            x = nn.Dense(DIM, dtype=jnp.bfloat16)(x)
        return nn.Dense(16, dtype=jnp.bfloat16)(x)


@pytest.mark.parametrize("pipeline", gp.PIPELINES)
def test_no_decided_cast_reads_its_cotangent_twice_where_current_scaling_must(pipeline):
    model = _Linear()
    x, y = jnp.ones((BATCH, DIM), jnp.float32), jnp.ones((BATCH, 16), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss(p, x, y):
        return jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)

    def passes(**kw):
        config = AdaLossConfig(grad_format="float8_e5m2", **kw)
        vg = jax_adaloss.value_and_grad(loss, config=config)
        step = lambda *a: vg(*a, adaloss_state=None)  # noqa: E731
        own = sum(c.reads_own_max for c in fp8_casts(step, params, x, y))
        return gp.compile_for(step, params, x, y, pipeline=pipeline).second_passes["f8e5m2"], own
    # the decided casts are one pass: only a cast no decision fitted (the loss cotangent's) may
    # read its own max
    assert passes() == (1, 1)
    assert passes(fp8_rule="current") == (LAYERS + 1, LAYERS + 1)  # every cast: two passes


def test_a_cpu_trace_of_the_same_step_neither_leaks_into_nor_takes_the_gpu_program():
    config = AdaLossConfig(grad_format="float8_e5m2")
    fun, args = _step(config)
    fresh = gp.compile_for(*_step(config)[:1], *args, pipeline="cublas")
    jax.block_until_ready(jax.jit(fun)(*args))  # traced for the CPU first (bf16 dots widened)
    gpu = gp.compile_for(fun, *args, pipeline="cublas")
    assert (gpu.kernel_bytes, gpu.kernels) == (fresh.kernel_bytes, fresh.kernels)
    jax.block_until_ready(jax.jit(fun)(*args))  # and the CPU still runs its own


@pytest.mark.parametrize("heads", [False, True])
def test_every_statistic_of_a_cotangent_is_one_kernel_on_the_gpu(heads):
    """max|g|, E[g²] and the two counts of a 16-bit cotangent too long for one GPU row reduction
    (131072 entries; with ``heads`` a GEMM's output seen transposed, as attention's is) are one
    kernel: three with the one that makes g and the decision that reads them; separate
    reductions take three more at least (XLA splits each in two)."""
    from jax_adaloss import reductions

    def step(a, b, one_pass):
        g = jnp.einsum("bhsd,bhtd->bsht", a, b) if heads else a * b
        s = reductions.statistics(g, sq_mean=True, below=2.0**-14, one_pass=one_pass)
        return jnp.sqrt(s.sq_mean) / s.absmax * s.nonzero - s.below
    shape = (8, 4, 64, 32) if heads else (8, 64, 256)
    args = (jnp.ones(shape, jnp.float16), jnp.ones(shape, jnp.float16))
    assert gp.compile_for(lambda a, b: step(a, b, None), *args).kernels == 3
    assert gp.compile_for(lambda a, b: step(a, b, False), *args).kernels >= 6


def test_the_decisions_add_few_kernels_to_the_gradient():
    """The bf16 MLP's gradient: adaloss's per-layer decisions (statistics, decision, hand-off,
    gradient checks) add at most 30% to ``jax.value_and_grad``'s kernels that move tensors (24
    there; one kernel per statistic pass and one per decision: 30). Its scalar kernels (the
    decisions' math, and XLA's copies of the per-leaf scale, inverse, marker and trace the
    program returns, several leaves sharing one value) stay at most four per gradient leaf."""
    fun, args = _step()
    leaves = len(jax.tree.leaves(args[0]))
    base = _compiled().kernels
    ada = gp.attribute(_compiled(AdaLossConfig(grad_format="bfloat16")).text)
    tensors = sum(c["kernels"] for k, c in ada.items() if k != "scalars")
    assert tensors <= 1.3 * base, (ada, base)
    assert ada["scalars"]["kernels"] <= 4 * leaves, ada


def test_the_underflow_signals_of_every_weight_take_one_kernel():
    """With ``underflow_feedback`` each weight's underflow ratio (an output of the gradient) is
    computed in one kernel for all of them, not a scalar kernel each: the feedback adds at most
    one kernel to the MLP's gradient (three weights report one)."""
    with_feedback = _compiled(AdaLossConfig(grad_format="bfloat16")).kernels
    without = _compiled(AdaLossConfig(grad_format="bfloat16", underflow_feedback=False)).kernels
    assert with_feedback - without <= 1, (with_feedback, without)


def test_a_loop_counts_its_body_per_iteration_and_the_slices_it_moves():
    """A scan's body runs once per iteration (its known trip count), and a kernel that reads a
    slice of the loop's stacked input or writes one into its stacked output in place moves the
    slice, not the buffer: about the two buffers' bytes in all, not trips × buffers."""
    xs = jnp.ones((64, 4096), jnp.float32)

    def f(xs):
        return jax.lax.scan(lambda c, x: (c + x, jnp.sin(c) * x), jnp.zeros(4096, jnp.float32), xs)
    prog = gp.compile_for(f, xs)
    buffers = 2 * xs.nbytes
    assert prog.kernels_run >= 64 > prog.kernels
    assert buffers <= prog.kernel_bytes_run <= 4 * buffers, (prog.kernel_bytes_run, buffers)


def test_a_donated_input_returned_unchanged_costs_no_copy():
    """A step's state returned as it came (``compile_for(..., donate_argnums=...)``, as training
    loops compile a step): not donated, XLA writes it to a new buffer with a copy kernel;
    donated, the output is the input's buffer and no kernel runs for it."""
    state, x = jnp.ones((1024,), jnp.float32), jnp.ones((1024,), jnp.float32)

    def step(state, x):
        return state, jnp.sin(x)
    kept = gp.compile_for(step, state, x)
    donated = gp.compile_for(step, state, x, donate_argnums=(0,))
    assert kept.kernels_run == donated.kernels_run + 1
    assert kept.kernel_bytes_run == donated.kernel_bytes_run + 2 * state.nbytes
