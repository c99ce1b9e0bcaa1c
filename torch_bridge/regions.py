"""Dynamic scales for opaque regions: ``torch.compile``d code and reentrant checkpoints.

The inside of an opaque region (one autograd node running a backward of its own)
cannot be given per-layer scales, and its incoming cotangent says little about
what happens inside: a compiled model that computes its loss in fp32 receives
one fp32 number. Each region therefore keeps what ``torch.amp.GradScaler``
keeps for a whole model: a scale ``D`` (start 2^16), halved after a step with a
non-finite gradient and doubled after 2000 finite ones, updated on device by
GradScaler's own kernel (``torch._amp_update_scale_``). At the region's
boundary the cotangent is brought to carry at least ``D`` (or more, if the
log-normal cast rule asks for more), within the usual caps and bounds.
"""

from __future__ import annotations

from typing import Any

import torch

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


def found_total(found_inf: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The per-device inf/NaN flags of one step summed on ``device`` (0: all finite), no sync."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    for f in found_inf:
        found = found + f.to(device)
    return found


class RegionScales:
    """Per-region dynamic scale ``D`` and growth tracker, keyed by region name."""

    def __init__(self) -> None:
        self._scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._loaded: dict[str, tuple[float, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._scales)

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        """``D`` of region ``name`` (a 0-d fp32 tensor on ``device``), created on first use."""
        entry = self._scales.get(name)
        if entry is None:
            value, tracker = self._loaded.pop(name, (INIT_SCALE, 0))
            entry = (torch.full((), value, dtype=torch.float32, device=device),
                     torch.full((), tracker, dtype=torch.int32, device=device))
            self._scales[name] = entry
        return entry[0]

    def update(self, found_inf: list[torch.Tensor]) -> None:
        """One step: halve every ``D`` if any of ``found_inf`` is set, else count towards growth."""
        for scale, tracker in self._scales.values():
            found = found_total(found_inf, scale.device)
            torch._amp_update_scale_(scale, tracker, found, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL)

    def state_dict(self) -> dict[str, Any]:
        out = {k: (float(v), int(t)) for k, (v, t) in self._scales.items()}
        out.update({k: v for k, v in self._loaded.items() if k not in out})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scales = {}
        self._loaded = {k: (float(v), int(t)) for k, (v, t) in state.items()}
