"""PyTorch models nobody here wrote, tiny configs, random init, no network.

Each :class:`TorchCase` builds a model from its library (HF ``transformers``,
``torchvision``, ``timm``) with a batch, and computes the loss as that
library's users do (HF: ``model(..., labels=...).loss``). The runners train
nothing: they take one backward of the same fp16-autocast forward under a given
loss factor and scaling method, and return fp32 gradients divided by the
factor, to compare with the same forward's loss-×1 gradients
(:func:`reference_grads`), which isolates backward underflow from forward
rounding.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from adaloss.config import AdaLossConfig
from adaloss_zoo.metrics import largest_finite_power

_AUTOCAST = torch.float16


@dataclasses.dataclass(frozen=True)
class TorchCase:
    """A zoo model: ``build(seed) -> (model, batch)``, ``loss(model, batch) -> fp32 scalar``.

    ``exclude`` names parameters with an analytically zero gradient (left out of
    error metrics); ``input_layers`` are weighted modules fed by the data alone
    (their input needs no gradient, so they scale nothing).
    """

    name: str
    build: Callable[[int], tuple[torch.nn.Module, Any]]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    exclude: tuple[str, ...] = ()


def _tokens(seed: int, batch: int = 2, seq: int = 16, vocab: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _images(seed: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _gpt2(seed: int) -> tuple[torch.nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=4)
    return GPT2LMHeadModel(cfg), _tokens(seed)


def _llama(seed: int) -> tuple[torch.nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg), _tokens(seed)


def _qwen3_moe(seed: int) -> tuple[torch.nn.Module, Any]:
    """A mixture of experts in transformers' default configuration: its experts run as
    ``torch._grouped_mm`` over 3-D expert weights (no ``nn.Linear``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=128, max_position_embeddings=64)
    return Qwen3MoeForCausalLM(cfg), _tokens(seed)


def _bert(seed: int) -> tuple[torch.nn.Module, Any]:
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=64)
    return BertForMaskedLM(cfg), _tokens(seed)


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _resnet18(seed: int) -> tuple[torch.nn.Module, Any]:
    import torchvision
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=10), _images(seed)


def _vit(seed: int) -> tuple[torch.nn.Module, Any]:
    import timm
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                              num_classes=10)
    return model, _images(seed)


def _image_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


CASES: dict[str, TorchCase] = {c.name: c for c in (
    TorchCase("hf-gpt2", _gpt2, _lm_loss),
    TorchCase("hf-llama", _llama, _lm_loss),
    TorchCase("hf-qwen3-moe", _qwen3_moe, _lm_loss),
    # the key bias shifts every attention logit of a query equally: softmax ignores it
    TorchCase("hf-bert", _bert, _lm_loss, exclude=("attention.self.key.bias",)),
    TorchCase("torchvision-resnet18", _resnet18, _image_loss),
    TorchCase("timm-vit", _vit, _image_loss),
)}


def _weighted_modules() -> tuple[type, ...]:
    kinds: list[type] = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
    try:
        from transformers.pytorch_utils import Conv1D
        kinds.append(Conv1D)
    except ImportError:  # pragma: no cover - transformers is in the zoo extra
        pass
    return tuple(kinds)


def expected_layers(model: torch.nn.Module, batch: Any, loss: Callable[..., torch.Tensor]) -> Counter[str]:
    """Weighted modules (Linear, Conv, HF ``Conv1D``) whose input needs a gradient, by the
    name of their weight, counted per call: the layers adaptive scaling must find."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: Counter[str] = Counter()

    def hook(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            seen[names[id(mod.weight)]] += 1

    kinds = _weighted_modules()
    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, kinds)]
    try:
        with torch.autocast("cpu", dtype=_AUTOCAST):
            loss(model, batch)
    finally:
        for h in handles:
            h.remove()
    return seen


def found_layers(reports: dict[str, Any]) -> Counter[str]:
    """Layer reports (not casts) by weight name, counting ``name@k`` repeats."""
    out: Counter[str] = Counter()
    for name in reports:
        if not name.startswith("cast:"):
            out[re.sub(r"@\d+$", "", name)] += 1
    return out


def _grads(model: torch.nn.Module, factor: float) -> dict[str, np.ndarray]:
    out = {}
    for n, p in model.named_parameters():
        g = torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float()
        out[n] = (g / factor).numpy().astype(np.float64)
    return out


_LOGITS = [1.0]  # the logit multiplier of the forwards run inside ``logit_scale``


@contextlib.contextmanager
def logit_scale(k: float) -> Iterator[None]:
    """Multiply every zoo model's logits by ``k`` in the forwards run inside: a forward hook on
    its output layer (the last ``nn.Linear``: lm_head, BERT's decoder, resnet's fc, ViT's
    head), so the libraries' own losses see a confident softmax (``k = 10, 30``). The logits
    are upcast to fp32 first, as the JAX zoo does and as the losses do anyway; a multiplier
    applied in fp16 would amplify the cotangent after the cast's decision (see the README)."""
    _LOGITS.append(float(k))
    try:
        yield
    finally:
        _LOGITS.pop()


def _output_layer(model: torch.nn.Module) -> torch.nn.Module:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]


def _forward(case: TorchCase, model: torch.nn.Module, batch: Any, factor: float, seed: int,
             dtype: torch.dtype = _AUTOCAST) -> torch.Tensor:
    torch.manual_seed(seed)  # the same dropout masks in every run
    model.zero_grad(set_to_none=True)
    k = _LOGITS[-1]
    handle = None if k == 1.0 else _output_layer(model).register_forward_hook(
        lambda mod, args, out: out.float() * k)
    try:
        with torch.autocast("cpu", dtype=dtype):
            return factor * case.loss(model, batch)
    finally:
        if handle is not None:
            handle.remove()


def reference_grads(case: TorchCase, model: torch.nn.Module, batch: Any, seed: int = 0,
                    dtype: torch.dtype = _AUTOCAST) -> dict[str, np.ndarray]:
    """The same fp16 (``dtype``) forward's loss-×1 gradients (no scaling): the reference."""
    _forward(case, model, batch, 1.0, seed, dtype).backward()
    return _grads(model, 1.0)


@dataclasses.dataclass
class RunResult:
    """One backward under one method: gradients (÷ factor, fp32), what adaloss reported."""

    grads: dict[str, np.ndarray]
    skipped: int = 0  # backward passes discarded (non-finite) before this one
    layers: dict[str, Any] = dataclasses.field(default_factory=dict)
    coverage: Any = None
    warnings: list[str] = dataclasses.field(default_factory=list)


def run_adaloss(case: TorchCase, model: torch.nn.Module, batch: Any, factor: float,
                config: AdaLossConfig | None = None, seed: int = 0, max_tries: int = 32,
                dtype: torch.dtype = _AUTOCAST, warm: int = 0) -> RunResult:
    """:class:`torch_bridge.AdaLossScaler` on repeated backward passes of the same batch until
    one is finite (its back-off lowers the decisions after each), as :func:`run_gradscaler`;
    gradients unscaled by ``unscale_``, and the passes skipped before (``dtype``: autocast's).
    ``warm``: that many steps first (learning rate 0), so that the scaler's state (the lift the
    underflow feedback keeps) has seen the batch."""
    import torch_bridge
    scaler = torch_bridge.AdaLossScaler(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(warm):
            scaler.scale(_forward(case, model, batch, factor, seed, dtype)).backward()
            scaler.step(opt)
            scaler.update()
        for _ in range(max_tries):
            scaler.scale(_forward(case, model, batch, factor, seed, dtype)).backward()
            scaler.unscale_(opt)
            grads = _grads(model, factor)
            finite = all(np.isfinite(g).all() for g in grads.values())
            scaler.step(opt)
            scaler.update()
            if finite:
                break
    return RunResult(grads, skipped=scaler.skipped_steps, layers=scaler.layer_reports(),
                     coverage=scaler.coverage(), warnings=[str(w.message) for w in caught])


def run_torchao(case: TorchCase, model: torch.nn.Module, batch: Any, factor: float, recipe: str,
                seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> RunResult:
    """torchao's float8 training on a copy of ``model``: ``convert_to_float8_training`` with the
    ``recipe`` (``tensorwise``: e4m3 inputs and weights, e5m2 output gradients, each at its own
    amax; ``rowwise``: e4m3 for all three, per row, powers of two) and ``emulate=True`` (no FP8
    GEMM on this machine: the same quantized values in a wide matmul); one backward under
    ``dtype`` autocast, the loss × ``factor``. Its ``nn.Linear`` layers only (GPT-2's
    ``Conv1D``, convolutions and grouped expert matmuls stay in ``dtype``)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    converted = convert_to_float8_training(copy.deepcopy(model), config=config)
    _forward(case, converted, batch, factor, seed, dtype).backward()
    return RunResult(_grads(converted, factor))


def train(case: TorchCase, factor: float, steps: int, dynamic: bool = False,
          config: AdaLossConfig | None = None, seed: int = 0) -> list[bool]:
    """``steps`` of Adam (lr 1e-3) on the case's batch, a fresh model, the loss × ``factor``,
    with :class:`torch_bridge.AdaLossScaler` (``dynamic``: ``torch.amp.GradScaler`` at its
    defaults) in the AMP recipe: per step, whether it was skipped."""
    import torch_bridge
    model, batch = case.build(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if dynamic else torch_bridge.AdaLossScaler(model, config)
    flags = []
    for step in range(steps):
        before = scaler.get_scale() if dynamic else scaler.skipped_steps
        scaler.scale(_forward(case, model, batch, factor, seed + step)).backward()
        scaler.step(opt)
        scaler.update()
        flags.append(scaler.get_scale() < before if dynamic else scaler.skipped_steps > before)
    return flags


def run_gradscaler(case: TorchCase, model: torch.nn.Module, batch: Any, factor: float, seed: int = 0,
                   max_tries: int = 32) -> RunResult:
    """``torch.amp.GradScaler`` (its defaults: 2^16, halve on overflow) on repeated backward
    passes of the same batch until one is finite; its gradients and the skips before it."""
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for tries in range(max_tries):
        scaler.scale(_forward(case, model, batch, factor, seed)).backward()
        scaler.unscale_(opt)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        grads = _grads(model, factor)
        scaler.step(opt)
        scaler.update()
        if finite:
            return RunResult(grads, skipped=tries)
    return RunResult(grads, skipped=max_tries)


def run_converged(case: TorchCase, model: torch.nn.Module, batch: Any, factor: float,
                  seed: int = 0) -> tuple[int, RunResult]:
    """A global dynamic scale given the time to grow: the largest finite power-of-two scale
    ``2^k`` (:func:`adaloss_zoo.metrics.largest_finite_power`), ``k`` and its gradients."""
    def at(k: int) -> tuple[bool, RunResult]:
        r = run_static(case, model, batch, factor, 2.0**k, seed)
        return all(np.isfinite(g).all() for g in r.grads.values()), r
    return largest_finite_power(at)


def run_static(case: TorchCase, model: torch.nn.Module, batch: Any, factor: float, scale: float,
               seed: int = 0) -> RunResult:
    """One fixed loss scale (``scale=1``: plain fp16), unscaled in fp32."""
    (scale * _forward(case, model, batch, factor, seed)).backward()
    return RunResult(_grads(model, factor * scale))
