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
from adaloss_study.legend import label  # noqa: E402


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
        ax.plot(_smooth(r.train_loss), label=f"{label(name)} (val {r.val_loss:.3f})")
    ax.set(xlabel="step", ylabel="train loss (moving mean of 10)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def underflow_over_steps(results: dict[str, RunResult], path: Path, threshold: float) -> Path:
    """Per method: mean and max over layers of the measured underflow rate, per measured step
    (the legend beside the axes, where it hides no curve)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in results.items():
        if not r.underflow:
            continue
        steps = sorted(r.underflow)
        mean = [np.mean(list(r.underflow[s].values())) for s in steps]
        worst = [np.max(list(r.underflow[s].values())) for s in steps]
        (line,) = ax.plot(steps, mean, marker="o", label=f"{label(name)} mean")
        ax.plot(steps, worst, ls="--", color=line.get_color(), label=f"{label(name)} max")
    ax.axhline(threshold, color="k", lw=0.8, ls=":", label=f"T = {threshold:g}")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="step", ylabel="share below u_min (per layer: mean, max)", title="Gradient underflow")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def row_label(name: str, casts: dict[str, str]) -> str:
    """A heatmap row's label: the layer's weight, or for a cast (``cast:k``) what it casts, in
    short (``cast:7 f16→f32 (16, 64, 84) jax_runner.py:212 loss``: the dtypes, the widened
    shape, the file and line of its site and the function)."""
    what = casts.get(name)
    if not what:
        return _short(name)
    what = re.sub(r"\bfloat(\d+)\b", r"f\1", what).replace(" → ", "→")
    site = re.search(r" at (?:.*/)?([^/:\s]+):(\d+)(?::\d+)?(?: \((?:.*\.)?([^.()]+)\))?$", what)
    if site:
        file, line, fn = site.groups()
        what = what[:site.start()] + f" {file}:{line}" + (f" {fn}" if fn else "")
    return f"{_short(name)} {what}"


def per_row(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row of ``grid`` (log2 scales; NaN: not recorded) from its smallest (0) to its largest
    (1) value, over at least one binade (a constant row is 0), and the rows' smallest and largest."""
    seen = ~np.isnan(grid)
    low = np.min(grid, axis=1, initial=np.inf, where=seen)
    high = np.max(grid, axis=1, initial=-np.inf, where=seen)
    low, high = np.where(np.isfinite(low), low, 0.0), np.where(np.isfinite(high), high, 0.0)
    return (grid - low[:, None]) / np.maximum(high - low, 1.0)[:, None], low, high


def scale_heatmap(result: RunResult, path: Path, title: str | None = None) -> Path:
    """Each layer's scale over the recorded steps, one row per layer, each row on a log2 scale of
    its own (its colour: log2 of the scale above the row's smallest; the row's range in its
    label), so that a cast at 2^28 does not flatten the layers around 2^10; cast rows name
    what they cast (``RunResult.casts``)."""
    steps = sorted(result.scales)
    layers = sorted({k for s in steps for k in result.scales[s]}, key=_natural)
    grid = np.array([[np.log2(result.scales[s].get(k, np.nan)) for s in steps] for k in layers])
    shown, low, high = per_row(grid)
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(layers) + 1.8))
    im = ax.imshow(shown, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0.0, vmax=1.0)
    casts = getattr(result, "casts", None) or {}
    labels = [f"{row_label(k, casts)}  2^{lo:.0f}..2^{hi:.0f}" for k, lo, hi in zip(layers, low, high)]
    ax.set_yticks(range(len(layers)), labels, fontsize=6)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7, rotation=90)
    ax.set(xlabel="step", title=f"{title or label(result.method)}: each layer's scale over training\n"
                                "(log2, each row over its own range, given beside its name)")
    fig.colorbar(im, ax=ax, label="0: the row's smallest scale, 1: its largest")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (the long row labels)
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
