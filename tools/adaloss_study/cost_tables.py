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
    """Markdown: adaloss against its baseline per (width, gradients, layout, blocks, program) of
    ``benchmarks/gpu_cost.py``'s JSON, with the bytes each kind of kernel adds."""
    lines = ["| width | gradients | layout | blocks | program | MB moved | kernels (scalar) | compile "
             "| est. H100 | bytes added: statistics / merges / rescales / model |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {tuple(r[k] for k in ("width", "config", "layout", "blocks", "program")): r
            for r in payload["rows"] if r["method"] == "baseline"}
    for r in payload["ratios"]:
        b = base.get(tuple(r[k] if k != "config" else payload.get("baseline_of", {}).get(r[k], r[k])
                           for k in ("width", "config", "layout", "blocks", "program")))
        mb = f" ({b['kernel_bytes_run'] / 1e6:,.0f} MB)" if b is not None else ""
        vs = f", {r['bytes_vs_current']:.3f}× current scaling's" if "bytes_vs_current" in r else ""
        x = r["extra"]
        lines.append(f"| {r['width']} | {r['config']} | {r['layout']} | {r['blocks']} | {r['program']} | "
                     f"{r['bytes']:.3f}×{mb}{vs} | {r['kernels']:.2f}× ({r['scalar_kernels']:.2f}) | "
                     f"{r['compile']:.2f}× | {r['estimate_h100']:.2f}× | "
                     + " / ".join(f"{100 * x.get(c, 0.0):+.1f}%" for c in ("statistics", "merges", "rescales",
                                                                          "model")) + " |")
    return "\n".join(lines)


def gpu_section(payload: dict[str, Any]) -> list[str]:
    """The results page's section of ``benchmarks/gpu_cost.py`` (the GPU program, no device)."""
    est = payload["estimate"]
    return ["## On a GPU: the compiled program", "",
            f"```\n{payload['command']}\n```", "",
            "No GPU has run these steps. XLA:GPU compiles them on this machine for an H100 target "
            "(`adaloss_tools.gpu_program`), and the optimized program says what a device would launch: "
            "kernels (fusions, library calls, copies) and the bytes they move, each kernel attributed "
            "to what it does by the frames XLA keeps (`adaloss_tools.gpu_program.attribute`): a "
            "statistics pass a decision reads, a merge of branches that carry different scales (their "
            "max pass and the rescaled sum written), a rescale on its own, a scalar kernel (a "
            "decision's math; a copy of a per-leaf scalar the gradient returns), or the model's own "
            "backward. At the toy width a step is launch-bound, and the estimated step time follows "
            "the kernel count; at the widths people train, the bytes.", "",
            f"jax {payload['jax']}, widths: " + "; ".join(
                f"{w}: vocab {v['vocab']}, dim {v['dim']}, {v['heads']} heads, seq {v['seq']}, batch "
                f"{v['batch']}" for w, v in payload["widths"].items()) + ". Compiled for an H100 (default "
            "flags; nothing "
            "ran). Kernels and MB: what one run launches and moves (each kernel reading its operands "
            "and writing its results once, the slice of a loop's buffer it reads or updates in place; "
            "a scanned body once per iteration). **Estimated** step time: MB ÷ bandwidth + flops ÷ "
            f"16-bit peak + kernels × {est['h100']['launch'] * 1e6:.0f} µs (H100 "
            f"{est['h100']['bandwidth'] / 1e12:.2f} TB/s, H200 {est['h200']['bandwidth'] / 1e12:.1f} TB/s, "
            f"{est['h100']['peak'] / 1e12:.0f} TFLOP/s). Baselines: the gradient against "
            "`jax.value_and_grad`, the training step against `jmp.DynamicLossScale`, each step "
            "compiled with its state donated (`donate_argnums`), as training loops compile it. "
            f"{payload.get('date', '')}.", "", gpu_table(payload), ""]
