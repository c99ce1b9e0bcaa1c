"""Where adaloss's JAX overhead goes: the backward with its parts taken out one at a time.

    python benchmarks/cost_breakdown.py                       # 8 and 32 blocks, unrolled and scanned
    python benchmarks/cost_breakdown.py --blocks 8 --layouts unrolled --json out.json

The model and batch of ``benchmarks/depth.py``. ``jax_adaloss.value_and_grad`` is compiled
once per variant, each removing one more part of the scale-propagating backward (the parts
are replaced with stand-ins, with ``unittest.mock``, so the rest of the program is unchanged):

1. ``adaloss``: as shipped;
2. ``- statistics``: every statistic of a tensor (E[g²], max|g|, the underflow counts, a
   cast's log-moments) is one element of it: what a free, perfectly fused statistics kernel
   would leave;
3. ``- decisions``: every layer and cast decision is the constant 2 (the scalar chain of
   the model scale, caps, bounds and the power-of-two floor gone; the rescales stay);
4. ``- merges``: a fan-in takes its first branch's scale;
5. ``- rescales``: cotangents are not multiplied by their scale, not stored by a reduction,
   and scales are not settled by one;
6. ``- fp32 weight grads``: weight gradients in the weights' format (jax's own transpose).

The last variant is jax's backward run through adaloss's tape; ``jax.value_and_grad`` is the
baseline. Compile time is the least of ``--compiles`` compilations (caches cleared between
them); step time the median of alternating rounds. The numbers are not the method's cost
(variants 2-6 compute wrong scales); they say which part of it a faster implementation would
have to change. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from depth import LM, _compile, _time, add_model_arguments, write_json
from tqdm import tqdm

import jax_adaloss
from adaloss import solver
from adaloss_study.cost_tables import table
from adaloss_study.overhead import machine
from jax_adaloss import backward, layers, reductions, regions

_F32 = jnp.float32


def _one(x: Any) -> jax.Array:
    """A stand-in statistic: one element of ``x``, positive."""
    return jnp.abs(jnp.reshape(x, -1)[0].astype(_F32)) + _F32(1e-3)


def _statistics_of(xs: Any, *, absmax: bool = True, sq_mean: bool = False, mean: bool = False,
                   nonzero: bool = False, below: float | None = None, logs: bool = False,
                   above: float | None = None, one_pass: bool | None = None) -> list[reductions.Statistics]:
    """Stand-in statistics: one element of each tensor; every entry non-zero, none below u_min
    or above a limit."""
    def stats(x: Any) -> reductions.Statistics:
        size = int(np.prod(np.shape(x)))
        return reductions.Statistics(
            _one(x), _one(x) if sq_mean else None, _one(x) if mean else None,
            _one(x) * 0 + size if nonzero or below is not None else None,
            _one(x) * 0 if below is not None else None, size,
            solver.LogStats(*(_one(x),) * 4) if logs else None, _one(x) * 0 if above is not None else None)
    return [stats(x) for x in xs]


def _constant_decision(*args: Any, **kwargs: Any) -> solver.LayerScale:
    return solver.LayerScale(*(_F32(2.0),) * 4)


#: (variant name, the patches it adds to the previous variant's)
ABLATIONS: list[tuple[str, list[tuple[Any, str, Any]]]] = [
    ("adaloss", []),
    ("- statistics", [(reductions, "statistics_of", _statistics_of)]),
    ("- decisions", [(solver, "layer_scale", _constant_decision),
                     (solver, "cast_scale", _constant_decision)]),
    ("- merges", [(solver, "merge_scale", lambda scales, *a, **k: scales[0])]),
    ("- rescales", [*((m, "_rescale", lambda ct, factor: ct) for m in (backward, layers, regions)),
                    (backward, "_stored", lambda x: x), (backward, "_settled", lambda x, inverses=None: x)]),
    ("- fp32 weight grads", [(layers, "weight_grad", lambda sw, node, g, q=None: node.vjp([g])[node.wgt])]),
]


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for target, name, value in patches:
            stack.enter_context(mock.patch.object(target, name, value))  # raises if the name is gone
        yield


def _least_compile(make: Callable[[], Any], args: tuple[Any, ...], compiles: int
                   ) -> tuple[Any, dict[str, Any]]:
    """Compile ``make()`` ``compiles`` times (caches cleared between); the fastest's record."""
    best: tuple[Any, dict[str, Any]] | None = None
    for _ in range(compiles):
        jax.clear_caches()
        compiled, record = _compile(make(), *args)
        if best is None or record["compile_s"] < best[1]["compile_s"]:
            best = compiled, record
    assert best is not None
    return best


def measure(blocks: int, scanned: bool, vocab: int, dim: int, heads: int, seq: int, batch: int,
            compiles: int, repeats: int, steps: int) -> dict[str, Any]:
    """One model's row: every variant's compile seconds, HLO size and median step time."""
    model = LM(vocab, dim, heads, blocks, scanned)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)), jnp.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(0), x)

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    args = (params, x, y)
    fns, records = {}, {}
    fns["jax"], records["jax"] = _least_compile(lambda: jax.value_and_grad(loss), args, compiles)
    patches: list[tuple[Any, str, Any]] = []
    for name, more in ABLATIONS:
        patches = patches + more
        with _patched(patches):
            fns[name], records[name] = _least_compile(lambda: jax_adaloss.value_and_grad(loss), args,
                                                      compiles)
    runs = {k: (lambda f=f: jax.block_until_ready(f(*args))) for k, f in fns.items()}
    for run in runs.values():  # warm-up
        run()
    ms = _time(runs, repeats, steps)
    return {"blocks": blocks, "layout": "scanned" if scanned else "unrolled",
            "variants": [{"name": k, "compile_s": records[k]["compile_s"], "hlo_ops": records[k]["hlo_ops"],
                          "bytes_accessed": records[k]["bytes_accessed"], "step_ms": ms[k]} for k in fns]}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--layouts", nargs="+", choices=("unrolled", "scanned"), default=["unrolled", "scanned"])
    add_model_arguments(ap)
    ap.add_argument("--compiles", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for b, layout in tqdm([(b, a) for b in args.blocks for a in args.layouts], desc="models"):
        rows.append(measure(b, layout == "scanned", args.vocab, args.dim, args.heads, args.seq, args.batch,
                            args.compiles, args.repeats, args.steps))
        tqdm.write(table(rows[-1:]))
    print(f"{machine()}; dim {args.dim}, seq {args.seq}, batch {args.batch}; "
          "ratios against jax.value_and_grad")
    print(table(rows))
    write_json(args, rows)
    return rows


if __name__ == "__main__":
    main()
