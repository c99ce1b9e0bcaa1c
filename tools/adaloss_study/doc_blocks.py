"""The measured numbers of ``README.md`` and ``docs/*.md``, written from the generated files.

A page holds a number only inside a block

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

whose text is ``BLOCKS[NAME](docs)``: a function of the committed results alone
(``docs/<case>/study.json`` from ``adaloss-study --gallery``, ``docs/*.json`` from the
benchmarks). ``adaloss-study --docs`` rewrites every block after a rerun;
``tests/test_doc_blocks.py`` fails when a block differs from what its files give. Outside the
blocks a page may state a measured figure only where the same paragraph names the command that
measures it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from adaloss_study import gallery

BEGIN = "<!-- generated: {} -->"
END = "<!-- end generated -->"
_BLOCK = re.compile(r"<!-- generated: (?P<name>[\w-]+) -->\n(?P<body>.*?)\n?<!-- end generated -->", re.S)

#: the study's cases shown outside the results page, with a short label
CASE_LABELS = {"default": "JAX, loss ×1e-3", "deep": "JAX, loss ×1e-8", "overflow": "JAX, loss ×1e3",
               "torch-default": "PyTorch, loss ×1e-3"}


def case_link(name: str, page: str = "results.md") -> str:
    """The link to a study case's section of the results page."""
    return f"{page}#{gallery.case_anchor(name)}"


def _records(docs: Path, names: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    cases = [c.name for c in gallery.CASES] if names is None else list(names)
    return {n: json.loads((docs / n / "study.json").read_text()) for n in cases
            if (docs / n / "study.json").exists()}


def _val(record: dict[str, Any], method: str) -> str:
    rows = record["summary"].get(method)
    if not rows:
        return "–"
    skipped = int(np.mean([r["skipped"] for r in rows]))
    return f"{np.mean([r['val_loss'] for r in rows]):.3f}" + (f" ({skipped} skipped)" if skipped else "")


def _json(docs: Path, name: str) -> Any:
    return json.loads((docs / name).read_text())


def _zoo_spans(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float, int]]:
    from adaloss_zoo.tables import ratio
    out = {}
    for fw in ("jax", "torch"):
        r = [q for q in (ratio(x) for x in rows if x["framework"] == fw) if np.isfinite(q)]
        out[fw] = (min(r), max(r), len(r))
    return out


def readme_results(docs: Path) -> str:
    """The README's table: val loss per method in the study's cases, the zoo in one line, the cost."""
    records = _records(docs, tuple(CASE_LABELS))
    methods = {"fp32": "fp32", "fp16": "fp16", "static": "static 2^15",
               "dynamic": "dynamic (GradScaler / jmp)", "adaloss-product": "adaloss"}
    steps = next(iter(records.values()))["args"]["steps"]
    lines = ["| val loss after " + f"{steps} steps | " + " | ".join(methods.values()) + " |",
             "|---|" + "---|" * len(methods)]
    for name, record in records.items():
        lines.append(f"| [{CASE_LABELS[name]}]({case_link(name, 'docs/results.md')}) | "
                     + " | ".join(_val(record, m) for m in methods) + " |")
    zoo = _json(docs, "zoo.json")
    spans = _zoo_spans(zoo)
    oh_jax = _json(docs, "overhead-jax/overhead.json")["ratio"]["adaloss-product"]
    oh_torch = _json(docs, "overhead-torch/overhead.json")["ratio"]["adaloss-product"]
    verdict = {fw: "a tie" if lo >= 0.95 and hi <= 1.05 else "ahead" if hi <= 1 else "mixed"
               for fw, (lo, hi, _) in spans.items()}
    lines += ["", f"On the [model zoo](docs/does-it-help.md) ({len(zoo)} rows: "
              f"{len({r['model'] for r in zoo})} third-party models × loss and logit factors, one "
              "backward each), adaloss's gradient error over the best global scale's is "
              f"{spans['jax'][0]:.2f}-{spans['jax'][1]:.2f} in JAX ({verdict['jax']}) and "
              f"{spans['torch'][0]:.2f}-{spans['torch'][1]:.2f} in PyTorch ({verdict['torch']}), with "
              f"{max(r['adaloss skipped'] for r in zoo)} skipped passes (the dynamic scale from 2^16: "
              f"up to {max(r['dynamic skipped'] for r in zoo)}). It costs "
              f"{oh_jax:.2f}× `jmp.DynamicLossScale`'s step time in JAX and {oh_torch:.2f}× "
              "`torch.amp.GradScaler`'s in PyTorch on this small model (2-core CPU)."]
    return "\n".join(lines)


def study_cases(docs: Path) -> str:
    """Every study case: final val loss relative to fp32 at the same seed, skipped steps."""
    return "\n".join(gallery.overview_table(_records(docs), page="results.md"))


def zoo_summary(docs: Path) -> str:
    """The zoo benchmark's summary bullets (``docs/zoo.json``)."""
    from adaloss_zoo.tables import summary
    return "\n".join(summary(_json(docs, "zoo.json")))


def threshold(docs: Path) -> str:
    """Measured underflow against T in every case, with and without the measured feedback."""
    lines = gallery._threshold_summary(_records(docs))[4:]  # the table, without heading and intro
    ablation = _records(docs, ("no-feedback", "torch-no-feedback"))
    with_fb = _records(docs, ("default", "torch-default"))
    rows = []
    for (name, off), on in zip(ablation.items(), with_fb.values(), strict=True):
        t = off["config"]["adaloss"]["threshold"]
        a = gallery._held_rows(off, "adaloss-product")
        b = gallery._held_rows(on, "adaloss-product")
        rows.append(f"| {name.replace('no-feedback', '').strip('-') or 'jax'} | "
                    f"{sum(r <= t for _, r, _, _ in a)} of {len(a)} | {sum(r <= t for _, r, _, _ in b)} of "
                    f"{len(b)} | {max(r for _, r, _, _ in a):.2e} | {max(r for _, r, _, _ in b):.2e} |")
    if rows:
        lines += ["The measured feedback, off (`adaloss-study --methods adaloss-product "
                  "--no-underflow-feedback --out docs/no-feedback`, and the same with `--framework torch "
                  "--out docs/torch-no-feedback`) and on (the default and torch-default cases):", "",
                  "| framework | ≤ T without feedback | ≤ T with feedback | worst without | worst with |",
                  "|---|---|---|---|---|", *rows]
    return "\n".join(lines).strip()


def cost(docs: Path) -> str:
    """Step time and compile time against the baselines: the study model, depth, the breakdown."""
    lines = []
    for fw, base in (("jax", "jmp.DynamicLossScale"), ("torch", "torch.amp.GradScaler")):
        r = _json(docs, f"overhead-{fw}/overhead.json")
        ms = r["median_ms"]
        lines.append(f"- **{fw}, the study model** ({r['parameters']:,} parameters): "
                     f"{r['ratio']['adaloss-product']:.2f}× `{base}`'s step time "
                     f"({ms['adaloss-product']:.1f} against {ms['dynamic']:.1f} ms; `{r['machine']}`).")
    depth = [r for r in _json(docs, "depth.json")["rows"]]
    for layout in ("unrolled", "scanned"):
        rows = [r for r in depth if r["layout"] == layout]
        if rows:
            grad = [r["ratio"]["grad_step"] for r in rows]
            comp = [r["ratio"]["compile"] for r in rows]
            lines.append(f"- **JAX, {layout}, {rows[0]['blocks']}-{rows[-1]['blocks']} blocks** "
                         f"(`benchmarks/depth.py`): gradient {min(grad):.2f}-{max(grad):.2f}× "
                         f"`jax.value_and_grad`, compile {min(comp):.2f}-{max(comp):.2f}×.")
    torch_rows = [r for r in depth if r["layout"] == "torch"]
    if torch_rows:
        step = [r["ratio"]["train_step"] for r in torch_rows]
        lines.append(f"- **torch CharGPT, {torch_rows[0]['parameters'] / 1e6:.2f}M-"
                     f"{torch_rows[-1]['parameters'] / 1e6:.2f}M parameters**: "
                     f"{min(step):.2f}-{max(step):.2f}× `torch.amp.GradScaler`'s training step.")
    breakdown = _json(docs, "cost_breakdown.json")["rows"]
    for r in breakdown:
        v = {x["name"]: x for x in r["variants"]}
        stats_free = next(x for x in r["variants"] if x["name"] not in ("jax", "adaloss"))
        lines.append(f"- **Breakdown, {r['blocks']} blocks {r['layout']}** "
                     f"(`benchmarks/cost_breakdown.py`): gradient "
                     f"{v['adaloss']['step_ms'] / v['jax']['step_ms']:.2f}× `jax.value_and_grad`, "
                     f"{stats_free['step_ms'] / v['jax']['step_ms']:.2f}× with every statistic free.")
    if (docs / "gpu_cost.json").exists():
        lines += gpu_cost_summary(docs)
    if (docs / "torch_step.json").exists():
        lines += torch_ops_summary(docs)
    return "\n".join(lines)


#: ``benchmarks/torch_step.py``'s methods: the default (its decisions compiled once the shapes
#: hold) and op by op (``fuse_decisions=False``) on host scalars and on device tensors
DEFAULT, HOST, DEVICE = "AdaLossScaler", "AdaLossScaler, op by op", "AdaLossScaler, device math"


def torch_ops_summary(docs: Path) -> list[str]:
    """The aten ops a PyTorch training step dispatches (each one or more GPU kernels),
    ``AdaLossScaler`` against ``torch.amp.GradScaler`` (``docs/torch_step.json``), the step
    time with bf16 autocast (``docs/torch_step_bf16.json``) and the bytes and time at GPT-2
    small's widths (``docs/torch_step_gpt2.json``)."""
    payload = _json(docs, "torch_step.json")
    rows = payload["rows"]

    def span(method: str) -> str:
        got = [r["ops"][method] / r["ops"]["GradScaler"] for r in rows if method in r["ops"]]
        lo, hi = f"{min(got):.2f}", f"{max(got):.2f}"
        return f"{lo}×" if lo == hi else f"{lo}-{hi}×"
    names = f"{rows[0]['model']} to {rows[-1]['model']}" if len(rows) > 1 else rows[0]["model"]
    dtype = payload.get("dtype", "float16")
    parts = []
    if all(DEFAULT in r["ops"] for r in rows):
        calls = sorted({f"{r['compiled_calls'].get(DEFAULT, 0) / r['decisions']:.1f}" for r in rows},
                       key=float)
        per = "-".join(calls[::len(calls) - 1] if len(calls) > 1 else calls)
        parts.append(f"the default, its decisions compiled once the shapes hold (a call per layer, cast "
                     f"and merge, one for the weights), {span(DEFAULT)} plus {per} compiled calls per "
                     "layer or cast (one kernel each on a CPU, a few on a GPU)")
    if all(HOST in r["ops"] for r in rows):
        parts.append(f"op by op on host scalars (a CPU's path until the shapes hold, or where they "
                     f"vary) {span(HOST)}")
    if all(DEVICE in r["ops"] for r in rows):
        parts.append(f"op by op on device tensors (a GPU's) {span(DEVICE)}")
    out = [f"- **torch, HF {names}, aten ops per training step** (`{payload['command']}`, "
           f"{dtype}; each op is one or more kernels on a GPU), ÷ `torch.amp.GradScaler`'s: "
           + "; ".join(parts) + "."]
    if all(DEFAULT in r.get("run_mean_ms", {}) for r in rows):  # what a short run sees
        cells = [f"{r['model']} mean {r['run_mean_ms'][DEFAULT] / r['run_mean_ms']['GradScaler']:.2f}×, "
                 f"median {r['run_median_ms'][DEFAULT] / r['run_median_ms']['GradScaler']:.2f}×"
                 for r in rows]
        warm = rows[0]["warmup_ms"][DEFAULT]
        stall = warm.index(max(warm)) + 1  # the step that compiled
        out.append(f"- **torch, the same models, a fresh scaler's first {payload['run_steps']} steps** "
                   f"(the same command, `{payload['machine']}`; the default compiles its decisions at "
                   f"step {stall} of them, a one-time stall), ÷ `torch.amp.GradScaler`'s: "
                   + "; ".join(cells) + ".")
    if (docs / "torch_step_bf16.json").exists():  # bf16 GEMMs: fast on a CPU, as fp16's are on a GPU
        bf16 = _json(docs, "torch_step_bf16.json")
        cells = []
        for r in bf16["rows"]:
            t = r["median_ms"]
            cells.append(f"{r['model']} " + ", ".join(f"{t[m] / t['GradScaler']:.2f}× {label}" for m, label in
                                                      ((DEFAULT, "default"), (HOST, "op by op")) if m in t))
        out.append(f"- **torch, the same models, step time with bf16 autocast** (`{bf16['command']}`, "
                   f"`{bf16['machine']}`), ÷ `torch.amp.GradScaler`'s: {'; '.join(cells)}.")
    if (docs / "torch_step_gpt2.json").exists():  # the widths people train: bytes decide
        wide = _json(docs, "torch_step_gpt2.json")
        for r in wide["rows"]:
            b, t, warm = r["bytes"], r["median_ms"], r.get("warmup_ms", {})
            label = {DEFAULT: "the default (its decisions compiled)", HOST: "op by op on host scalars",
                     DEVICE: "op by op on device tensors"}
            cells = [f"{label.get(m, m)} {b[m] / b['GradScaler']:.2f}× the bytes, "
                     f"{t[m] / t['GradScaler']:.2f}× the time" for m in b if m != "GradScaler"]
            line = (f"- **torch at GPT-2 small's widths, {r['model']}** (`{wide['command']}`, "
                    f"`{wide['machine']}`; bytes: what the step's aten ops and compiled calls read and "
                    f"write, {b['GradScaler'] / 1e9:.1f} GB for `torch.amp.GradScaler`): " + "; ".join(cells))
            if DEFAULT in warm:
                line += (f"; the default's slowest warm-up step (the one that compiles its decisions) "
                         f"{max(warm[DEFAULT]) / 1e3:.1f} s, against {t[DEFAULT] / 1e3:.1f} s a step after")
            out.append(line + ".")
    return out


def departures(docs: Path) -> str:
    """The default against the paper's settings on the zoo (``docs/departures.json``)."""
    result = _json(docs, "departures.json")
    rows = result["rows"]
    variants = list(dict.fromkeys(v for r in rows for v in r["median"]))

    def cell(r: dict[str, Any], v: str) -> str:
        if v not in r["median"]:
            return "–"
        return f"{r['median'][v]:.3g}" + (f" ({r['skipped'][v]} skipped)" if r["skipped"][v] else "")

    lines = ["| framework | model | loss × | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    lines += [f"| {r['framework']} | {r['model']} | {r['factor']:g} | "
              + " | ".join(cell(r, v) for v in variants) + " |" for r in rows]
    lines.append("")
    for v in variants[1:]:
        rel = [r["median"][v] / r["median"]["default"] for r in rows
               if v in r["median"] and r["median"]["default"] > 0]
        top = f"{max(rel):.0f}" if max(rel) >= 10 else f"{max(rel):.2f}"
        lines.append(f"- **{v} / default**: median {np.median(rel):.2f}×, range {min(rel):.2f}-"
                     f"{top}×; worse than the default by more than 5 % on "
                     f"{sum(x > 1.05 for x in rel)} of {len(rel)} rows.")
    return "\n".join(lines)


def skips(docs: Path) -> str:
    """Skipped steps training the zoo, adaloss against a global dynamic scale (``docs/skips.json``):
    the runs where either skipped a step, and a count of the others."""
    result = _json(docs, "skips.json")
    rows = result["rows"]

    def cell(r: dict[str, Any], m: str) -> str:
        return f"{r['skipped'][m]} ({r['in_a_row'][m]} in a row)" if r["skipped"][m] else "0"

    shown = [r for r in rows if r["skipped"]["adaloss"] or r["skipped"]["dynamic"]]
    lines = ["| framework | model | loss × | adaloss | dynamic scale |", "|---|---|---|---|---|"]
    lines += [f"| {r['framework']} | {r['model']} | {r['factor']:g} | {cell(r, 'adaloss')} | "
              f"{cell(r, 'dynamic')} |" for r in shown]
    models = len({(r["framework"], r["model"]) for r in rows})
    factors = ", ".join(f"×{f:g}" for f in dict.fromkeys(r["factor"] for r in rows))
    worse = sum(r["skipped"]["adaloss"] > r["skipped"]["dynamic"]
                or r["in_a_row"]["adaloss"] > r["in_a_row"]["dynamic"] for r in rows)
    lines += ["", f"{len(rows)} runs of {rows[0]['steps']} steps ({models} models at loss {factors}); "
              f"neither skipped a step in the {len(rows) - len(shown)} runs not shown. adaloss skipped "
              f"{sum(r['skipped']['adaloss'] for r in rows)} steps in all, the dynamic scale "
              f"{sum(r['skipped']['dynamic'] for r in rows)}; adaloss skipped more (in all or in a row) "
              f"on {worse} of {len(rows)} runs."]
    return "\n".join(lines)


def fp8(docs: Path) -> str:
    """The FP8 benchmark (``docs/fp8.json``): its summaries and tables."""
    from adaloss_zoo.fp8_tables import section
    return "\n".join(section(_json(docs, "fp8.json"))).rstrip("\n")


def gpu_program(docs: Path) -> str:
    """The GPU program of the FP8 steps, H100 target (``docs/gpu_program.json``, written by
    ``python benchmarks/gpu_program.py``): the MLP's table, the LM's counts, the bytes."""
    rows = [r for r in _json(docs, "gpu_program.json")["rows"] if r["target"] == "h100"]

    def get(model: str, method: str, pipeline: str) -> dict[str, Any]:
        return next(r for r in rows if (r["model"], r["method"], r["pipeline"]) == (model, method, pipeline))

    def conv(r: dict[str, Any]) -> str:
        c, j = r["converts"], r["jaxpr_casts"]
        return f"{c['f8e4m3fn']} ({j['f8e4m3fn']}) / {c['f8e5m2']} ({j['f8e5m2']})"

    def ratio(a: dict[str, Any], b: dict[str, Any], key: str = "kernel_bytes") -> str:
        return f"{a[key] / b[key]:.2f}×"
    lines = ["| method | pipeline | e4m3 / e5m2 converts (the jaxpr's) | GEMMs: FP8 / all (reading fp8) "
             "| kernels | MB moved (XLA's count) | second passes e4m3 / e5m2 | temp MB |",
             "|---|---|---|---|---|---|---|---|"]
    for method in ("jax.value_and_grad", "flax Fp8DotGeneralOp", "adaloss", "current", "one scale",
                   "adaloss e4m3 operands", "current e4m3 operands"):
        for pipeline in ("triton", "cublas"):
            r = get("mlp", method, pipeline)
            sp = r["second_passes"]
            lines.append(f"| {method} | {pipeline} | {conv(r)} | {r['fp8_gemms']} / {r['gemms']} "
                         f"({r['gemms_reading_fp8']}) | {r['kernels']} | {r['kernel_bytes'] / 1e6:.1f} "
                         f"({r['bytes_accessed'] / 1e6:.1f}) | {sp['f8e4m3fn']} / {sp['f8e5m2']} | "
                         f"{r['temp_bytes'] / 1e6:.1f} |")
    lm = {m: (get(m, "adaloss", "triton"), get(m, "adaloss e4m3 operands", "triton"))
          for m in ("lm-unrolled", "lm-scanned")}

    def kept(r: dict[str, Any], fmt: str, what: str) -> str:
        """How many of the jaxpr's casts to ``fmt`` the program keeps; more converts than casts are
        copies (only those casts convert to ``fmt``): XLA repeated a cast in fusions that read it."""
        c, j = r["converts"][fmt], r["jaxpr_casts"][fmt]
        return f"{c} of the jaxpr's {j} {what}" if c <= j else \
            f"the jaxpr's {j} {what} as {c} converts (XLA repeats some in the fusions that read them)"

    def lm_text(model: str) -> str:
        grads, both = lm[model]
        return (f"{kept(grads, 'f8e5m2', 'cotangent casts')} and, with e4m3 "
                f"operands, {both['fp8_gemms']} FP8 GEMMs of {both['gemms']} (the other "
                f"{both['gemms'] - both['fp8_gemms']} multiply activations: attention), keeping "
                f"{kept(both, 'f8e4m3fn', 'operand casts')}")

    def passes(model: str, method: str) -> str:
        t, c = get(model, method, "triton"), get(model, method, "cublas")
        return (f"{t['second_passes']['f8e5m2']} (Triton) and {c['second_passes']['f8e5m2']} (cuBLAS) "
                f"of its {t['jaxpr_casts']['f8e5m2']} casts, {t['own_max']} of which read their own max")
    blocks = _json(docs, "gpu_program.json")["lm"]["blocks"]
    flax, ada, cur = (get("mlp", m, "cublas") for m in ("flax Fp8DotGeneralOp", "adaloss", "current"))
    both = get("mlp", "adaloss e4m3 operands", "cublas")

    def vs_current(model: str) -> str:
        return ", ".join(f"{ratio(get(model, 'adaloss', p), get(model, 'current', p))} ({name})"
                         for p, name in (("triton", "Triton"), ("cublas", "cuBLAS")))
    lines += ["", f"- The depth benchmark's LM ({blocks} blocks, fp16 forward), Triton pipeline: unrolled, "
              f"{lm_text('lm-unrolled')}; scanned (a loop body counted once), {lm_text('lm-scanned')}. "
              "Every GEMM with a weight reads fp8 values; the operand casts XLA drops are dead or "
              "duplicate ones.",
              f"- Second passes over a cotangent, LM unrolled: current scaling makes "
              f"{passes('lm-unrolled', 'current')}; adaloss {passes('lm-unrolled', 'adaloss')}.",
              f"- MB moved, adaloss's e5m2 gradients against current scaling's: MLP "
              f"{vs_current('mlp')}; LM unrolled {vs_current('lm-unrolled')}. Against flax's FP8 "
              f"step (cuBLAS): {ratio(ada, flax)} its bytes and {ratio(ada, flax, 'temp_bytes')} its "
              f"temporary memory; with e4m3 operands (the same work as flax's) {ratio(both, flax)} and "
              f"{ratio(both, flax, 'temp_bytes')}. adaloss's temporary memory is "
              f"{ratio(ada, cur, 'temp_bytes')} current scaling's (cuBLAS)."]
    return "\n".join(lines)


def gpu_cost_summary(docs: Path) -> list[str]:
    """The default's GPU-program rows in a line per width and program, for the does-it-help page."""
    table = _json(docs, "gpu_cost.json")["ratios"]
    out = []
    for program, base in (("gradient", "`jax.value_and_grad`"), ("step", "`jmp.DynamicLossScale`")):
        for width in dict.fromkeys(r["width"] for r in table):
            rows = [r for r in table if (r["width"], r["config"], r["layout"], r["program"])
                    == (width, "fp16", "unrolled", program)]
            for r in rows:
                out.append(f"- **JAX on an H100, the compiled program, {width} width, {r['blocks']} blocks "
                           f"unrolled, {program}** (`benchmarks/gpu_cost.py`, no device): bytes moved "
                           f"{r['bytes']:.2f}× {base}'s, kernels {r['kernels']:.2f}×, estimated step time "
                           f"{r['estimate_h100']:.2f}×.")
    return out


def fp8_depth(docs: Path) -> str:
    """Per-layer scales against one scale, current and delayed scaling in FP8 at depth
    (``docs/fp8_depth.json``, written by ``python benchmarks/fp8_depth.py``)."""
    from adaloss_zoo.fp8_tables import depth_summary, depth_table
    payload = _json(docs, "fp8_depth.json")
    return "\n".join([depth_table(payload), "", *depth_summary(payload)])


def torch_fp8(docs: Path) -> str:
    """FP8 GEMMs in PyTorch, adaloss against torchao and bf16: step time and error
    (``docs/torch_fp8.json``, written by ``python benchmarks/torch_fp8.py``)."""
    from adaloss_zoo.fp8_tables import gemm_summary, gemm_table
    payload = _json(docs, "torch_fp8.json")
    gemms = (", each fp8 GEMM a bf16 stand-in (its time left out of the time outside the GEMMs; the "
             "errors from the real `torch._scaled_mm`)" if payload.get("gemm") == "stand-in" else "")
    head = (f"`{payload['command']}`, `{payload['machine']}`, batch {payload['batch']} × {payload['seq']} "
            f"tokens, median of {payload['repeats']} alternating rounds{gemms}:")
    return "\n".join([head, "", gemm_table(payload), "", *gemm_summary(payload)])


def _summary(fn: Callable[..., Any]) -> str:
    """The first sentence of ``fn``'s docstring, on one line, its reST literals in Markdown."""
    text = " ".join((fn.__doc__ or "").split()).replace("``", "`")
    text = re.sub(r":(func|meth|class):`~?([\w.]+)`", r"`\2`", text.split(". ")[0].rstrip("."))
    return text.replace("|", "\\|")  # a table cell


def rules(docs: Path) -> str:
    """The rule tables each front dispatches on, read from the code (``docs`` unused): JAX's per
    primitive and per decision kind (``jax_adaloss.trace``, ``jax_adaloss.layers``), torch's
    per autograd node name (``torch_bridge.graph``) and per node kind (``torch_bridge.layers``)."""
    from jax_adaloss import layers, regions, trace

    try:
        from torch_bridge import graph
        from torch_bridge import layers as torch_layers
    except ImportError as e:
        raise RuntimeError("the design page's rule table reads torch_bridge: "
                           "pip install -e '.[torch]'") from e

    def names(xs: Any) -> str:
        return ", ".join(f"`{x}`" for x in sorted(xs))

    rows = ["| front | matched by | what the backward does there | rule |", "|---|---|---|---|"]
    by_rule: dict[Any, list[str]] = {}
    for prim, rule in trace.CLASSIFY.items():
        by_rule.setdefault(rule, []).append(prim)
    for rule, prims in by_rule.items():
        rows.append(f"| JAX | {names(prims)} | {_summary(rule)} | `trace.Tape.{rule.__name__}` |")
    def by_kind(front: str, table: dict[str, Any], owner: str) -> list[str]:
        out = []
        for kind, (wide, fp8) in table.items():
            rule = f"`{owner}.{wide.__name__}`" + ("" if fp8 is wide else f"; fp8: `{fp8.__name__}`")
            out.append(f"| {front} | node kind `{kind}` | {_summary(wide)} | {rule} |")
        return out

    rows += by_kind("JAX", layers.SWEEP, "jax_adaloss.layers")
    kinds = {**{p: p for p in trace.REGION_FORWARD}, **dict.fromkeys(trace._REMAT, "remat")}
    for kind, rule in regions.REGIONS.items():
        start = trace.REGION_FORWARD.get(kind)
        rows.append(f"| JAX | {names(p for p, k in kinds.items() if k == kind)} with layers inside | "
                    f"{_summary(rule)} | {'' if start is None else f'`trace.Tape.{start.__name__}`; '}"
                    f"`jax_adaloss.regions.{rule.__name__}` |")
    for what, xs in (("a layer: a matmul or convolution of a weight and data", [*graph._MATMUL, graph._CONV]),
                     ("a cast: the cotangent narrowed", [graph._CAST]),
                     ("a scalar factor: the scale lowered where the product would overflow",
                      graph._SCALAR_OPERAND),
                     ("an opaque region: one scale in, its dynamic scale out", graph._REGIONS),
                     ("a fused RNN: one layer decision for every time step's matmuls", graph.FUSED_RNN),
                     ("a normalization (fp8: the next cast fits its own tensor)", graph._NORMS),
                     ("an indexed read (an embedding): how a weight is found", graph._LOOKUP)):
        rows.append(f"| PyTorch | {names(xs)} | {what} | `torch_bridge/graph.py` |")
    rows += by_kind("PyTorch", torch_layers.RULES, "torch_bridge.layers")
    return "\n".join(rows)


def failures(docs: Path) -> str:
    """The page "When global loss scaling fails" (``docs/failures.json``)."""
    from adaloss_study import failure_tables
    return failure_tables.page(docs)


def failures_summary(docs: Path) -> str:
    """Per failure mechanism, whom adaloss beats, ties and loses to (``docs/failures.json``)."""
    from adaloss_study import failure_tables
    return failure_tables.summary(docs)


def failures_line(docs: Path) -> str:
    """One sentence: where adaloss beats, ties and loses to the other scalers (``docs/failures.json``)."""
    from adaloss_study import failure_tables
    return failure_tables.line(docs)


def coverage(docs: Path) -> str:
    """The coverage table: what adaloss does with every layer type (``docs/coverage.json``)."""
    from adaloss_zoo import coverage as cov
    return cov.page(_json(docs, "coverage.json"))


def coverage_line(docs: Path) -> str:
    """One sentence: how many layer types are probed, by status (``docs/coverage.json``)."""
    from adaloss_zoo import coverage as cov
    return cov.line(_json(docs, "coverage.json"))


BLOCKS: dict[str, Callable[[Path], str]] = {
    "coverage": coverage,
    "coverage-line": coverage_line,
    "readme-results": readme_results,
    "failures": failures,
    "failures-summary": failures_summary,
    "failures-line": failures_line,
    "study-cases": study_cases,
    "zoo-summary": zoo_summary,
    "threshold": threshold,
    "cost": cost,
    "departures": departures,
    "skips": skips,
    "fp8": fp8,
    "gpu-program": gpu_program,
    "fp8-depth": fp8_depth,
    "torch-fp8": torch_fp8,
    "rules": rules,
}


def blocks(text: str) -> list[tuple[str, str]]:
    """The ``(name, body)`` of every generated block in ``text``."""
    return [(m["name"], m["body"]) for m in _BLOCK.finditer(text)]


def stale(text: str, docs: Path) -> list[str]:
    """The names of the blocks in ``text`` whose body differs from what the files under ``docs`` give."""
    return [name for name, body in blocks(text) if name not in BLOCKS or body != BLOCKS[name](docs)]


def refresh(text: str, docs: Path) -> str:
    """``text`` with every generated block rewritten from the files under ``docs``."""
    def one(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in BLOCKS:
            raise KeyError(f"unknown generated block {name!r}; known: {sorted(BLOCKS)}")
        return f"{BEGIN.format(name)}\n{BLOCKS[name](docs)}\n{END}"
    return _BLOCK.sub(one, text)


def pages(root: Path) -> list[Path]:
    """The README and the documentation's pages under ``root``."""
    return [root / "README.md", *sorted(p for p in (root / "docs").rglob("*.md") if "_build" not in p.parts)]


def refresh_all(root: Path) -> list[Path]:
    """Rewrite the generated blocks of every page under ``root`` (from ``root/docs``); the changed pages."""
    changed = []
    for page in pages(root):
        old = page.read_text()
        new = refresh(old, root / "docs")
        if new != old:
            page.write_text(new)
            changed.append(page)
    return changed
