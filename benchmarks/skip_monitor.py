"""What watching for skipped steps costs on clean steps: ``jax_adaloss.SkipMonitor`` after each
jitted training step, against the same loop without it.

    python benchmarks/skip_monitor.py                 # docs/skip_monitor.json, table printed
    python benchmarks/skip_monitor.py --steps 50 --repeats 3

The depth benchmark's LM (:mod:`depth`) and its adaloss training step (``adaloss()`` chained with
``optax.adam``), jitted with the parameters and the optimizer state donated, as a training loop
writes it. Blocks of ``--steps`` steps alternate between the two loops (``--repeats`` each, the
first of each discarded as warm-up); each block ends when the device is done. Reported: the
median time per step of each loop, their ratio, the time the monitor's calls take on the host
beside the running steps (on a CPU backend they share its cores) and alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from depth import LM, add_model_arguments, train_steps

import jax_adaloss
from adaloss.skips import SkippedStepsWarning


def _block(step: Any, params: Any, state: Any, x: Any, y: Any, steps: int, monitor: Any
           ) -> tuple[float, float, Any, Any]:
    """Run ``steps`` steps; (seconds per step, seconds in the monitor per step, params, state)."""
    in_monitor = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        params, state, _ = step(params, state, x, y)
        if monitor is not None:
            m0 = time.perf_counter()
            monitor(state)
            in_monitor += time.perf_counter() - m0
    jax.block_until_ready((params, state))
    if monitor is not None:
        m0 = time.perf_counter()
        monitor.flush(state)
        in_monitor += time.perf_counter() - m0
    return (time.perf_counter() - t0) / steps, in_monitor / steps, params, state


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=6, help="blocks per loop (the first is warm-up)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parents[1] / "docs" / "skip_monitor.json")
    args = ap.parse_args(argv)
    model = LM(args.vocab, args.dim, args.heads, args.blocks)
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq + 1), 0, args.vocab)
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(1), x)

    def loss(p: Any, x: Any, y: Any) -> Any:  # (as the depth benchmark's)
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    step_fn, (_, state) = train_steps(loss, params)["adaloss"]
    step = jax.jit(step_fn, donate_argnums=(0, 1))
    params = jax.tree.map(jnp.copy, params)
    times: dict[str, list[float]] = {"without": [], "with": []}
    host: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedStepsWarning)  # clean steps only
        for r in range(args.repeats):
            for name in ("without", "with"):
                monitor = jax_adaloss.SkipMonitor() if name == "with" else None
                per_step, in_monitor, params, state = _block(step, params, state, x, y, args.steps, monitor)
                if r > 0:
                    times[name].append(per_step)
                    if monitor is not None:
                        host.append(in_monitor)
    jax.block_until_ready(state)
    idle = jax_adaloss.SkipMonitor()
    idle(state)
    t0 = time.perf_counter()
    for _ in range(200):  # the monitor alone, no step running beside it
        idle(state)
    idle_us = 1e6 * (time.perf_counter() - t0) / 200
    skipped = int(optax.tree.get(state, "skipped"))
    without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
    out = {"command": "python benchmarks/skip_monitor.py", "jax": jax.__version__,
           "backend": jax.default_backend(),
           "model": (f"depth LM: vocab {args.vocab}, dim {args.dim}, {args.heads} heads, seq {args.seq}, "
                     f"batch {args.batch}, {args.blocks} blocks, fp16"),
           "date": time.strftime("%Y-%m-%d"),
           "steps_per_block": args.steps, "blocks": args.repeats - 1, "skipped": skipped,
           "ms_per_step": {"without": 1e3 * without, "with": 1e3 * with_},
           "ratio": with_ / without, "monitor_us_per_step": 1e6 * statistics.median(host),
           "monitor_us_idle": idle_us,
           "blocks_ms_per_step": {k: [1e3 * v for v in vs] for k, vs in times.items()}}
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['model']}: {out['ms_per_step']['without']:.2f} ms/step without the monitor, "
          f"{out['ms_per_step']['with']:.2f} with ({out['ratio']:.3f}x); the monitor's calls "
          f"{out['monitor_us_per_step']:.0f} us/step on the host beside the running steps, "
          f"{idle_us:.0f} us alone; {skipped} skipped")
    return out


if __name__ == "__main__":
    main()
