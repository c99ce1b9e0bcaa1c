"""Measure gradient underflow per layer: a low-precision backward against an fp32 one.

For every weighted layer of ``fun`` (named as in :class:`BackwardReport`), the
cotangent entering the layer is captured in a low-precision backward under a
scaling method (adaptive, or one global loss scale; 1 means no scaling) and in
a reference backward of ``reference`` at the same arguments. An entry non-zero in the
second that the first holds below ``u_min`` underflowed (``measured``, what ``T`` bounds);
one it holds at zero was lost outright (``flushed``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from adaloss import solver
from adaloss.config import AdaLossConfig
from adaloss.report import LayerUnderflow, compare_layers, measurement_config
from jax_adaloss.api import _value_and_grad


@functools.lru_cache(maxsize=32)
def _jitted(fun: Callable[..., Any], argnums: int | tuple[int, ...], config: AdaLossConfig,
            adaptive: bool) -> Callable[..., Any]:
    """One compiled capturing backward per (function, argnums, config, mode)."""
    return jax.jit(_value_and_grad(fun, argnums, config=config, return_report=True, capture_cotangents=True,
                                   reference=None if adaptive else "global"))


def layer_cotangents(fun: Callable[..., Any], *args: Any, argnums: int | Sequence[int] = 0,
                     loss_scale: float | None = None, config: AdaLossConfig | None = None,
                     state: Any = None) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``{layer name: (incoming cotangent as carried, the scale it carries)}`` in ``fun``'s
    backward (casts included, named ``cast:k``).

    ``loss_scale=None``: adaptive per-layer scaling with ``config``; a number: one
    global loss scale (the seed of the backward), no per-layer scales. ``state``: a training
    run's optimizer state holding :func:`jax_adaloss.adaloss`'s, whose back-off and lifts the
    adaptive backward then applies (as the run's next step would).
    """
    config = measurement_config(config, loss_scale)
    kwargs = {} if state is None or loss_scale is not None else {"adaloss_state": state}
    _, report = _jitted(fun, argnums if isinstance(argnums, int) else tuple(argnums), config,
                        loss_scale is None)(*args, **kwargs)
    return {k: (v, report.cotangent_scales[k]) for k, v in report.cotangents.items()}


def compare_cotangents(low: dict[str, tuple[Any, Any]], ref: dict[str, tuple[Any, Any]],
                       config: AdaLossConfig) -> dict[str, LayerUnderflow]:
    """Per layer present in both (casts left out): measured and predicted underflow.

    ``ref``'s cotangents must be unscaled (carried scale 1)."""
    def predicted(r: Any, scale: Any) -> jax.Array:
        sigma = jnp.sqrt(solver.variance(solver.tensor_stats(jnp.asarray(r, jnp.float32), jnp), jnp))
        return solver.predicted_underflow(config, sigma, jnp.asarray(scale, jnp.float32),
                                          jax.scipy.special.erf, jnp)
    return compare_layers(low, ref, predicted, config.underflow_limit)


def measure_underflow(fun: Callable[..., Any], reference: Callable[..., Any], *args: Any,
                      argnums: int | Sequence[int] = 0, loss_scale: float | None = None,
                      config: AdaLossConfig | None = None) -> dict[str, LayerUnderflow]:
    """Per-layer underflow of ``fun``'s low-precision backward, against ``reference``'s.

    ``fun`` and ``reference`` take the same arguments (e.g. the same model in fp16
    and in fp32). ``loss_scale=None`` measures adaptive scaling (``config``); a
    number measures one global loss scale (``1``: no scaling).
    """
    config = AdaLossConfig() if config is None else config
    low = layer_cotangents(fun, *args, argnums=argnums, loss_scale=loss_scale, config=config)
    ref = layer_cotangents(reference, *args, argnums=argnums, loss_scale=1.0, config=config)
    return compare_cotangents(low, ref, config)


__all__ = ["LayerUnderflow", "compare_cotangents", "layer_cotangents", "measure_underflow"]
