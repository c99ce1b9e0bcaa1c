"""Per-parameter gradient error against a reference, framework-neutral (NumPy)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

import numpy as np

T = TypeVar("T")


class GradError(NamedTuple):
    """``‖g − g_ref‖ / ‖g_ref‖`` per parameter, summarised.

    Attributes:
      worst: the largest relative error over the compared parameters.
      median: their median.
      per_leaf: the error of every compared parameter.
      zero: parameters whose gradient is exactly zero while the reference's is not.
    """

    worst: float
    median: float
    per_leaf: dict[str, float]
    zero: list[str]


def relative_error(g: np.ndarray, ref: np.ndarray) -> float:
    """``‖g − ref‖ / ‖ref‖`` in float64 (inf when ``g`` is not finite)."""
    g = np.asarray(g, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


def grad_error(grads: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
               exclude: tuple[str, ...] = ()) -> GradError:
    """Compare ``grads`` with ``ref`` leaf by leaf (same keys).

    Leaves whose reference gradient is exactly zero, or whose name contains one of
    ``exclude`` (an analytically zero gradient, whose reference is rounding noise:
    e.g. BERT's attention key bias, under softmax's shift invariance), are left out.
    """
    missing = sorted(set(ref) - set(grads))
    if missing:
        raise KeyError(f"no gradient for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    per_leaf: dict[str, float] = {}
    zero: list[str] = []
    for name, r in ref.items():
        r = np.asarray(r)
        if any(e in name for e in exclude) or not np.any(r):
            continue
        g = np.asarray(grads[name])
        per_leaf[name] = relative_error(g, r)
        if not np.any(g):
            zero.append(name)
    if not per_leaf:
        raise ValueError("no parameter with a non-zero reference gradient to compare")
    errs = np.array(list(per_leaf.values()))
    return GradError(float(np.max(errs)), float(np.median(errs)), per_leaf, zero)


def largest_finite_power(finite_at: Callable[[int], tuple[bool, T]], lo: int = 0, hi: int = 100
                         ) -> tuple[int, T]:
    """The largest ``k`` in ``[lo, hi]`` with ``finite_at(k)[0]`` true, by bisection, with
    that call's result: the power-of-two global scale ``2^k`` a dynamic loss scale settles at
    once its growth has had time to act (it grows until a backward overflows, then halves).
    Assumes overflow is monotone in the scale; ``lo``'s result if even ``2^lo`` overflows."""
    ok, best = finite_at(lo)
    if not ok:
        return lo, best
    while hi > lo:
        mid = (lo + hi + 1) // 2
        ok, out = finite_at(mid)
        if ok:
            lo, best = mid, out
        else:
            hi = mid - 1
    return lo, best
