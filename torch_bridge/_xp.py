"""Array namespaces :mod:`adaloss.solver`'s scalar formulas run on, for PyTorch gradients.

A layer's decision is ~30 operations on 0-d fp32 values. On an accelerator they
are 0-d tensors on the device (no host synchronisation); on the CPU the device
*is* the host, and the same fp32 arithmetic on NumPy scalars costs ~0.5 µs an
operation instead of ~4 µs for a 0-d tensor, which is most of the bridge's
overhead on small models. Both namespaces are ``array_api_compat``'s, with the
elementwise functions replaced by the library's own where they behave
identically on the solver's inputs (one dtype, fp32; Python floats are weak).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import array_api_compat.numpy as _compat_np
import array_api_compat.torch as _compat_torch
import numpy as np
import torch

_ELEMENTWISE = ("abs", "exp", "log", "sqrt", "isfinite", "maximum", "minimum", "where", "frexp",
                "ldexp", "ones_like", "zeros_like", "full_like", "stack", "reshape")


def _namespace(compat: Any, lib: Any, astype: Callable[..., Any]) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(**{k: getattr(compat, k) for k in dir(compat) if not k.startswith("_")})
    for name in _ELEMENTWISE:
        setattr(ns, name, getattr(lib, name))
    ns.astype = astype  # the solver never mutates what astype returns
    return ns


xp = _namespace(_compat_torch, torch,
                lambda x, dtype, /, *, copy=False: x if x.dtype == dtype and not copy else x.to(dtype))
np_xp = _namespace(_compat_np, np, lambda x, dtype, /, *, copy=False: np.asarray(x).astype(dtype, copy=copy))


def _np_clip(x: Any, /, min: Any = None, max: Any = None) -> Any:  # noqa: A002 (the standard's names)
    """The standard's ``clip`` on NumPy scalars in two ufuncs (NaN stays NaN), ~5x faster than
    ``array_api_compat``'s general one on a 0-d value."""
    if min is not None:
        x = np.maximum(x, min)
    return x if max is None else np.minimum(x, max)


np_xp.clip = _np_clip


class ScalarMath(NamedTuple):
    """Where a backward's scalar decisions are computed: ``xp`` with converters."""

    xp: Any
    to_xp: Callable[[torch.Tensor], Any]  # a 0-d fp32 tensor -> a value of ``xp``
    to_torch: Callable[[Any], torch.Tensor]  # and back (a 0-d fp32 tensor on the device)


def _np_to_torch(x: Any) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, dtype=np.float32))


def _torch_to_np(t: torch.Tensor) -> Any:
    """A CPU tensor's value for NumPy. A 0-d one (most of them) through ``tolist``, which
    dispatches no aten op (``.numpy()`` a ``detach``): a float of at most 32 bits (fp16, bf16
    too) as an fp32 scalar (exact: fp32 holds every such value), others in their kind."""
    if t.dim() == 0:
        v = t.tolist()
        if t.is_floating_point():
            return np.float32(v) if t.dtype.itemsize <= 4 else np.float64(v)
        return np.bool_(v) if t.dtype == torch.bool else np.int64(v)
    return t.numpy()


_IDENTITY = lambda x: x  # noqa: E731
ON_TENSORS = ScalarMath(xp, _IDENTITY, _IDENTITY)
ON_HOST = ScalarMath(np_xp, _torch_to_np, _np_to_torch)


def scalar_math(g: torch.Tensor, host_math: bool = True) -> ScalarMath:
    """NumPy scalars for plain CPU gradients ``g`` (if ``host_math``), 0-d tensors like ``g``
    otherwise: on an accelerator, and for a tensor subclass (a ``FakeTensor`` under
    ``FakeTensorMode``, a ``DTensor``), whose values NumPy cannot read."""
    plain = type(g) is torch.Tensor or type(g) is torch.nn.Parameter
    return ON_HOST if host_math and plain and g.device.type == "cpu" else ON_TENSORS


__all__ = ["ON_HOST", "ON_TENSORS", "ScalarMath", "np_xp", "scalar_math", "xp"]
