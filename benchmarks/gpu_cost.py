"""The backward's cost on the GPU program, compiled without a GPU: kernels, bytes, compile time.

    pip install -e '.[gpu-program]' -e ./tools        # the CUDA plugin (no CUDA libraries)
    python benchmarks/gpu_cost.py                     # docs/gpu_cost.json, table printed
    python benchmarks/gpu_cost.py --widths gpt2 --layouts unrolled --configs fp16 --programs gradient

The depth benchmark's LM (:mod:`depth`) at the widths people train (``--widths``: ``toy``,
vocab 256, dim 128, 4 heads, seq 64, batch 8, 8 blocks; ``gpt2``, GPT-2 small's vocab-32k
widths, dim 768, 12 heads, seq 1024, batch 8, 4 blocks; ``1b``, a 1B-class layer, dim 2048,
16 heads, seq 2048, batch 4, 2 blocks; ``--blocks`` overrides the depth), its blocks unrolled
or scanned, for each gradient format ``--configs`` (``fp16``: the default, the LM in fp16;
``bf16``: the LM and the gradients in bf16; ``fp8``: e5m2 gradients of the fp16 LM;
``fp8-current``: the same with ``fp8_rule="current"``, per-tensor current scaling, the FP8
row's reference), compiled for an H100 target with default flags
(:mod:`adaloss_tools.gpu_program`), two programs each beside its baseline:

- the gradient: ``jax_adaloss.value_and_grad`` (at its initial state) against
  ``jax.value_and_grad``;
- the training step: ``adaloss()`` chained with ``optax.adam`` against
  ``jmp.DynamicLossScale`` (GradScaler's defaults) around ``jax.value_and_grad`` and the same
  Adam (:func:`depth.train_steps`), each compiled with its state (parameters, optimizer and
  loss-scale state) donated, as training loops compile it (``jax.jit(step,
  donate_argnums=...)``): state a step leaves unchanged (a bias's lift exponent) costs no copy.

Read from the optimized program: kernels launched per run and the bytes they move (a scanned
body counted once per iteration), each kernel attributed to what it does
(:func:`adaloss_tools.gpu_program.attribute`: the model's own backward, statistics passes,
merges, rescales, scalar kernels), XLA's flops, temporary memory and compile seconds. An
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

from adaloss_tools import gpu_program as gp

gp.environment()

import jax  # noqa: E402
from cost_programs import BASELINE_OF, CONFIGS, KEYS, WIDTHS, programs  # noqa: E402
from tqdm import tqdm  # noqa: E402

#: the estimate's figures: HBM bandwidth (bytes/s), dense 16-bit tensor-core peak (flop/s), and
#: the time a kernel takes at least, launched back to back from XLA's thunk sequence (s)
TARGETS = {"h100": {"bandwidth": 3.35e12, "peak": 989e12, "launch": 4e-6},
           "h200": {"bandwidth": 4.8e12, "peak": 989e12, "launch": 4e-6}}
def estimate_ms(row: dict[str, Any], flops: float, target: str) -> float:
    """The stated model's step time in ms (an estimate: nothing ran)."""
    t = TARGETS[target]
    seconds = row["kernel_bytes_run"] / t["bandwidth"] + flops / t["peak"] + row["kernels_run"] * t["launch"]
    return 1e3 * seconds


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """adaloss / baseline per (width, config, layout, blocks, program); ``extra``: the bytes
    each category adds, as a fraction of the baseline's (``model``: the model's own kernels'
    bytes against the baseline's total); an fp8 row's ``bytes_vs_current``: against the same
    program with ``fp8_rule="current"``."""
    def key(r: dict[str, Any], config: str | None = None) -> tuple[Any, ...]:
        return tuple((config or r["config"]) if k == "config" else r[k] for k in KEYS)
    base = {key(r, BASELINE_OF.get(r["config"])): r for r in rows if r["method"] == "baseline"}
    current = {key(r): r for r in rows if r["method"] == "adaloss" and r["config"] == "fp8-current"}
    out = []
    for r in rows:
        b = base.get(key(r, BASELINE_OF.get(r["config"])))
        if r["method"] != "adaloss" or b is None:
            continue
        total = b["kernel_bytes_run"]
        extra = {c: v["bytes"] / total for c, v in r["attribution"].items() if c != "model"}
        extra["model"] = (r["attribution"]["model"]["bytes"] - total) / total
        row = {k: r[k] for k in KEYS} | {
            "kernels": r["kernels_run"] / b["kernels_run"], "bytes": r["kernel_bytes_run"] / total,
            "compile": r["compile_s"] / b["compile_s"],
            "scalar_kernels": r["attribution"]["scalars"]["kernels"] / b["kernels_run"],
            **{f"estimate_{t}": r["estimate_ms"][t] / b["estimate_ms"][t] for t in TARGETS},
            "extra": extra}
        cur = current.get(key(r, "fp8-current"))
        if r["config"] == "fp8" and cur is not None:
            row["bytes_vs_current"] = r["kernel_bytes_run"] / cur["kernel_bytes_run"]
        out.append(row)
    return out


def line(r: dict[str, Any]) -> str:
    extra = " ".join(f"{c} {100 * v:+.1f}%" for c, v in r["extra"].items() if abs(v) >= 5e-4)
    vs = f" vs current {r['bytes_vs_current']:.3f}x" if "bytes_vs_current" in r else ""
    return (f"{r['width']:4s} {r['config']:11s} {r['layout']:8s} {r['blocks']:2d} {r['program']:8s} "
            f"bytes {r['bytes']:.3f}x{vs} kernels {r['kernels']:.2f}x (scalar {r['scalar_kernels']:.2f}) "
            f"compile {r['compile']:.2f}x est. H100 {r['estimate_h100']:.2f}x | {extra}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", nargs="+", choices=sorted(WIDTHS), default=list(WIDTHS))
    ap.add_argument("--blocks", type=int, default=None, help="every width's depth (default: its own)")
    ap.add_argument("--layouts", nargs="+", choices=("unrolled", "scanned"),
                    default=["unrolled", "scanned"])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--programs", nargs="+", choices=("gradient", "step"), default=["gradient", "step"])
    ap.add_argument("--json", type=Path, default=Path(__file__).parents[1] / "docs" / "gpu_cost.json")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    todo = [(w, c, lay) for w in args.widths for c in args.configs for lay in args.layouts]
    for width, config, layout in tqdm(todo, desc="models"):
        blocks = args.blocks or WIDTHS[width]["blocks"]
        for (program, method), (fun, fargs) in programs(width, config, blocks, layout == "scanned").items():
            shared = method == "baseline" and BASELINE_OF.get(config) in args.configs
            if program not in args.programs or shared:
                continue
            # a training step's state (all but the batch) donated, as training loops do
            donate = tuple(range(len(fargs) - 2)) if program == "step" else ()
            prog = gp.compile_for(fun, *fargs, target="h100", donate_argnums=donate)
            rows.append({"width": width, "config": config, "layout": layout, "blocks": blocks,
                         "program": program, "method": method,
                         **{k: v for k, v in prog.row().items() if k not in ("converts", "second_passes")},
                         "attribution": gp.attribute(prog.text)})
            tqdm.write(f"{width} {config} {layout} {program} {method}: {prog.kernels_run} kernels, "
                       f"{prog.kernel_bytes_run / 1e9:.3f} GB, {prog.compile_s:.1f} s")
    for r in rows:  # a scanned row's flops: its unrolled twin's (XLA counts a loop body once)
        twin = next((u for u in rows if u["layout"] == "unrolled"
                     and all(u[k] == r[k] for k in ("width", "config", "blocks", "program", "method"))), r)
        r["estimate_flops"] = twin["flops"]
        r["estimate_ms"] = {t: estimate_ms(r, twin["flops"], t) for t in TARGETS}
    table = ratios(rows)
    for r in table:
        print(line(r))
    payload = {"command": "python benchmarks/gpu_cost.py", "jax": jax.__version__, "widths": WIDTHS,
               "baseline_of": BASELINE_OF, "target": "h100", "estimate": TARGETS,
               "date": time.strftime("%Y-%m-%d"), "rows": rows, "ratios": table}
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return table


if __name__ == "__main__":
    main()
