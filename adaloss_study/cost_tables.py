"""Markdown tables of ``benchmarks/cost_breakdown.py``'s rows (its JSON), for the console and the
results page."""

from __future__ import annotations

from typing import Any

from adaloss_study.commands import benchmark_command

_FLAGS = ("blocks", "layouts", "dim", "heads", "seq", "batch", "vocab", "compiles", "repeats", "steps")


def _bytes(v: dict[str, Any], base: dict[str, Any]) -> str:
    """Bytes accessed (XLA's cost analysis) and the ratio to ``base``'s; "–" where not measured."""
    if "bytes_accessed" not in v:
        return "–"
    return f"{v['bytes_accessed'] / 1e6:.0f} MB ({v['bytes_accessed'] / base['bytes_accessed']:.2f}×)"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per (model, variant), seconds and ms with their ratio to ``jax``."""
    lines = ["| blocks | layout | variant | compile (s) | HLO ops | bytes | step (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(v for v in r["variants"] if v["name"] == "jax")
        for v in r["variants"]:
            lines.append(f"| {r['blocks']} | {r['layout']} | {v['name']} | {v['compile_s']:.1f} "
                         f"({v['compile_s'] / base['compile_s']:.2f}×) | {v['hlo_ops']} | "
                         f"{_bytes(v, base)} | {v['step_ms']:.1f} ({v['step_ms'] / base['step_ms']:.2f}×) |")
    return "\n".join(lines)


def section(result: dict[str, Any]) -> list[str]:
    """The results page's section from the benchmark's JSON."""
    a = result["args"]
    return ["## Where the JAX overhead goes", "",
            "```\n" + benchmark_command("benchmarks/cost_breakdown.py", _FLAGS, a) + "\n```", "",
            f"The depth benchmark's model (dim {a['dim']}, seq {a['seq']}, batch {a['batch']}); "
            "`jax_adaloss.value_and_grad` with one more part of the backward replaced by a stand-in "
            "in each line (statistics: one element of the tensor; decisions: the constant 2; merges: "
            "the first branch's scale; rescales: none; weight gradients: in the weights' format). "
            "Bytes: what the compiled gradient's instructions read and write, by XLA's cost "
            "analysis (a scanned body counted once). "
            "The variants below `adaloss` compute wrong scales: they show which part a faster "
            "implementation would have to change, not a configuration to run. Ratios against "
            f"`jax.value_and_grad`; least of {a['compiles']} compilations, median of {a['repeats']} "
            f"alternating rounds of {a['steps']} calls. `{result.get('machine', '')}`, "
            f"{result.get('date', '')}.", "", table(result["rows"]), ""]
