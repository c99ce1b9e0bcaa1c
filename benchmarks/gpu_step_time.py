"""One prepared accelerator run: fp16 GPT of ~100M parameters, adaloss vs dynamic global scaling.

    python benchmarks/gpu_step_time.py                 # the ~100M preset (an H200: a few minutes)
    python benchmarks/gpu_step_time.py --preset tiny   # smoke test on CPU
    python benchmarks/gpu_step_time.py --budget-s 420  # one device run that ends in 7 minutes

The study's overhead measurement (:mod:`adaloss_study.overhead`: fp16 with no
scaling, ``jmp.DynamicLossScale`` with GradScaler's defaults, adaloss-product;
jitted steps with backward, (un)scaling and Adam, timed alternately after a
warm-up round that includes compilation) on the study's CharGPT at GPT-2-small
size and random tokens. Prints and writes (``--json``) the median step times,
their ratios, the warm-up (compile) times and the device.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from typing import Any

import jax
import numpy as np

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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
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
    signal.alarm(0)
    result.update(preset=args.preset, backend=jax.default_backend())
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
