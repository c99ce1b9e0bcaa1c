"""Equivalent Flax and PyTorch models for the parity tests.

Both keep fp32 parameters and compute in fp16: Flax with ``dtype=float16``,
torch under ``torch.autocast("cpu", dtype=torch.float16)``. Where one framework
would insert a cast the other does not, both make it explicit, so the two
backward graphs have the same layers, casts and fan-outs:

- layer norms and softmax run in fp32 on an explicitly upcast input (Flax's
  ``LayerNorm`` upcasts inside; torch's autocast on CPU would not);
- the residual stream stays fp16 in both (torch: the fp32 embedding output is
  cast down explicitly, so no fp32+fp16 promotion hides a cast);
- GELU (the tanh approximation) runs in fp32 in both: in fp16, XLA rounds after
  every elementwise op of its backward while torch's kernel rounds once, and
  that alone moved the measured underflow of the next layer by up to 1.5e-3;
- attention scores are divided by a power of two.

Parameters are named alike (Flax ``params/fc1/kernel`` <-> torch ``fc1.weight``);
:func:`torch_name` maps a Flax layer name to torch's, :func:`load_flax` copies
Flax parameters into a torch module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

F16 = jnp.float16


# -- Flax -----------------------------------------------------------------------------
class FlaxMLP(fnn.Module):
    dtype: Any = F16

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = fnn.relu(fnn.Dense(64, dtype=self.dtype, name="fc1")(x))
        x = fnn.gelu(fnn.Dense(64, dtype=self.dtype, name="fc2")(x).astype(jnp.float32))
        return fnn.Dense(10, dtype=self.dtype, name="fc3")(x)


class FlaxResidual(fnn.Module):
    dtype: Any = F16

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = fnn.Dense(64, dtype=self.dtype, name="fc_in")(x)
        for i in range(2):
            y = fnn.LayerNorm(dtype=self.dtype, name=f"ln{i}")(h)
            y = fnn.gelu(fnn.Dense(128, dtype=self.dtype, name=f"up{i}")(y).astype(jnp.float32))
            h = h + fnn.Dense(64, dtype=self.dtype, name=f"down{i}")(y)
        return fnn.Dense(10, dtype=self.dtype, name="head")(h)


class FlaxCNN(fnn.Module):
    dtype: Any = F16

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, 8, 8, 1]
        pad = ((1, 1), (1, 1))
        x = fnn.relu(fnn.Conv(8, (3, 3), padding=pad, dtype=self.dtype, name="c1")(x))
        x = fnn.relu(fnn.Conv(16, (3, 3), strides=2, padding=pad, dtype=self.dtype, name="c2")(x))
        x = fnn.Conv(16, (3,), padding=((1, 1),), dtype=self.dtype, name="c3")(
            x.reshape(x.shape[0], -1, 16))
        return fnn.Dense(10, dtype=self.dtype, name="fc")(x.reshape(x.shape[0], -1))


class FlaxGPT(fnn.Module):
    """One pre-LN transformer block, tied input/output embedding."""

    vocab: int = 32
    dim: int = 32
    heads: int = 2
    max_len: int = 16
    dtype: Any = F16

    @fnn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        b, t = tokens.shape
        d, nh = self.dim, self.heads
        dt = self.dtype
        emb = fnn.Embed(self.vocab, d, dtype=dt, name="emb")
        pos = self.param("pos", fnn.initializers.normal(0.02), (self.max_len, d))
        h = emb(tokens) + pos[:t].astype(dt)
        y = fnn.LayerNorm(dtype=dt, name="ln1")(h)
        qkv = fnn.Dense(3 * d, use_bias=False, dtype=dt, name="qkv")(y).reshape(b, t, 3, nh, d // nh)
        q, k, v = (a[:, :, 0] for a in jnp.split(qkv, 3, axis=2))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.asarray(np.sqrt(d // nh), dt)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, jnp.finfo(dt).min)
        att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(dt)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        h = h + fnn.Dense(d, dtype=dt, name="proj")(y)
        y = fnn.LayerNorm(dtype=dt, name="ln2")(h)
        y = fnn.gelu(fnn.Dense(4 * d, dtype=dt, name="fc1")(y).astype(jnp.float32))
        h = h + fnn.Dense(d, dtype=dt, name="fc2")(y)
        return emb.attend(fnn.LayerNorm(dtype=dt, name="ln_f")(h))


def flax_xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# -- torch ----------------------------------------------------------------------------
def _compute_dtype() -> torch.dtype:
    on = torch.is_autocast_enabled("cpu")
    return torch.get_autocast_dtype("cpu") if on else torch.float32


class TorchMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        return self.fc3(F.gelu(self.fc2(x).float(), approximate="tanh"))


class TorchResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.head = nn.Linear(16, 64), nn.Linear(64, 10)
        for i in range(2):
            self.add_module(f"ln{i}", nn.LayerNorm(64, eps=1e-6))
            self.add_module(f"up{i}", nn.Linear(64, 128))
            self.add_module(f"down{i}", nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        for i in range(2):
            y = getattr(self, f"ln{i}")(h.float())
            y = F.gelu(getattr(self, f"up{i}")(y).float(), approximate="tanh")
            h = h + getattr(self, f"down{i}")(y)
        return self.head(h)


class TorchCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.c3 = nn.Conv1d(16, 16, 3, padding=1)
        self.fc = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, 8, 8]
        x = F.relu(self.c2(F.relu(self.c1(x))))
        x = self.c3(x.flatten(2))  # [B, C, H·W]
        return self.fc(x.transpose(1, 2).flatten(1))  # Flax's (position, channel) order


class TorchGPT(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 2, max_len: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.ln1, self.ln2, self.ln_f = (nn.LayerNorm(dim, eps=1e-6) for _ in range(3))
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        dt = _compute_dtype()
        d, nh = self.pos.shape[1], self.heads
        h = self.emb(tokens).to(dt) + self.pos[:t].to(dt)
        q, k, v = self.qkv(self.ln1(h.float())).view(b, t, 3, nh, d // nh).unbind(2)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # [B, H, T, Dh]
        att = (q @ k.transpose(-1, -2)) / float(np.sqrt(d // nh))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~mask, torch.finfo(att.dtype).min).float(), dim=-1)
        y = (att.to(v.dtype) @ v).transpose(1, 2).reshape(b, t, d)
        h = h + self.proj(y)
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h.float())).float(), approximate="tanh"))
        return F.linear(self.ln_f(h.float()), self.emb.weight)


def torch_xent(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


# -- pairing ----------------------------------------------------------------------------
def torch_name(flax_name: str) -> str:
    """``params/fc1/kernel`` -> ``fc1.weight``; ``cast:k`` unchanged."""
    if flax_name.startswith("cast:"):
        return flax_name
    base, _, dup = flax_name.partition("@")
    parts = base.split("/")
    if parts[0] == "params":
        parts = parts[1:]
    parts[-1] = {"kernel": "weight", "embedding": "weight", "scale": "weight"}.get(parts[-1], parts[-1])
    return ".".join(parts) + (f"@{dup}" if dup else "")


def _to_torch(path: str, value: np.ndarray) -> np.ndarray:
    if path.endswith("kernel"):
        if value.ndim == 2:
            return value.T
        return np.transpose(value, (value.ndim - 1, value.ndim - 2, *range(value.ndim - 2)))
    return value


def to_torch_layout(params: Any) -> dict[str, np.ndarray]:
    """A Flax ``{"params": ...}`` tree (of parameters or of their gradients) as torch's
    ``{name: array}`` (kernels transposed to torch's layout)."""
    out = {}
    for p, v in jax.tree_util.tree_flatten_with_path(params["params"])[0]:
        key = jax.tree_util.keystr(p, simple=True, separator="/")
        out[torch_name("params/" + key)] = np.array(_to_torch(key, np.asarray(v)))
    return out


def load_flax(module: nn.Module, params: Any) -> None:
    """Copy Flax ``params`` into ``module``'s parameters (kernels transposed to torch's layout)."""
    flat = to_torch_layout(params)
    own = dict(module.named_parameters())
    if set(flat) != set(own):
        raise ValueError(f"parameter names differ: {sorted(set(flat) ^ set(own))}")
    with torch.no_grad():
        for name, v in flat.items():
            own[name].copy_(torch.from_numpy(v))


# name -> (Flax module, torch module factory, data maker: key -> (jax x, torch x, labels np))
def _dense_data(key: jax.Array) -> tuple[Any, Any, np.ndarray]:
    kx, ky = jax.random.split(key)
    x = np.asarray(jax.random.normal(kx, (32, 16)))
    return x, torch.from_numpy(x.copy()), np.asarray(jax.random.randint(ky, (32,), 0, 10))


def _image_data(key: jax.Array) -> tuple[Any, Any, np.ndarray]:
    kx, ky = jax.random.split(key)
    x = np.asarray(jax.random.normal(kx, (16, 8, 8, 1)))
    return x, torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), \
        np.asarray(jax.random.randint(ky, (16,), 0, 10))


def _token_data(key: jax.Array) -> tuple[Any, Any, np.ndarray]:
    kx, ky = jax.random.split(key)
    x = np.asarray(jax.random.randint(kx, (8, 16), 0, 32))
    return x, torch.from_numpy(x.astype(np.int64)), np.asarray(jax.random.randint(ky, (8, 16), 0, 32))


PAIRS: dict[str, tuple[type, Callable[[], nn.Module], Callable[[jax.Array], tuple[Any, Any, np.ndarray]]]] = {
    "mlp": (FlaxMLP, TorchMLP, _dense_data),
    "residual": (FlaxResidual, TorchResidual, _dense_data),
    "cnn": (FlaxCNN, TorchCNN, _image_data),
    "gpt": (FlaxGPT, TorchGPT, _token_data),
}
