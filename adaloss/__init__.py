"""Framework-neutral core of adaptive loss scaling: the config, the solver's formulas and the
decisions both fronts make with them (:mod:`adaloss.decisions`, :mod:`adaloss.feedback`), the
reports.

Imports neither JAX nor PyTorch; ``jax_adaloss`` and ``torch_bridge`` build on it.
"""

from adaloss.config import GRAD_FORMATS, STAT_MODELS, AdaLossConfig, FormatLimits, format_limits

__all__ = ["AdaLossConfig", "FormatLimits", "GRAD_FORMATS", "STAT_MODELS", "format_limits"]
