"""Small unmodified torch models for the torch_bridge tests (fp32 parameters)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Residual(nn.Module):
    """Two residual blocks; the skip and MLP branches carry different scales."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + strided Conv2d + Conv1d + Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.c3 = nn.Conv1d(16, 16, 3, padding=1)
        self.fc = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.c1(x)))
        x = F.relu(self.c2(x))
        return self.fc(F.relu(self.c3(x.flatten(2))).flatten(1))


class HandAttentionGPT(nn.Module):
    """Embedding, hand-written causal attention, LayerNorm, tied output projection."""

    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 4, max_len: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        h = self.tok(tokens) + self.pos(torch.arange(t))
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        h = h + self.mlp(self.ln2(h))
        return self.ln_f(h) @ self.tok.weight.T


class EncoderGPT(nn.Module):
    """nn.TransformerEncoderLayer (torch.fx cannot trace it) + nn.MultiheadAttention, tied head."""

    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.enc = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.mha = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.ln = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.enc(self.emb(tokens), src_mask=mask, is_causal=True)
        h = h + self.mha(h, h, h, attn_mask=mask, need_weights=False)[0]
        return F.linear(self.ln(h), self.emb.weight)


def make_case(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, input, labels) by name."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name in ("gpt", "encoder"):
        x = torch.randint(0, 32, (8, 16), generator=g)
        y = torch.randint(0, 32, (8, 16), generator=g)
        return (HandAttentionGPT() if name == "gpt" else EncoderGPT()), x, y
    if name == "conv":
        return ConvNet(), torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
    model = {"mlp": MLP, "residual": Residual}[name]()
    return model, torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g)


def xent(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


NAMES = ["mlp", "residual", "conv", "gpt", "encoder"]
