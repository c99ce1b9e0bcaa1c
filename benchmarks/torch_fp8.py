"""PyTorch FP8 training with FP8 GEMMs, side by side: adaloss's converted layers under
:class:`torch_bridge.AdaLossScaler` against torchao's float8 training (``emulate=False``: its
GEMMs are ``torch._scaled_mm`` too) and bf16 autocast, step time and gradient error (CPU).

    python benchmarks/torch_fp8.py                    # docs/torch_fp8.json, tables printed
    python benchmarks/torch_fp8.py --models hf-llama --repeats 3 --json /tmp/torch_fp8.json
    python benchmarks/torch_fp8.py --gemm stand-in    # where the CPU's fp8 GEMM is a reference kernel

Models: the torch zoo's ``hf-gpt2``, ``hf-llama`` and ``hf-bert`` (:mod:`adaloss_zoo.torch_zoo`)
and ``gpt2-10m`` (HF GPT-2, 6 layers × 384, vocab 1000: 10.7M parameters). Methods:

- ``bf16``: ``torch.autocast(bfloat16)``, no scaling (the GEMMs in bf16);
- ``adaloss``: :func:`torch_bridge.convert_to_float8_training` (e4m3 inputs and weights at their
  per-tensor current power-of-two scales, e5m2 gradients) under ``AdaLossScaler`` with the same
  config: every GEMM of a converted layer one ``_scaled_mm``, the gradients' scales decided per
  layer before the GEMM that produces them;
- ``current``: the same converted layers without a scaler: each cotangent cast at its own
  per-tensor current power-of-two scale (Transformer Engine's current scaling, power of two);
- ``torchao tensorwise`` / ``rowwise``: ``torchao.float8.convert_to_float8_training`` with that
  recipe and ``emulate=False``; ``tensorwise p2``: ``round_scales_to_power_of_2=True`` (the
  rowwise recipe's default), the scales adaloss uses. torchao converts ``nn.Linear`` only, so
  GPT-2's ``Conv1D`` layers are first replaced by equal ``nn.Linear`` layers for it (the
  ``layers`` column counts the converted layers of each).

Step time: a training step (bf16 autocast forward, backward, AdamW, ``zero_grad``) on a batch of
``--batch`` × ``--seq`` tokens, the methods alternating ``--repeats`` rounds of ``--steps`` steps
each, the median ms/step, and of it the time outside ``torch._scaled_mm`` (with ``--gemm stand-in``,
each GEMM a bf16 matmul of the dequantized operands, whose time is left out: the step's time is
then not an FP8 step's, the time outside the GEMMs is). Error (always the real ``_scaled_mm``;
``--seeds 0`` skips it): one backward of the zoo's batch at loss ×1 against the same bf16
forward's backward (:func:`adaloss_zoo.torch_zoo.reference_grads`), per parameter
``‖g − g_ref‖/‖g_ref‖``, median and worst, the mean over ``--seeds``.

Not a test: ``tests/test_torch_float8.py`` pins the GEMM counts and the behaviour.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import torch_bridge
from adaloss import AdaLossConfig
from adaloss_study.overhead import machine
from adaloss_zoo import torch_zoo as tz
from adaloss_zoo.fp8_tables import GEMM_METHODS as METHODS
from adaloss_zoo.fp8_tables import gemm_summary, gemm_table
from adaloss_zoo.metrics import grad_error

CONFIG = AdaLossConfig(grad_format="float8_e5m2", operand_format="float8_e4m3fn")
BF16 = torch.bfloat16


def _gpt2_10m(seed: int) -> tuple[torch.nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=1000, n_positions=128, n_embd=384, n_layer=6, n_head=6)
    return GPT2LMHeadModel(cfg), tz._tokens(seed)


CASES = {**{k: tz.CASES[k] for k in ("hf-gpt2", "hf-llama", "hf-bert")},
         "gpt2-10m": tz.TorchCase("gpt2-10m", _gpt2_10m, tz._lm_loss)}


def linearized(model: torch.nn.Module) -> tuple[torch.nn.Module, set[str]]:
    """A copy of ``model`` with every HF ``Conv1D`` replaced by the ``nn.Linear`` it equals
    (weight transposed), for torchao, which converts ``nn.Linear`` only; and the names of the
    transposed weights."""
    from transformers.pytorch_utils import Conv1D
    model = copy.deepcopy(model)
    names: set[str] = set()
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                lin = torch.nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    lin.weight.copy_(child.weight.t())
                    lin.bias.copy_(child.bias)
                setattr(parent, name, lin)
                names.add(f"{fqn}.{name}.weight" if fqn else f"{name}.weight")
    return model, names


def _torchao(model: torch.nn.Module, recipe: str) -> tuple[torch.nn.Module, set[str]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    p2 = recipe.endswith(" p2")
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe.removesuffix(" p2")), emulate=False,
                              **({"round_scales_to_power_of_2": True} if p2 else {}))
    model, transposed = linearized(model)
    return convert_to_float8_training(model, config=cfg), transposed


def converted(method: str, model: torch.nn.Module) -> tuple[torch.nn.Module, Any, set[str]]:
    """``method``'s copy of ``model``, its scaler (or None) and the names of its transposed
    weights (against ``model``'s)."""
    if method == "bf16":
        return copy.deepcopy(model), None, set()
    if method.startswith("torchao "):
        m, transposed = _torchao(model, method.removeprefix("torchao "))
        return m, None, transposed
    m = torch_bridge.convert_to_float8_training(copy.deepcopy(model), CONFIG)
    return m, (torch_bridge.AdaLossScaler(m, CONFIG) if method == "adaloss" else None), set()


def count_layers(model: torch.nn.Module) -> int:
    """Layers whose GEMMs are FP8 (adaloss's or torchao's)."""
    from torchao.float8.float8_linear import Float8Linear as TorchaoLinear
    return sum(isinstance(m, (torch_bridge.Float8Linear, TorchaoLinear)) for m in model.modules())


def _grads(model: torch.nn.Module, transposed: set[str]) -> dict[str, np.ndarray]:
    return {n: (g.T if n in transposed else g) for n, g in tz._grads(model, 1.0).items()}


def errors(case: tz.TorchCase, seeds: int) -> dict[str, dict[str, float]]:
    """Each method's gradient error at loss ×1 (median and worst parameter), mean over seeds."""
    out: dict[str, list[Any]] = {m: [] for m in METHODS if m != "bf16"}
    for seed in range(seeds):
        model, batch = case.build(seed)
        ref = tz.reference_grads(case, copy.deepcopy(model), batch, seed, dtype=BF16)
        for method in out:
            m, scaler, transposed = converted(method, model)
            if scaler is not None:
                r = tz.run_adaloss(case, m, batch, 1.0, CONFIG, seed, dtype=BF16)
                grads, skipped = r.grads, r.skipped
            else:
                tz._forward(case, m, batch, 1.0, seed, BF16).backward()
                grads, skipped = _grads(m, transposed), 0
            e = grad_error(grads, ref, case.exclude)
            out[method].append((e.median, e.worst, skipped))
    return {m: {"median": float(np.mean([v[0] for v in vs])), "worst": float(np.mean([v[1] for v in vs])),
                "skipped": int(max(v[2] for v in vs))} for m, vs in out.items()}


class GemmClock:
    """Stands in for ``torch._scaled_mm`` (adaloss's layers and torchao's call it by that name) and
    adds up the seconds spent in it. With ``stand_in``, each call is a bf16 matmul of its
    dequantized operands instead: for a CPU whose fp8 GEMM is oneDNN's reference implementation
    (``ONEDNN_VERBOSE=1`` prints ``ref:any``: ~0.4 s for one 512 × 128 × 384 GEMM), where a step
    is all GEMM and what can be compared is the time outside the GEMMs."""

    def __init__(self, stand_in: bool) -> None:
        self.real, self.stand_in, self.seconds = torch._scaled_mm, stand_in, 0.0

    def __call__(self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.stand_in:
            out = (a.to(BF16) @ b.to(BF16)).float() * (scale_a * scale_b)
            out = (out if bias is None else out + bias).to(out_dtype or BF16)
        else:
            out = self.real(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, scale_result=scale_result,
                            out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        self.seconds += time.perf_counter() - t0
        return out

    def __enter__(self) -> GemmClock:
        torch._scaled_mm = self
        return self

    def __exit__(self, *exc: object) -> None:
        torch._scaled_mm = self.real


def _timer(case: tz.TorchCase, method: str, model: torch.nn.Module, batch: torch.Tensor, steps: int
           ) -> tuple[Callable[[], None], int]:
    m, scaler, _ = converted(method, model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def run() -> None:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=BF16):
                loss = case.loss(m, batch)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
    run()  # warm-up: the graph plan, torchao's first casts
    return run, count_layers(m)


def times(case: tz.TorchCase, batch: int, seq: int, repeats: int, steps: int, stand_in: bool = False
          ) -> dict[str, Any]:
    """Median ms per training step of each method, alternating rounds, and of it outside
    ``torch._scaled_mm`` (:class:`GemmClock`); the FP8 layers of each."""
    model, _ = case.build(0)
    ids = tz._tokens(0, batch, seq)
    rounds: dict[str, list[float]] = {m: [] for m in METHODS}
    outside: dict[str, list[float]] = {m: [] for m in METHODS}
    with GemmClock(stand_in) as clock:
        timers = {m: _timer(case, m, model, ids, steps) for m in METHODS}
        for _ in tqdm(range(repeats), desc=case.name, leave=False):
            for m, (run, _) in timers.items():
                clock.seconds = 0.0
                t0 = time.perf_counter()
                run()
                total = time.perf_counter() - t0
                rounds[m].append(1e3 * total / steps)
                outside[m].append(1e3 * (total - clock.seconds) / steps)
    return {"ms_per_step": rounds, "median_ms": {m: statistics.median(v) for m, v in rounds.items()},
            "outside_gemm_ms": {m: statistics.median(v) for m, v in outside.items()},
            "layers": {m: n for m, (_, n) in timers.items()},
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--seeds", type=int, default=2, help="model/batch seeds of the error columns")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7, help="alternating rounds per method")
    ap.add_argument("--steps", type=int, default=5, help="training steps per round")
    ap.add_argument("--gemm", choices=("scaled_mm", "stand-in"), default="scaled_mm",
                    help="stand-in: each _scaled_mm a bf16 matmul of its dequantized operands (a CPU "
                         "whose fp8 GEMM is oneDNN's reference kernel): compare the time outside the GEMMs")
    ap.add_argument("--json", type=Path, default=Path("docs/torch_fp8.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # transformers' config notes, torchao's deprecations
    rows: list[dict[str, Any]] = []
    for name in args.models:
        t0 = time.perf_counter()
        row = {"model": name, **times(CASES[name], args.batch, args.seq, args.repeats, args.steps,
                                      args.gemm == "stand-in"),
               "errors": errors(CASES[name], args.seeds) if args.seeds else {}}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        command = "python benchmarks/torch_fp8.py" + (" --gemm stand-in" if args.gemm == "stand-in" else "")
        payload = {"command": command, "machine": machine("torch"),
                   "batch": args.batch, "seq": args.seq, "repeats": args.repeats, "steps": args.steps,
                   "seeds": args.seeds, "gemm": args.gemm, "rows": rows}
        print(gemm_table({**payload, "rows": [row]}), flush=True)
        args.json.write_text(json.dumps(payload, indent=1))
    print("\n".join(gemm_summary(payload)))


if __name__ == "__main__":
    main()
