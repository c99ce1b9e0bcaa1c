"""What a scale-propagating backward decided, for logging and for ``update_every``."""

from __future__ import annotations

from typing import NamedTuple

import jax


class LayerReport(NamedTuple):
    """One scale decision of the last backward (a weighted layer or a narrowing cast).

    Attributes:
      scale: the scale this layer applied to its input cotangent (fp32, may be < 1).
      model_scale: the statistical part of ``scale``, before the overflow caps.
      sigma: the modelled spread σ (σ_ln of ``log|g|`` for a cast).
      incoming_scale: scale ``P`` carried by the cotangent arriving at the layer.
      outgoing_scale: ``P · scale``, carried by the cotangent it sends on.
      predicted_underflow: fraction of the modelled quantity predicted to stay below u_min.
      grad_absmax: ``max|g|`` of the incoming cotangent (fp32).
      fan_in: ``n``, terms summed into each entry of the input gradient (1 for a cast).
    """

    scale: jax.Array
    model_scale: jax.Array
    sigma: jax.Array
    incoming_scale: jax.Array
    outgoing_scale: jax.Array
    predicted_underflow: jax.Array
    grad_absmax: jax.Array
    fan_in: jax.Array


class ScaleCache(NamedTuple):
    """Per-layer statistical scales kept between calls for ``update_every > 1``.

    Pass the ``cache`` of the previous call's report as ``adaloss_cache=``.
    """

    step: jax.Array  # int32: calls made so far
    model_scales: dict[str, jax.Array]


class BackwardReport(NamedTuple):
    """Per-layer decisions of one backward, keyed by layer name.

    A weighted layer is named after its weight's path in the differentiated
    arguments (``params/Dense_0/kernel``; ``…@1`` for a second use of the same
    weight); a narrowing cast ``cast:k`` (k-th in forward order).
    """

    layers: dict[str, LayerReport]
    cache: ScaleCache
