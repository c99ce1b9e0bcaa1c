"""Step time: adaloss vs one dynamic global loss scale (flax DynamicScale), same model.

    python benchmarks/step_time.py --repeats 5 --steps 50

Both steps are jitted and include the backward, the (un)scaling and adam; the
model is the char-level GPT of ``examples/char_gpt.py`` in fp16 compute with
fp32 parameters. The two are timed alternately in one process; the ratio of
medians is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax.training.dynamic_scale import DynamicScale

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import char_gpt  # noqa: E402

import jax_adaloss  # noqa: E402


def make_steps(loss_fn, lr: float):
    adam = optax.adam(lr)
    tx = jax_adaloss.adaloss(inner=optax.adam(lr))

    @jax.jit
    def ada_step(params, state, x, y):
        loss, grads = jax_adaloss.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    def dyn_step(params, state, x, y):
        opt_state, dyn = state
        dyn, finite, loss, grads = dyn.value_and_grad(loss_fn)(params, x, y)
        updates, new_opt = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_params, params)
        opt_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_opt, opt_state)
        return params, (opt_state, dyn), loss

    return (ada_step, tx.init), (dyn_step, lambda p: (adam.init(p), DynamicScale()))


def time_steps(step, params, state, data, steps: int) -> float:
    params, state, loss = step(params, state, *next(data))
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, state, loss = step(params, state, *next(data))
    jax.block_until_ready((params, loss))
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    vocab = len(set(char_gpt.TEXT))
    graphdef, params = char_gpt.build(vocab, jnp.float16)
    loss_fn = char_gpt.make_loss(graphdef, 1.0)
    (ada, ada_init), (dyn, dyn_init) = make_steps(loss_fn, 1e-3)
    data = char_gpt.batches(char_gpt.TEXT, 64, args.batch, 0)
    times: dict[str, list[float]] = {"adaloss": [], "dynamic": []}
    for _ in range(args.repeats):
        times["adaloss"].append(time_steps(ada, params, ada_init(params), data, args.steps))
        times["dynamic"].append(time_steps(dyn, params, dyn_init(params), data, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>8}: median {1e3 * med[k]:.2f} ms/step  (runs: "
              + ", ".join(f"{1e3 * t:.2f}" for t in v) + ")")
    print(f"ratio adaloss / dynamic: {med['adaloss'] / med['dynamic']:.3f}")


if __name__ == "__main__":
    main()
