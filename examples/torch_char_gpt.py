"""The char-level GPT of ``char_gpt.py`` in PyTorch, trained under autocast fp16.

    python examples/torch_char_gpt.py --steps 300

Same text, sizes and optimizer as the Flax example; the model is a plain
``nn.Module`` (hand-written causal attention, tied embedding). Trains it four
ways from the same initial weights: fp32; fp16 autocast with no loss scaling;
with ``torch.amp.GradScaler``; with ``torch_bridge.AdaLossScaler`` (the only
line that changes is the scaler's constructor).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import torch_bridge
from adaloss_study.torch_models import CharGPT

sys.path.insert(0, os.path.dirname(__file__))
from char_gpt import TEXT, parse_args, print_losses  # noqa: E402


def batches(text: str, seq: int, batch: int, seed: int):
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(data) - seq - 1, batch)
        yield (torch.stack([data[i:i + seq] for i in idx]),
               torch.stack([data[i + 1:i + seq + 1] for i in idx]))


MODES = ("fp32", "fp16", "fp16+GradScaler", "fp16+adaloss")


def make_scaler(mode: str, model: nn.Module, config: torch_bridge.AdaLossConfig | None = None) -> Any:
    """The scaler a mode uses (``None`` for fp32 and plain fp16)."""
    if mode == "fp16+GradScaler":
        return torch.amp.GradScaler("cpu")
    if mode == "fp16+adaloss":
        return torch_bridge.AdaLossScaler(model, config)
    return None


def train_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, x: torch.Tensor,
               y: torch.Tensor, mode: str, loss_factor: float) -> torch.Tensor:
    """One step of the usual autocast + scaler loop; returns the (detached) loss."""
    opt.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.float16) if mode != "fp32" else contextlib.nullcontext()
    with ctx:
        logits = model(x)
    loss = loss_factor * F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.detach()


def train(mode: str, steps: int, lr: float, loss_factor: float, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = CharGPT(len(set(TEXT)))
    opt = torch.optim.Adam(model.parameters(), lr)
    scaler = make_scaler(mode, model)
    data = batches(TEXT, 64, 16, seed)
    losses = []
    t0 = time.perf_counter()
    for _ in tqdm(range(steps), desc=mode, leave=False, disable=None):
        losses.append(train_step(model, opt, scaler, *next(data), mode, loss_factor))
    out: dict[str, Any] = {"losses": [float(v) / loss_factor for v in losses],
                           "seconds": time.perf_counter() - t0}
    if isinstance(scaler, torch_bridge.AdaLossScaler):
        out["skipped"] = scaler.skipped_steps
        out["scales"] = {k: float(r.scale) for k, r in scaler.layer_reports().items()}
    elif scaler is not None:
        out["scale"] = float(scaler.get_scale())
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    runs = {m: train(m, args.steps, args.lr, args.loss_factor) for m in MODES}
    print_losses(runs, args.steps, args.loss_factor)
    print(f"\nskipped steps (adaloss): {runs['fp16+adaloss']['skipped']}; "
          f"GradScaler's final scale: {runs['fp16+GradScaler']['scale']:g}")
    print("wall time: " + ", ".join(f"{m} {r['seconds']:.1f}s" for m, r in runs.items()))


if __name__ == "__main__":
    main()
