"""Where per-layer scales pay in FP8: the depth benchmark's LM at growing depth, untrained and
trained, each FP8 gradient method against one scale for the whole backward (JAX, CPU).

    python benchmarks/fp8_depth.py                      # 8/32/64 blocks, 300 steps: docs/fp8_depth.json
    python benchmarks/fp8_depth.py --blocks 8 --steps 20 --json /tmp/fp8_depth.json

The LM of ``benchmarks/depth.py`` (vocab 256, dim 128, 4 heads, seq 64, batch 8; unrolled) in
bf16, FP8 training's compute dtype, with fp32 parameters and loss. At each ``--blocks`` it is
trained ``--steps`` steps (Adam, learning rate 1e-3, plain bf16 training with
``jax.value_and_grad``) on the Shakespeare corpus (:mod:`adaloss_study.corpus`); at step 0 and
after the training, one backward of a held-out validation batch under each method is compared
with that forward's fp32 backward (per-parameter ``‖g − g_ref‖/‖g_ref‖``: the median and the
worst parameter), for e5m2 and e4m3 gradients (``--formats``):

- ``adaloss``: ``AdaLossConfig(grad_format=fmt)``, a scale per layer from the decisions;
- ``one scale``: ``layer_rule=False``: the loss cotangent's scale (fitted to the format) carried
  through the whole backward, every cast at that one scale;
- ``current``: ``fp8_rule="current"``: per-tensor current scaling, each cast's own ``max|g|``;
- ``delayed``: flax's ``fp8_ops.out_qdq`` on every layer's output
  (:mod:`adaloss_zoo.fp8_delayed`), amax history 16, after 16 steps on the same batch.

Prints a Markdown table and writes ``--json`` after every depth. Not a test: minutes at 64
blocks on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU measurement, whatever plugins are installed

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
import optax
from depth import LM
from tqdm import tqdm

from adaloss import AdaLossConfig
from adaloss_study.corpus import batches, load_corpus
from adaloss_study.overhead import machine
from adaloss_zoo import jax_zoo as jz
from adaloss_zoo.fp8_delayed import count_layers, delayed_value_and_grad, init_metas
from adaloss_zoo.fp8_tables import depth_summary, depth_table
from adaloss_zoo.metrics import grad_error

FORMATS = ("float8_e5m2", "float8_e4m3fn")
METHODS: dict[str, dict[str, Any]] = {"adaloss": {}, "one scale": {"layer_rule": False},
                                      "current": {"fp8_rule": "current"}}
WARM = 16  # delayed scaling's warm-up steps on the measured batch, its history's length


def _named(grads: Any) -> dict[str, np.ndarray]:  # fp64 leaves by parameter path
    return jz._names(jax.tree.map(lambda a: np.asarray(a, np.float64), grads))


#: parameters with an analytically zero gradient (attention's key bias, under softmax's shift
#: invariance): their reference is rounding noise
EXCLUDE = ("key/bias",)


def _error(grads: Any, ref: dict[str, np.ndarray]) -> dict[str, float]:
    e = grad_error(_named(grads), ref, EXCLUDE)
    return {"median": e.median, "worst": e.worst}


def methods(loss: Any, params: Any, formats: tuple[str, ...]) -> dict[str, Any]:
    """The jitted backwards, compiled once per depth: ``"reference"`` and ``(format, method)``
    -> ``run(params)`` (delayed: ``run(params, metas)``)."""
    out: dict[Any, Any] = {"reference": jax.jit(jz._method_value_and_grad(
        "reference", 1.0, AdaLossConfig(grad_format="bfloat16"), jax.value_and_grad)(loss))}
    for fmt in formats:
        for name, kw in METHODS.items():
            out[fmt, name] = jax.jit(jz._method_value_and_grad(
                "adaloss", 1.0, AdaLossConfig(grad_format=fmt, **kw), jax.value_and_grad)(loss))
        out[fmt, "delayed"] = jax.jit(delayed_value_and_grad(loss, jnp.dtype(getattr(jnp, fmt))))
    return out


def errors(runs: dict[Any, Any], params: Any, layers: int, formats: tuple[str, ...]
           ) -> dict[str, dict[str, dict[str, float]]]:
    """Each method's gradient error at ``params``, per format."""
    ref = _named(runs["reference"](params)[1])
    out: dict[str, dict[str, dict[str, float]]] = {}
    for fmt in formats:
        row = {name: _error(runs[fmt, name](params)[1], ref) for name in METHODS}
        metas = init_metas(layers, WARM)
        for _ in range(WARM):
            _, _, metas = runs[fmt, "delayed"](params, metas)
        row["delayed"] = _error(runs[fmt, "delayed"](params, metas)[1], ref)
        out[fmt] = row
    return out


def measure(blocks: int, steps: int, formats: tuple[str, ...], seed: int = 0) -> dict[str, Any]:
    """One depth: the errors at step 0 and after ``steps`` training steps."""
    corpus = load_corpus()
    rng = np.random.default_rng(seed)
    train, val = batches(corpus.train, 64, 8, rng), batches(corpus.val, 64, 8, rng)
    model = LM(256, 128, 4, blocks, dtype=jnp.bfloat16)
    x0, _ = next(train)
    params = model.init(jax.random.key(seed), jnp.asarray(x0))
    vx, vy = (jnp.asarray(a) for a in next(val))

    def loss_on(x: jax.Array, y: jax.Array) -> Any:
        def loss(p: Any) -> tuple[jax.Array, None]:
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), None
        return loss

    opt = optax.adam(1e-3)

    @jax.jit
    def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        (value, _), g = jax.value_and_grad(lambda q: loss_on(x, y)(q), has_aux=True)(p)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, value

    row: dict[str, Any] = {"blocks": blocks, "steps": steps}
    start = time.perf_counter()
    val_loss = loss_on(vx, vy)
    runs, layers = methods(val_loss, params, formats), count_layers(val_loss, params)
    row["untrained"] = errors(runs, params, layers, formats)
    state, value = opt.init(params), jnp.nan
    for _ in tqdm(range(steps), desc=f"{blocks} blocks", leave=False):
        x, y = next(train)
        params, state, value = step(params, state, jnp.asarray(x), jnp.asarray(y))
    row["train_loss"] = float(value)
    row["trained"] = errors(runs, params, layers, formats)
    row["seconds"] = time.perf_counter() - start
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--json", type=Path, default=Path(__file__).parents[1] / "docs" / "fp8_depth.json")
    args = ap.parse_args()
    rows = []
    for blocks in args.blocks:
        rows.append(measure(blocks, args.steps, tuple(args.formats)))
        payload = {"machine": machine(), "jax": jax.__version__, "steps": args.steps, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(depth_table({"rows": rows[-1:]}), flush=True)
    print(depth_table(payload), *depth_summary(payload), sep="\n")


if __name__ == "__main__":
    main()
