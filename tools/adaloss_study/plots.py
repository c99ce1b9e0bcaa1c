"""The study's figures (matplotlib, written as PNG)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from adaloss_study.jax_runner import RunResult  # noqa: E402


def _smooth(x: list[float], k: int = 10) -> np.ndarray:
    x = np.asarray(x, float)
    if len(x) < k:
        return x
    return np.convolve(x, np.ones(k) / k, mode="valid")


def _natural(name: str) -> tuple[Any, ...]:
    """``cast:2`` before ``cast:10``."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _short(name: str) -> str:
    return name.removeprefix("params/").removesuffix("/value")


def loss_curves(results: dict[str, RunResult], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        ax.plot(_smooth(r.train_loss), label=f"{name} (val {r.val_loss:.3f})")
    ax.set(xlabel="step", ylabel="train loss (moving mean of 10)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def underflow_over_steps(results: dict[str, RunResult], path: Path, threshold: float) -> Path:
    """Per method: mean and max over layers of the measured underflow rate, per measured step."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        if not r.underflow:
            continue
        steps = sorted(r.underflow)
        mean = [np.mean(list(r.underflow[s].values())) for s in steps]
        worst = [np.max(list(r.underflow[s].values())) for s in steps]
        (line,) = ax.plot(steps, mean, marker="o", label=f"{name} mean")
        ax.plot(steps, worst, ls="--", color=line.get_color(), label=f"{name} max")
    ax.axhline(threshold, color="k", lw=0.8, ls=":", label=f"T = {threshold:g}")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="step", ylabel="measured underflow rate (per layer)", title="Gradient underflow")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scale_heatmap(result: RunResult, path: Path) -> Path:
    """log2 of each layer's scale over the recorded steps."""
    steps = sorted(result.scales)
    layers = sorted({k for s in steps for k in result.scales[s]}, key=_natural)
    grid = np.array([[np.log2(result.scales[s].get(k, np.nan)) for s in steps] for k in layers])
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(layers) + 1.5))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(layers)), [_short(k) for k in layers], fontsize=6)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7, rotation=90)
    ax.set(xlabel="step", title=f"{result.method}: log2(scale) per layer")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fp8_fractions(results: dict[str, RunResult], path: Path, cfg: Any) -> Path:
    """Per adaloss method: the largest fraction any layer's fp8 cast flushed to zero and saturated,
    per step (the spike's steps shaded)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        if not r.fp8_flushed:
            continue
        steps = sorted(r.fp8_flushed)
        flushed = [max(r.fp8_flushed[s].values(), default=0.0) for s in steps]
        saturated = [max(r.fp8_saturated[s].values(), default=0.0) for s in steps]
        (line,) = ax.plot(steps, flushed, label=f"{name} flushed")
        ax.plot(steps, saturated, ls="--", color=line.get_color(), label=f"{name} saturated")
    if cfg.spike_at is not None:
        ax.axvspan(cfg.spike_at, cfg.spike_at + cfg.spike_steps, color="0.85",
                   label=f"loss ×{cfg.spike:g}")
    ax.set_yscale("symlog", linthresh=1e-5)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="step", ylabel="largest fraction over the layers",
           title=f"{cfg.adaloss.grad_format} casts: flushed and saturated")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
