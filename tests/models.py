"""Small Flax models used by the tests: fp32 parameters, compute in ``dtype``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(64, dtype=self.dtype)(x))
        x = nn.gelu(nn.Dense(64, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


class ResidualMLP(nn.Module):
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(64, dtype=self.dtype)(x)
        for _ in range(2):
            y = nn.LayerNorm(dtype=self.dtype)(h)
            y = nn.Dense(64, dtype=self.dtype)(nn.gelu(nn.Dense(128, dtype=self.dtype)(y)))
            h = h + y
        return nn.Dense(10, dtype=self.dtype)(h)


class CNN(nn.Module):
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # x: [B, 8, 8, 1]
        x = nn.relu(nn.Conv(8, (3, 3), dtype=self.dtype)(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2, dtype=self.dtype)(x))
        x = nn.Conv(16, (3,), dtype=self.dtype)(x.reshape(x.shape[0], -1, 16))  # a 1-D conv
        return nn.Dense(10, dtype=self.dtype)(x.reshape(x.shape[0], -1))


class Block(nn.Module):
    dim: int
    heads: int
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        b, t, d = h.shape
        y = nn.LayerNorm(dtype=self.dtype)(h)
        qkv = nn.Dense(3 * d, use_bias=False, dtype=self.dtype)(y)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, self.heads, d // self.heads), 3, axis=2)
        q, k, v = (a[:, :, 0] for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(self.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(mask, att, jnp.finfo(self.dtype).min), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        h = h + nn.Dense(d, dtype=self.dtype)(y)
        y = nn.LayerNorm(dtype=self.dtype)(h)
        return h + nn.Dense(d, dtype=self.dtype)(nn.gelu(nn.Dense(4 * d, dtype=self.dtype)(y)))


class TinyGPT(nn.Module):
    vocab: int = 32
    dim: int = 32
    heads: int = 4
    layers: int = 1
    max_len: int = 16
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        emb = nn.Embed(self.vocab, self.dim, dtype=self.dtype)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.dim))
        h = emb(tokens) + pos[: tokens.shape[1]].astype(self.dtype)
        for _ in range(self.layers):
            h = Block(self.dim, self.heads, self.dtype)(h)
        h = nn.LayerNorm(dtype=self.dtype)(h)
        return emb.attend(h)  # tied output projection


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy, computed in fp32 (the fp32→fp16 cast sits right after it)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def make_case(name: str, key: jax.Array) -> tuple[type, dict, jax.Array, jax.Array]:
    """(model class, params, inputs in fp32, labels) for a test model by name."""
    kx, ky, kp = jax.random.split(key, 3)
    if name == "gpt":
        x = jax.random.randint(kx, (8, 16), 0, 32)
        y = jax.random.randint(ky, (8, 16), 0, 32)
        cls = TinyGPT
    elif name == "cnn":
        x, y, cls = jax.random.normal(kx, (16, 8, 8, 1)), jax.random.randint(ky, (16,), 0, 10), CNN
    else:
        x, y = jax.random.normal(kx, (32, 16)), jax.random.randint(ky, (32,), 0, 10)
        cls = {"mlp": MLP, "residual": ResidualMLP}[name]
    params = cls(dtype=jnp.float32).init(kp, x)
    return cls, params, x, y
