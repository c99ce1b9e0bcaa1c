"""Markdown tables of ``benchmarks/depth.py``'s rows (its JSON), for the console and the results page."""

from __future__ import annotations

from typing import Any

from adaloss_study.commands import benchmark_command

_FLAGS = ("blocks", "dim", "heads", "seq", "batch", "vocab", "repeats", "steps", "train_blocks", "layouts")


def command(args: dict[str, Any]) -> str:
    """The command line that wrote a JSON with these ``args``."""
    return benchmark_command("benchmarks/depth.py", _FLAGS, args)


def torch_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per depth, AdaLossScaler / GradScaler."""
    lines = ["| blocks | params | first step (s) | train step (ms) |", "|---|---|---|---|"]
    for r in rows:
        f, ms = r["first_step_s"], r["median_ms"]
        lines.append(f"| {r['blocks']} | {r['parameters'] / 1e6:.2f}M | {r['ratio']['first_step']:.2f}× "
                     f"({f['adaloss-product']:.2f} vs {f['dynamic']:.2f}) | {r['ratio']['train_step']:.2f}× "
                     f"({ms['adaloss-product']:.1f} vs {ms['dynamic']:.1f}) |")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per depth, adaloss / baseline ratios and the absolute seconds/ms."""
    lines = ["| blocks | layout | params | trace | compile (s) | HLO ops | bytes | temp mem | grad step | "
             "train compile | train step (ms) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q, g, ms = r["ratio"], r["grad"], r["median_ms"]
        train = (f"{q['train_compile']:.2f}× | {q['train_step']:.2f}× ({ms['step_ada']:.1f} vs "
                 f"{ms['step_dyn']:.1f})") if "train_step" in q else "– | –"
        lines.append(
            f"| {r['blocks']} | {r['layout']} | {r['parameters'] / 1e6:.2f}M | {q['trace']:.2f}× | "
            f"{q['compile']:.2f}× "
            f"({g['adaloss']['compile_s']:.1f} vs {g['jax']['compile_s']:.1f}) | {q['hlo_ops']:.2f}× | "
            f"{_ratio(q.get('bytes'))} | "
            f"{q['temp_memory']:.2f}× | {q['grad_step']:.2f}× ({ms['grad_ada']:.1f} vs "
            f"{ms['grad_jax']:.1f}) | {train} |")
    return "\n".join(lines)


def section(result: dict[str, Any]) -> list[str]:
    """The results page's section from the benchmark's JSON."""
    a = result["args"]
    rows = result["rows"]
    out = ["## Depth: compile and step time from 2 to 32 blocks", "", f"```\n{command(a)}\n```", "",
           f"Linen pre-LayerNorm transformer LM, dim {a['dim']}, {a['heads']} heads, seq {a['seq']}, "
           f"batch {a['batch']}, fp16 compute; unrolled (a Python loop) or scanned (`nn.scan`). "
           "Ratios are adaloss / baseline: the gradient against `jax.value_and_grad`, the training "
           "step (gradient, unscaling, skip, Adam) against `jmp.DynamicLossScale`, timed in "
           f"alternation (median of {a['repeats']} rounds of {a['steps']} calls); training steps up "
           f"to {a['train_blocks']} blocks; bytes: what the compiled gradient's instructions read "
           "and write, by XLA's cost analysis (a scanned body counted once). "
           f"`{result.get('machine', '')}`; a shared 2-core CPU, noisy "
           "(compare ratios, not absolute times).", ""]
    out += [table([r for r in rows if r["layout"] != "torch"]), ""]
    torch_rows = [r for r in rows if r["layout"] == "torch"]
    if torch_rows:
        out += ["The study's torch CharGPT at the same sizes, autocast fp16: `AdaLossScaler` against "
                "`torch.amp.GradScaler` (first step: graph planning; median training step).", "",
                torch_table(torch_rows), ""]
    return out
