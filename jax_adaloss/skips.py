"""Saying why steps are skipped, outside the jitted step.

:func:`jax_adaloss.adaloss` skips an update whose gradients hold an inf or NaN, counts it
(``skipped``, ``consecutive_skipped``) and keeps a :class:`~jax_adaloss.transform.SkipRecord` of
the latest one in its state, all on device: the step has no conditional and no callback, whose
predicate or data XLA:GPU would read on the host every step. The host reads them here:

- :func:`skip_diagnosis` (reads the device): why the latest skipped update was skipped
  (:func:`adaloss.skips.diagnose`: a non-finite loss, the first layer whose backward made an
  inf/NaN, a weight gradient that overflowed, by name).
- :class:`SkipMonitor`, called with the optimizer state after each step: it warns once per run
  of ``after`` skipped updates in a row (:class:`adaloss.skips.SkippedStepsWarning`), with the
  diagnosis. It never waits for the device: each call dispatches one tiny copy of three counters
  and starts their transfer to the host, and reads the copies of earlier steps once they are
  there (so a warning comes a step or two late); the state itself is read only to warn.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaloss.skips import (
    WARN_AFTER,
    LayerCheck,
    SkipDiagnosis,
    SkippedStepsWarning,
    SkipRate,
    checked_after,
    diagnose,
    warning_text,
)
from jax_adaloss.api import _leaf_name
from jax_adaloss.scaled_grad import NO_LAYER, decode_trace
from jax_adaloss.transform import AdaLossState


def _field(opt_state: Any, name: str, owner: str) -> Any:
    """``owner.name`` inside ``opt_state`` (an optax state, a flax ``TrainState``'s, an nnx
    ``Optimizer.opt_state``)."""
    got = optax.tree.get(opt_state, name,
                         filtering=lambda path, _: getattr(path[-1], "tuple_name", None) == owner)
    if got is None:
        raise TypeError("expected a pytree holding one jax_adaloss.adaloss() state (e.g. the optimizer "
                        f"state), got {type(opt_state).__name__}")
    return got


def _host(x: Any) -> np.ndarray:
    return np.asarray(getattr(x, "value", x))  # (an nnx Variable holds its array)


def skip_diagnosis(opt_state: Any) -> SkipDiagnosis | None:
    """Why the latest skipped update of the :func:`jax_adaloss.adaloss` state in ``opt_state``
    was skipped (``None``: none was). Reads the device."""
    record = _field(opt_state, "last_skip", "AdaLossState")
    if int(_host(record.skip_step)) < 0:
        return None
    leaves = jax.tree_util.tree_flatten_with_path(_field(opt_state, "scales", "AdaLossState"))[0]
    names = [_leaf_name(0, path, False) for path, _ in leaves]
    codes = [int(c) for c in _host(record.skip_leaves)]
    parts = [decode_trace(c >> 1) for c in codes]
    layers = sorted((position, name, ok) for name, (position, ok, _) in zip(names, parts)
                    if position < NO_LAYER)
    return diagnose(all(loss_ok for _, _, loss_ok in parts),
                    [LayerCheck(name, name, ok) for _, name, ok in layers],
                    {name: bool(c & 1) for name, c in zip(names, codes)},
                    bool(_host(record.skip_mixed_scales)))


_COUNTERS = ("count", "skipped", "consecutive_skipped")


def _follow(tree: Any, path: Any) -> Any:
    """The node at a key path (``jax.tree_util`` keys), or ``None`` where the tree differs."""
    for key in path:
        try:
            if isinstance(key, jax.tree_util.GetAttrKey):
                tree = getattr(tree, key.name)
            elif isinstance(key, jax.tree_util.DictKey):
                tree = tree[key.key]
            elif isinstance(key, jax.tree_util.SequenceKey):
                tree = tree[key.idx]
            else:
                return None
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
    return tree


@jax.jit
def _counters(count: jax.Array, skipped: jax.Array, in_a_row: jax.Array) -> jax.Array:
    return jnp.stack([count, skipped, in_a_row]).astype(jnp.int32)


class SkipMonitor:
    """Warns once per run of ``after`` skipped updates in a row, and when skips are frequent
    though never that many in a row (:class:`adaloss.skips.SkipRate`), with the cause
    (:func:`skip_diagnosis`), without waiting for the device.

    Call it with the optimizer state after each step (any pytree holding the
    :func:`jax_adaloss.adaloss` state: ``opt_state``, ``state.opt_state``,
    ``optimizer.opt_state``); at the end of training, :meth:`flush` reads what is still in
    flight. ``after=None`` never warns.

    >>> monitor = jax_adaloss.SkipMonitor()                        # doctest: +SKIP
    >>> for batch in data:                                          # doctest: +SKIP
    ...     params, opt_state, loss = step(params, opt_state, batch)
    ...     monitor(opt_state)
    """

    def __init__(self, after: int | None = WARN_AFTER) -> None:
        self.after = checked_after(after, "after")
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._warned_run: int | None = None  # the update count at which the run warned about began
        self._rate = SkipRate()  # skips too frequent, though never `after` in a row
        self._skipped: int | None = None  # the skipped count of the step read last
        # the outer state's type -> the key path to its AdaLossState (None: not an object in it)
        self._where: dict[type, Any] = {}

    def __call__(self, opt_state: Any) -> None:
        """Note this step's counters (a copy, transferred in the background) and warn for the
        earlier steps whose counters have arrived."""
        if self.after is None:
            return
        counts = _counters(*self._counters_of(opt_state))
        counts.copy_to_host_async()
        self._in_flight.append(counts)
        self._drain(opt_state, wait=False)

    def _counters_of(self, opt_state: Any) -> list[Any]:
        """``count``, ``skipped``, ``consecutive_skipped``: the way to the
        :class:`~jax_adaloss.AdaLossState` inside ``opt_state`` is found once per type of the
        outer state, then followed (a search walks the whole state); by name where it holds no
        such object (an nnx ``Optimizer``'s state holds its arrays in variables)."""
        key = type(opt_state)
        if key not in self._where:
            found = jax.tree_util.tree_flatten_with_path(
                opt_state, is_leaf=lambda x: isinstance(x, AdaLossState))[0]
            paths = [path for path, x in found if isinstance(x, AdaLossState)]
            self._where[key] = paths[0] if len(paths) == 1 else None
        path = self._where[key]
        state = _follow(opt_state, path) if path is not None else None
        if not isinstance(state, AdaLossState):
            return [_field(opt_state, f, "AdaLossState") for f in _COUNTERS]
        return [state.count, state.skipped, state.consecutive_skipped]

    def flush(self, opt_state: Any) -> None:
        """Wait for every noted step's counters and warn where due."""
        self._drain(opt_state, wait=True)

    def _drain(self, opt_state: Any, wait: bool) -> None:
        while self._in_flight and (wait or self._in_flight[0].is_ready()):
            count, skipped, in_a_row = (int(v) for v in np.asarray(self._in_flight.popleft()))
            started = count - in_a_row
            frequent = self._rate.note(self._skipped is not None and skipped > self._skipped)
            self._skipped = skipped
            if in_a_row >= self.after and started != self._warned_run:
                self._warned_run = started
                diagnosis = skip_diagnosis(opt_state)
                warnings.warn(warning_text(diagnosis, in_a_row, skipped, count), SkippedStepsWarning,
                              stacklevel=3)
            elif frequent:
                warnings.warn(self._rate.text(skip_diagnosis(opt_state), skipped, count),
                              SkippedStepsWarning, stacklevel=3)
