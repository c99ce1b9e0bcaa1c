"""``adaloss()``: the optax transformation that unscales adaptive-scaled gradients.

Each :class:`ScaledGrad` leaf is divided by its own scale in fp32; plain arrays
(from ``jax.grad``) pass through unchanged, and gradients none of whose float leaves is a
``ScaledGrad`` (``jax.value_and_grad`` kept where ``jax_adaloss.value_and_grad`` belongs: no
loss scaling at all) raise an ``AdaLossCoverageWarning`` that names the remedy. A step whose
unscaled gradients are not all finite is skipped and counted, with no exception and no host
sync.

Two forms:

- ``optax.chain(adaloss(), optax.adam(1e-3))``: on a skipped step this link
  emits zero updates, but later links still run on them (adam decays its
  moments, and its momentum still moves the parameters).
- ``adaloss(inner=optax.adam(1e-3))``: the guaranteed skip. ``inner`` runs on
  the unscaled gradients and, on a skipped step, its state is kept as it was
  and the updates are zero, so neither the parameters nor any optimizer state
  change. Use this form (``inner`` may be any optax transformation, a chain,
  or ``optax.MultiSteps``).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adaloss import solver
from adaloss.config import AdaLossConfig
from adaloss.report import AdaLossCoverageWarning
from jax_adaloss.scaled_grad import (
    MISPLACED,
    NO_LAYER,
    ScaledGrad,
    StatelessScaledGrad,
    is_scaled_grad,
)


class SkipRecord(NamedTuple):
    """What :func:`adaloss` kept of the latest skipped update, for
    :func:`jax_adaloss.skip_diagnosis` (and :class:`jax_adaloss.SkipMonitor`) to say why. Its
    fields' names are unique in an optax state (``optax.tree.get(state, "skip_step")``).

    Attributes:
      skip_step: the ``count`` of that update (int32; -1 before any skip).
      skip_mixed_scales: whether its scales were combined as values (bool).
      skip_leaves: fp32, one entry per parameter leaf (in the order ``jax.tree.leaves`` gives
        them): ``2 · trace + finite``, its gradient's ``ScaledGrad.trace`` (a plain
        array's: no layer, everything finite) and whether its unscaled gradient was finite.
        One array, so that keeping it costs one select on a GPU, not one per leaf.
    """

    skip_step: jax.Array
    skip_mixed_scales: jax.Array
    skip_leaves: jax.Array


class AdaLossState(NamedTuple):
    """State of :func:`adaloss`; read fields with ``optax.tree.get(state, "skipped")``.

    Attributes:
      count: updates seen (int32).
      skipped: updates skipped (int32): a gradient was not finite, or its scales were mixed.
      mixed_scales: updates skipped because a ``ScaledGrad``'s scale was combined with others
        as if it were a value (int32; ``ScaledGrad.inverse``): gradients reduced across
        devices or micro-batches with ``jax.lax.pmean``/``psum`` or ``jax.tree.map``. Reduce
        them with :func:`jax_adaloss.pmean` / :func:`jax_adaloss.psum` /
        :func:`jax_adaloss.tree_add` instead. Outside ``jit`` such an update raises.
      consecutive_skipped: skipped updates since the last finite one (int32).
      last_finite: whether the last update's gradients were all finite.
      scales: per-leaf fp32 scale of the last update's gradients (1 for plain arrays).
      backoff: the back-off exponent ``h`` (int32): every skipped step raises it by one,
        ``config.backoff_interval`` finite steps in a row lower it by one. Pass this state
        to the backward (``value_and_grad(...)(params, batch, adaloss_state=opt_state)``)
        and its decisions aim ``2^-h`` lower in the format's range, so that an overflow
        cannot recur step after step.
      backoff_good: finite steps since ``backoff`` last changed (int32).
      lift: per parameter leaf, the lift exponent ``k`` (int32) of the layer that leaf is the
        weight of (``AdaLossConfig.underflow_feedback``): raised by one after a step whose
        gradient reports (``ScaledGrad.underflow``) that the cotangents the layer scaled
        reached the next layers with more than ``T/2`` of their entries below ``u_min``,
        lowered by one below ``T/32`` (:func:`adaloss.solver.lift_update`); the backward given this
        state multiplies that layer's statistical scale by ``2^k``.
      last_skip: a :class:`SkipRecord` of the latest skipped update.
      inner_state: state of ``inner`` (``optax.EmptyState()`` without one).
    """

    count: jax.Array
    skipped: jax.Array
    mixed_scales: jax.Array
    consecutive_skipped: jax.Array
    last_finite: jax.Array
    scales: Any
    backoff: jax.Array
    backoff_good: jax.Array
    lift: jax.Array
    last_skip: SkipRecord
    inner_state: Any


def _one(_: Any) -> jax.Array:
    return jnp.ones((), jnp.float32)


#: the trace of a gradient that carries none (a plain array): no layer, everything finite
#: (:func:`~jax_adaloss.scaled_grad.encode_trace`, written out: importing runs no computation)
_CLEAN = 4.0 * NO_LAYER + 2.0 + 1.0


def _trace_of(g: Any) -> jax.Array:
    if isinstance(g, ScaledGrad) and g.trace is not None:
        return jnp.asarray(g.trace, jnp.float32)
    return jnp.full((), _CLEAN, jnp.float32)


def _no_skip(params: Any) -> SkipRecord:
    n = len(jax.tree.leaves(params))
    return SkipRecord(skip_step=jnp.full((), -1, jnp.int32), skip_mixed_scales=jnp.asarray(False),
                      skip_leaves=jnp.full((n,), 2 * _CLEAN + 1, jnp.float32))


def _refuse_stateless(updates: Any) -> None:
    """Raise (at trace time: the marker is a type) on gradients whose backward had no
    ``adaloss_state``: their decisions cannot back off, and an overflow that repeats would skip
    every step without a word."""
    leaves = jax.tree.leaves(updates, is_leaf=is_scaled_grad)
    if any(isinstance(g, StatelessScaledGrad) for g in leaves):
        raise ValueError(
            "adaloss(): these gradients come from a backward that was not given adaloss's state, so "
            "its scale decisions cannot back off after a skipped step, and an overflow that repeats "
            "(a confident model, a large loss) would skip every step. Pass the optimizer state to "
            "the backward: jax_adaloss.value_and_grad(loss_fn)(params, batch, "
            "adaloss_state=opt_state) (flax TrainState: adaloss_state=state.opt_state; nnx: "
            "adaloss_state=optimizer.opt_state), or adaloss_state=None to train without back-off.")


#: said when ``adaloss()`` is given float gradients none of which is a ``ScaledGrad``
PLAIN_GRADIENTS = (
    "adaloss(): none of these gradients is a ScaledGrad: they come from jax.value_and_grad or "
    "jax.grad, which computed them with no loss scaling at all (in fp16, gradients below 6e-8 "
    "are already zero), so adaloss() only passes them on. Compute them with "
    "jax_adaloss.value_and_grad(loss_fn)(params, batch, adaloss_state=opt_state) (or "
    "jax_adaloss.grad), the one other change a training step needs. To refuse such gradients "
    "instead: warnings.simplefilter('error', adaloss.report.AdaLossCoverageWarning).")


def _say_if_plain(updates: Any) -> None:
    """Warn (at trace time: once per compiled step) when float gradients hold no ``ScaledGrad``:
    the optimizer was swapped but the gradient function was not, and nothing is scaled."""
    leaves = jax.tree.leaves(updates, is_leaf=is_scaled_grad)
    floats = [g for g in leaves if isinstance(g, ScaledGrad)
              or (hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.inexact))]
    if floats and not any(isinstance(g, ScaledGrad) for g in floats):
        warnings.warn(PLAIN_GRADIENTS, AdaLossCoverageWarning, stacklevel=3)


#: said once per process by ``adaloss()`` without ``inner`` (the chain form)
CHAIN_SKIPS = (
    "adaloss() without inner=: on a skipped step it emits zero updates, and the "
    "transformations chained after it still run on them (optax.adam's moments decay and its "
    "momentum still moves the parameters). For a skip that changes neither the parameters nor "
    "any optimizer state, pass the optimizer inside: jax_adaloss.adaloss(inner=optax.adam(lr)).")
_said: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        warnings.warn(text, UserWarning, stacklevel=4)


def _unscale(g: Any) -> Any:
    if isinstance(g, ScaledGrad):
        return g.unscale()
    return g


def _scale_of(g: Any) -> jax.Array:
    return jnp.asarray(g.scale, jnp.float32) if isinstance(g, ScaledGrad) else _one(g)


def _finite(x: Any) -> jax.Array:
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.all(jnp.isfinite(x))
    return jnp.asarray(True)


def _stacked(leaves: list[jax.Array], dtype: Any) -> jax.Array:
    return jnp.stack(leaves).astype(dtype) if leaves else jnp.zeros((0,), dtype)


#: ``|scale · inverse − 1|`` above this: scales were combined (fp32 rounding of ``1 / scale``
#: for a scale that is not a power of two stays below 2^-23)
MISMATCH_TOL = 2.0**-20


def _consistent(updates: Any) -> jax.Array:
    """Whether every checked ``ScaledGrad`` still has ``scale · inverse = 1``; raises outside jit."""
    checked = [g.mismatch() for g in jax.tree.leaves(updates, is_leaf=is_scaled_grad)
               if isinstance(g, ScaledGrad) and g.inverse is not None]
    if not checked:
        return jnp.asarray(True)
    ok = jnp.max(jnp.stack(checked)) <= MISMATCH_TOL
    if not isinstance(ok, jax.core.Tracer) and not bool(ok):
        raise ValueError(MISPLACED.format(
            what="scale * inverse != 1: summed with jax.tree.map(jnp.add, ...), "
                 "averaged over devices whose scales differ, or clipped or scaled before adaloss"))
    return ok


def _zero_nonfinite(tree: Any, finite: jax.Array) -> Any:
    def f(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.where(finite, x, jnp.zeros_like(x))
        return x
    return jax.tree.map(f, tree)


def adaloss(config: AdaLossConfig | None = None,
            inner: optax.GradientTransformation | None = None
            ) -> optax.GradientTransformationExtraArgs:
    """Unscale per-leaf scaled gradients in fp32 and skip non-finite steps.

    Args:
      config: the :class:`~adaloss.config.AdaLossConfig` of the backward (its ``backoff_interval``;
        unscaling needs only the scales the gradients carry).
      inner: optional transformation to run on the unscaled gradients with a
        guaranteed skip (see the module docstring).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`AdaLossState`.
    """
    if config is not None and not isinstance(config, AdaLossConfig):
        if hasattr(config, "init") and hasattr(config, "update"):
            raise TypeError(
                f"adaloss(): its first argument is the AdaLossConfig, and this is an optax "
                f"transformation ({type(config).__name__}); pass the optimizer as inner: "
                "jax_adaloss.adaloss(inner=optax.adam(lr)) (or adaloss(config, inner=...)).")
        raise TypeError(f"config must be an AdaLossConfig, got {type(config).__name__}")
    config = AdaLossConfig() if config is None else config
    if inner is not None and hasattr(inner, "gradient_transformation"):
        inner = inner.gradient_transformation()  # optax.MultiSteps
    if inner is not None and not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"inner must be an optax GradientTransformation, got {type(inner).__name__}")
    wrapped = optax.with_extra_args_support(inner) if inner is not None else None

    def init(params: Any) -> AdaLossState:
        if wrapped is None:
            _say_once(CHAIN_SKIPS)
        def zero(_: Any = None) -> jax.Array:  # one buffer each: a jitted step may donate the state
            return jnp.zeros((), jnp.int32)
        return AdaLossState(
            count=zero(), skipped=zero(), mixed_scales=zero(), consecutive_skipped=zero(),
            last_finite=jnp.asarray(True),
            scales=jax.tree.map(_one, params),
            backoff=zero(), backoff_good=zero(), lift=jax.tree.map(zero, params),
            last_skip=_no_skip(params),
            inner_state=wrapped.init(params) if wrapped is not None else optax.EmptyState(),
        )

    def update(updates: Any, state: AdaLossState, params: Any = None,
               **extra_args: Any) -> tuple[Any, AdaLossState]:
        if not isinstance(state, AdaLossState):
            raise TypeError(
                f"adaloss() state must be an AdaLossState, got {type(state).__name__}. A checkpoint "
                "restored without a target (orbax's StandardCheckpointer.restore(path)) comes back as "
                "dicts: restore with an abstract target laid out as what was saved; for "
                "ckptr.save(path, {'params': params, 'opt_state': opt_state}): "
                "ckptr.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, "
                "{'params': params, 'opt_state': tx.init(params)})) (nnx: the abstract "
                "nnx.state(optimizer) from nnx.eval_shape).")
        _refuse_stateless(updates)
        _say_if_plain(updates)
        unscaled = jax.tree.map(_unscale, updates, is_leaf=is_scaled_grad)
        scales = jax.tree.map(_scale_of, updates, is_leaf=is_scaled_grad)
        grad_finite = _stacked([_finite(x) for x in jax.tree.leaves(unscaled)], jnp.bool_)
        finite = jnp.all(grad_finite)
        consistent = _consistent(updates)
        ok = finite & consistent
        unscaled = _zero_nonfinite(unscaled, ok)
        inner_state = state.inner_state
        if wrapped is not None:
            new_updates, new_inner = wrapped.update(unscaled, inner_state, params, **extra_args)
            new_updates = _zero_nonfinite(new_updates, ok)
            inner_state = optax.tree.where(ok, new_inner, inner_state)
        else:
            new_updates = unscaled
        skipped = jnp.logical_not(ok).astype(jnp.int32)
        backoff, good = solver.backoff_update(config, state.backoff, state.backoff_good, finite, jnp)

        def lift_one(g: Any, k: jax.Array) -> jax.Array:
            if not isinstance(g, ScaledGrad) or g.underflow is None:
                return k
            return solver.lift_update(config, k, g.underflow, finite, jnp)
        lift = jax.tree.map(lift_one, updates, state.lift, is_leaf=is_scaled_grad)
        traces = _stacked([_trace_of(g) for g in jax.tree.leaves(updates, is_leaf=is_scaled_grad)],
                          jnp.float32)
        seen = SkipRecord(skip_step=state.count, skip_mixed_scales=jnp.logical_not(consistent),
                          skip_leaves=2 * traces + grad_finite.astype(jnp.float32))
        return new_updates, AdaLossState(
            count=optax.safe_increment(state.count),
            skipped=state.skipped + skipped,
            mixed_scales=state.mixed_scales + jnp.logical_not(consistent).astype(jnp.int32),
            consecutive_skipped=jnp.where(ok, 0, state.consecutive_skipped + 1),
            last_finite=finite,
            scales=scales,
            backoff=backoff, backoff_good=good, lift=lift,
            last_skip=optax.tree.where(ok, state.last_skip, seen),
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init, update)
