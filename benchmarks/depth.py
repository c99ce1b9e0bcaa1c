"""Cost of adaptive loss scaling against depth: trace, compile, step time and memory (JAX).

    python benchmarks/depth.py                          # 2/8/16/32 blocks, the default LM
    python benchmarks/depth.py --blocks 2 8 --json out.json

A linen pre-LayerNorm transformer LM (fp16 compute, fp32 parameters and loss), its blocks
unrolled (a Python loop) or scanned (``nn.scan``, MaxText-style).
For each depth, two jitted functions of the same model and batch are compared:

- the gradient: ``jax_adaloss.value_and_grad`` against ``jax.value_and_grad``: trace,
  lowering and compile seconds, instructions in the optimised HLO, the bytes its instructions
  access (XLA's cost analysis; a scanned body counted once), compiled temp memory, median step
  time;
- the training step (gradient, unscaling, non-finite skip, Adam): ``adaloss()`` chained with
  ``optax.adam`` against ``jmp.DynamicLossScale`` (GradScaler's defaults) around
  ``jax.value_and_grad`` and the same Adam, timed in alternation.

With ``--layouts torch`` (default: all three), the study's torch CharGPT at the same sizes:
``AdaLossScaler`` against ``torch.amp.GradScaler`` (first step, median training step).

Prints a Markdown table of the ratios (adaloss / baseline) and writes ``--json``. Not a test:
timings depend on the machine; docs/results.md keeps the table measured here.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from tqdm import tqdm

import jax_adaloss
from adaloss_study.depth_tables import table, torch_table
from adaloss_study.overhead import machine

F16 = jnp.float16


class Block(nn.Module):
    heads: int
    dtype: Any = F16

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array) -> tuple[jax.Array, None]:
        x = nn.LayerNorm(dtype=self.dtype)(h)
        h = h + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype,
                                                deterministic=True)(x, mask=mask)
        x = nn.Dense(4 * h.shape[-1], dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(h))
        return h + nn.Dense(h.shape[-1], dtype=self.dtype)(nn.gelu(x)), None


class LM(nn.Module):
    vocab: int
    dim: int
    heads: int
    blocks: int
    scanned: bool = False  # nn.scan over the blocks (MaxText-style) instead of a Python loop
    dtype: Any = F16  # the compute dtype (parameters and loss in fp32)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.dim, dtype=self.dtype)
        mask = nn.make_causal_mask(tokens)
        h = embed(tokens)
        if self.scanned:
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=nn.broadcast, length=self.blocks)
            h, _ = stack(self.heads, self.dtype, name="blocks")(h, mask)
        else:
            for _ in range(self.blocks):
                h, _ = Block(self.heads, self.dtype)(h, mask)
        return embed.attend(nn.LayerNorm(dtype=self.dtype)(h)).astype(jnp.float32)


def _hlo_size(text: str) -> int:
    return len(re.findall(r"= \S+ [\w\-]+\(", text))


def _compile(fn: Any, *args: Any) -> tuple[Any, dict[str, float]]:
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    mem = compiled.memory_analysis()
    return compiled, {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
                      "hlo_ops": _hlo_size(compiled.as_text()),
                      "temp_bytes": getattr(mem, "temp_size_in_bytes", float("nan")),
                      "bytes_accessed": bytes_accessed(compiled)}


def bytes_accessed(compiled: Any) -> float:
    """XLA's cost analysis of ``compiled``: the bytes its instructions read and write (a loop's
    body counted once), a machine-independent proxy for the passes over memory."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("bytes accessed", float("nan")))


def _time(runs: dict[str, Any], repeats: int, steps: int) -> dict[str, float]:
    """Median ms per call of each zero-argument ``run`` (which blocks), in alternation."""
    rounds: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            rounds[k].append(1e3 * (time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in rounds.items()}


def train_steps(loss: Any, params: Any, config: Any = None, abstract: bool = False
                ) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """The two training steps (gradient, unscaling, non-finite skip, Adam) and their state
    arguments (the batch ``x, y`` follows them): ``"adaloss"`` (``adaloss()`` chained with
    ``optax.adam``, ``config`` for both) and ``"dynamic"`` (``jmp.DynamicLossScale`` with
    GradScaler's defaults around ``jax.value_and_grad`` and the same Adam). ``abstract``: the
    optimizer states as shapes only (``params`` may be ``jax.ShapeDtypeStruct`` leaves: to
    compile, not to run)."""
    ada_tx = optax.chain(jax_adaloss.adaloss(config), optax.adam(1e-4))
    adam = optax.adam(1e-4)

    def ada_step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax_adaloss.value_and_grad(loss, config=config)(p, x, y, adaloss_state=s)
        updates, s = ada_tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    def dyn_step(p: Any, s: Any, ls_arrays: tuple[jax.Array, jax.Array], x: jax.Array, y: jax.Array
                 ) -> tuple[Any, Any, tuple[jax.Array, jax.Array], jax.Array]:
        # the scale's arrays cross the jit boundary (Traced.trace does not take jmp's object)
        ls = jmp.DynamicLossScale(*ls_arrays)
        value, grads = jax.value_and_grad(lambda q: ls.scale(loss(q, x, y)))(p)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_s = adam.update(grads, s, p)
        p, s = jmp.select_tree(finite, (optax.apply_updates(p, updates), new_s), (p, s))
        ls = ls.adjust(finite)
        return p, s, (ls.loss_scale, ls.counter), value

    ls0 = jmp.DynamicLossScale(jnp.float32(2.0**16))
    init = jax.eval_shape if abstract else (lambda f, p: f(p))
    return {"adaloss": (ada_step, (params, init(ada_tx.init, params))),
            "dynamic": (dyn_step, (params, init(adam.init, params), (ls0.loss_scale, ls0.counter)))}


def _train_steps(loss: Any, params: Any, x: jax.Array, y: jax.Array, runs: dict[str, Any]
                 ) -> dict[str, Any]:
    """Compile the two training steps; add their timed runs to ``runs``."""
    steps = train_steps(loss, params)
    ada_step, (_, ada_state) = steps["adaloss"]
    dyn_step, dyn_state = steps["dynamic"]
    ada_train, ada_tc = _compile(ada_step, params, ada_state, x, y)
    dyn_train, dyn_tc = _compile(dyn_step, *dyn_state, x, y)

    state = {"ada": (params, ada_state), "dyn": dyn_state}

    def run_ada() -> None:
        p, s, v = ada_train(*state["ada"], x, y)
        state["ada"] = (p, s)
        v.block_until_ready()

    def run_dyn() -> None:
        p, s, ls, v = dyn_train(*state["dyn"], x, y)
        state["dyn"] = (p, s, ls)
        v.block_until_ready()

    runs["step_ada"], runs["step_dyn"] = run_ada, run_dyn
    return {"adaloss": ada_tc, "dynamic": dyn_tc}


def measure(blocks: int, vocab: int, dim: int, heads: int, seq: int, batch: int,
            repeats: int, steps: int, train: bool = True, scanned: bool = False) -> dict[str, Any]:
    """One depth's row; ``train=False`` leaves out the training steps (their compile is long)."""
    model = LM(vocab, dim, heads, blocks, scanned)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(0), x)

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    # the gradients alone
    ada_vg, ada_c = _compile(jax_adaloss.value_and_grad(loss), params, x, y)
    jax_vg, jax_c = _compile(jax.value_and_grad(loss), params, x, y)

    runs = {"grad_ada": lambda: jax.block_until_ready(ada_vg(params, x, y)),
            "grad_jax": lambda: jax.block_until_ready(jax_vg(params, x, y))}
    train_c: dict[str, Any] = {}
    if train:
        train_c = _train_steps(loss, params, x, y, runs)
    for run in runs.values():  # warm-up
        run()
    ms = _time(runs, repeats, steps)
    n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    return {"blocks": blocks, "layout": "scanned" if scanned else "unrolled", "parameters": n,
            "grad": {"adaloss": ada_c, "jax": jax_c},
            "train_step": train_c, "median_ms": ms,
            "ratio": {"trace": ada_c["trace_s"] / jax_c["trace_s"],
                      "compile": ada_c["compile_s"] / jax_c["compile_s"],
                      "hlo_ops": ada_c["hlo_ops"] / jax_c["hlo_ops"],
                      "bytes": ada_c["bytes_accessed"] / jax_c["bytes_accessed"],
                      "temp_memory": ada_c["temp_bytes"] / max(jax_c["temp_bytes"], 1),
                      "grad_step": ms["grad_ada"] / ms["grad_jax"]}
            | ({"train_compile": train_c["adaloss"]["compile_s"] / train_c["dynamic"]["compile_s"],
                "train_step": ms["step_ada"] / ms["step_dyn"]} if train else {})}


def measure_torch(blocks: int, vocab: int, dim: int, heads: int, seq: int, batch: int,
                  repeats: int, steps: int) -> dict[str, Any]:
    """One depth's torch row: the study's CharGPT under autocast fp16 on CPU, a training step
    (forward, backward, unscaling, Adam, scaler update) with ``AdaLossScaler`` against
    ``torch.amp.GradScaler``, timed in alternation; the first step (graph planning) too."""
    import torch

    from adaloss_study.jax_runner import RunConfig
    from adaloss_study.torch_models import CharGPT
    from adaloss_study.torch_runner import Trainer

    cfg = RunConfig(dim=dim, heads=heads, layers=blocks, seq=seq, batch=batch, lr=1e-4)
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, vocab, (batch, seq + 1)).astype(np.int64))
    x, y = tokens[:, :-1], tokens[:, 1:]
    trainers = {m: Trainer(m, cfg, lambda c: CharGPT(vocab, c.dim, c.heads, c.layers, c.seq))
                for m in ("adaloss-product", "dynamic")}
    first = {}
    for m, t in trainers.items():
        t0 = time.perf_counter()
        t.step(x, y)
        first[m] = time.perf_counter() - t0
    ms = _time({m: (lambda t=t: t.step(x, y)) for m, t in trainers.items()}, repeats, steps)
    n = sum(p.numel() for p in trainers["dynamic"].model.parameters())
    return {"blocks": blocks, "layout": "torch", "parameters": n, "first_step_s": first, "median_ms": ms,
            "ratio": {"first_step": first["adaloss-product"] / first["dynamic"],
                      "train_step": ms["adaloss-product"] / ms["dynamic"]}}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 8, 16, 32])
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--train-blocks", type=int, default=16,
                    help="time the training steps up to this depth (the baseline's compile grows fast)")
    ap.add_argument("--layouts", nargs="+", choices=("unrolled", "scanned", "torch"),
                    default=["unrolled", "scanned", "torch"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for b, layout in tqdm([(b, a) for b in args.blocks for a in args.layouts], desc="depths"):
        if layout == "torch":
            rows.append(measure_torch(b, args.vocab, args.dim, args.heads, args.seq, args.batch,
                                      args.repeats, args.steps))
            tqdm.write(torch_table(rows[-1:]).splitlines()[-1])
            continue
        rows.append(measure(b, args.vocab, args.dim, args.heads, args.seq, args.batch,
                            args.repeats, args.steps, train=b <= args.train_blocks,
                            scanned=layout == "scanned"))
        tqdm.write(table(rows[-1:]).splitlines()[-1])
    print(f"{machine()}; dim {args.dim}, seq {args.seq}, batch {args.batch}; ratios are adaloss / baseline")
    print(table([r for r in rows if r["layout"] != "torch"]))
    if any(r["layout"] == "torch" for r in rows):
        print(torch_table([r for r in rows if r["layout"] == "torch"]))
    write_json(args, rows)
    return rows


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The LM's size and batch (``--vocab --dim --heads --seq --batch``), with this benchmark's defaults."""
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)


def write_json(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """``{"args", "rows", "machine", "date"}`` to ``args.json`` (if given), which the results page reads."""
    if args.json is None:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                     "machine": machine(), "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
