"""The page "When global loss scaling fails" and its summaries, from ``docs/failures.json``
(``benchmarks/failures.py``).

Per case and framework, each method's runs over the seeds: skipped steps, the longest run of
them, the parameters that never moved, the final held-out loss, progress against fp32 and
whether the user was told; then a verdict for adaloss against each other method, computed
from the medians (:func:`verdict`), never written by hand.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

#: how each method is named on the page
NAMES = {
    "fp32": "fp32 (reference)",
    "gradscaler": "`torch.amp.GradScaler`",
    "deepspeed": "DeepSpeed `DynamicLossScaler`",
    "megatron": "Megatron-core `DynamicGradScaler`",
    "fairscale": "fairscale `LayerwiseGradientScaler`",
    "jmp": "`jmp.DynamicLossScale` + `optax.apply_if_finite`",
    "adaloss": "adaloss",
    "adaloss-one-scale": "adaloss, one statistical scale (`layer_rule=False`)",
}
#: final losses (each over fp32's at the same seed) closer than this are a tie
TIE = 0.02


def _issue_link(ref: str) -> str:
    if "#" not in ref or "/" not in ref:
        return ref
    repo, number = ref.split("#", 1)
    return f"[{ref}](https://github.com/{repo}/issues/{number})"


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _span(xs: list[int]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def _runs(rows: list[dict[str, Any]], case: str, framework: str) -> dict[str, list[dict[str, Any]]]:
    """The runs of a case by method, each with ``vs_fp32``: its final loss over fp32's at the
    same seed (``None``: not finite)."""
    ref = {r["seed"]: r["final_loss"] for r in rows
           if r["case"] == case and r["framework"] == framework and r["method"] == "fp32"}
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["case"] == case and r["framework"] == framework:
            if "final_loss" in r:
                f, base = r["final_loss"], ref.get(r["seed"])
                finite = f == f and abs(f) != float("inf") and base
                r = {**r, "vs_fp32": f / base if finite else None}
            out.setdefault(r["method"], []).append(r)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's runs of a case: medians over the seeds, spans, and what was said."""
    if any("unsupported" in r for r in runs):
        return {"unsupported": runs[0]["unsupported"]}
    return {
        "seeds": len(runs),
        "skipped": [r["skipped"] for r in runs],
        "longest": [r["longest_skip_run"] for r in runs],
        "steps": runs[0]["steps"],
        "never_moved": [len(r["never_moved"]) for r in runs],
        "parameters": runs[0]["parameters"],
        "final_loss": _median([r["final_loss"] for r in runs]),
        "vs_fp32": _median([r["vs_fp32"] for r in runs]),
        "diverged": sum(r["vs_fp32"] is None for r in runs),
        "progress": _median([r.get("progress") for r in runs]),
        "told": sum(r["told"] is not None for r in runs),
        "said": next((r["told"] for r in runs if r["told"]), None),
        "crashed": [r["crashed"]["step"] for r in runs if r["crashed"]],
        "crash": next((r["crashed"]["error"] for r in runs if r["crashed"]), None),
    }


def verdict(ada: dict[str, Any], other: dict[str, Any]) -> str:
    """``better``, ``ties`` or ``worse``: adaloss against ``other``, from the summaries. A method
    whose run raised or ended with a non-finite loss (in any seed) loses to one that did not;
    then the median final loss over fp32's (within :data:`TIE`: a tie), then fewer skipped
    steps, then fewer parameters that never moved."""
    fa = bool(ada["crashed"]) or ada["diverged"] > 0
    fo = bool(other["crashed"]) or other["diverged"] > 0
    if fa != fo:
        return "worse" if fa else "better"
    ra, ro = ada["vs_fp32"], other["vs_fp32"]
    if ra is not None and ro is not None and abs(ra - ro) > TIE:
        return "better" if ra < ro else "worse"
    for key in ("skipped", "never_moved"):  # then fewer skipped steps, then fewer frozen parameters
        a, o = _median(ada[key]), _median(other[key])
        if a != o:
            return "better" if a < o else "worse"
    return "ties"


def _fmt(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _table(summaries: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| method | skipped steps | longest run | never moved | final loss | ÷ fp32's | "
             "progress vs fp32 | told |", "|---|---|---|---|---|---|---|---|"]
    for method, s in summaries.items():
        name = NAMES.get(method, method)
        if "unsupported" in s:
            lines.append(f"| {name} | cannot run: {s['unsupported']} | | | | | | |")
            continue
        crashed = (f" (raised at step {_span(s['crashed'])} in {len(s['crashed'])}/{s['seeds']})"
                   if s["crashed"] else "")
        lines.append(f"| {name} | {_span(s['skipped'])} of {s['steps']}{crashed} | {_span(s['longest'])} | "
                     f"{_span(s['never_moved'])} of {s['parameters']} | {_fmt(s['final_loss'], '.3f')} | "
                     f"{_fmt(s['vs_fp32'], '.3f')} | {_fmt(s['progress'])} | {s['told']}/{s['seeds']} |")
    return lines


def _verdicts(summaries: dict[str, dict[str, Any]]) -> tuple[dict[str, str], str]:
    ada = summaries.get("adaloss")
    if ada is None or "unsupported" in ada:
        return {}, ""
    got = {m: verdict(ada, s) for m, s in summaries.items()  # (the ablation: its own section)
           if m not in ("fp32", "adaloss", "adaloss-one-scale") and "unsupported" not in s}
    parts = []
    for word, said in (("better", "better than"), ("ties", "ties"), ("worse", "worse than")):
        ms = [NAMES.get(m, m) for m, v in got.items() if v == word]
        if ms:
            parts.append(f"{said} " + ", ".join(ms))
    return got, "adaloss: " + "; ".join(parts) + "."


def _said(summaries: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for method, s in summaries.items():
        if s.get("said"):
            out.append(f"- {NAMES.get(method, method)}: “{s['said'][:200]}”")
    return out


def page(docs: Path) -> str:
    """The body of ``docs/failures.md``."""
    import json
    data = json.loads((docs / "failures.json").read_text())
    rows, cases = data["rows"], data["cases"]
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    out = [f"Generated from `docs/failures.json`, written by `{data['command'].strip()}` on {data['date']} "
           f"({versions}). Each row: the runs of {len({r['seed'] for r in rows})} seeds (same initialisation "
           "and batches for every method); spans are min–max over the seeds, losses and progress their "
           "medians. *Never moved*: parameters bitwise equal to their initial values at the end. "
           "*Final loss*: on a held-out batch, in fp32; *÷ fp32's*: over fp32's at the same seed; "
           "*progress*: (L0 − L) / (L0 − L_fp32). *Told*: runs in which the method said anything about "
           "skipped steps or its scale (a warning, a log record shown by default, an exception). The "
           "verdict under each table is computed: a run that raised or ended with a non-finite loss "
           f"loses; then the final loss over fp32's (within ±{TIE:.0%}: a tie), then fewer skipped "
           "steps, then fewer parameters that never moved.", ""]
    summary_rows = []
    for name, case in cases.items():
        out += [f"## {case['title']}", "",
                "Reported in " + ", ".join(_issue_link(r) for r in case["reports"]) + ".", "",
                case["mechanism"], ""]
        for framework, methods in data["methods"].items():
            runs = _runs(rows, name, framework)
            if not runs:
                continue
            summaries = {m: summarize(runs[m]) for m in methods if m in runs}
            got, sentence = _verdicts(summaries)
            summary_rows.append((case["title"], framework, got))
            out += [f"**{'PyTorch' if framework == 'torch' else 'JAX'}**", ""] + _table(summaries) + [""]
            if sentence:
                out += [sentence, ""]
            said = _said(summaries)
            if said:
                out += ["What was said (first message):", ""] + said + [""]
        if case.get("note"):
            out += [f"Why: {case['note']}", ""]
    out += ["## Where per-layer scales change the result", "",
            "adaloss against adaloss with one statistical scale for every layer (`layer_rule=False`: the "
            "casts' decisions, the caps and the skipping stay), median progress against fp32 and the most "
            "parameters that never moved, per case:", "",
            "| case | framework | per-layer: progress | never moved | one scale: progress | never moved |",
            "|---|---|---|---|---|---|"]
    for name, case in cases.items():
        for framework in ("torch", "jax"):
            runs = _runs(rows, name, framework)
            if "adaloss" not in runs or "adaloss-one-scale" not in runs:
                continue
            a, o = summarize(runs["adaloss"]), summarize(runs["adaloss-one-scale"])
            out.append(f"| {case['title']} | {framework} | {_fmt(a['progress'])} | {max(a['never_moved'])} | "
                       f"{_fmt(o['progress'])} | {max(o['never_moved'])} |")
    return "\n".join(out)


def _all_verdicts(data: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Per case, adaloss's verdict against every other method of both frameworks."""
    out = {}
    for name in data["cases"]:
        got: dict[str, str] = {}
        for framework, methods in data["methods"].items():
            runs = _runs(data["rows"], name, framework)
            got.update(_verdicts({m: summarize(runs[m]) for m in methods if m in runs})[0])
        out[name] = got
    return out


def line(docs: Path) -> str:
    """One sentence for the README: on how many mechanisms adaloss beats every other scaler,
    ties or beats them, and loses to some (which)."""
    import json
    data = json.loads((docs / "failures.json").read_text())
    verdicts = _all_verdicts(data)
    n = len(verdicts)
    best = sum(all(v == "better" for v in got.values()) for got in verdicts.values())
    held = sum(all(v != "worse" for v in got.values()) for got in verdicts.values())
    lost = [data["cases"][c]["title"].split(":")[0].lower() for c, got in verdicts.items()
            if any(v == "worse" for v in got.values())]
    return (f"adaloss beats every other scaler on {best} of {n} mechanisms, ties or beats them all on "
            f"{held}, and loses to some on {len(lost)}" + (f" ({'; '.join(lost)})" if lost else "") + ".")


def summary(docs: Path) -> str:
    """A few lines for the README and does-it-help: per mechanism, whom adaloss beats, ties and
    loses to (the verdicts of :func:`page`)."""
    import json
    data = json.loads((docs / "failures.json").read_text())
    lines = ["| mechanism | adaloss better than | ties | worse than |", "|---|---|---|---|"]
    for name, got in _all_verdicts(data).items():
        case = data["cases"][name]
        cells = [", ".join(_short(m) for m, v in got.items() if v == w) or "–"
                 for w in ("better", "ties", "worse")]
        lines.append(f"| {case['title']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(method: str) -> str:
    return {"gradscaler": "GradScaler", "deepspeed": "DeepSpeed", "megatron": "Megatron-core",
            "fairscale": "fairscale", "jmp": "jmp"}.get(method, method)
