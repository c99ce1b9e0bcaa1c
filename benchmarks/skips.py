"""Skipped steps: adaloss against a global dynamic scale, training every zoo model.

    python benchmarks/skips.py --json docs/skips.json

For each zoo model (:mod:`adaloss_zoo`, both frameworks) and loss factor, ``--steps`` steps of
Adam (lr 1e-3) from the same initialisation on the model's batch, in each library's own
training idiom, once with adaloss and once with the global dynamic scale people use, from
2^16: ``torch.amp.GradScaler`` at its defaults, ``jmp.DynamicLossScale`` with
``optax.apply_if_finite``. Per run: the skipped steps and the longest run of consecutive
skipped steps. adaloss must skip no more than the dynamic scale, in total and in a row.

``tests/test_zoo.py`` runs the same check on two models and reads the JSON for the others; the
limits page's table is generated from it (``adaloss-study --docs``).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

METHODS = ("adaloss", "dynamic")


def longest_run(flags: list[bool]) -> int:
    """The longest run of consecutive ``True``."""
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


def _row(framework: str, model: str, factor: float, flags: dict[str, list[bool]]) -> dict[str, Any]:
    return {"framework": framework, "model": model, "factor": factor, "steps": len(flags["adaloss"]),
            "skipped": {m: sum(f) for m, f in flags.items()},
            "in_a_row": {m: longest_run(f) for m, f in flags.items()}}


def torch_rows(factors: list[float], names: list[str] | None, steps: int) -> list[dict[str, Any]]:
    from adaloss_zoo import torch_zoo as tz
    rows = []
    for name in _pick(names, tz.CASES):
        for f in factors:
            flags = {m: tz.train(tz.CASES[name], f, steps, dynamic=m == "dynamic") for m in METHODS}
            rows.append(_row("torch", name, f, flags))
            print(_line(rows[-1]), flush=True)
    return rows


def jax_rows(factors: list[float], names: list[str] | None, steps: int) -> list[dict[str, Any]]:
    from adaloss_zoo import jax_zoo as jz
    rows = []
    for name in _pick(names, jz.CASES):
        for f in factors:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                flags = {m: jz.CASES[name]().train(steps, f, dynamic=m == "dynamic")["skip_flags"]
                         for m in METHODS}
            rows.append(_row("jax", name, f, flags))
            print(_line(rows[-1]), flush=True)
    return rows


def _pick(names: list[str] | None, cases: dict[str, Any]) -> list[str]:
    return list(cases) if names is None else [n for n in names if n in cases]


def _line(r: dict[str, Any]) -> str:
    return (f"{r['framework']:5} {r['model']:22} ×{r['factor']:<6g} "
            + "  ".join(f"{m} {r['skipped'][m]} skipped ({r['in_a_row'][m]} in a row)" for m in METHODS))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "jax", "both"], default="both")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 1e-3, 1e-6])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", nargs="+", default=None, help="zoo names (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    if args.framework in ("torch", "both"):
        rows += torch_rows(args.factors, args.models, args.steps)
    if args.framework in ("jax", "both"):
        rows += jax_rows(args.factors, args.models, args.steps)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()}, "rows": rows},
                                        indent=1))
    return rows


if __name__ == "__main__":
    main()
