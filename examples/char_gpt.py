"""A small char-level GPT (Flax nnx) trained in fp16 with adaptive loss scaling.

    python examples/char_gpt.py --steps 300

Trains the same model from the same initial weights three ways — fp32, fp16
with no loss scaling, fp16 with ``adaloss`` — and prints the loss curves side
by side, the skipped steps and the per-layer scales of the last step.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jax_adaloss
from adaloss_study.models import CharGPT

TEXT = """\
First Citizen: Before we proceed any further, hear me speak.
All: Speak, speak.
First Citizen: You are all resolved rather to die than to famish?
All: Resolved. resolved.
First Citizen: First, you know Caius Marcius is chief enemy to the people.
All: We know't, we know't.
First Citizen: Let us kill him, and we'll have corn at our own price. Is't a verdict?
All: No more talking on't; let it be done: away, away!
Second Citizen: One word, good citizens.
First Citizen: We are accounted poor citizens, the patricians good. What authority surfeits
on would relieve us: if they would yield us but the superfluity, while it were wholesome,
we might guess they relieved us humanely; but they think we are too dear: the leanness
that afflicts us, the object of our misery, is as an inventory to particularise their
abundance; our sufferance is a gain to them. Let us revenge this with our pikes, ere we
become rakes: for the gods know I speak this in hunger for bread, not in thirst for revenge.
"""


def batches(text: str, seq: int, batch: int, seed: int):
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], np.int32)
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(data) - seq - 1, batch)
        x = np.stack([data[i:i + seq] for i in idx])
        y = np.stack([data[i + 1:i + seq + 1] for i in idx])
        yield jnp.asarray(x), jnp.asarray(y)


def train(mode: str, steps: int, lr: float, loss_factor: float, seed: int = 0) -> dict[str, Any]:
    """Train with ``mode`` in {"fp32", "fp16", "fp16+adaloss"}; returns losses and telemetry.

    The nnx idiom: the Module is passed to the gradient function (only its
    ``nnx.Param``s are differentiated), the batch is closed over inside ``nnx.jit``,
    and ``nnx.Optimizer`` applies the update. adaloss swaps in two names:
    ``jax_adaloss.value_and_grad`` for ``nnx.value_and_grad`` and
    ``adaloss(inner=...)`` around the optimizer.
    """
    vocab = len(set(TEXT))
    model = CharGPT(vocab, dtype=jnp.float32 if mode == "fp32" else jnp.float16, rngs=nnx.Rngs(seed))
    adaptive = mode == "fp16+adaloss"
    tx = jax_adaloss.adaloss(inner=optax.adam(lr)) if adaptive else optax.adam(lr)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model: CharGPT, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> Any:
        def loss_fn(model: CharGPT) -> jax.Array:
            logits = model(x).astype(jnp.float32)  # loss in fp32
            logp = jax.nn.log_softmax(logits)
            return -loss_factor * jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))

        if adaptive:
            (loss, grads), report = jax_adaloss.value_and_grad(loss_fn, return_report=True)(
                model, adaloss_state=optimizer.opt_state)  # back-off after skipped steps
        else:
            (loss, grads), report = nnx.value_and_grad(loss_fn)(model), None
        optimizer.update(model, grads)
        return loss, report

    losses, report = [], None
    data = batches(TEXT, 64, 16, seed)
    t0 = time.perf_counter()
    for _ in tqdm(range(steps), desc=mode, leave=False, disable=None):
        x, y = next(data)
        loss, report = step(model, optimizer, x, y)
        losses.append(loss)
    losses = [float(v) / loss_factor for v in jax.device_get(losses)]
    out = {"losses": losses, "seconds": time.perf_counter() - t0}
    if adaptive:
        out["skipped"] = int(optax.tree.get(optimizer.opt_state, "skipped"))
        out["scales"] = {k: float(v.scale) for k, v in report.layers.items()}
        out["outgoing"] = {k: float(v.outgoing_scale) for k, v in report.layers.items()}
    return out


def parse_args(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The examples' command line: steps, learning rate, loss factor."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--loss-factor", type=float, default=1e-4,
                    help="multiply the loss by this (small values make plain fp16 underflow)")
    return ap.parse_args(argv)


def print_losses(runs: dict[str, dict[str, Any]], steps: int, loss_factor: float) -> None:
    """The losses of every run side by side at ~10 steps."""
    width = max(14, *(len(m) + 2 for m in runs))
    print(f"\nloss (÷ loss factor {loss_factor:g}), {steps} steps of batch 16 × 64 chars")
    print(f"{'step':>6} " + " ".join(f"{m:>{width}}" for m in runs))
    every = max(1, steps // 10)
    for i in sorted({0, *range(every, steps, every), steps - 1}):
        print(f"{i:>6} " + " ".join(f"{runs[m]['losses'][i]:>{width}.4f}" for m in runs))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    runs = {m: train(m, args.steps, args.lr, args.loss_factor)
            for m in ("fp32", "fp16", "fp16+adaloss")}
    print_losses(runs, args.steps, args.loss_factor)
    ada = runs["fp16+adaloss"]
    print(f"\nskipped steps (adaloss): {ada['skipped']}")
    print("per-layer scales of the last step (scale applied / scale carried after);"
          " casts listed where they scale:")
    for name in sorted(ada["scales"], key=lambda n: (n.startswith("cast"), n)):
        if name.startswith("cast") and ada["scales"][name] == 1.0:
            continue
        print(f"  {name:<40} {ada['scales'][name]:>10g} {ada['outgoing'][name]:>12g}")
    print("\nwall time: " + ", ".join(f"{m} {r['seconds']:.1f}s" for m, r in runs.items()))


if __name__ == "__main__":
    main()
