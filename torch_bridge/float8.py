"""FP8 training for ``nn.Module``s: linear layers whose three GEMMs are ``torch._scaled_mm``.

:func:`convert_to_float8_training` replaces every ``nn.Linear`` and Hugging Face ``Conv1D``
(selected by ``module_filter_fn``, as torchao's conversion of the same name) with a
:class:`Float8Linear` that keeps the same parameters. Its forward quantizes the layer's input and
weight to ``config.operand_format`` (e4m3) at their own per-tensor scales
(:func:`adaloss.solver.operand_scale`: current scaling, a power of two) and multiplies the fp8
values in one ``torch._scaled_mm``; the backward's input-gradient and weight-gradient GEMMs are
``torch._scaled_mm`` of the cotangent in ``config.grad_format`` (e5m2) and the saved fp8
operands, accumulated in fp32 with the scales applied to the output.

Under :class:`~torch_bridge.AdaLossScaler` the cotangent's scale is adaloss's decision, made
before the GEMM that produces that cotangent (the scaler hands the layer its fp8 cotangent and
scale: no read of the tensor before its cast); without a scaler the layer casts the cotangent at
its own per-tensor current scale (torchao's tensorwise recipe).

Layout: the GEMMs' operands are laid out as CUDA's ``_scaled_mm`` requires (the first row-major,
the second column-major, e4m3 × e4m3 forward, e5m2 × e4m3 backward); shapes whose inner or outer
dimensions are not multiples of 16 run on a CPU only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaloss import solver
from adaloss.config import AdaLossConfig
from torch_bridge._xp import ScalarMath, xp
from torch_bridge.graph import FP8_NODE
from torch_bridge.layers import FP8_COTANGENT
from torch_bridge.stats import fp8_histogram, min_max

_F32 = torch.float32
assert FP8_NODE == "_Float8MatmulBackward"  # autograd's name for _Float8Matmul's node


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-d) with column-major strides: ``_scaled_mm``'s second operand."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def quantize(x: torch.Tensor, config: AdaLossConfig, fmt: str, limit: float, scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in the fp8 format ``fmt`` at ``scale`` (default: its own per-tensor current scale,
    :func:`adaloss.solver.operand_scale`), saturating (:func:`adaloss.solver.to_fp8`), and that
    scale as a 0-d fp32 tensor: ``x ≈ q / s``."""
    if scale is None:
        scale = solver.operand_scale(config, solver.absmax(min_max(x), xp), xp)  # one pass
    # a power of two scales a 16-bit x exactly in its own dtype (one pass, no fp32 copy)
    y = x * scale if config.power_of_two and x.dtype.itemsize == 2 else x.to(_F32) * scale
    return solver.to_fp8(y, getattr(torch, fmt), limit, xp), scale


def _gemm_dtype(dtype: torch.dtype, power_of_two: bool) -> torch.dtype:
    """What an FP8 GEMM returns: a bf16 result directly with power-of-two scales (the fp32
    accumulator times the scales, rounded once); fp32 otherwise, rounded to ``dtype`` after."""
    return dtype if power_of_two and dtype == torch.bfloat16 else _F32


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(_row_major(a), _col_major(b), scale_a=scale_a.to(_F32).reshape(()),
                            scale_b=scale_b.to(_F32).reshape(()), out_dtype=dtype)


class _Float8Matmul(torch.autograd.Function):
    """``x @ w + bias`` (``w``: ``[in, out]``) with fp8 operands, forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                config: AdaLossConfig, dtype: torch.dtype) -> torch.Tensor:
        shape = x.shape
        # the operands in the compute dtype first, as autocast's linear casts them
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        qx, sx = quantize(x2, config, config.operand_format, config.operand_limit)
        qw, sw = quantize(w.to(dtype), config, config.operand_format, config.operand_limit)
        out_dtype = _gemm_dtype(dtype, config.power_of_two)
        one = torch.ones((), dtype=_F32, device=x.device)
        y = _scaled_mm(qx, qw, one / sx, one / sw, out_dtype).to(dtype)
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(qx, qw, sx, sw)
        ctx.config, ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.dtype = config, shape, x.dtype, w.dtype, dtype
        ctx.has_bias = bias is not None
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        qx, qw, sx, sw = ctx.saved_tensors
        config: AdaLossConfig = ctx.config
        g2 = gy.reshape(-1, gy.shape[-1])
        handed = getattr(ctx, FP8_COTANGENT, None)
        if handed is not None:  # the scaler's: its decided scale, the cast already made
            delattr(ctx, FP8_COTANGENT)
            q, s = handed
            q = q.reshape(-1, q.shape[-1])
        else:  # standalone: the cotangent's own per-tensor current scale
            m = g2.abs().amax().to(_F32)
            s = torch.ones((), dtype=_F32, device=gy.device)
            q, sg = quantize(g2, config, config.grad_format, config.overflow_limit,
                             solver.fp8_fit_scale(config, m, s, xp).scale)
            s = s / sg
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = g @ wᵀ: [M, out] @ [out, in], in the compute dtype
            # (then in the input's, as autocast's cast of the input gives it)
            dx = _scaled_mm(q, qw.t(), s, 1 / sw, _gemm_dtype(ctx.dtype, config.power_of_two))
            dx = dx.to(ctx.dtype).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # dw = xᵀ @ g: [in, M] @ [M, out], accumulated in fp32
            dw = _scaled_mm(qx.t(), q, 1 / sx, s, _F32).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:  # from the cotangent the node received
            db = g2.sum(0, dtype=_F32) * (s if handed is not None else 1)
        return dx, dw, db, None, None

    @staticmethod
    def weight_statistics(ctx: Any, sm: ScalarMath) -> solver.TensorStats:
        """``E[W²]`` and ``max|W|`` of the weight the forward multiplied (its fp8 values
        dequantized), what a decision reads of it, in ``sm``'s namespace: from the histogram of
        the fp8 weight (:func:`torch_bridge.stats.fp8_histogram`), not a widened copy."""
        _, qw, _, sw = ctx.saved_tensors
        config: AdaLossConfig = ctx.config
        h = fp8_histogram(qw, 0.0, config.operand_limit, sm)
        s = sm.to_xp(sw)
        return solver.TensorStats(None, h.sq_sum / qw.numel() / (s * s), None, None, h.absmax / s)


class Float8Linear(torch.nn.Module):
    """A linear layer (``nn.Linear`` or HF ``Conv1D``) whose GEMMs are ``torch._scaled_mm``,
    holding the original layer's ``weight`` and ``bias`` parameters (optimizer state and
    parameter names unchanged).

    Args:
      weight, bias: the parameters; ``weight`` is ``[out, in]`` (``nn.Linear``) or, with
        ``transposed``, ``[in, out]`` (``Conv1D``).
      config: an :class:`~adaloss.config.AdaLossConfig` with an fp8 ``grad_format`` and
        ``operand_format``.
    """

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, config: AdaLossConfig,
                 transposed: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.config, self.transposed = config, transposed

    @property
    def in_features(self) -> int:
        return self.weight.shape[0 if self.transposed else 1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1 if self.transposed else 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            w = self.weight if self.transposed else self.weight.t()
            return _Float8Matmul.apply(x, w, self.bias, self.config, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, operands={self.config.operand_format}, "
                f"gradients={self.config.grad_format}")


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def convert_to_float8_training(module: torch.nn.Module, config: AdaLossConfig | None = None, *,
                               module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None
                               ) -> torch.nn.Module:
    """Replace, in place, every ``nn.Linear`` and HF ``Conv1D`` of ``module`` (those for which
    ``module_filter_fn(layer, fqn)`` is true, if given) by a :class:`Float8Linear` sharing its
    parameters, and return ``module`` (``module`` itself if it is such a layer: its
    replacement). ``config`` defaults to e5m2 gradients and e4m3 operands; train the result
    with :class:`~torch_bridge.AdaLossScaler` given the same config. Convolutions are not
    converted. Raises where nothing was converted."""
    config = AdaLossConfig(grad_format="float8_e5m2", operand_format="float8_e4m3fn") if config is None \
        else config
    if not isinstance(config, AdaLossConfig):
        raise TypeError(f"config must be an AdaLossConfig, got {type(config).__name__}")
    if not config.fp8 or config.operand_format is None:
        raise ValueError("convert_to_float8_training needs an fp8 grad_format and an operand_format, "
                         f"got grad_format={config.grad_format!r}, operand_format={config.operand_format!r}")
    conv1d = _conv1d_type()

    def replacement(layer: torch.nn.Module, fqn: str) -> Float8Linear | None:
        linear = type(layer) is torch.nn.Linear
        if not (linear or (conv1d is not None and isinstance(layer, conv1d))):
            return None
        if module_filter_fn is not None and not module_filter_fn(layer, fqn):
            return None
        return Float8Linear(layer.weight, layer.bias, config, transposed=not linear)

    converted = 0
    top = replacement(module, "")
    if top is not None:
        return top
    for fqn, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child, f"{fqn}.{name}" if fqn else name)
            if new is not None:
                setattr(parent, name, new)
                converted += 1
    if not converted:
        raise ValueError(f"convert_to_float8_training: no nn.Linear or Conv1D in {type(module).__name__} "
                         "was converted (none there, or module_filter_fn refused them all)")
    return module


__all__ = ["Float8Linear", "convert_to_float8_training", "quantize"]
