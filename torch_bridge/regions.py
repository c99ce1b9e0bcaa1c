"""Dynamic scales kept GradScaler's way: opaque regions' and the global backward's.

The inside of an opaque region (one autograd node running a backward of its own:
``torch.compile``d code, reentrant checkpoints) cannot be given per-layer scales, and its
incoming cotangent says little about what happens inside: a compiled model that computes its
loss in fp32 receives one fp32 number. A backward that cannot carry per-layer scales at all
(``torch.autograd.grad`` on a scaled loss, ``create_graph=True``: a gradient penalty's recipe)
has one scale for every gradient. Each of them keeps what ``torch.amp.GradScaler`` keeps for a
whole model: a scale ``D`` (start ``init_scale``, 2^16), multiplied by ``backoff_factor`` (0.5)
after a step with a non-finite gradient and by ``growth_factor`` (2) after ``growth_interval``
(2000) finite ones, updated on device by GradScaler's own kernel
(``torch._amp_update_scale_``). At a region's boundary the cotangent is brought to carry at least
``D`` (or more, if the log-normal cast rule asks for more), within the usual caps and bounds;
a global backward's loss is multiplied by ``D`` (:data:`GLOBAL`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000
#: the name of the global backward's scale among the regions' (no region is named so)
GLOBAL = "<global backward>"


class Growth(NamedTuple):
    """GradScaler's schedule of a dynamic scale (its constructor's arguments, validated as it does)."""

    init_scale: float = INIT_SCALE
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL

    def checked(self) -> Growth:
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"The growth factor must be > 1.0, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"The backoff factor must be < 1.0 (and > 0), got {self.backoff_factor}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval > 0):
            raise ValueError(f"growth_interval must be a positive int, got {self.growth_interval!r}")
        return self


def found_total(found_inf: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The per-device inf/NaN flags of one step summed on ``device`` (0: all finite), no sync."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    for f in found_inf:
        found = found + f.to(device)
    return found


class RegionScales:
    """Per-region dynamic scale ``D`` and growth tracker, keyed by region name."""

    def __init__(self, growth: Growth | None = None) -> None:
        self.growth = Growth() if growth is None else growth.checked()
        self._scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._loaded: dict[str, tuple[float, int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._scales or name in self._loaded

    def __bool__(self) -> bool:
        return bool(self._scales)

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        """``D`` of region ``name`` (a 0-d fp32 tensor on ``device``), created on first use."""
        entry = self._scales.get(name)
        if entry is None:
            value, tracker = self._loaded.pop(name, (self.growth.init_scale, 0))
            entry = (torch.full((), value, dtype=torch.float32, device=device),
                     torch.full((), tracker, dtype=torch.int32, device=device))
            self._scales[name] = entry
        return entry[0]

    def update(self, found_inf: list[torch.Tensor]) -> None:
        """One step: halve every ``D`` if any of ``found_inf`` is set, else count towards growth."""
        g = self.growth
        for scale, tracker in self._scales.values():
            found = found_total(found_inf, scale.device)
            torch._amp_update_scale_(scale, tracker, found, g.growth_factor, g.backoff_factor,
                                     g.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        out = {k: (float(v), int(t)) for k, (v, t) in self._scales.items()}
        out.update({k: v for k, v in self._loaded.items() if k not in out})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scales = {}
        self._loaded = {k: (float(v), int(t)) for k, (v, t) in state.items()}
