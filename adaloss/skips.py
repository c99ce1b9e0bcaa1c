"""Why a step was skipped, and when to say so: the diagnosis both fronts give.

A step is skipped when a gradient is inf or NaN. One skip now and then is the back-off at
work (each skipped step lowers every decision's target range by half). Several in a row are
not: a forward that overflows skips every step at any scale, and a backward that overflows
inside one op (an activation whose 16-bit intermediate overflows) may too. After
:data:`WARN_AFTER` skipped steps in a row each front warns once (a
:class:`SkippedStepsWarning`), naming the cause :func:`diagnose` finds, checked in this order:

1. ``loss``: the loss itself is inf or NaN. The forward overflowed; no loss scale helps.
2. ``cotangent``: the loss is finite, and walking the layer decisions from the loss back
   (the order the backward reaches them), the first whose incoming cotangent is not finite
   is layer ``X``: the inf/NaN was made after the decision before it (``Y``, or the loss) had
   a finite cotangent, in the backward of the ops between ``X``'s output and ``Y``'s input
   (an activation, a normalization, attention, the loss function).
3. ``weight_gradient``: every cotangent up to layer ``X`` was finite, but the gradient of
   ``X``'s weight is not: the weight gradient, a sum over the batch, overflowed.
4. ``gradient``: a parameter's gradient is not finite though no cotangent a decision read
   was (a parameter without a layer: a bias, a norm's scale, an embedding).
5. ``mixed_scales`` (JAX): scaled gradients were combined as if their scales were values.
6. ``unknown``: nothing the backward read was non-finite: the gradients were changed after
   it (an inf written in, a hook), or the inf/NaN arose where the fronts see no layer
   (inside a region compiled by ``torch.compile``, or a scanned body).

The fronts collect the facts (the loss, each decision's ``max|g|``, each gradient) on the host
only for skipped steps; the diagnosis and the message are written here once.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import NamedTuple

#: Skipped steps in a row after which a front warns (once per run of skipped steps).
WARN_AFTER = 3
#: The steps :class:`SkipRate` looks back over.
RATE_WINDOW = 100
#: A front also warns when more than this share of the last :data:`RATE_WINDOW` steps were
#: skipped (:class:`SkipRate`): skips that never come :data:`WARN_AFTER` in a row (a forward that
#: overflows on one batch in three) would otherwise go unsaid.
RATE_WARN = 0.2


def checked_after(value: int | None, name: str) -> int | None:
    """``value`` (skipped steps in a row before a front warns; ``None``: never), or a
    ``ValueError`` naming ``name``."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


class SkippedStepsWarning(RuntimeWarning):
    """Steps are being skipped in a row: what :func:`diagnose` found, and the remedy."""


class SkipCause(enum.Enum):
    """Why a step was skipped (see the module docstring for the order they are checked in)."""

    LOSS = "loss"
    COTANGENT = "cotangent"
    WEIGHT_GRADIENT = "weight_gradient"
    GRADIENT = "gradient"
    MIXED_SCALES = "mixed_scales"
    UNKNOWN = "unknown"


class LayerCheck(NamedTuple):
    """One decision of a backward: its name (a layer is named after its weight, ``w@1`` for a
    second use of ``w``; ``cast:…`` for a narrowing cast), the weight whose gradient it makes
    (``None``: none) and whether its incoming cotangent was finite."""

    name: str
    weight: str | None
    finite: bool


@dataclasses.dataclass(frozen=True)
class SkipDiagnosis:
    """The cause of a skipped step.

    Attributes:
      cause: a :class:`SkipCause`.
      where: the layer (``cotangent``, ``weight_gradient``) or parameter (``gradient``) named.
      after: for ``cotangent``: the decision just before ``where`` on the way back from the loss,
        whose cotangent was still finite (``None``: the loss itself).
    """

    cause: SkipCause
    where: str | None = None
    after: str | None = None

    def describe(self) -> str:
        """One sentence: what was not finite, and what to do."""
        c = self.cause
        if c is SkipCause.LOSS:
            return ("the loss itself is inf or NaN: the forward overflowed (an activation or a logit "
                    "beyond the 16-bit format's range, a log or a division of 0) or the data holds "
                    "inf/NaN. No loss scale can fix a forward overflow: compute the op that overflows "
                    "in fp32 (the loss, softmax and normalizations; under torch.autocast a custom "
                    "op may need .float()), use bf16, check the inputs, or lower the learning rate "
                    "if the model is diverging")
        if c is SkipCause.COTANGENT:
            before = (f"the one that reached {self.after!r} (the decision before it, from the loss)"
                      if self.after is not None else "the loss")
            return (f"the first inf/NaN cotangent reaches layer {self.where!r}, and {before} was "
                    "finite: the backward of the ops between them (an activation, a normalization, "
                    "attention, the loss function) made it, e.g. a 16-bit "
                    "intermediate that overflows although its result would not. Each skipped step "
                    "lowers the scales by half; if skips go on, compute those ops in fp32 (an "
                    "overflow that happens at scale 1 no scale can fix)")
        if c is SkipCause.WEIGHT_GRADIENT:
            return (f"the cotangent entering layer {self.where!r} was finite but its weight's "
                    "gradient is not: the weight gradient (a sum over the batch) overflowed. Each "
                    "skipped step lowers the scales by half; if skips go on, keep the weights "
                    "and their gradients in fp32 (autocast, or an fp32 master copy) or use a mean "
                    "rather than a sum over the batch")
        if c is SkipCause.GRADIENT:
            return (f"the gradient of {self.where!r} is inf or NaN while every cotangent a layer "
                    "received was finite: its backward (a bias, a norm's scale, an embedding) "
                    "overflowed, or the gradient was changed after the backward")
        if c is SkipCause.MIXED_SCALES:
            return ("scaled gradients were combined as if their scales were values (jax.lax.pmean, "
                    "jax.tree.map(jnp.add, ...)): reduce them with jax_adaloss.pmean / psum / tree_add")
        return ("no value the backward's decisions read was inf or NaN: the gradients were made "
                "non-finite after the backward (written in place, a hook, an optimizer wrapper), or "
                "inside a region without layer decisions (a module compiled by torch.compile, a scanned "
                "body)")


def diagnose(loss_finite: bool, layers: Sequence[LayerCheck], grads: Mapping[str, bool],
             mixed_scales: bool = False) -> SkipDiagnosis:
    """The cause of a skipped step from what it computed.

    Args:
      loss_finite: whether the loss was finite.
      layers: the decisions of the backward in the order it reached them (from the loss).
      grads: per parameter name, whether its gradient is finite (in any order; the first
        non-finite one in this order is named when no layer explains it).
      mixed_scales: whether scaled gradients were combined as values (JAX).
    """
    if not loss_finite:
        return SkipDiagnosis(SkipCause.LOSS)
    previous: str | None = None
    for check in layers:
        if not check.finite:
            return SkipDiagnosis(SkipCause.COTANGENT, check.name, previous)
        if check.weight is not None and grads.get(check.weight, True) is False:
            return SkipDiagnosis(SkipCause.WEIGHT_GRADIENT, check.name)
        previous = check.name
    bad = next((name for name, ok in grads.items() if not ok), None)
    if bad is not None:
        return SkipDiagnosis(SkipCause.GRADIENT, bad)
    if mixed_scales:
        return SkipDiagnosis(SkipCause.MIXED_SCALES)
    return SkipDiagnosis(SkipCause.UNKNOWN)


class SkipRate:
    """Which of the last :data:`RATE_WINDOW` steps were skipped. :meth:`note` says when to warn:
    once the share exceeds :data:`RATE_WARN`, and again only after it has fallen to half of it."""

    def __init__(self) -> None:
        self.recent: collections.deque[bool] = collections.deque(maxlen=RATE_WINDOW)
        self.said = False

    def note(self, skipped: bool) -> bool:
        """Note a step; whether to warn now."""
        self.recent.append(bool(skipped))
        share = sum(self.recent) / RATE_WINDOW
        if share <= RATE_WARN / 2:
            self.said = False
        if len(self.recent) == RATE_WINDOW and share > RATE_WARN and not self.said:
            self.said = True
            return True
        return False

    def text(self, diagnosis: SkipDiagnosis, skipped: int, steps: int) -> str:
        """The warning, with the latest skipped step's ``diagnosis``."""
        return (f"adaloss: {sum(self.recent)} of the last {RATE_WINDOW} optimizer steps were skipped "
                f"({skipped} of {steps} so far), fewer than {WARN_AFTER} in a row, because a gradient "
                f"is inf or NaN. Latest cause: {diagnosis.describe()}.")


def warning_text(diagnosis: SkipDiagnosis, in_a_row: int, skipped: int, steps: int) -> str:
    """The warning a front gives after ``in_a_row`` skipped steps in a row."""
    return (f"adaloss: {in_a_row} optimizer steps skipped in a row ({skipped} of {steps} so far) "
            f"because a gradient is inf or NaN. Cause: {diagnosis.describe()}.")

