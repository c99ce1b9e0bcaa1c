"""The compiled backward grows linearly with depth: XLA must not recompute earlier decisions.

Each layer's scale depends on the scale it receives, and the residual stream is a chain of
merges. XLA fuses cheap elementwise producers into every consumer, so unless the scales and
the merged cotangents are materialised, each fusion recomputes the whole chain above it and
the program (compile and step time) grows with the square of the depth. The count of
instructions in the optimised HLO pins this on CPU, independent of timing noise.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_adaloss
from jax_adaloss.cotangents import _settled, _stored

F16 = jnp.float16


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        x = nn.LayerNorm(dtype=F16)(h)  # fp32 statistics: a cast decision in the backward
        x = nn.Dense(32, dtype=F16)(x)
        return h + nn.Dense(h.shape[-1], dtype=F16)(nn.gelu(x))  # a merge on the residual stream


class _Stack(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(16, dtype=F16)(x)
        for _ in range(self.depth):
            h = _Block()(h)
        return nn.Dense(4, dtype=F16)(h).astype(jnp.float32)


def _compiled_size(depth: int) -> int:
    model = _Stack(depth)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 12)), F16)
    params = model.init(jax.random.key(0), x)

    def loss(p: dict) -> jax.Array:
        return jnp.mean(model.apply(p, x) ** 2)

    text = jax.jit(jax_adaloss.value_and_grad(loss)).lower(params).compile().as_text()
    return len(re.findall(r"= \S+ [\w\-]+\(", text))


def test_compiled_backward_grows_linearly_with_depth() -> None:
    sizes = {d: _compiled_size(d) for d in (2, 4, 8)}
    per_block_short = (sizes[4] - sizes[2]) / 2
    per_block_long = (sizes[8] - sizes[4]) / 4
    # quadratic growth (the chains duplicated) made the second 1.35x the first
    assert per_block_long <= 1.1 * per_block_short, sizes


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_stored_is_bitwise_identity(dtype: jnp.dtype) -> None:
    info = jnp.finfo(dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, float(info.max), -float(info.max),
                        float(info.smallest_subnormal), -float(info.smallest_subnormal),
                        float(info.smallest_normal), 1.0, -1.5], np.float32)
    bits = np.arange(2**16, dtype=np.uint16)  # every pattern: negative NaNs too
    values = np.concatenate([special.astype(dtype), bits.view(dtype)])
    x = jnp.asarray(values, dtype)
    out = jax.jit(_stored)(x)
    assert out.dtype == x.dtype
    got, want = np.asarray(out).view(np.uint16), np.asarray(x).view(np.uint16)
    x32 = np.asarray(x, np.float32)
    nan = np.isnan(x32)
    if dtype == jnp.bfloat16:  # its subnormals are fp32's, which XLA's arithmetic flushes (to ±0)
        want = np.where(np.abs(x32) < float(info.smallest_normal), want & 0x8000, want)
    np.testing.assert_array_equal(got[~nan], want[~nan])  # every other value, -0 and ±inf
    assert not np.isfinite(np.asarray(out, np.float32)[nan]).any()  # a NaN stays non-finite


def test_settled_scales_are_unchanged() -> None:
    s = jnp.asarray([0.0, 2.0**-126, 1.0, 3.0, 2.0**40, 3.4e38, np.inf], jnp.float32)
    got = jax.jit(lambda v: jnp.stack([_settled(x) for x in v]))(s)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(s))
    pairs = jax.jit(lambda v: [_settled((a, b)) for a, b in zip(v, v[::-1])])(s)  # one reduction each
    np.testing.assert_array_equal(np.asarray(pairs), np.stack([np.asarray(s), np.asarray(s)[::-1]], 1))


class _Carried(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array, _: None) -> tuple[jax.Array, None]:
        return _Block()(h), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        stack = nn.scan(_Carried, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        h, _ = stack()(nn.Dense(16, dtype=F16)(x), None)
        return nn.Dense(4, dtype=F16)(h).astype(jnp.float32)


@pytest.mark.parametrize("scanned", [False, True])
def test_reports_are_traced_only_when_asked_for(scanned: bool) -> None:
    # the per-layer reports (predicted underflow: an erf each) cost trace and compile time;
    # without return_report they are left out, and the gradients are bitwise the same
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 12)), F16)
    model = _Scanned() if scanned else _Stack(3)
    params = model.init(jax.random.key(0), x)

    def loss(p: dict) -> jax.Array:
        return jnp.mean(model.apply(p, x) ** 2)

    plain = jax_adaloss.value_and_grad(loss)
    reported = jax_adaloss.value_and_grad(loss, return_report=True)
    erfs = {name: str(jax.make_jaxpr(f)(params)).count(" erf ") for name, f in
            (("plain", plain), ("reported", reported))}
    assert erfs["plain"] == 0 < erfs["reported"], erfs
    (v1, g1), ((v2, g2), report) = jax.jit(plain)(params), jax.jit(reported)(params)
    assert len(report.layers) >= 4 and float(v1) == float(v2)  # scanned: stacked per layer
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
