"""The default config against the paper's settings, one departure reverted at a time, on the zoo.

    python benchmarks/departures.py --json docs/departures.json

For each zoo model (:mod:`adaloss_zoo`, both frameworks) and loss factor, one backward of the
same fp16 forward under each variant below (repeated on the batch until finite, its back-off
raised after each non-finite pass, as :mod:`benchmarks.zoo` runs ``adaloss``), against that
forward's loss-×1 gradients; the median per-parameter error ``‖g − g_ref‖/‖g_ref‖``:

- ``default``: :class:`adaloss.AdaLossConfig` as shipped;
- ``subnormal u_min``: ``u_min=6.0e-8``, the authors' value (fp16's smallest subnormal is
  2^-24 ≈ 5.96e-8), instead of fp16's smallest normal number 2^-14;
- ``paper bounds``: ``layer_bound=16, accum_bound=1024``, the authors' defaults, instead of no
  bound;
- ``authors' preset``: :meth:`adaloss.AdaLossConfig.authors_preset` (both of the above, the
  ``gradient`` model, no measured feedback);
- ``fp16 weight grads`` (JAX only): the default config with each ``dot_general`` layer's weight
  gradient computed by ``jax.vjp`` in the weights' 16-bit format, as the paper's code and
  PyTorch's nodes do, instead of one ``dot_general`` with fp32 accumulation and output (a stand-in
  patched in with ``unittest.mock``, as ``benchmarks/cost_breakdown.py`` does; not a setting);
- ``dynamic``: the global dynamic scale from 2^16 (``torch.amp.GradScaler`` /
  ``jmp.DynamicLossScale``), for reference.

The design page's table of departures is generated from the JSON
(``adaloss-study --docs``). Not a test: ``tests/test_doc_blocks.py`` runs it at a tiny size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from adaloss.config import AdaLossConfig
from adaloss_zoo.metrics import grad_error

#: name -> the config it runs (None: the global dynamic scale)
VARIANTS: dict[str, AdaLossConfig | None] = {
    "default": AdaLossConfig(),
    "subnormal u_min": AdaLossConfig(u_min=6.0e-8),
    "paper bounds": AdaLossConfig(layer_bound=16.0, accum_bound=1024.0),
    "authors' preset": AdaLossConfig.authors_preset(),
    "dynamic": None,
}
#: JAX only: the default config with a part of the backward replaced
JAX_VARIANTS = ("fp16 weight grads",)


@contextlib.contextmanager
def fp16_weight_grads() -> Iterator[None]:
    """Each ``dot_general`` layer's weight gradient by ``jax.vjp`` in the weights' format."""
    import jax

    from jax_adaloss import layers
    jax.clear_caches()
    with mock.patch.object(layers, "weight_grad",  # raises if the name is gone
                           lambda sw, node, g, q=None: node.vjp([g])[node.wgt]):
        yield
    jax.clear_caches()


def _row(framework: str, model: str, factor: float, runs: dict[str, tuple[Any, int]], ref: Any,
         exclude: tuple[str, ...]) -> dict[str, Any]:
    return {"framework": framework, "model": model, "factor": factor,
            "median": {v: grad_error(g, ref, exclude).median for v, (g, _) in runs.items()},
            "skipped": {v: n for v, (_, n) in runs.items()}}


def torch_rows(factors: list[float], names: list[str] | None) -> list[dict[str, Any]]:
    from adaloss_zoo import torch_zoo as tz
    rows = []
    for name in _pick(names, tz.CASES):
        case = tz.CASES[name]
        model, batch = case.build(0)
        ref = tz.reference_grads(case, model, batch)
        for f in factors:
            runs = {}
            for variant, config in VARIANTS.items():
                r = (tz.run_gradscaler(case, model, batch, f) if config is None
                     else tz.run_adaloss(case, model, batch, f, config))
                runs[variant] = (r.grads, r.skipped)
            rows.append(_row("torch", name, f, runs, ref, case.exclude))
            print(_line(rows[-1]), flush=True)
    return rows


def jax_rows(factors: list[float], names: list[str] | None) -> list[dict[str, Any]]:
    from adaloss_zoo import jax_zoo as jz
    rows = []
    for name in _pick(names, jz.CASES):
        case = jz.CASES[name]()
        ref = case.grads("reference", 1.0).grads
        for f in factors:
            runs = {}
            for variant, config in VARIANTS.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    g, skipped = case.dynamic(f) if config is None else case.adaloss(f, config)
                runs[variant] = (g.grads, skipped)
            with fp16_weight_grads(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g, skipped = case.adaloss(f, AdaLossConfig())
            runs[JAX_VARIANTS[0]] = (g.grads, skipped)
            rows.append(_row("jax", name, f, runs, ref, case.exclude))
            print(_line(rows[-1]), flush=True)
    return rows


def _pick(names: list[str] | None, cases: dict[str, Any]) -> list[str]:
    return list(cases) if names is None else [n for n in names if n in cases]


def _line(r: dict[str, Any]) -> str:
    return (f"{r['framework']:5} {r['model']:22} ×{r['factor']:<6g} "
            + "  ".join(f"{v} {m:.3g} ({r['skipped'][v]} skipped)" for v, m in r["median"].items()))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "jax", "both"], default="both")
    ap.add_argument("--factors", type=float, nargs="+", default=[1e-6, 1e-8])
    ap.add_argument("--models", nargs="+", default=None, help="zoo names (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    makers: dict[str, Callable[[list[float], list[str] | None], list[dict[str, Any]]]] = {
        "torch": torch_rows, "jax": jax_rows}
    rows = [r for fw in ("torch", "jax") if args.framework in (fw, "both")
            for r in makers[fw](args.factors, args.models)]
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()}, "rows": rows},
                                        indent=1))
    return rows


if __name__ == "__main__":
    main()
