"""Flax nnx models of the study (and of ``examples/char_gpt.py``): fp32 parameters,
computation in ``dtype``."""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, dtype: Any, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, dtype=dtype, rngs=rngs)
        self.heads = heads
        self.ln2 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

    def attention(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads), 3, 2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray((d // self.heads) ** -0.5, x.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, att, jnp.finfo(x.dtype).min), axis=-1)
        return self.proj(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d))

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h + self.attention(self.ln1(h))
        return h + self.down(nnx.gelu(self.up(self.ln2(h))))


class CharGPT(nnx.Module):
    """Decoder-only transformer with a tied output projection."""

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2,
                 max_len: int = 64, dtype: Any = jnp.float16, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, dim, dtype=dtype, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, dim)))
        self.blocks = nnx.List([Block(dim, heads, dtype, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]].astype(self.dtype)
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(self.ln(h))


class DigitsCNN(nnx.Module):
    """Two 3x3 convolutions (the second strided) and a linear head, for 8x8 digits (NHWC)."""

    def __init__(self, dtype: Any = jnp.float16, *, rngs: nnx.Rngs) -> None:
        self.c1 = nnx.Conv(1, 16, (3, 3), padding=((1, 1), (1, 1)), dtype=dtype, rngs=rngs)
        self.c2 = nnx.Conv(16, 32, (3, 3), strides=2, padding=((1, 1), (1, 1)), dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 32, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.c2(nnx.relu(self.c1(x))))
        return self.head(x.reshape(x.shape[0], -1))
