"""PyTorch's training step under AdaLossScaler against torch.amp.GradScaler: aten ops dispatched
per step (each one or more GPU kernels) and CPU step time, on HF GPT-2.

    python benchmarks/torch_step.py                  # docs/torch_step.json, table printed
    python benchmarks/torch_step.py --repeats 3 --dtype bfloat16 --json docs/torch_step_bf16.json
    python benchmarks/torch_step.py --models gpt2-2x128 --repeats 3 --json /tmp/torch_step.json

Models (``transformers.GPT2LMHeadModel``, vocab 1000, 64 positions): ``gpt2-2x128`` (the torch
zoo's ``hf-gpt2``: 2 layers × 128), ``gpt2-4x256`` and ``gpt2-6x384`` (≥ 1M parameters); and at
GPT-2 small's widths, ``gpt2-2x768-v32k`` (2 layers × 768, 12 heads, vocab 32768: the
vocabulary's tensors weigh most) and ``gpt2-12x768-v32k`` (GPT-2 small's 12 layers); run them
with ``--batch 4 --seq 512``. A step:
fp16 autocast forward on a batch of ``--batch`` × ``--seq`` tokens, the scaler's scaled backward,
``scaler.step(AdamW)``, ``scaler.update()``, ``zero_grad``. ``AdaLossScaler``: the default
(``fuse_decisions="auto"``: each decision, its statistics, math and rescale, one
inductor-compiled call once ``STEADY_AFTER`` backwards met the same shapes; warmed up past
that, each warm-up step's time kept: the step that compiles is the first-run cost);
``AdaLossScaler, op by op``: ``fuse_decisions=False``, the scalar decisions on NumPy scalars (a
CPU's path before the shapes hold, or where they vary); ``AdaLossScaler, device math``: op by op
on 0-d tensors (``host_math=False``), as on a GPU, where each is a kernel. ``--dtype
bfloat16``: bf16 autocast and gradients (on a CPU without fp16 GEMM kernels, whose fp16 GEMMs
dominate the step). ``--device cuda``: on a
GPU (each step synchronized), the device check the compiled decisions have not had yet. Ops: every
aten op dispatched in one step (a ``TorchDispatchMode`` counting them, views included, the
backward's too; a compiled call counts as the ops it launches itself), the mean of 3 steps;
bytes: what those ops read and write (each op its tensor arguments and results once, a view
nothing; a compiled call its arguments and results), the machine-independent cost at widths
where a step is bound by memory traffic;
per layer: adaloss's ops beyond GradScaler's over the layers the scaler decides for. Time:
the methods alternating ``--repeats`` rounds of ``--steps`` steps, the median ms/step; and a
fresh scaler's first ``--run-steps`` (30) steps, each timed, the compile included: their mean
beside their median (what a short run sees, and what a long one does).

Not a test: ``tests/test_study_cli.py`` runs a tiny preset.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

import torch_bridge
from adaloss_study.overhead import machine

#: name -> (layers, width, vocab, positions)
MODELS = {"gpt2-2x128": (2, 128, 1000, 64), "gpt2-4x256": (4, 256, 1000, 64),
          "gpt2-6x384": (6, 384, 1000, 64), "gpt2-2x768-v32k": (2, 768, 32768, 1024),
          "gpt2-12x768-v32k": (12, 768, 32768, 1024)}
METHODS = ("GradScaler", "AdaLossScaler", "AdaLossScaler, op by op", "AdaLossScaler, device math")


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree`` (lists, tuples, dicts), each distinct tensor once (a
    sparse tensor: its indices and values)."""
    seen: set[int] = set()
    total = 0
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            if x.is_sparse:
                stack.extend([x._indices(), x._values()])
            elif x.device.type != "meta":
                total += x.numel() * x.element_size()
    return total


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (by name), and the bytes they move:
    each op reads its tensor arguments and writes its tensor results once (an in-place op reads
    and writes its tensor), a view moves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.bytes += tensor_bytes((args, kwargs or {})) + tensor_bytes(out)
        return out


def build(name: str, seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    layers, dim, vocab, positions = MODELS[name]
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=dim, n_layer=layers,
                                      n_head=max(4, dim // 64)))


def stepper(name: str, method: str, batch: int, seq: int, dtype: torch.dtype = torch.float16,
            device: str = "cpu", run_steps: int = 30) -> tuple[Callable[[], None], Any, list[float]]:
    """One training step of ``method`` on a fresh copy of the model on ``device``, its scaler,
    and the ms of each of its first steps, at least ``run_steps`` (the scaler's plan, the
    optimizer's state, and for the default the steps before and at which its decisions
    compile); the step returns once the device has finished it."""
    model = build(name).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = torch_bridge.AdaLossConfig(grad_format=str(dtype).removeprefix("torch."))
    kind = torch.device(device).type
    scaler = (torch.amp.GradScaler(kind) if method == "GradScaler" else
              torch_bridge.AdaLossScaler(model, config, host_math="device math" not in method,
                                         **({} if method == "AdaLossScaler" else {"fuse_decisions": False})))
    tokens = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODELS[name][2], (batch, seq), generator=tokens).to(device)

    def step() -> None:
        with torch.autocast(kind, dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if kind == "cuda":
            torch.cuda.synchronize()
    fused = getattr(getattr(scaler, "_schedule", None), "fused", None)
    warmup = []
    for _ in range(max(run_steps, 2 + (fused.steady_after if fused is not None else 0))):
        t0 = time.perf_counter()
        step()
        warmup.append(1e3 * (time.perf_counter() - t0))
    assert fused is None or scaler._schedule.active, "the default scaler did not compile its decisions"
    return step, scaler, warmup


def count_ops(step: Callable[[], None], scaler: Any, steps: int = 3) -> tuple[Counter[str], float, float]:
    """Per step: the aten ops dispatched (by name), the calls of compiled decisions (what
    ``fuse_decisions`` runs instead of ops: no op a dispatch mode sees, each one kernel on a CPU
    and a few on a GPU), and the bytes both move (a compiled call: its tensor arguments read
    once and its results written once)."""
    fused = getattr(getattr(scaler, "_schedule", None), "fused", None)
    calls = 0
    moved = 0
    if fused is not None:
        run = fused._run

        def counted(fn: Any, static: Any, args: Any, **kwargs: Any) -> Any:
            nonlocal calls, moved
            out = run(fn, static, args, **kwargs)
            if out is not None:  # (None: not compiled; the ops then ran under the counter)
                calls += 1
                moved += tensor_bytes(args) + tensor_bytes(out)
            return out
        fused._run = counted
    try:
        with OpCounter() as c:
            for _ in range(steps):
                step()
    finally:
        if fused is not None:
            del fused._run
    return Counter({k: v / steps for k, v in c.ops.items()}), calls / steps, (c.bytes + moved) / steps


def measure(name: str, batch: int, seq: int, repeats: int, steps: int, methods: tuple[str, ...] = METHODS,
            dtype: torch.dtype = torch.float16, device: str = "cpu", run_steps: int = 30) -> dict[str, Any]:
    made = {m: stepper(name, m, batch, seq, dtype, device, run_steps) for m in methods}
    runs = {m: (step, scaler) for m, (step, scaler, _) in made.items()}
    counted = {m: count_ops(step, scaler) for m, (step, scaler) in runs.items()}
    ops = {m: c for m, (c, _, _) in counted.items()}
    rounds: dict[str, list[float]] = {m: [] for m in methods}
    for _ in tqdm(range(repeats), desc=name, leave=False):
        for m, (step, _) in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            rounds[m].append(1e3 * (time.perf_counter() - t0) / steps)
    scaler = next(sc for m, (_, sc) in runs.items() if m != "GradScaler")
    layers = len(scaler.layer_reports())
    extra = {m: dict(Counter({k: c[k] - ops["GradScaler"].get(k, 0) for k in c}).most_common(12))
             for m, c in ops.items() if m != "GradScaler"}
    return {"model": name, "parameters": sum(p.numel() for p in build(name).parameters()),
            "ops": {m: sum(c.values()) for m, c in ops.items()}, "decisions": layers,
            "compiled_calls": {m: n for m, (_, n, _) in counted.items() if n},
            "bytes": {m: b for m, (_, _, b) in counted.items()},
            "extra_ops_top": extra,
            "ms_per_step": rounds, "median_ms": {m: statistics.median(v) for m, v in rounds.items()},
            "warmup_ms": {m: w for m, (_, _, w) in made.items()},
            "run_steps": run_steps,
            "run_mean_ms": {m: statistics.mean(w[:run_steps]) for m, (_, _, w) in made.items()},
            "run_median_ms": {m: statistics.median(w[:run_steps]) for m, (_, _, w) in made.items()}}


def table(payload: dict[str, Any]) -> str:
    """Per model and method: aten ops per step (and over GradScaler's, and beyond them per
    decision), compiled calls per step, the bytes moved, the median ms/step (and over
    GradScaler's), the slowest warm-up step (the default's: the one that compiles), and over a
    run's first steps from a fresh scaler (the compile included) the mean and the median step
    over GradScaler's."""
    lines = ["| model | method | aten ops / step | ÷ GradScaler's | extra per decision "
             "| compiled calls / step | MB moved / step | ÷ GradScaler's | ms/step | ÷ GradScaler's "
             "| slowest warm-up step, s | first steps: mean ÷ GradScaler's | median ÷ GradScaler's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        o, t, calls = r["ops"], r["median_ms"], r.get("compiled_calls", {})
        b, warm = r.get("bytes", {}), r.get("warmup_ms", {})
        mean, median = r.get("run_mean_ms", {}), r.get("run_median_ms", {})
        for i, m in enumerate(o):
            per = "" if m == "GradScaler" else f"{(o[m] - o['GradScaler']) / r['decisions']:.0f}"
            size = f"{r['parameters'] / 1e6:.1f}M, {r['decisions']} decisions"
            model = f"{r['model']} ({size})" if i == 0 else ""
            mb = (f"{b[m] / 1e6:,.0f} | {b[m] / b['GradScaler']:.3f}" if m in b and "GradScaler" in b
                  else " | ")
            slowest = f"{max(warm[m]) / 1e3:.1f}" if m in warm else ""
            run = (f"{mean[m] / mean['GradScaler']:.2f} | {median[m] / median['GradScaler']:.2f}"
                   if m in mean and "GradScaler" in mean else " | ")
            lines.append(f"| {model} | {m} | {o[m]:.0f} | {o[m] / o['GradScaler']:.2f} | {per} "
                         f"| {calls.get(m, 0):.0f} | {mb} | {t[m]:.1f} | {t[m] / t['GradScaler']:.2f} "
                         f"| {slowest} | {run} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS)[:3], choices=list(MODELS),
                    help="default: the three small ones")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--run-steps", type=int, default=30,
                    help="a fresh scaler's first steps, timed one by one (compile included): "
                         "their mean and median")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                    help="the autocast dtype (and the gradient format)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cuda: a GPU's kernels, timed)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="keep inductor's on-disk cache (default: a fresh one, so that the compile "
                         "timed is a first run's)")
    ap.add_argument("--json", type=Path, default=Path("docs/torch_step.json"))
    args = ap.parse_args(argv)
    if not args.warm_cache:  # read by inductor each time it looks for its cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torch_step_inductor_")
    if "GradScaler" not in args.methods:
        ap.error("--methods must include GradScaler (the baseline)")
    warnings.simplefilter("ignore")  # transformers' config notes
    dtype = getattr(torch, args.dtype)
    rows = [measure(m, args.batch, args.seq, args.repeats, args.steps, tuple(args.methods), dtype,
                    args.device, args.run_steps) for m in args.models]
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "benchmarks/torch_step.py", *given])
    payload = {"command": command, "machine": machine("torch"), "device": args.device,
               "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "repeats": args.repeats,
               "steps": args.steps, "run_steps": args.run_steps, "rows": rows}
    args.json.write_text(json.dumps(payload, indent=1))
    print(table(payload))
    return payload


if __name__ == "__main__":
    main()
