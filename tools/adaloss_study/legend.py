"""What the study prints: each method's display name and one-line meaning, and the columns'.

The method names are ``--methods``'s; the default adaptive method, ``adaloss-product`` (the
paper's product model, :class:`~adaloss.config.AdaLossConfig`'s default), is shown as
``adaloss``, the README's name for it, and ``--methods adaloss`` selects it.
"""

from __future__ import annotations

import math
import textwrap

#: the legend's lines are wrapped to this width, as the tables fit it
WIDTH = 100

#: ``--methods`` accepts these names for the method they map to
ALIASES = {"adaloss": "adaloss-product"}

#: the name a method is shown under (the README's); others are shown as named
LABELS = {"adaloss-product": "adaloss"}


def label(method: str) -> str:
    """The name ``method`` is shown under."""
    return LABELS.get(method, method)


def _pow2(x: float) -> str:
    """``2^15`` for 32768; other numbers as they are."""
    k = math.log2(x) if x > 0 else 0.5
    return f"2^{int(k)}" if k == int(k) else f"{x:g}"


def _methods(framework: str, static_scale: float, growth: int) -> dict[str, str]:
    dynamic = ("torch.amp.GradScaler (from 2^16, x2 after 2000 clean steps, /2 and skip on "
               "overflow)" if framework == "torch" else
               "jmp.DynamicLossScale with GradScaler's rule (from 2^16, x2 after 2000 clean "
               "steps, /2 and skip on overflow)")
    return {
        "fp32": "fp32 compute, no scaling: the reference",
        "fp16": "fp16 compute, no loss scaling",
        "bf16": "bf16 compute, no quantization, no scaling",
        "static": f"one fixed loss scale, {_pow2(static_scale)} (--static-scale)",
        "dynamic": dynamic,
        "dynamic-grow": f"the same rule with its growth interval scaled to the run ({growth} steps)",
        "adaloss-product": "adaptive per-layer scales, the default AdaLossConfig (product model)",
        "adaloss-output": "adaptive, the output statistical model",
        "adaloss-gradient": "adaptive, the gradient statistical model (the paper's preset)",
        "adaloss-e2e": "adaptive, and every GEMM's inputs and weights in e4m3 too",
        "cast-only": "one scale from the loss cotangent's statistics (layer_rule=False)",
        "largest-safe": "per-layer scales set by the overflow caps alone",
        "current": "per-tensor current scaling (each cast at its own max, as Transformer Engine)",
        "delayed-16": "flax fp8_ops delayed scaling, an amax history of 16 steps",
        "delayed-1024": "flax fp8_ops delayed scaling, an amax history of 1024 steps",
        "torchao-tensorwise": "torchao float8 training, tensorwise scales",
        "torchao-rowwise": "torchao float8 training, rowwise scales",
        "fp32-cold": "fp32 with no update at step 0 (delayed scaling's cold start)",
    }


def legend(methods: list[str], framework: str, threshold: float, u_min: float, grad_format: str,
           static_scale: float, growth: int, measure_every: int, seeds: int) -> str:
    """The lines under the study's tables: what each shown method and column means."""
    said = _methods(framework, static_scale, growth)
    width = max(len(label(m)) for m in methods) + 4

    def entry(name: str, text: str, at: int) -> list[str]:
        return textwrap.wrap(text, WIDTH, initial_indent=f"  {name:<{at - 2}}",
                             subsequent_indent=" " * at, break_on_hyphens=False)
    lines = ["methods:"]
    for m in methods:
        alias = f" (--methods {m})" if label(m) != m else ""
        lines += entry(label(m), said.get(m, m) + alias, width)
    spread = f"mean ±std over {seeds} seeds" if seeds > 1 else "one seed"
    columns = [
        ("cells", f"{spread}; val: on held-out data; train loss: the mean of the last 20 steps"),
        ("skipped", "steps skipped for a non-finite gradient"),
        ("under mean/max", f"per layer, the share of its incoming cotangent's entries (non-zero in an "
                           f"fp32 backward at the same weights) that the scale leaves below u_min = "
                           f"{u_min:.3g} ({grad_format}'s smallest normal): the mean and the max over "
                           f"layers and measurements (every {measure_every} steps)"),
        ("within T", f"the share of those layer-measurements at most T = {threshold:g}"),
        ("carried", f"the share the {grad_format} backward itself holds below u_min (it adds what "
                    "its arithmetic loses at any scale)"),
        ("flushed", "the largest share held at zero (fp8: flushed by the casts)"),
        ("step time", "not compared here: the methods ran one after another. Each run's ms/step is "
                      "in study.json; adaloss-study --overhead times them alternately"),
    ]
    lines.append("columns:")
    for name, text in columns:
        lines += entry(name, text, 18)
    return "\n".join(lines)
