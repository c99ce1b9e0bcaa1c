"""The PyTorch change in its smallest form: a Transformer classifier trained under fp16
autocast with ``torch_bridge.AdaLossScaler`` in place of ``torch.amp.GradScaler``.

    python examples/torch_minimal.py --steps 30

Needs only ``pip install 'adaloss[torch]'`` (no JAX): CI runs it in a fresh environment with
that install alone. Runs on a GPU if there is one, else on the CPU (fp16 autocast works there
too, slowly). Exits non-zero if the loss did not fall or a step was skipped.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import torch_bridge


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    vocab, dim, classes = 64, 32, 4
    model = nn.Sequential(
        nn.Embedding(vocab, dim),
        nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0),
        nn.Flatten(), nn.Linear(dim * 8, classes)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch_bridge.AdaLossScaler(model)  # was: torch.amp.GradScaler()
    x = torch.randint(0, vocab, (64, 8), device=device)
    y = x[:, 0] % classes  # learnable: the class is the first token's
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps on {device}, "
          f"{scaler.skipped_steps} skipped; jax imported: {'jax' in sys.modules}")
    return 0 if losses[-1] < 0.5 * losses[0] and scaler.skipped_steps == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
