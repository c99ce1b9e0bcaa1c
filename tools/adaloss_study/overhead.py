"""Step-time overhead of adaptive scaling against dynamic global scaling on the study model.

    adaloss-study --overhead                     # JAX: adaloss vs jmp.DynamicLossScale
    adaloss-study --overhead --framework torch   # AdaLossScaler vs torch.amp.GradScaler

Every method trains the same model (same seed) in one process. After a warm-up
(compilation, graph planning), the methods are timed in alternation: ``repeats``
rounds of ``steps`` steps each on the same pre-loaded batches; a step is forward,
backward, (un)scaling, Adam and the scaler's update. The ratio is of medians.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm import tqdm

from adaloss_study.jax_runner import RunConfig
from adaloss_study.tasks import Task

BASELINE = "dynamic"
METHODS = ("fp16", BASELINE, "adaloss-product")


def _jax_timer(method: str, cfg: RunConfig, task: Task, batches: list[tuple[np.ndarray, np.ndarray]],
               warmup: int) -> tuple[Callable[[], None], int]:
    import jax

    from adaloss_study.jax_runner import Trainer

    t = Trainer(method, cfg, task.flax_model, telemetry=False)
    data = [tuple(jax.device_put(a) for a in b) for b in batches]

    def run_all() -> None:
        value = None
        for x, y in data:
            value, _, _ = t.step(x, y)
        jax.block_until_ready((t.params, value))

    for _ in range(warmup):
        run_all()
    return run_all, sum(int(np.prod(p.shape)) for p in jax.tree.leaves(t.params))


def _torch_timer(method: str, cfg: RunConfig, task: Task, batches: list[tuple[np.ndarray, np.ndarray]],
                 warmup: int) -> tuple[Callable[[], None], int]:
    from adaloss_study.torch_runner import Trainer, _tensor

    t = Trainer(method, cfg, task.torch_model)
    data = [(_tensor(x), _tensor(y)) for x, y in batches]

    def run_all() -> None:
        for x, y in data:
            t.step(x, y)

    for _ in range(warmup):
        run_all()
    return run_all, sum(p.numel() for p in t.model.parameters())


def measure(framework: str, cfg: RunConfig, task: Task, methods: tuple[str, ...] = METHODS,
            repeats: int = 7, steps: int = 30, progress: bool = True) -> dict[str, Any]:
    """Time ``methods`` alternately; returns per-round ms/step, medians and ratios to ``dynamic``."""
    if BASELINE not in methods:
        raise ValueError(f"methods must include the baseline {BASELINE!r}")
    if repeats < 1 or steps < 1:
        raise ValueError(f"repeats and steps must be >= 1, got {repeats} and {steps}")
    train = task.train(cfg.seed)
    batches = [next(train) for _ in range(steps)]
    make = _torch_timer if framework == "torch" else _jax_timer
    timers, n_params, warmup_s = {}, 0, {}
    for m in methods:
        t0 = time.perf_counter()
        timers[m], n_params = make(m, cfg, task, batches, warmup=1)
        warmup_s[m] = time.perf_counter() - t0  # model, compilation or graph plan, one round
    rounds: dict[str, list[float]] = {m: [] for m in methods}
    for _ in tqdm(range(repeats), desc=f"overhead ({framework})", leave=False,
                  disable=None if progress else True):
        for m, run_all in timers.items():
            t0 = time.perf_counter()
            run_all()
            rounds[m].append(1e3 * (time.perf_counter() - t0) / steps)
    median = {m: statistics.median(v) for m, v in rounds.items()}
    return {"framework": framework, "task": task.name, "parameters": n_params, "steps": steps,
            "repeats": repeats, "machine": machine(framework), "ms_per_step": rounds,
            "median_ms": median, "warmup_s": warmup_s,
            "ratio": {m: median[m] / median[BASELINE] for m in methods}}


def machine(framework: str = "jax") -> str:
    """What ran a measurement: the framework's version, its device kind or threads, the CPU architecture."""
    if framework == "torch":
        import torch
        return f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}"
    import jax
    return f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {platform.machine()}"


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per method, median and per-round ms/step, ratio to the baseline."""
    lines = [f"| method | median ms/step | rounds (ms/step) | vs {BASELINE} |", "|---|---|---|---|"]
    for m, rounds in result["ms_per_step"].items():
        lines.append(f"| {m} | {result['median_ms'][m]:.2f} | " + ", ".join(f"{t:.1f}" for t in rounds)
                     + f" | {result['ratio'][m]:.3f} |")
    return "\n".join(lines)
