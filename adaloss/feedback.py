"""What the measured feedback hears during one backward, kept the same way by both fronts.

A layer decision's scale is carried into the layers below it; where such a cotangent enters a
layer (or an fp8 cast), its subnormal fraction (or the cast's fp8 signal) is heard by every
decision behind its scale. After the backward, :func:`adaloss.decisions.signals` turns what
each decision heard into one underflow ratio per weight, which sets that weight's lift.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from adaloss.decisions import any_of


class Feedback:
    """Per layer decision, whether a cap or bound set its scale below the statistical one
    (``limited``) and the fractions it heard; per weight, ratios measured elsewhere (a
    scanned region's, over its iterations)."""

    def __init__(self) -> None:
        self.fractions: dict[str, list[Any]] = defaultdict(list)
        self.limited: dict[str, Any] = {}
        self.ratios: list[tuple[str, Any]] = []
        # (weight, ratio, ran): a conditional's, where ``ran`` says whether the branch taken
        # holds decisions of that weight
        self.branches: list[tuple[str, Any, Any]] = []

    def decided(self, name: str, limited: Any) -> None:
        """Layer decision ``name`` was made; ``limited``: a cap or bound set its scale."""
        self.limited[name] = limited

    def flags(self, behind: Iterable[str]) -> list[Any]:
        """The ``limited`` flags of the decisions ``behind`` a scale, in name order."""
        return [self.limited[n] for n in sorted(behind)]

    def held(self, behind: Iterable[str]) -> Any:
        """Whether a cap or bound limited any decision ``behind`` a scale (None: none is behind
        it; :func:`adaloss.decisions.any_of` of their :meth:`flags`)."""
        return any_of(self.flags(behind))

    def hear(self, behind: Iterable[str], fraction: Any) -> None:
        """A cotangent carrying the scale the decisions ``behind`` set reached a layer or a
        cast with this subnormal fraction (or fp8 signal)."""
        for name in behind:
            self.fractions[name].append(fraction)

    def signal_arguments(self, weight_of: Callable[[str], str]
                         ) -> tuple[tuple[str, ...], list[list[Any]], list[Any], list[tuple[str, Any]]]:
        """The arguments of :func:`adaloss.decisions.signals` after the config and the
        namespace: each decision's weight, its fractions, its flag, and the other ratios."""
        names = list(self.fractions)
        return (tuple(weight_of(n) for n in names), [self.fractions[n] for n in names],
                [self.limited[n] for n in names], list(self.ratios))

    def weights(self, weight_of: Callable[[str], str]) -> list[str]:
        """The weights :func:`adaloss.decisions.signals` returns a value for, in its order."""
        seen = [weight_of(n) for n in self.fractions] + [w for w, _ in self.ratios] \
            + [w for w, _, _ in self.branches]
        return list(dict.fromkeys(seen))
