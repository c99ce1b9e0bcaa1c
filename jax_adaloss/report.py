"""What a scale-propagating backward decided, for logging and for ``update_every``."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from adaloss.report import Coverage, LayerReport

__all__ = ["BackwardReport", "Coverage", "LayerReport", "ScaleCache"]


class ScaleCache(NamedTuple):
    """Per-layer statistical scales kept between calls for ``update_every > 1``.

    Pass the ``cache`` of the previous call's report as ``adaloss_cache=``.
    """

    step: jax.Array  # int32: calls made so far
    model_scales: dict[str, jax.Array]
    # the spread behind each model scale: σ (layers) or the log-normal LogStats (casts)
    spreads: dict[str, Any]


class BackwardReport(NamedTuple):
    """Per-layer decisions of one backward, keyed by layer name.

    A weighted layer is named after its weight's path in the differentiated
    arguments (``params/Dense_0/kernel``; ``…@1`` for a second use of the same
    weight); a narrowing cast ``cast:k`` (k-th in forward order). ``cotangents``
    holds each layer's incoming cotangent (as carried, i.e. multiplied by its
    incoming scale) when requested with ``capture_cotangents=True``, else is empty;
    ``cotangent_scales`` the scale each of those carries. ``coverage`` counts the
    matmuls/convolutions seen, the layers scaled and the opaque regions.
    """

    layers: dict[str, LayerReport]
    cache: ScaleCache
    cotangents: dict[str, jax.Array]
    cotangent_scales: dict[str, jax.Array]
    coverage: Coverage
