"""One prepared accelerator run: fp16 GPT of ~100M parameters, adaloss vs dynamic global scaling.

    python benchmarks/gpu_step_time.py                 # the ~100M preset (an H200: a few minutes)
    python benchmarks/gpu_step_time.py --preset tiny   # smoke test on CPU

Both steps are jitted (backward, (un)scaling, adam); the dynamic baseline is
``jmp.DynamicLossScale`` with GradScaler's defaults. Timed alternately after
compilation; prints compile times, median step times, their ratio and the
device, and writes them as JSON (``--json``) for the results page.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import jax_adaloss
from adaloss_study.models import CharGPT

PRESETS = {
    "100m": {"vocab": 256, "dim": 768, "heads": 12, "layers": 12, "seq": 512, "batch": 16},
    "tiny": {"vocab": 64, "dim": 32, "heads": 2, "layers": 1, "seq": 16, "batch": 2},
}


def make_steps(graphdef: Any, lr: float) -> dict[str, Any]:
    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(x).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))

    adam = optax.adam(lr)
    tx = jax_adaloss.adaloss(inner=optax.adam(lr))

    @jax.jit
    def ada_step(params: Any, state: Any, x: Any, y: Any) -> Any:
        loss, grads = jax_adaloss.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    def dyn_step(params: Any, state: Any, x: Any, y: Any) -> Any:
        opt_state, ls = state
        loss, grads = jax.value_and_grad(lambda p: ls.scale(loss_fn(p, x, y)))(params)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt = adam.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt)
        params, opt_state = jmp.select_tree(finite, new, (params, opt_state))
        return params, (opt_state, ls.adjust(finite)), ls.unscale(loss)

    return {"adaloss": (ada_step, tx.init),
            "dynamic": (dyn_step, lambda p: (adam.init(p), jmp.DynamicLossScale(jnp.float32(2.0**16))))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    model = CharGPT(p["vocab"], p["dim"], p["heads"], p["layers"], p["seq"], dtype=jnp.float16,
                    rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, p["vocab"], (p["batch"], p["seq"])), jnp.int32)
    y = jnp.asarray(rng.integers(0, p["vocab"], (p["batch"], p["seq"])), jnp.int32)
    steps = make_steps(graphdef, 1e-4)
    states, compile_s, times = {}, {}, {k: [] for k in steps}
    for name, (step, init) in steps.items():
        t0 = time.perf_counter()
        out = step(params, init(params), x, y)
        jax.block_until_ready(out)
        compile_s[name] = time.perf_counter() - t0
        states[name] = out[:2]
    for _ in range(args.repeats):
        for name, (step, _) in steps.items():
            prm, st = states[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                prm, st, loss = step(prm, st, x, y)
            jax.block_until_ready((prm, loss))
            times[name].append((time.perf_counter() - t0) / args.steps)
            states[name] = (prm, st)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "preset": args.preset, "parameters": int(n_params),
              **{f"{k}_ms": 1e3 * v for k, v in med.items()},
              "ratio": med["adaloss"] / med["dynamic"], "compile_s": compile_s}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
