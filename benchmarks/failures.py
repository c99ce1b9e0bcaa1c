"""When global loss scaling fails: the mechanisms people report, under every scaler they use.

    python benchmarks/failures.py --json docs/failures.json        # every case, 3 seeds (~30 min)
    python benchmarks/failures.py --cases summed-loss --seeds 0 --json /tmp/f.json

Each case reproduces one failure mechanism from public reports on a small model: the study's
char GPT (``adaloss_study``, both frameworks) trained on its Shakespeare corpus, or an MLP on
a fixed synthetic task. Every method trains it from the same initialisation on the same batches:

- PyTorch (fp16 autocast, Adam): ``torch.amp.GradScaler`` at its defaults; DeepSpeed's
  ``DynamicLossScaler`` with the fp16 config's documented defaults; Megatron-core's
  ``DynamicGradScaler`` with ``OptimizerConfig``'s defaults; fairscale's
  ``LayerwiseGradientScaler`` with its docstring's per-layer scales (2^10); ``AdaLossScaler``
  (default, and with one statistical scale: ``layer_rule=False``); fp32 as the reference.
  DeepSpeed and Megatron scalers are used standalone with the step their own optimizer
  wrappers run (ZeRO's ``backward``/``has_inf_or_nan``/``update_scale``; Megatron's
  ``_amp_foreach_non_finite_check_and_unscale_``/``update``), one rank.
- JAX (fp16 compute, fp32 parameters, ``optax.adam``): ``jmp.DynamicLossScale`` (2^15, as
  jmp's README) with ``optax.apply_if_finite``; ``jax_adaloss`` (default, and
  ``layer_rule=False``) with its documented ``SkipMonitor``; fp32.

Per run: skipped steps and the longest run of them, the parameters that never moved (bitwise
equal to their initial values at the end), the final loss on a held-out batch (fp32), the
progress against fp32 at the same seed, ``(L0 - L) / (L0 - L_fp32)``, and whether the user was
told: a Python warning, a log record a default configuration shows (WARNING or above), or an
exception, said during training, about skipped steps or the scale. The docs page is generated
from the JSON (``adaloss-study --gallery``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from skips import longest_run  # (benchmarks/skips.py)

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: what a method says counts as telling the user about the failure when it mentions one of these
_ABOUT = re.compile(r"skip|overflow|\binf\b|nan|scale|finite", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Case:
    """One failure mechanism: its model, data and loss, and the public reports it comes from."""

    name: str
    title: str
    reports: tuple[str, ...]
    mechanism: str
    model: str  # "gpt" | "mlp" | "deep" | "heads"
    steps: int
    loss: str = "mean"  # "mean" | "sum" over the batch (and tokens)
    factor: float = 1.0  # multiplies the loss
    input_scale: float = 1.0  # multiplies the MLP's inputs (unnormalised features)
    bad_every: int = 0  # every bad_every-th batch (MLP) has inputs x bad_input: the forward overflows
    bad_input: float = 1.0
    task: str = "classify"  # the MLP's: "classify" (cross-entropy) | "regress" (squared error, 1 output)
    bursts: tuple[int, ...] = ()  # steps at which a burst of bad_len batches whose loss spikes x spike starts
    bad_len: int = 0
    spike: float = 1.0
    head_factors: tuple[float, float] = (1.0, 1.0)  # "heads": the two loss terms' weights
    batch: int = 64
    lr: float = 1e-3
    pretrained: bool = False  # the GPT starts from weights pretrained here in fp32
    note: str = ""  # what the measurement shows, and why (no numbers: the tables hold them)


CASES: dict[str, Case] = {c.name: c for c in (
    Case("summed-loss", "A loss summed over tokens: the scale backs off at start-up",
         ("NVIDIA/apex#289", "pytorch/pytorch#55585", "microsoft/DeepSpeed#931"),
         "The loss is summed over the batch's 1024 tokens instead of averaged, so every gradient is "
         "1024x larger: at a start-up scale of 2^16 (2^32 for Megatron) the backward overflows, and a "
         "global scaler skips steps halving its scale until it fits.",
         "gpt", 300, loss="sum",
         note="every method ends at fp32's loss; the global scalers lose their first steps backing off "
              "from the start-up overflow (Megatron-core's 2^32 the most), which adaloss's decisions "
              "fit at the first step."),
    Case("forward-overflow", "An fp16 forward that overflows: the scale collapses",
         ("NVIDIA/apex#318", "NVIDIA/apex#834", "huggingface/transformers#5651"),
         "Every third batch holds unnormalised features (x 2e4) whose first fp16 matmul overflows: "
         "the loss itself is inf, no scale can help, and each such batch halves a global scale. A "
         "scale halved once per bad batch and doubled once per 2000 clean ones falls towards 0, "
         "where every gradient underflows (or, at 0, every step is skipped).",
         "mlp", 600, bad_every=3, bad_input=2e4,
         note="every method skips the batches whose loss is inf. A global scaler also skips, and so "
              "drops, the outlier batches whose forward stays finite but whose gradients overflow its "
              "scale; fp32 and adaloss train on those, and here that costs progress: Adam's moments take "
              "the outliers' gradients. GradScaler's scale, halved at every skip, fell to 2^-128, where "
              "its inverse is inf and unscaling turned zero gradients into NaN without its check "
              "flagging them: the parameters became NaN (this CPU). DeepSpeed's scaler reached its "
              "minimum scale of 1 and raised. adaloss said so: a fifth of the last 100 steps skipped."),
    Case("bad-batch-bursts", "Bursts of bad batches halve the scale again and again",
         ("NVIDIA/apex#493", "facebookresearch/fairseq#515"),
         "Two bursts of ten bad batches whose loss spikes (x 1e9) overflow the backward at the current "
         "scale; each halves a global scale, which then needs 2000 clean steps per doubling to "
         "recover, while the task's small gradients (a loss x 1e-4) underflow at the lowered scale.",
         "mlp", 400, factor=1e-4, bursts=(100, 200), bad_len=10, spike=1e9,
         note="the global scalers overflow on most spike batches and skip them, which here helps: a "
              "spike's gradient inflates Adam's second moment for the steps after it. adaloss's caps "
              "keep the spike batches finite, so it trains on them as fp32 does and ties fp32 rather "
              "than beating it; no flush of the task's gradients by the lowered global scales shows in "
              "the losses within these steps."),
    Case("small-gradients", "Gradients below what the scale reaches",
         ("the study's 'deep' case",),
         "The loss is normalised by a large constant (a mean over a 1M-token global batch, x 2^-20): "
         "the gradients sit below fp16's subnormals even at 2^16, and a global dynamic scale grows "
         "only after 2000 clean steps.",
         "gpt", 300, factor=2.0**-20,
         note="with Adam's epsilon at 1e-8, the update of gradients this small barely depends on their "
              "low bits (fp32's own progress is slow): every method ties fp32."),
    Case("deep-saturating", "A deep saturating stack whose bottom layers never move",
         ("fairscale LayerwiseGradientScaler's motivation",),
         "Sixteen sigmoid layers: each multiplies the cotangent by at most 1/4, so the bottom layers' "
         "gradients are ~1e-10 of the top's and underflow in fp16 under one global scale sized for "
         "the top.",
         "deep", 300,
         note="under one scale the bottom layers' gradients underflow and their parameters never move "
              "(GradScaler, DeepSpeed, Megatron-core, fairscale at its documented 2^10, and adaloss "
              "with one statistical scale); adaloss's per-layer scales keep them moving as in fp32. At "
              "this depth those layers barely change the loss within 300 steps, so the losses tie."),
    Case("two-losses", "Two loss terms far apart: the small head never moves",
         ("facebookresearch/fairscale#811",),
         "A classification term weighted 1024 and a regression term weighted 1e-8 share a trunk: the "
         "large term caps a global scale far below where the small head's gradients are representable "
         "in fp16.",
         "heads", 300, head_factors=(1024.0, 1e-8),
         note="the regression head's gradients, 1e-8 of the loss, fall into or below fp16's subnormals "
              "under the global scale the classification term caps, and that head trains slower (the "
              "held-out loss is mostly its squared error); adaloss's layer decisions scale it on its own. "
              "fairscale cannot run a shared trunk with two heads."),
    Case("wgrad-over-range", "A weight gradient above fp16's range at scale 1",
         ("pytorch/pytorch#99640", "microsoft/DeepSpeed#1599"),
         "Unnormalised inputs (x 1000) and a loss summed over a batch of 512: the first layer's "
         "fp16 weight gradient exceeds 65504 even unscaled. A scaler whose minimum scale is 1 "
         "(DeepSpeed, Megatron-core, jmp) can only skip.",
         "mlp", 300, loss="sum", input_scale=1000.0, batch=512,
         note="the global scalers skip their first steps until their scale is low enough, and end above "
              "fp32's loss; jmp, whose scale stops at 1, skips every step and nothing trains. adaloss "
              "caps the layer's scale where its weight gradient would overflow (in JAX its weight "
              "gradients are fp32), and skips nothing."),
    Case("fine-tune", "Fine-tuning a pretrained GPT in fp16",
         ("fp16 fine-tuning on GPUs without bf16",),
         "The study's GPT pretrained here in fp32 (1500 steps, written by the benchmark), then "
         "fine-tuned in fp16 on the held-out plays, as on GPUs without bf16.",
         "gpt", 200, pretrained=True, lr=3e-4,
         note="a pretrained model's gradients sit well inside fp16's range at 2^16: every method ties "
              "fp32 (Megatron-core after its start-up back-off from 2^32), and so do per-layer scales."),
)}

TORCH_METHODS = ("fp32", "gradscaler", "deepspeed", "megatron", "fairscale", "adaloss", "adaloss-one-scale")
JAX_METHODS = ("fp32", "jmp", "adaloss", "adaloss-one-scale")
FRAMEWORKS = {"torch": TORCH_METHODS, "jax": JAX_METHODS}

_IN, _HIDDEN, _CLASSES, _DEPTH = 32, 64, 10, 16
_SEQ, _GPT_BATCH = 64, 16
PRETRAIN_STEPS = 1500


# -- data ----------------------------------------------------------------------------------
def _corpus() -> Any:
    from adaloss_study.corpus import load_corpus
    return load_corpus()


def _teacher(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).normal(size=(_IN, _CLASSES)).astype(np.float32)


def _mlp_batch(case: Case, rng: np.random.Generator, teacher: np.ndarray, step: int | None,
               n: int | None = None) -> dict[str, np.ndarray]:
    """A batch of the synthetic task: class = argmax of a fixed linear teacher, and a regression
    target (its first logit); ``step`` None: a clean held-out batch."""
    x = rng.normal(size=(n or case.batch, _IN)).astype(np.float32)
    logits = x @ teacher
    y, r = logits.argmax(1).astype(np.int32), logits[:, :1].astype(np.float32)
    if step is not None and case.bad_every and step % case.bad_every == case.bad_every - 1:
        x = x * np.float32(case.bad_input)
    spiked = step is not None and any(b <= step < b + case.bad_len for b in case.bursts)
    return {"x": x * np.float32(case.input_scale), "y": y, "r": r,
            "k": np.float32(case.spike if spiked else 1.0)}  # a bad batch's loss spikes


def batches(case: Case, seed: int) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray], int]:
    """The training batches, the held-out batch and the vocabulary size (0: not a GPT)."""
    rng = np.random.default_rng(seed)
    if case.model == "gpt":
        from adaloss_study.corpus import batches as windows
        corpus = _corpus()
        data = corpus.val if case.pretrained else corpus.train
        it = windows(data, _SEQ, _GPT_BATCH, rng)
        one = np.float32(1.0)
        train = [{**dict(zip("xy", next(it))), "k": one} for _ in range(case.steps)]
        held = windows(corpus.val, _SEQ, 64, np.random.default_rng(10_000 + seed))
        return train, {**dict(zip("xy", next(held))), "k": one}, len(corpus.vocab)
    teacher = _teacher(seed)
    train = [_mlp_batch(case, rng, teacher, step) for step in range(case.steps)]
    return train, _mlp_batch(case, np.random.default_rng(10_000 + seed), teacher, None, 1024), 0


class Unsupported(Exception):
    """A method that cannot run a case: the message says why."""


class _Listening:
    """What a method told the user while it trained: Python warnings, and log records a default
    configuration shows (WARNING and above, from any logger)."""

    def __enter__(self) -> list[str]:
        self.heard: list[str] = []
        heard, seen = self.heard, set()

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:  # (once: it propagates to root too)
                if record.levelno >= logging.WARNING and id(record) not in seen:
                    seen.add(id(record))
                    heard.append(f"log {record.name}: {record.getMessage()}")

        self.handler = Handler(logging.DEBUG)
        self.loggers = [logging.getLogger()] + [
            lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
        for lg in self.loggers:
            lg.addHandler(self.handler)
        self.caught = warnings.catch_warnings(record=True)
        self.warned = self.caught.__enter__()
        warnings.simplefilter("always")
        return heard

    def __exit__(self, *exc: Any) -> None:
        self.caught.__exit__(*exc)
        for lg in self.loggers:
            lg.removeHandler(self.handler)
        self.heard.extend(f"warning {w.category.__name__}: {w.message}" for w in self.warned)


def _told(heard: list[str], crashed: dict[str, Any] | None) -> str | None:
    """The first thing said about skipped steps or the scale, or ``None``."""
    said = heard + ([f"raised {crashed['error']}"] if crashed else [])
    return next((s[:300] for s in said if _ABOUT.search(s)), None)


def _result(case: Case, method: str, seed: int, flags: list[bool], moved: dict[str, bool], l0: float,
            final: float, heard: list[str], crashed: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    return {"case": case.name, "method": method, "seed": seed, "steps": len(flags),
            "skipped": int(sum(flags)), "longest_skip_run": longest_run(flags),
            "never_moved": sorted(n for n, m in moved.items() if not m), "parameters": len(moved),
            "initial_loss": l0, "final_loss": final, "crashed": crashed, "told": _told(heard, crashed),
            "seconds": round(seconds, 1)}


# -- PyTorch ---------------------------------------------------------------------------------
def _torch_pretrained(seed: int, vocab: int) -> dict[str, Any]:
    """The study's GPT trained here in fp32 on the training plays (written once per seed)."""
    import torch
    import torch.nn.functional as F

    from adaloss_study.corpus import batches as windows
    from adaloss_study.corpus import cache_dir
    from adaloss_study.torch_models import CharGPT
    path = cache_dir() / "failures" / f"torch-gpt-{PRETRAIN_STEPS}-seed{seed}.pt"
    if path.exists():
        return torch.load(path)
    torch.manual_seed(seed)
    model = CharGPT(vocab, 64, 4, 2, _SEQ)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    it = windows(_corpus().train, _SEQ, _GPT_BATCH, np.random.default_rng(20_000 + seed))
    for _ in range(PRETRAIN_STEPS):
        x, y = (torch.as_tensor(a, dtype=torch.long) for a in next(it))
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model.state_dict()


def torch_model(case: Case, seed: int, vocab: int) -> Any:
    import torch
    from torch import nn
    torch.manual_seed(seed)
    if case.model == "gpt":
        from adaloss_study.torch_models import CharGPT
        model = CharGPT(vocab, 64, 4, 2, _SEQ)
        if case.pretrained:
            model.load_state_dict(_torch_pretrained(seed, vocab))
        return model
    if case.model == "heads":
        class Heads(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.trunk = nn.Sequential(nn.Linear(_IN, _HIDDEN), nn.ReLU(),
                                           nn.Linear(_HIDDEN, _HIDDEN), nn.ReLU())
                self.a, self.b = nn.Linear(_HIDDEN, _CLASSES), nn.Linear(_HIDDEN, 1)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                h = self.trunk(x)
                return self.a(h), self.b(h)
        return Heads()
    depth, act = (2, nn.ReLU) if case.model == "mlp" else (_DEPTH, nn.Sigmoid)
    layers: list[nn.Module] = [nn.Linear(_IN, _HIDDEN), act()]
    for _ in range(depth - 1):
        layers += [nn.Linear(_HIDDEN, _HIDDEN), act()]
    # fairscale's LayerwiseGradientScaler needs the last module unscaled (its tests end so)
    return nn.Sequential(*layers, nn.Linear(_HIDDEN, _CLASSES), nn.Identity())


def torch_loss(case: Case, model: Any, b: dict[str, Any], autocast: bool, train: bool = True) -> Any:
    """The case's loss (fp32); held-out (``train=False``): the per-example mean, no factor."""
    import torch
    import torch.nn.functional as F
    red = case.loss if train else "mean"
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        out = model(b["x"])
    if case.model == "gpt":
        loss = F.cross_entropy(out.float().flatten(0, 1), b["y"].flatten(), reduction=red)
    elif case.model == "heads":
        fa, fb = case.head_factors if train else (1.0, 1.0)
        loss = fa * F.cross_entropy(out[0].float(), b["y"]) + fb * F.mse_loss(out[1].float(), b["r"])
    elif case.task == "regress":
        loss = F.mse_loss(out[:, :1].float(), b["r"], reduction=red)
    else:
        loss = F.cross_entropy(out.float(), b["y"], reduction=red)
    return loss * (case.factor * b["k"]) if train else loss


def torch_trainer(method: str, case: Case, model: Any) -> Callable[[dict[str, Any]], bool]:
    """One training step of ``method``: returns whether it skipped the optimizer step."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=case.lr)

    def loss_of(b: dict[str, Any], autocast: bool = True) -> Any:
        return torch_loss(case, model, b, autocast)

    if method == "fp32":
        def step(b: dict[str, Any]) -> bool:
            opt.zero_grad(set_to_none=True)
            loss_of(b, False).backward()
            opt.step()
            return False
        return step
    if method == "gradscaler":
        scaler = torch.amp.GradScaler("cpu")  # 2^16, x2 every 2000 clean steps, x0.5 on inf/NaN

        def step(b: dict[str, Any]) -> bool:
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_of(b)).backward()
            scaler.unscale_(opt)
            found = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0  # step() reads it
            scaler.step(opt)
            scaler.update()
            return found
        return step
    if method == "deepspeed":
        from deepspeed.runtime.fp16 import loss_scaler as ds
        from deepspeed.runtime.precision_config import DeepSpeedFP16Config
        from deepspeed.runtime.utils import has_inf_or_nan

        class _OneRank:  # update_scale asks deepspeed.comm for the rank only to decide who logs
            @staticmethod
            def get_rank(group: Any = None) -> int:
                return 0
        ds.dist = _OneRank()
        # the fp16 config's documented defaults: 2^16, window 1000, hysteresis 2, min scale 1
        scaler = ds.DynamicLossScaler(**DeepSpeedFP16Config(enabled=True).dynamic_loss_scale_args())

        def step(b: dict[str, Any]) -> bool:  # as ZeRO's fp16 step
            opt.zero_grad(set_to_none=True)
            used = scaler.loss_scale
            scaler.backward(loss_of(b))
            overflow = any(bool(has_inf_or_nan(p.grad)) for p in params if p.grad is not None)
            scaler.update_scale(overflow)
            if not overflow:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / used)
                opt.step()
            return overflow
        return step
    if method == "megatron":
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler
        from torch.overrides import TorchFunctionMode

        class _OnCPU(TorchFunctionMode):  # grad_scaler.py creates its tensors on device="cuda"
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = dict(kwargs or {})
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return func(*args, **kwargs)

        with _OnCPU():  # what get_megatron_optimizer passes with OptimizerConfig's defaults
            scaler = DynamicGradScaler(initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0,
                                       backoff_factor=0.5, growth_interval=1000, hysteresis=2)
        found_inf = torch.zeros(1)

        def step(b: dict[str, Any]) -> bool:  # as MixedPrecisionOptimizer.step, one rank
            opt.zero_grad(set_to_none=True)
            (scaler.scale * loss_of(b)).backward()
            found_inf.fill_(0.0)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [p.grad for p in params if p.grad is not None], found_inf, scaler.inv_scale)
            skipped = bool(found_inf.item() > 0)
            scaler.update(skipped)
            if not skipped:
                opt.step()
            return skipped
        return step
    if method == "fairscale":
        from fairscale.optim.layerwise_gradient_scaler import LayerwiseGradientScaler
        if not isinstance(model, torch.nn.Sequential):
            raise Unsupported("LayerwiseGradientScaler scales layers in the order nn.Module registers "
                              "them, so it needs a flat nn.Sequential (not attention blocks, shared "
                              "trunks, tied embeddings)")
        # its docstring's example: 2^8-2^10 per layer
        scaler = LayerwiseGradientScaler(model, {n: 2.0**10 for n, m in model.named_modules()
                                                 if isinstance(m, torch.nn.Linear)})

        def step(b: dict[str, Any]) -> bool:
            opt.zero_grad(set_to_none=True)
            scaler.scale()
            loss_of(b).backward()
            scaler.unscale()
            scaler.step(opt)
            return any(li.found_inf_or_nan for li in scaler.layer_info)
        return step
    if method in ("adaloss", "adaloss-one-scale"):
        from adaloss import AdaLossConfig
        from torch_bridge import AdaLossScaler
        cfg = AdaLossConfig() if method == "adaloss" else AdaLossConfig(layer_rule=False)
        scaler = AdaLossScaler(model, cfg)

        def step(b: dict[str, Any]) -> bool:
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_of(b)).backward()
            scaler.step(opt)
            scaler.update()
            return scaler.last_step_skipped
        return step
    raise ValueError(f"unknown method {method!r}")


def run_torch(case: Case, method: str, seed: int, train: list[dict[str, np.ndarray]],
              held: dict[str, np.ndarray], vocab: int) -> dict[str, Any]:
    import torch
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    def tensors(b: dict[str, np.ndarray]) -> dict[str, Any]:
        return {k: torch.as_tensor(v, dtype=torch.long if v.dtype.kind == "i" else torch.float32)
                for k, v in b.items()}

    model = torch_model(case, seed, vocab)
    held_t = tensors(held)

    def evaluate() -> float:
        with torch.no_grad():
            return float(torch_loss(case, model, held_t, autocast=False, train=False))

    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    l0 = evaluate()
    try:
        step = torch_trainer(method, case, model)
    except Unsupported as e:
        return {"case": case.name, "method": method, "seed": seed, "unsupported": str(e)}
    flags: list[bool] = []
    crashed = None
    t0 = time.perf_counter()
    with _Listening() as heard:
        for i, b in enumerate(train):
            try:
                flags.append(bool(step(tensors(b))))
            except Exception as e:  # noqa: BLE001 (a scaler that gives up: the run ends there)
                crashed = {"step": i, "error": f"{type(e).__name__}: {e}"}
                break
    moved = {n: not torch.equal(p.detach(), init[n]) for n, p in model.named_parameters()}
    return _result(case, method, seed, flags, moved, l0, evaluate(), heard, crashed, time.perf_counter() - t0)


# -- JAX -------------------------------------------------------------------------------------
def _jax_modules() -> tuple[type, type]:
    import flax.nnx as nnx

    class MLP(nnx.Module):
        def __init__(self, depth: int, act: Callable[[Any], Any], dtype: Any, rngs: nnx.Rngs) -> None:
            widths = [_IN] + [_HIDDEN] * depth + [_CLASSES]
            self.layers = nnx.List([nnx.Linear(a, b, dtype=dtype, rngs=rngs)
                                    for a, b in zip(widths, widths[1:])])
            self.act = act

        def __call__(self, x: Any) -> Any:
            for layer in self.layers[:-1]:
                x = self.act(layer(x))
            return self.layers[-1](x)

    class Heads(nnx.Module):
        def __init__(self, dtype: Any, rngs: nnx.Rngs) -> None:
            self.t1 = nnx.Linear(_IN, _HIDDEN, dtype=dtype, rngs=rngs)
            self.t2 = nnx.Linear(_HIDDEN, _HIDDEN, dtype=dtype, rngs=rngs)
            self.a = nnx.Linear(_HIDDEN, _CLASSES, dtype=dtype, rngs=rngs)
            self.b = nnx.Linear(_HIDDEN, 1, dtype=dtype, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            h = nnx.relu(self.t2(nnx.relu(self.t1(x))))
            return self.a(h), self.b(h)

    return MLP, Heads


def jax_model(case: Case, seed: int, vocab: int, dtype: Any) -> Any:
    import flax.nnx as nnx
    import jax
    rngs = nnx.Rngs(seed)
    if case.model == "gpt":
        from adaloss_study.models import CharGPT
        model = CharGPT(vocab, 64, 4, 2, _SEQ, dtype=dtype, rngs=rngs)
        if case.pretrained:
            graphdef, params = nnx.split(model)
            return nnx.merge(graphdef, jax.tree.map(lambda a, b: b.astype(a.dtype), params,
                                                    _jax_pretrained(seed, vocab)))
        return model
    mlp, heads = _jax_modules()
    if case.model == "heads":
        return heads(dtype, rngs)
    return mlp(2, nnx.relu, dtype, rngs) if case.model == "mlp" else mlp(_DEPTH, nnx.sigmoid, dtype, rngs)


def _jax_pretrained(seed: int, vocab: int) -> Any:
    """The study's GPT trained here in fp32 on the training plays (written once per seed)."""
    import pickle

    import flax.nnx as nnx
    import jax
    import optax

    from adaloss_study.corpus import batches as windows
    from adaloss_study.corpus import cache_dir
    from adaloss_study.models import CharGPT
    path = cache_dir() / "failures" / f"jax-gpt-{PRETRAIN_STEPS}-seed{seed}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())
    import jax.numpy as jnp
    graphdef, params = nnx.split(CharGPT(vocab, 64, 4, 2, _SEQ, dtype=jnp.float32, rngs=nnx.Rngs(seed)))
    tx = optax.adam(3e-3)
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        def loss(p: Any) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, p)(x), y).mean()
        g = jax.grad(loss)(params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    it = windows(_corpus().train, _SEQ, _GPT_BATCH, np.random.default_rng(20_000 + seed))
    for _ in range(PRETRAIN_STEPS):
        params, state = step(params, state, *next(it))
    params = jax.tree.map(np.asarray, params)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(params))
    return params


def jax_loss(case: Case, graphdef: Any, train: bool = True) -> Callable[..., Any]:
    import flax.nnx as nnx
    import jax.numpy as jnp
    import optax

    def loss(params: Any, b: dict[str, Any]) -> Any:
        out = nnx.merge(graphdef, params)(b["x"])
        red = jnp.sum if train and case.loss == "sum" else jnp.mean
        if case.model == "heads":
            fa, fb = case.head_factors if train else (1.0, 1.0)
            ce = optax.softmax_cross_entropy_with_integer_labels(out[0].astype(jnp.float32), b["y"]).mean()
            value = fa * ce + fb * jnp.mean((out[1].astype(jnp.float32) - b["r"]) ** 2)
        elif case.task == "regress":
            value = red((out[:, :1].astype(jnp.float32) - b["r"]) ** 2)
        else:
            value = red(optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), b["y"]))
        return value * (case.factor * b["k"]) if train else value
    return loss


def run_jax(case: Case, method: str, seed: int, train: list[dict[str, np.ndarray]],
            held: dict[str, np.ndarray], vocab: int) -> dict[str, Any]:
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp
    import jmp
    import optax

    import jax_adaloss
    from adaloss import AdaLossConfig
    dtype = jnp.float32 if method == "fp32" else jnp.float16
    graphdef, params = nnx.split(jax_model(case, seed, vocab, dtype))
    loss_fn = jax_loss(case, graphdef)
    wide = nnx.split(jax_model(case, seed, vocab, jnp.float32))[0]  # the held-out loss in fp32
    evaluate = jax.jit(lambda p: jax_loss(case, wide, train=False)(p, held))
    init = jax.tree.map(np.asarray, params)
    l0 = float(evaluate(params))
    monitor = None
    if method == "fp32":
        tx = optax.adam(case.lr)
        state: Any = tx.init(params)

        @jax.jit
        def step(params: Any, state: Any, b: Any) -> Any:
            g = jax.grad(loss_fn)(params, b)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state, jnp.zeros((), bool)
    elif method == "jmp":
        tx = optax.apply_if_finite(optax.adam(case.lr), max_consecutive_errors=2**31 - 1)
        state = (tx.init(params), jmp.DynamicLossScale(jnp.float32(2.0**15)))  # jmp's README

        @jax.jit
        def step(params: Any, state: Any, b: Any) -> Any:
            opt_state, ls = state
            g = jax.grad(lambda p: ls.scale(loss_fn(p, b)))(params)
            g = ls.unscale(g)
            finite = jmp.all_finite(g)
            u, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, u), (opt_state, ls.adjust(finite)), ~finite
    else:
        cfg = AdaLossConfig() if method == "adaloss" else AdaLossConfig(layer_rule=False)
        tx = jax_adaloss.adaloss(inner=optax.adam(case.lr), config=cfg)
        state = tx.init(params)
        vg = jax_adaloss.value_and_grad(loss_fn, config=cfg)
        monitor = jax_adaloss.SkipMonitor()

        @jax.jit
        def step(params: Any, state: Any, b: Any) -> Any:
            before = optax.tree.get(state, "skipped")
            _, g = vg(params, b, adaloss_state=state)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state, optax.tree.get(state, "skipped") > before
    flags: list[bool] = []
    t0 = time.perf_counter()
    with _Listening() as heard:
        for b in train:
            params, state, skipped = step(params, state, b)
            if monitor is not None:
                monitor(state)
            flags.append(bool(skipped))
    moved = {jax.tree_util.keystr(k): not np.array_equal(np.asarray(v), np.asarray(v0))
             for (k, v), v0 in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(init))}
    return _result(case, method, seed, flags, moved, l0, float(evaluate(params)), heard, None,
                   time.perf_counter() - t0)


# -- the table -------------------------------------------------------------------------------
def with_progress(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's progress against fp32 at the same case, framework and seed."""
    ref = {(r["framework"], r["case"], r["seed"]): r for r in rows
           if r["method"] == "fp32" and "final_loss" in r}
    for r in rows:
        f = ref.get((r["framework"], r["case"], r["seed"]))
        if "final_loss" not in r or f is None:
            continue
        gained = f["initial_loss"] - f["final_loss"]
        r["progress"] = (r["initial_loss"] - r["final_loss"]) / gained if gained > 0 else None
        if not math.isfinite(r["final_loss"]):
            r["progress"] = None
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--frameworks", nargs="*", default=list(FRAMEWORKS), choices=list(FRAMEWORKS))
    ap.add_argument("--methods", nargs="*", default=None, help="a subset of each framework's methods")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--describe", action="store_true",
                    help="rewrite the cases' titles, reports and notes in --json from this file (their "
                         "parameters must be those the runs used), without running anything")
    args = ap.parse_args(argv)
    if args.describe:
        describe(args.json)
        return
    rows: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d")
    for name in args.cases:
        case = CASES[name]
        for seed in args.seeds:
            train, held, vocab = batches(case, seed)
            for fw in args.frameworks:
                run = run_torch if fw == "torch" else run_jax
                for method in FRAMEWORKS[fw]:
                    if args.methods and method not in args.methods and method != "fp32":
                        continue
                    row = {"framework": fw, **run(case, method, seed, train, held, vocab)}
                    rows.append(row)
                    print(_line(row), flush=True)
    rows = with_progress(rows)
    if args.json:
        out = {"command": "python benchmarks/failures.py " + " ".join(sys.argv[1:]), "date": started,
               "versions": _versions(), "cases": {n: dataclasses.asdict(CASES[n]) for n in args.cases},
               "methods": FRAMEWORKS, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1, default=float) + "\n")


#: what a case says (rewritten by --describe), as opposed to what its runs used
_TEXT = ("title", "reports", "mechanism", "note")


def describe(path: Path) -> None:
    """Rewrite the text of the cases in ``path`` from :data:`CASES`; raises if a case's
    parameters differ from those its runs used."""
    data = json.loads(path.read_text())
    for name, saved in data["cases"].items():
        now = dataclasses.asdict(CASES[name])
        changed = [k for k in now if k not in _TEXT and now[k] != saved.get(k)
                   and not (isinstance(now[k], tuple) and list(now[k]) == saved.get(k))]
        if changed:
            raise ValueError(f"case {name}: {changed} differ from the runs'; rerun it")
        data["cases"][name] = now
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def _line(r: dict[str, Any]) -> str:
    head = f"{r['framework']:5} {r['case']:18} {r['method']:18} seed {r['seed']}"
    if "unsupported" in r:
        return f"{head}  cannot run: {r['unsupported'][:60]}"
    return (f"{head}  skipped {r['skipped']:3d} (run {r['longest_skip_run']:3d})  never moved "
            f"{len(r['never_moved']):2d}/{r['parameters']}  loss {r['initial_loss']:.3f} -> "
            f"{r['final_loss']:.3f}"
            f"  told {'yes' if r['told'] else 'no'}{'  CRASHED' if r['crashed'] else ''}  {r['seconds']}s")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("torch", "jax", "flax", "optax", "jmp", "deepspeed", "megatron-core", "fairscale"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


if __name__ == "__main__":
    main()
