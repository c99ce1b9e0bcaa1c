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


def gpu_table(payload: dict[str, Any]) -> str:
    """Markdown: adaloss against its baseline per (gradients, layout, blocks, program) of
    ``benchmarks/gpu_cost.py``'s JSON."""
    rows = payload["rows"]

    def get(r: dict[str, Any], method: str) -> dict[str, Any]:
        keys = ("config", "layout", "blocks", "program")
        return next(x for x in rows if x["method"] == method and all(x[k] == r[k] for k in keys))

    def pair(a: float, b: float, fmt: str) -> str:
        return f"{a / b:.2f}× ({a:{fmt}} vs {b:{fmt}})"
    lines = ["| gradients | layout | blocks | program | kernels | MB moved | compile (s) | est. H100 (ms) "
             "| est. H200 (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] != "adaloss":
            continue
        b = get(r, "baseline")
        lines.append(f"| {r['config']} | {r['layout']} | {r['blocks']} | {r['program']} | "
                     f"{pair(r['kernels_run'], b['kernels_run'], 'd')} | "
                     f"{pair(r['kernel_bytes_run'] / 1e6, b['kernel_bytes_run'] / 1e6, '.0f')} | "
                     f"{pair(r['compile_s'], b['compile_s'], '.1f')} | "
                     f"{pair(r['estimate_ms']['h100'], b['estimate_ms']['h100'], '.2f')} | "
                     f"{pair(r['estimate_ms']['h200'], b['estimate_ms']['h200'], '.2f')} |")
    return "\n".join(lines)


def gpu_section(payload: dict[str, Any]) -> list[str]:
    """The results page's section of ``benchmarks/gpu_cost.py`` (the GPU program, no device)."""
    est = payload["estimate"]
    return ["## On a GPU: the compiled program", "",
            f"```\n{payload['command']}\n```", "",
            "No GPU has run these steps. XLA:GPU compiles them on this machine for an H100 target "
            "(`jax_adaloss.gpu_program`), and the optimized program says what a device would launch: "
            "kernels (fusions and library calls) and the bytes they move. Each layer decision reads its "
            "cotangent in one kernel (every statistic in one variadic reduction) and decides in a "
            "second; a merge of branches that carry different scales reads them in one and decides in "
            "another before the sum is written. At these sizes a step is launch-bound, so the "
            "estimated step time follows the kernel count.", "",
            f"jax {payload['jax']}, {payload['model']}, compiled for an H100 (default flags; nothing "
            "ran). Kernels and MB: what one run launches and moves (each kernel reading its operands "
            "and writing its results once, the slice of a loop's buffer it reads or updates in place; "
            "a scanned body once per iteration). **Estimated** step time: MB ÷ bandwidth + flops ÷ "
            f"16-bit peak + kernels × {est['h100']['launch'] * 1e6:.0f} µs (H100 "
            f"{est['h100']['bandwidth'] / 1e12:.2f} TB/s, H200 {est['h200']['bandwidth'] / 1e12:.1f} TB/s, "
            f"{est['h100']['peak'] / 1e12:.0f} TFLOP/s). Baselines: the gradient against "
            "`jax.value_and_grad`, the training step against `jmp.DynamicLossScale`. "
            f"{payload.get('date', '')}.", "", gpu_table(payload), ""]
