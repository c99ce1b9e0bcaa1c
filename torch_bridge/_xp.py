"""The array namespace :mod:`adaloss.solver` runs on for PyTorch tensors."""

from __future__ import annotations

import array_api_compat.torch as xp

__all__ = ["xp"]
