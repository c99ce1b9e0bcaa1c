"""The study's char-level GPT in PyTorch under one precision/scaling method
(``adaloss-study --framework torch``); same methods and result record as
:mod:`adaloss_study.jax_runner`.

- ``fp32``: no autocast; ``fp16``: ``torch.autocast`` fp16, no scaler;
- ``static``: ``torch.amp.GradScaler(init_scale=2^k)`` that never grows and backs
  off by a factor 1 − 1e-7 (GradScaler requires < 1): a fixed scale that still
  skips non-finite steps;
- ``dynamic``: ``torch.amp.GradScaler`` with its defaults (2^16, ×2 every 2000
  steps, ÷2 on overflow); ``dynamic-grow``: with ``growth_interval=RunConfig.growth``;
- ``adaloss-<model>``, ``cast-only``, ``largest-safe``: :class:`torch_bridge.AdaLossScaler`
  with :func:`adaloss_study.jax_runner.adaloss_config`.

With an fp8 ``grad_format`` every method but ``fp32`` runs under ``torch.autocast`` bf16:
``bf16`` (no quantization), ``adaloss-<model>``, ``cast-only`` and ``current`` (the bridge's
fp8 casts), ``adaloss-e2e`` (:func:`torch_bridge.convert_to_float8_training`: the linear
layers' inputs and weights in e4m3 too, every GEMM a ``torch._scaled_mm``, under the scaler),
``torchao-tensorwise`` / ``torchao-rowwise`` (torchao's float8 training,
``convert_to_float8_training`` with ``emulate=False``: its ``nn.Linear`` layers' GEMMs
``torch._scaled_mm`` of e4m3 inputs and weights, its gradients at their own amax, e5m2 / e4m3
per row), and ``fp32-cold``.

Adam's ε is ``adam_eps × loss_factor``, as in JAX.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import torch_bridge
from adaloss_study.jax_runner import RunConfig, RunResult, adaloss_config, check_method
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
    if method == "dynamic-grow":
        return torch.amp.GradScaler("cpu", growth_interval=cfg.growth)
    config = adaloss_config(method, cfg.adaloss)
    return None if config is None else torch_bridge.AdaLossScaler(model, config)


def _convert(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """torchao's float8 training of ``model``'s ``nn.Linear`` layers (``torchao-<recipe>``)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    recipe = method.split("-", 1)[1]
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=False)
    return convert_to_float8_training(model, config=config)


class Trainer:
    """One method's module, Adam and scaler; :meth:`step` is one training step."""

    def __init__(self, method: str, cfg: RunConfig,
                 make_model: Callable[[RunConfig], torch.nn.Module]) -> None:
        check_method(method, cfg, "torch")
        torch.manual_seed(cfg.seed)
        self.method, self.cfg = method, cfg
        self.model = make_model(cfg)
        if method.startswith("torchao-"):
            self.model = _convert(self.model, method)
        if method == "adaloss-e2e":
            self.model = torch_bridge.convert_to_float8_training(
                self.model, adaloss_config(method, cfg.adaloss))
        self.opt = torch.optim.Adam(self.model.parameters(), cfg.lr, eps=cfg.eps)
        self.scaler = _scaler(method, self.model, cfg)
        self.low = method not in ("fp32", "fp32-cold")
        self.dtype = torch.bfloat16 if cfg.adaloss.fp8 or method == "bf16" else torch.float16
        self.steps = 0

    def loss_of(self, x: torch.Tensor, y: torch.Tensor, autocast: bool, factor: float = 1.0) -> torch.Tensor:
        ctx = torch.autocast("cpu", dtype=self.dtype) if autocast else contextlib.nullcontext()
        with ctx:
            logits = self.model(x)
        return (self.cfg.loss_factor * factor) * F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def step(self, x: torch.Tensor, y: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, bool]:
        """Forward, backward, (un)scaling, Adam and the scaler's update, the loss × ``factor`` (a
        spike): (loss, skipped)."""
        scaler = self.scaler
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_of(x, y, self.low, factor)
        self.steps += 1
        if scaler is None:
            loss.backward()
            if self.method == "fp32-cold" and self.steps == 1:  # no gradient; Adam counts the step
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
            self.opt.step()
            return loss.detach(), False
        before = getattr(scaler, "skipped_steps", None)
        scale_before = None if before is not None else float(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(self.opt)
        scaler.update()
        if before is not None:
            return loss.detach(), scaler.skipped_steps > before
        return loss.detach(), float(scaler.get_scale()) < scale_before


def run(method: str, cfg: RunConfig, data: Iterator[tuple[np.ndarray, np.ndarray]],
        val: list[tuple[np.ndarray, np.ndarray]], make_model: Callable[[RunConfig], torch.nn.Module],
        progress: bool = True) -> RunResult:
    """Train ``cfg.steps`` steps of ``method``; ``data`` yields (x, y) batches and
    ``make_model(cfg)`` builds the module."""
    t = Trainer(method, cfg, make_model)
    scaler, model = t.scaler, t.model
    adaptive = isinstance(scaler, torch_bridge.AdaLossScaler)
    res = RunResult(method)
    for i in tqdm(range(cfg.steps), desc=method, leave=False, disable=None if progress else True):
        xn, yn = next(data)
        x, y = _tensor(xn), _tensor(yn)
        factor = cfg.factor(i)
        if t.low and not cfg.adaloss.fp8 and cfg.measure_every and i % cfg.measure_every == 0:
            current = None if adaptive else (float(scaler.get_scale()) if scaler is not None else 1.0)
            got = compare_cotangents(
                torch_bridge.layer_cotangents(model, functools.partial(t.loss_of, x, y, True),
                                              loss_scale=current, config=cfg.adaloss,
                                              scaler=scaler if adaptive else None),
                torch_bridge.layer_cotangents(model, functools.partial(t.loss_of, x, y, False),
                                              loss_scale=1.0, config=cfg.adaloss), cfg.adaloss)
            res.add_underflow(i, got)
        t0 = time.perf_counter()
        loss, skip = t.step(x, y, factor)
        res.add_step(time.perf_counter() - t0, float(loss) / (cfg.loss_factor * factor), skip)
        if adaptive and cfg.adaloss.fp8:  # every step, as in JAX
            reports = scaler.layer_reports()
            fp8 = {k: r for k, r in reports.items() if r.flushed is not None}
            res.fp8_flushed[i] = {k: float(r.flushed) for k, r in fp8.items()}
            res.fp8_saturated[i] = {k: float(r.saturated) for k, r in fp8.items()}
        near_spike = cfg.spike_at is not None and cfg.spike_at - 1 <= i < cfg.spike_at + 2 * cfg.spike_steps
        if i % max(1, cfg.measure_every) == 0 or i == cfg.steps - 1 or near_spike:
            if adaptive:
                reports = scaler.layer_reports()
                res.scales[i] = {k: float(r.scale) for k, r in reports.items()}
                res.limited[i] = sorted(k for k, r in reports.items()
                                    if float(r.unrounded_scale) < float(r.model_scale))
                res.held[i] = sorted(k for k, r in reports.items() if bool(r.incoming_held))
                res.casts = scaler.cast_sites()
            else:
                res.scales[i] = {"global": float(scaler.get_scale()) if scaler is not None else 1.0}
    with torch.no_grad():
        val_loss = float(np.mean([float(t.loss_of(_tensor(x), _tensor(y), t.low)) for x, y in val])
                         ) / cfg.loss_factor
    return res.finish(val_loss)
