"""The study's char-level GPT in PyTorch under one precision/scaling method
(``adaloss-study --framework torch``); same methods and result record as
:mod:`adaloss_study.jax_runner`.

- ``fp32``: no autocast; ``fp16``: ``torch.autocast`` fp16, no scaler;
- ``static``: ``torch.amp.GradScaler(init_scale=2^k)`` that never grows and backs
  off by a factor 1 − 1e-7 (GradScaler requires < 1): a fixed scale that still
  skips non-finite steps;
- ``dynamic``: ``torch.amp.GradScaler`` with its defaults (2^16, ×2 every 2000
  steps, ÷2 on overflow);
- ``adaloss-<model>``: :class:`torch_bridge.AdaLossScaler`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import torch_bridge
from adaloss_study.jax_runner import METHODS, RunConfig, RunResult
from torch_bridge.underflow import compare_cotangents


def _tensor(a: np.ndarray) -> torch.Tensor:
    """Integer arrays as int64 (indices, labels), float arrays as they are."""
    a = np.asarray(a)
    return torch.from_numpy(a.astype(np.int64) if a.dtype.kind in "iu" else a.copy())


def _scaler(method: str, model: torch.nn.Module, cfg: RunConfig) -> Any:
    if method == "static":
        return torch.amp.GradScaler("cpu", init_scale=cfg.static_scale, growth_interval=2**31 - 1,
                                    backoff_factor=1.0 - 1e-7)
    if method == "dynamic":
        return torch.amp.GradScaler("cpu")
    if method.startswith("adaloss-"):
        config = dataclasses.replace(cfg.adaloss, model=method.split("-", 1)[1])
        return torch_bridge.AdaLossScaler(model, config)
    return None


def run(method: str, cfg: RunConfig, data: Iterator[tuple[np.ndarray, np.ndarray]],
        val: list[tuple[np.ndarray, np.ndarray]], make_model: Callable[[RunConfig], torch.nn.Module],
        progress: bool = True) -> RunResult:
    """Train ``cfg.steps`` steps of ``method``; ``data`` yields (x, y) batches and
    ``make_model(cfg)`` builds the module."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    torch.manual_seed(cfg.seed)
    model = make_model(cfg)
    opt = torch.optim.Adam(model.parameters(), cfg.lr)
    scaler = _scaler(method, model, cfg)
    low = method != "fp32"

    def loss_of(x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
        ctx = torch.autocast("cpu", dtype=torch.float16) if autocast else contextlib.nullcontext()
        with ctx:
            logits = model(x)
        return cfg.loss_factor * F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    res = RunResult(method)
    for i in tqdm(range(cfg.steps), desc=method, leave=False, disable=None if progress else True):
        xn, yn = next(data)
        x, y = _tensor(xn), _tensor(yn)
        if low and cfg.measure_every and i % cfg.measure_every == 0:
            adaptive = isinstance(scaler, torch_bridge.AdaLossScaler)
            current = None if adaptive else (float(scaler.get_scale()) if scaler is not None else 1.0)
            got = compare_cotangents(
                torch_bridge.layer_cotangents(model, functools.partial(loss_of, x, y, True),
                                              loss_scale=current,
                                              config=scaler.config if adaptive else cfg.adaloss),
                torch_bridge.layer_cotangents(model, functools.partial(loss_of, x, y, False),
                                              loss_scale=1.0, config=cfg.adaloss), cfg.adaloss)
            res.add_underflow(i, got)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y, low)
        if scaler is None:
            loss.backward()
            opt.step()
            skip = False
        else:
            before = getattr(scaler, "skipped_steps", None)
            scale_before = None if before is not None else float(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skip = (scaler.skipped_steps > before) if before is not None else \
                float(scaler.get_scale()) < scale_before
        res.add_step(time.perf_counter() - t0, float(loss.detach()) / cfg.loss_factor, bool(skip))
        if i % max(1, cfg.measure_every) == 0 or i == cfg.steps - 1:
            if isinstance(scaler, torch_bridge.AdaLossScaler):
                reports = scaler.layer_reports()
                res.scales[i] = {k: float(r.scale) for k, r in reports.items()}
                res.limited[i] = sorted(k for k, r in reports.items()
                                    if float(r.unrounded_scale) < float(r.model_scale))
            else:
                res.scales[i] = {"global": float(scaler.get_scale()) if scaler is not None else 1.0}
    with torch.no_grad():
        val_loss = float(np.mean([float(loss_of(_tensor(x), _tensor(y), low)) for x, y in val])
                         ) / cfg.loss_factor
    return res.finish(val_loss)
