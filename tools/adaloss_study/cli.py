"""``adaloss-study``: fp32 vs fp16 with no / static / dynamic / adaptive loss scaling.

    adaloss-study                       # char GPT on Shakespeare, JAX, loss ×1e-3, the default methods
    adaloss-study --steps 100 --methods fp32 dynamic adaloss-product --seeds 3
    adaloss-study --overhead            # step-time ratio adaloss / dynamic scaling
    adaloss-study --grad-format float8_e5m2 --spike-at 150   # FP8 gradients, a loss spike mid-run

Prints two tables, each at most 100 columns wide, and a legend of their methods and columns
(final val/train loss, val perplexity, skipped steps; per-layer measured underflow: mean/max
fraction below u_min, the share of layer-steps within ``T``, what the backward carries below
u_min and the largest fraction flushed to zero), and writes ``study.json`` and PNG plots (loss
curves, underflow over steps, per-layer scale heatmaps) to ``--out``, naming each on exit.
Step times are in ``study.json`` only: the methods run one after another (``--overhead``
times them alternately).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from adaloss.config import AdaLossConfig
from adaloss_study import jax_runner, legend, plots
from adaloss_study.jax_runner import (
    DEFAULT_METHODS,
    FP8_METHODS,
    METHODS,
    TORCH_FP8_METHODS,
    RunConfig,
    RunResult,
)
from adaloss_study.tasks import TASKS


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="adaloss-study", description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["jax", "torch"], default="jax",
                    help="jax: jax_adaloss, jmp; torch: torch_bridge, torch.amp.GradScaler")
    ap.add_argument("--task", choices=["shakespeare", "digits"], default="shakespeare",
                    help="shakespeare: char GPT; digits: small CNN on scikit-learn's 8x8 digits")
    ap.add_argument("--methods", nargs="+", choices=(*METHODS, *legend.ALIASES), default=None,
                    help=f"default: {' '.join(DEFAULT_METHODS)}; with an fp8 --grad-format: "
                         f"{' '.join(FP8_METHODS)} (torch: {' '.join(TORCH_FP8_METHODS)})")
    ap.add_argument("--grad-format", choices=["float16", "float8_e5m2", "float8_e4m3fn"], default="float16",
                    help="AdaLossConfig.grad_format; fp8: every method but fp32 computes in bf16 and "
                         "quantizes each layer's cotangent")
    ap.add_argument("--spike-at", type=int, default=None,
                    help="multiply the loss by 1000 for 10 steps from this step (every method)")
    ap.add_argument("--steps", type=int, default=RunConfig.steps)
    ap.add_argument("--batch", type=int, default=RunConfig.batch)
    ap.add_argument("--seq", type=int, default=RunConfig.seq)
    ap.add_argument("--dim", type=int, default=RunConfig.dim)
    ap.add_argument("--layers", type=int, default=RunConfig.layers)
    ap.add_argument("--lr", type=float, default=RunConfig.lr)
    ap.add_argument("--loss-factor", type=float, default=RunConfig.loss_factor,
                    help="multiply the loss by this (small values make fp16 gradients underflow; "
                         "the default 1e-3 is the mean over a 1M-token batch, see the README)")
    ap.add_argument("--adam-eps", type=float, default=RunConfig.adam_eps,
                    help="Adam's eps at loss x1 (runs use adam_eps x loss_factor)")
    ap.add_argument("--growth-interval", type=int, default=None,
                    help="dynamic-grow's growth interval (default: steps // 20)")
    ap.add_argument("--static-scale", type=float, default=RunConfig.static_scale)
    ap.add_argument("--measure-every", type=int, default=RunConfig.measure_every,
                    help="measure per-layer underflow every N steps (0: never)")
    ap.add_argument("--seeds", type=int, default=1, help="repeat with N seeds; report mean ± std")
    ap.add_argument("--u-min", type=float, default=None, help="AdaLossConfig.u_min override")
    ap.add_argument("--accum-bound", type=float, default=None, help="AdaLossConfig.accum_bound")
    ap.add_argument("--layer-bound", type=float, default=None, help="AdaLossConfig.layer_bound")
    ap.add_argument("--update-every", type=int, default=None,
                    help="AdaLossConfig.update_every (PyTorch: --framework torch; JAX refuses > 1)")
    ap.add_argument("--no-underflow-feedback", dest="underflow_feedback", action="store_const", const=False,
                    default=None, help="AdaLossConfig.underflow_feedback=False: the statistical model alone")
    ap.add_argument("--overhead", action="store_true",
                    help="time fp16, dynamic and adaloss-product alternately on the task's model "
                         "(--repeats rounds of --steps steps) and write <out>/overhead.json")
    ap.add_argument("--repeats", type=int, default=7, help="with --overhead: timed rounds per method")
    ap.add_argument("--out", type=Path, default=Path("study_out"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--gallery", action="store_true",
                    help="run the failure-case gallery and write <out>/results.md; with --out docs (in the "
                         "repository) also the generated numbers of README.md and docs/*.md")
    ap.add_argument("--docs", action="store_true",
                    help="rewrite the generated numbers of README.md and docs/*.md (in the current "
                         "directory) from docs/*.json and the gallery's study.json files")
    ap.add_argument("--reuse", action="store_true",
                    help="with --gallery: read the cases' existing study.json instead of rerunning")
    return ap


def _summary(r: RunResult, threshold: float, cfg: RunConfig | None = None) -> dict[str, float]:
    """One run's row: losses, skips, underflow (left below u_min by the scales: mean, max, the
    share of layer-steps at most ``threshold``; held below u_min as carried: mean; flushed to
    zero: max; with fp8, what the casts flushed: max) and step time; with a spike (``cfg``), the
    mean train loss over the spike and the 20 steps after it."""
    rates = np.array([v for step in r.underflow.values() for v in step.values()], float)
    flushed = [v for step in (r.fp8_flushed or r.flushed).values() for v in step.values()]
    carried = [v for step in r.carried.values() for v in step.values()]
    extra = {}
    # fp8: a method whose casts report nothing (fp32, bf16, delayed and torchao scaling) has no
    # flushed fraction to show, not a zero one
    unmeasured = float("nan") if cfg is not None and cfg.adaloss.fp8 else 0.0
    if cfg is not None and cfg.spike_at is not None:
        window = r.train_loss[cfg.spike_at:cfg.spike_at + cfg.spike_steps + 20]
        extra["spike_loss"] = float(np.mean(window)) if window else float("nan")
    return extra | {"train_loss": float(np.mean(r.train_loss[-20:])), "val_loss": r.val_loss,
            "val_ppl": r.val_ppl, "skipped": r.skipped,
            "underflow_mean": float(rates.mean()) if rates.size else 0.0,
            "underflow_max": float(rates.max()) if rates.size else 0.0,
            "within_T": float(np.mean(rates <= threshold)) if rates.size else 1.0,
            "carried_mean": float(np.mean(carried)) if carried else 0.0,
            "flushed_max": float(np.max(flushed)) if flushed else unmeasured, "step_ms": r.step_ms}


#: the study's two console tables: (title, [(summary key, header, format)])
TABLES = (
    ("training", [("spike_loss", "spike loss", ".4f"), ("val_loss", "val loss", ".4f"),
                  ("val_ppl", "val ppl", ".3f"), ("train_loss", "train loss", ".4f"),
                  ("skipped", "skipped", ".0f")]),
    ("per-layer underflow", [("underflow_mean", "under mean", ".2e"), ("underflow_max", "under max", ".2e"),
                             ("within_T", "within T", ".2f"), ("carried_mean", "carried", ".2e"),
                             ("flushed_max", "flushed", ".2e")]),
)


def _cell(vals: np.ndarray, fmt: str) -> str:
    """Mean (and ±std over seeds, one significant digit) of ``vals``; ``–`` where none was measured."""
    if np.isnan(vals).all():
        return "–"
    mean = f"{vals.mean():{fmt}}"
    if len(vals) == 1:
        return mean
    return mean + (f"±{vals.std():.0e}" if "e" in fmt else f"±{vals.std():{fmt}}")


def _table(rows: dict[str, list[dict[str, float]]]) -> str:
    """The study's tables, each at most 100 columns wide: per method (shown by its
    :func:`~adaloss_study.legend.label`), the training columns, then the underflow columns."""
    out = []
    for title, cols in TABLES:
        cols = [c for c in cols if any(c[0] in r for runs in rows.values() for r in runs)]
        cells = {legend.label(m): [_cell(np.array([r[k] for r in runs], float), fmt) for k, _, fmt in cols]
                 for m, runs in rows.items()}
        first = max(len("method"), *(len(m) for m in cells)) + 2
        width = max([len(h) for _, h, _ in cols] + [len(x) for row in cells.values() for x in row]) + 2
        head = f"{'method':<{first}}" + "".join(f"{h:>{width}}" for _, h, _ in cols)
        out += [title, head, "-" * len(head)]
        out += [f"{m:<{first}}" + "".join(f"{x:>{width}}" for x in row) for m, row in cells.items()]
        out.append("")
    return "\n".join(out[:-1])


def write_plots(first: dict[str, RunResult], base: RunConfig, out: Path,
                title: str) -> list[tuple[Path, str]]:
    """The study's PNG plots of the first seed's runs, into ``out``: (path, what it shows)."""
    ada = base.adaloss
    written = [(plots.loss_curves(first, out / "loss.png", title), "train loss per method"),
               (plots.underflow_over_steps(first, out / "underflow.png", ada.threshold),
                "measured underflow per method over training, and T")]
    if ada.fp8:
        written.append((plots.fp8_fractions(first, out / "fp8_fractions.png", base),
                        "what the fp8 casts flushed and saturated"))
    for m, r in first.items():
        if any(r.scales.values()) and "global" not in next(iter(r.scales.values()), {}):
            written.append((plots.scale_heatmap(r, out / f"scales_{m}.png", legend.label(m)),
                            f"{legend.label(m)}'s scale per layer over training"))
    return written


def replot(record: dict[str, Any], out: Path) -> list[tuple[Path, str]]:
    """:func:`write_plots` from a saved ``study.json`` record (what a gallery run reused)."""
    fields = {f.name for f in dataclasses.fields(RunResult)}
    by_step = {f.name for f in dataclasses.fields(RunResult) if f.name not in ("train_loss", "step_seconds",
                                                                               "casts")
               and isinstance(getattr(RunResult("x"), f.name), dict)}
    first = {}
    for m, run in record["runs"].items():
        kept = {k: ({int(s): v for s, v in val.items()} if k in by_step else val)
                for k, val in run.items() if k in fields}
        first[m] = RunResult(**kept)
    config = dict(record["config"])
    base = RunConfig(**{**config, "adaloss": AdaLossConfig(**config["adaloss"])})
    args = record.get("args", {})
    title = f"{args.get('task', 'shakespeare')} ({args.get('framework', 'jax')})"
    return write_plots(first, base, out, title)


def _run_config(args: argparse.Namespace) -> RunConfig:
    overrides = {k: getattr(args, k) for k in ("u_min", "accum_bound", "layer_bound", "update_every",
                                                  "underflow_feedback")
                 if getattr(args, k) is not None}
    return RunConfig(steps=args.steps, batch=args.batch, seq=args.seq, dim=args.dim, layers=args.layers,
                     lr=args.lr, loss_factor=args.loss_factor, adam_eps=args.adam_eps,
                     growth_interval=args.growth_interval, static_scale=args.static_scale,
                     measure_every=args.measure_every, spike_at=args.spike_at,
                     adaloss=AdaLossConfig(grad_format=args.grad_format, **overrides))


def _args_record(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Step-time overhead (:mod:`adaloss_study.overhead`); prints a table, writes ``overhead.json``."""
    from adaloss_study import overhead as oh

    base = _run_config(args)
    result = oh.measure(args.framework, base, TASKS[args.task](base), repeats=args.repeats,
                        steps=min(args.steps, 30))
    result["args"] = _args_record(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1))
    print(f"{args.task}, {args.framework}, {result['parameters']} parameters, {result['machine']}\n"
          f"{oh.table(result)}\nwrote {args.out}/overhead.json")
    return result


def study(args: argparse.Namespace) -> dict[str, Any]:
    """Run every method (× seeds) of ``args``; print the table, write JSON (and plots) to ``args.out``."""
    base = _run_config(args)
    if args.methods is None:
        fp8 = TORCH_FP8_METHODS if args.framework == "torch" else FP8_METHODS
        args.methods = list(fp8 if base.adaloss.fp8 else DEFAULT_METHODS)
    args.methods = list(dict.fromkeys(legend.ALIASES.get(m, m) for m in args.methods))
    for method in args.methods:  # before any run: a wrong one fails at once
        try:
            jax_runner.check_method(method, base, args.framework)
        except ValueError as e:
            raise SystemExit(f"adaloss-study: {e}") from None
    if args.framework == "torch":
        from adaloss_study import torch_runner as runner
    else:
        runner = jax_runner
    task = TASKS[args.task](base)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods}
    first: dict[str, RunResult] = {}
    for seed in range(args.seeds):
        cfg = dataclasses.replace(base, seed=seed)
        val = task.val(seed)
        make = task.torch_model if args.framework == "torch" else task.flax_model
        for method in args.methods:
            result = runner.run(method, cfg, task.train(seed), val, make)
            rows[method].append(_summary(result, base.adaloss.threshold, cfg))
            first.setdefault(method, result)
            print(f"  {legend.label(method):<18} seed {seed}: val loss {result.val_loss:.4f}, "
                  f"skipped {result.skipped}, {result.step_ms:.1f} ms/step", file=sys.stderr)
    ada = base.adaloss
    print(f"\n{args.task}, {args.framework}, {args.steps} steps, batch {args.batch} x {args.seq}, "
          f"loss factor {args.loss_factor:g}, {args.seeds} seed(s)\n{ada.grad_format} gradients, "
          f"threshold T = {ada.threshold:g}, u_min = {ada.underflow_limit:.3g}\n\n{_table(rows)}\n\n"
          + legend.legend(args.methods, args.framework, ada.threshold, ada.underflow_limit,
                          ada.grad_format, base.static_scale, base.growth, base.measure_every,
                          args.seeds))
    record = {"args": _args_record(args),
              "config": dataclasses.asdict(base), "summary": rows,
              "runs": {m: dataclasses.asdict(r) for m, r in first.items()}}
    (args.out / "study.json").write_text(json.dumps(record, indent=1, default=float))
    written = [(args.out / "study.json", "every run's numbers, per step and per layer")]
    if not args.no_plots:
        written += write_plots(first, base, args.out, f"{args.task} ({args.framework})")
    print("\nwrote:\n" + "\n".join(f"  {path}  {what}" for path, what in written))
    return record


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.docs:
        from adaloss_study import doc_blocks

        changed = doc_blocks.refresh_all(Path.cwd())
        print("rewrote " + (", ".join(map(str, changed)) if changed else "nothing: every block is current"))
        return 0
    if args.gallery:
        from adaloss_study import gallery

        path = gallery.write_results(args.out, lambda extra: _dispatch(_parser().parse_args(extra)),
                                     gallery.CASES, reuse=args.reuse, overhead=gallery.OVERHEAD,
                                     fp8=gallery.FP8_CASES)
        print(f"wrote {path}")
        if args.out.resolve() == (Path.cwd() / "docs").resolve():  # the repository's own pages
            from adaloss_study import doc_blocks

            for page in doc_blocks.refresh_all(Path.cwd()):
                print(f"rewrote the generated numbers of {page}")
        return 0
    _dispatch(args)
    return 0


def _dispatch(args: argparse.Namespace) -> dict[str, Any]:
    return overhead(args) if args.overhead else study(args)


if __name__ == "__main__":
    sys.exit(main())
