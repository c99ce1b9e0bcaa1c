"""One prepared accelerator run: adaloss against global scaling, timed on the device.

    python benchmarks/gpu_step_time.py                 # ~100M study GPT, then GPT-2/1B widths
    python benchmarks/gpu_step_time.py --preset tiny --widths toy --blocks 1   # smoke test on CPU
    python benchmarks/gpu_step_time.py --budget-s 420  # one device run that ends in 7 minutes

Two measurements, each timed alternately after a warm-up call that includes compilation:

- the study's overhead measurement (:mod:`adaloss_study.overhead`: fp16 with no scaling,
  ``jmp.DynamicLossScale`` with GradScaler's defaults, adaloss-product; jitted steps with
  backward, (un)scaling and Adam) on the study's CharGPT at GPT-2-small size (``--preset``),
  random tokens;
- the programs whose bytes and kernels :mod:`gpu_cost` reads without a device
  (:mod:`cost_programs`: the gradient against ``jax.value_and_grad``, the training step
  against ``jmp.DynamicLossScale``) at ``--widths`` (default GPT-2 small's and a 1B-class
  layer's), ``--configs``, ``--layouts``: the device's answer to its estimates.

Prints and writes (``--json``) the median times, their ratios, the warm-up (compile) times and
the device. No GPU time is claimed without this run on one.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from cost_programs import CONFIGS, WIDTHS, programs

from adaloss_study import overhead
from adaloss_study.jax_runner import RunConfig
from adaloss_study.tasks import Task

PRESETS = {
    "100m": {"vocab": 256, "dim": 768, "heads": 12, "layers": 12, "seq": 512, "batch": 16},
    "tiny": {"vocab": 64, "dim": 32, "heads": 2, "layers": 1, "seq": 16, "batch": 2},
}


def random_tokens(vocab: int, cfg: RunConfig) -> Task:
    """Uniform random tokens: the step time does not depend on the data."""
    def train(seed: int) -> Any:
        rng = np.random.default_rng(seed)
        while True:
            yield (rng.integers(0, vocab, (cfg.batch, cfg.seq)).astype(np.int32),
                   rng.integers(0, vocab, (cfg.batch, cfg.seq)).astype(np.int32))

    def flax_model(c: RunConfig, dtype: Any, seed: int) -> Any:
        import flax.nnx as nnx

        from adaloss_study.models import CharGPT
        return CharGPT(vocab, c.dim, c.heads, c.layers, c.seq, dtype=dtype, rngs=nnx.Rngs(seed))

    return Task("random-tokens", train, lambda seed: [], flax_model, lambda c: None)


def time_programs(widths: list[str], configs: list[str], layouts: list[str], blocks: int | None,
                  steps: int, repeats: int, which: tuple[str, ...] = ("gradient", "step")
                  ) -> list[dict[str, Any]]:
    """Per (width, config, layout, program): adaloss's and the baseline's median ms per call,
    timed alternately in ``repeats`` rounds of ``steps`` calls, and their first call's seconds
    (compilation included)."""
    rows = []
    for width in widths:
        for config in configs:
            for layout in layouts:
                depth = blocks or WIDTHS[width]["blocks"]
                progs = programs(width, config, depth, layout == "scanned", concrete=True)
                for program in which:
                    runs, first = {}, {}
                    for method in ("adaloss", "baseline"):
                        fun, args = progs[(program, method)]
                        f = jax.jit(fun)
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(*args))
                        first[method] = time.perf_counter() - t0
                        runs[method] = (f, args)
                    ms: dict[str, list[float]] = {m: [] for m in runs}
                    for _ in range(repeats):
                        for m, (f, args) in runs.items():
                            t0 = time.perf_counter()
                            for _ in range(steps):
                                out = f(*args)
                            jax.block_until_ready(out)
                            ms[m].append(1e3 * (time.perf_counter() - t0) / steps)
                    med = {m: statistics.median(v) for m, v in ms.items()}
                    rows.append({"width": width, "config": config, "layout": layout, "blocks": depth,
                                 "program": program, "median_ms": med, "first_call_s": first,
                                 "ratio": med["adaloss"] / med["baseline"]})
                    print(f"{width} {config} {layout} {program}: adaloss {med['adaloss']:.2f} ms, "
                          f"baseline {med['baseline']:.2f} ms ({rows[-1]['ratio']:.3f}x)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--widths", nargs="*", choices=sorted(WIDTHS), default=["gpt2", "1b"],
                    help="the cost programs' widths to time (none: only the study's preset)")
    ap.add_argument("--blocks", type=int, default=None, help="their depth (default: each width's)")
    ap.add_argument("--configs", nargs="+", choices=[c for c in CONFIGS if c != "fp8-current"],
                    default=["fp16", "bf16"])
    ap.add_argument("--layouts", nargs="+", choices=("unrolled", "scanned"), default=["unrolled"])
    ap.add_argument("--programs", nargs="+", choices=("gradient", "step"), default=["gradient", "step"])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--budget-s", type=int, default=0,
                    help="stop with an error after this many seconds (0: no limit): a device session's "
                         "time is finite, and a run killed from outside leaves nothing")
    args = ap.parse_args(argv)
    if args.budget_s > 0:
        def out_of_time(*_: Any) -> None:
            raise SystemExit(f"gpu_step_time: over the --budget-s of {args.budget_s} s; "
                             "lower --steps/--repeats or use a smaller --preset")
        signal.signal(signal.SIGALRM, out_of_time)
        signal.alarm(args.budget_s)
    p = PRESETS[args.preset]
    cfg = RunConfig(dim=p["dim"], heads=p["heads"], layers=p["layers"], seq=p["seq"], batch=p["batch"],
                    lr=1e-4)
    result = overhead.measure("jax", cfg, random_tokens(p["vocab"], cfg), repeats=args.repeats,
                              steps=args.steps, progress=False)
    result["programs"] = time_programs(args.widths, args.configs, args.layouts, args.blocks,
                                       max(1, args.steps // 4), args.repeats, tuple(args.programs))
    signal.alarm(0)
    result.update(preset=args.preset, backend=jax.default_backend())
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
