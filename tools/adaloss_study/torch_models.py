"""PyTorch models of the study (and of ``examples/torch_char_gpt.py``): the char GPT
as a plain ``nn.Module``, same sizes as the Flax one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        att = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        h = h + self.proj(y)
        return h + self.down(F.gelu(self.up(self.ln2(h)), approximate="tanh"))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln(h), self.embed.weight)  # tied output projection


class DigitsCNN(nn.Module):
    """The Flax ``DigitsCNN`` in torch (takes NHWC like the data, computes NCHW)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.head = nn.Linear(4 * 4 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c2(F.relu(self.c1(x.permute(0, 3, 1, 2)))))
        return self.head(x.flatten(1))
