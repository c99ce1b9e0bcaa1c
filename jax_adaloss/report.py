"""What a scale-propagating backward decided, for logging."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from adaloss.report import Coverage, LayerReport

__all__ = ["BackwardReport", "CastSites", "Coverage", "LayerReport"]


@dataclasses.dataclass(frozen=True)
class CastSites:
    """What each cast decision casts, by its name: ``(("cast:0", "float16 → float32 (8, 16, 40)
    at model.py:42 (loss)"), ...)`` (its cotangent's dtype, the widened value's dtype and shape,
    and the line of the user's code that widened it). Static (a pytree with no leaves): it
    passes through ``jit`` as part of the report's structure."""

    sites: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, str]:
        """``{name: what}``."""
        return dict(self.sites)


jax.tree_util.register_static(CastSites)


class BackwardReport(NamedTuple):
    """Per-layer decisions of one backward, keyed by layer name.

    A weighted layer is named after its weight's path in the differentiated
    arguments (``params/Dense_0/kernel``; ``…@1`` for a second use of the same
    weight); a narrowing cast ``cast:k`` (k-th in forward order). ``cotangents``
    holds each layer's incoming cotangent (as carried, i.e. multiplied by its
    incoming scale) when requested with ``capture_cotangents=True``, else is empty;
    ``cotangent_scales`` the scale each of those carries. ``coverage`` counts the
    matmuls/convolutions seen, the layers scaled and the opaque regions; ``casts`` what each
    cast outside a region casts (:class:`~jax_adaloss.report.CastSites`).
    """

    layers: dict[str, LayerReport]
    cotangents: dict[str, jax.Array]
    cotangent_scales: dict[str, jax.Array]
    coverage: Coverage
    casts: CastSites = CastSites()
