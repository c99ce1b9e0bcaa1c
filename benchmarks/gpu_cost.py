"""The backward's cost on the GPU program, compiled without a GPU: kernels, bytes, compile time.

    pip install -e '.[gpu-program]'                  # the CUDA plugin (no CUDA libraries)
    python benchmarks/gpu_cost.py                     # docs/gpu_cost.json, table printed
    python benchmarks/gpu_cost.py --blocks 8 --layouts unrolled --configs fp16

The depth benchmark's LM (:mod:`depth`: vocab 256, dim 128, 4 heads, seq 64, batch 8) at
``--blocks`` depths, its blocks unrolled or scanned, for each gradient format ``--configs``
(``fp16``: the default, the LM in fp16; ``bf16``: the LM and the gradients in bf16;
``fp8``: e5m2 gradients of the fp16 LM), compiled for an H100 target with default flags
(:mod:`jax_adaloss.gpu_program`), two programs each beside its baseline:

- the gradient: ``jax_adaloss.value_and_grad`` (at its initial state) against
  ``jax.value_and_grad``;
- the training step: ``adaloss()`` chained with ``optax.adam`` against
  ``jmp.DynamicLossScale`` (GradScaler's defaults) around ``jax.value_and_grad`` and the same
  Adam (:func:`depth.train_steps`).

Read from the optimized program: kernels launched per run and the bytes they move (a scanned
body counted once per iteration), XLA's flops, temporary memory and compile seconds. An
**estimated** step time per target comes from a stated model, nothing having run:
``bytes / bandwidth + flops / peak + kernels × launch``, with :data:`TARGETS`' figures (a
scanned row takes its unrolled twin's flops: XLA's analysis counts a loop body once).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from jax_adaloss import gpu_program as gp

gp.environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from depth import LM, train_steps  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jax_adaloss  # noqa: E402
from adaloss.config import AdaLossConfig  # noqa: E402

#: the estimate's figures: HBM bandwidth (bytes/s), dense 16-bit tensor-core peak (flop/s), and
#: the time a kernel takes at least, launched back to back from XLA's thunk sequence (s)
TARGETS = {"h100": {"bandwidth": 3.35e12, "peak": 989e12, "launch": 4e-6},
           "h200": {"bandwidth": 4.8e12, "peak": 989e12, "launch": 4e-6}}
#: gradient format -> (the LM's compute dtype, the config)
CONFIGS = {"fp16": (jnp.float16, AdaLossConfig()),
           "bf16": (jnp.bfloat16, AdaLossConfig(grad_format="bfloat16")),
           "fp8": (jnp.float16, AdaLossConfig(grad_format="float8_e5m2"))}


def estimate_ms(row: dict[str, Any], flops: float, target: str) -> float:
    """The stated model's step time in ms (an estimate: nothing ran)."""
    t = TARGETS[target]
    seconds = row["kernel_bytes_run"] / t["bandwidth"] + flops / t["peak"] + row["kernels_run"] * t["launch"]
    return 1e3 * seconds


def programs(config: str, blocks: int, scanned: bool) -> dict[tuple[str, str], tuple[Any, tuple[Any, ...]]]:
    """(program, method) -> (function, its arguments) for one model."""
    dtype, cfg = CONFIGS[config]
    model = LM(256, 128, 4, blocks, scanned, dtype)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 65)), jnp.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(0), x)

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    vg = jax_adaloss.value_and_grad(loss, config=cfg)
    steps = train_steps(loss, params, cfg)
    return {("gradient", "adaloss"): (lambda p, x, y: vg(p, x, y, adaloss_state=None), (params, x, y)),
            ("gradient", "baseline"): (jax.value_and_grad(loss), (params, x, y)),
            ("step", "adaloss"): (steps["adaloss"][0], (*steps["adaloss"][1], x, y)),
            ("step", "baseline"): (steps["dynamic"][0], (*steps["dynamic"][1], x, y))}


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """adaloss / baseline per (config, layout, blocks, program)."""
    base = {(r["config"], r["layout"], r["blocks"], r["program"]): r
            for r in rows if r["method"] == "baseline"}
    out = []
    for r in rows:
        b = base.get((r["config"], r["layout"], r["blocks"], r["program"]))
        if r["method"] != "adaloss" or b is None:
            continue
        out.append({k: r[k] for k in ("config", "layout", "blocks", "program")}
                   | {"kernels": r["kernels_run"] / b["kernels_run"],
                      "bytes": r["kernel_bytes_run"] / b["kernel_bytes_run"],
                      "compile": r["compile_s"] / b["compile_s"],
                      **{f"estimate_{t}": r["estimate_ms"][t] / b["estimate_ms"][t] for t in TARGETS}})
    return out


def line(r: dict[str, Any]) -> str:
    return (f"{r['config']:5s} {r['layout']:8s} {r['blocks']:3d} {r['program']:8s} "
            f"kernels {r['kernels']:.2f}x bytes {r['bytes']:.2f}x compile {r['compile']:.2f}x "
            f"est. H100 {r['estimate_h100']:.2f}x")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--layouts", nargs="+", choices=("unrolled", "scanned"),
                    default=["unrolled", "scanned"])
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--programs", nargs="+", choices=("gradient", "step"), default=["gradient", "step"])
    ap.add_argument("--json", type=Path, default=Path(__file__).parents[1] / "docs" / "gpu_cost.json")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    todo = [(c, b, lay) for c in args.configs for b in args.blocks for lay in args.layouts]
    for config, blocks, layout in tqdm(todo, desc="models"):
        for (program, method), (fun, fargs) in programs(config, blocks, layout == "scanned").items():
            if program not in args.programs:
                continue
            prog = gp.compile_for(fun, *fargs, target="h100")
            row = {"config": config, "layout": layout, "blocks": blocks, "program": program, "method": method,
                   **{k: v for k, v in prog.row().items() if k not in ("converts", "second_passes")}}
            rows.append(row)
    for r in rows:  # a scanned row's flops: its unrolled twin's (XLA counts a loop body once)
        twin = next((u for u in rows if u["layout"] == "unrolled"
                     and all(u[k] == r[k] for k in ("config", "blocks", "program", "method"))), r)
        r["estimate_flops"] = twin["flops"]
        r["estimate_ms"] = {t: estimate_ms(r, twin["flops"], t) for t in TARGETS}
    table = ratios(rows)
    for r in table:
        print(line(r))
    args.json.write_text(json.dumps({"command": "python benchmarks/gpu_cost.py", "jax": jax.__version__,
                                     "model": "depth LM: vocab 256, dim 128, 4 heads, seq 64, batch 8",
                                     "target": "h100", "estimate": TARGETS, "date": time.strftime("%Y-%m-%d"),
                                     "rows": rows, "ratios": table}, indent=1) + "\n")
    return table


if __name__ == "__main__":
    main()
