"""The array namespace :mod:`adaloss.solver` runs on for PyTorch tensors.

``array_api_compat.torch``, with its elementwise functions replaced by torch's
own where they behave identically on the solver's inputs (0-d fp32 tensors of
one dtype and device): the compatibility wrappers cost ~5 µs a call (type
promotion checks), which adds up to milliseconds per backward on the
~30 scalar operations of each layer's decision.
"""

from __future__ import annotations

import types
from typing import Any

import array_api_compat.torch as _compat
import torch


def _astype(x: torch.Tensor, dtype: torch.dtype, /, *, copy: bool = True) -> torch.Tensor:
    return x if x.dtype == dtype and not copy else x.to(dtype)


_FAST: dict[str, Any] = {
    name: getattr(torch, name)
    for name in ("abs", "exp", "log", "sqrt", "isfinite", "maximum", "minimum", "where", "frexp",
                 "ldexp", "ones_like", "zeros_like", "full_like", "stack", "reshape")
}
# the solver never mutates what astype returns
_FAST["astype"] = lambda x, dtype, /, *, copy=False: _astype(x, dtype, copy=copy)

xp = types.SimpleNamespace(**{k: getattr(_compat, k) for k in dir(_compat) if not k.startswith("_")})
for _name, _fn in _FAST.items():
    setattr(xp, _name, _fn)

__all__ = ["xp"]
