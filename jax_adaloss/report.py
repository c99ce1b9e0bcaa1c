"""What a scale-propagating backward decided, for logging."""

from __future__ import annotations

from typing import NamedTuple

import jax

from adaloss.report import Coverage, LayerReport

__all__ = ["BackwardReport", "Coverage", "LayerReport"]


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
    cotangents: dict[str, jax.Array]
    cotangent_scales: dict[str, jax.Array]
    coverage: Coverage
