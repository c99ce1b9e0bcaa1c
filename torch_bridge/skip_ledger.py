"""The skipped steps of an :class:`~torch_bridge.scaler.AdaLossScaler`: counted, diagnosed from
the iteration's backwards (:func:`adaloss.skips.diagnose`: a non-finite loss, or the first layer
whose backward made an inf/NaN), and said once per run of ``warn_after`` in a row."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from adaloss import skips
from adaloss.report import weight_of
from torch_bridge.sharded import local_grad, own_values

if TYPE_CHECKING:
    from torch_bridge.hooks import BackwardRecord


class SkipLedger:
    """Skipped optimizer steps and iterations, and why.

    ``steps``: optimizer steps skipped; ``last``: whether the latest ``step()`` skipped;
    ``run``: iterations in a row, up to the last ``update()``, whose step was skipped;
    ``iterations``: such iterations in all; ``last_skip``: the latest diagnosis; ``causes``:
    skipped iterations per :class:`adaloss.skips.SkipCause` value. ``records``: the backwards of
    the iteration in progress (their losses and decisions say why it skipped).
    """

    def __init__(self, warn_after: int | None) -> None:
        self.warn_after = skips.checked_after(warn_after, "warn_after_skips")
        self.steps = 0
        self.last = False
        self.this_iteration = False  # a step() of the iteration in progress skipped
        self.records: list[BackwardRecord] = []
        self.run = 0
        self.iterations = 0
        self.last_skip: skips.SkipDiagnosis | None = None
        self.causes: dict[str, int] = {}
        self.rate = skips.SkipRate()  # skips too frequent, though never warn_after in a row

    def stepped(self, skipped: bool) -> None:
        """A ``step()`` (or ``scale_loss`` exit) read its inf/NaN flag: ``skipped`` or not."""
        self.last = skipped
        self.this_iteration |= skipped
        if skipped:
            self.steps += 1

    def end_iteration(self, model: torch.nn.Module | None, last: BackwardRecord | None,
                      iteration: int) -> str | None:
        """After an iteration's ``update()``: count it if a step skipped, say why (reading the
        device only now), and return the warning's text once per run of ``warn_after`` in a row,
        or when skips are frequent though never that many in a row (:class:`adaloss.skips.SkipRate`),
        else ``None``; the iteration's records are dropped."""
        skipped, self.this_iteration = self.this_iteration, False
        records, self.records = self.records or ([last] if last is not None else []), []
        frequent = self.rate.note(skipped) and self.warn_after is not None
        if not skipped:
            self.run = 0
        else:
            self.run += 1
            self.iterations += 1
            diagnosis = _diagnose(model, records)
            self.last_skip = diagnosis
            self.causes[diagnosis.cause.value] = self.causes.get(diagnosis.cause.value, 0) + 1
            if self.run == self.warn_after:
                return skips.warning_text(diagnosis, self.run, self.iterations, iteration)
        if frequent and self.last_skip is not None:
            return self.rate.text(self.last_skip, self.iterations, iteration)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"in_a_row": self.run, "iterations": self.iterations, "causes": dict(self.causes)}

    def load_state_dict(self, steps: int, counted: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``counted``; empty: a state saved before it existed) and the
        count of skipped optimizer ``steps``."""
        self.steps = steps
        self.run = int(counted.get("in_a_row", 0))
        self.iterations = int(counted.get("iterations", steps))
        self.causes = {str(k): int(v) for k, v in counted.get("causes", {}).items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "records": []}  # (the backwards' graphs stay in their process)


def _diagnose(model: torch.nn.Module | None, records: list[BackwardRecord]) -> skips.SkipDiagnosis:
    """:func:`adaloss.skips.diagnose` from an iteration's backwards (their losses, each decision's
    ``max|g|``, in the order the backward reached them) and the model's gradients."""
    loss_finite = all(r.loss is None or bool(torch.isfinite(r.loss).all()) for r in records)
    checks: list[list[skips.LayerCheck]] = []
    for r in records:
        decided = [(name, d.to_torch(r.math)) for name, d in r.decisions.items()]
        checks.append([skips.LayerCheck(name, None if d.kind == "cast" else weight_of(name),
                                        bool(torch.isfinite(d.absmax).all()))
                       for name, d in reversed(decided)])  # (recorded in forward order)
    layers = next((c for c in checks if not all(k.finite for k in c)), checks[-1] if checks else [])
    grads = {} if model is None else {
        name: bool(torch.isfinite(own_values(local_grad(p.grad))).all())
        for name, p in model.named_parameters() if p.grad is not None}
    return skips.diagnose(loss_finite, layers, grads)

