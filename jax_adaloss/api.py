"""``value_and_grad`` and ``grad``: jax's calling convention, adaptive loss scaling inside."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaloss import solver
from adaloss.config import AdaLossConfig
from jax_adaloss import _nnx, reductions
from jax_adaloss.backward import REFERENCES, Reference, scaled_backward
from jax_adaloss.report import BackwardReport
from jax_adaloss.scaled_grad import (
    NO_LAYER,
    ScaledGrad,
    encode_trace,
    mark_stateless,
    rescale,
    trace_parts,
)
from jax_adaloss.weight_grads import is_float

CACHE_KWARG = "adaloss_cache"  # (refused: gone with update_every, see wrapped)
STATE_KWARG = "adaloss_state"

Argnums = Any  # int | nnx.DiffState | a sequence of them


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _leaf_name(argi: int, path: Any, prefixed: bool) -> str:
    """``a/b/c`` path of a differentiated leaf (``argN/…`` when several args are differentiated);
    an nnx ``Variable``'s trailing ``/value`` is left out."""
    keys = list(path)
    if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
        keys = keys[:-1]
    rest = jax.tree_util.keystr(tuple(keys), simple=True, separator="/")
    if not rest:
        return f"arg{argi}"
    return f"arg{argi}/{rest}" if prefixed else rest


def _weight_nums(weights: int | Sequence[int] | None, pos: tuple[int, ...], n: int
                 ) -> tuple[int, ...] | None:
    """Positions of the weight arguments (``None``: the default), checked against ``pos``,
    the differentiated positions."""
    if weights is None:
        return None
    out = (weights,) if isinstance(weights, int) else tuple(weights)
    if not out or not all(isinstance(a, int) and not isinstance(a, bool) for a in out):
        raise TypeError(f"weights must be an int or a non-empty sequence of ints, got {weights!r}")
    out = tuple(a % n if -n <= a < n else a for a in out)
    stray = [a for a in out if a not in pos]
    if stray:
        raise ValueError(f"weights={weights!r} names argument(s) {stray} that are not differentiated "
                         f"(argnums={pos}); weights must be a subset of argnums")
    return out


def value_and_grad(fun: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False, *,
                   config: AdaLossConfig | None = None, allow_int: bool = False,
                   return_report: bool = False, capture_cotangents: bool = False,
                   weights: int | Sequence[int] | None = None, wrt: Any = None) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, with adaptive per-layer loss scaling in the backward.

    Every float leaf of the gradient is a :class:`ScaledGrad` (``value / scale``
    is the gradient); unscale with :func:`jax_adaloss.adaloss` (or
    ``ScaledGrad.unscale``). ``fun`` must return a real scalar (or
    ``(scalar, aux)`` with ``has_aux``).

    Weights and data: a matmul or convolution is a *layer* (it gets its own
    scale) when one operand is computed from the weights only, through casts,
    transposes, reshapes, constants and scalar factors, and the other from data.
    The weights are the leaves of the arguments named by ``weights`` (default: the
    first of ``argnums``; with Flax nnx, every differentiated Module). Everything
    else is data: other arguments, keyword arguments, arrays ``fun`` closes over
    (the batch in a jitted train step) and anything computed from them. Name the
    weight arguments when inputs are differentiated too, e.g.
    ``value_and_grad(f, argnums=(0, 1), weights=0)(params, x)``.

    Flax nnx Modules may be passed as arguments, as to ``nnx.value_and_grad``:
    only their ``wrt`` state is differentiated (default ``nnx.Param``; a filter,
    or ``argnums=nnx.DiffState(i, filter)``), the gradient is an ``nnx.State``,
    and their other state (BatchNorm statistics, RNG counts) is written back.

    With ``return_report=True`` the function returns ``((value, grads), report)``,
    a :class:`BackwardReport` with per-layer scales, statistics and coverage
    counts. ``capture_cotangents=True (with ``return_report``) also puts each
    layer's incoming cotangent in ``report.cotangents``, for underflow measurements.

    Back-off: pass the optimizer state holding :func:`jax_adaloss.adaloss`'s state as the
    keyword argument ``adaloss_state=`` (not forwarded to ``fun``; any pytree containing
    one :class:`AdaLossState`, e.g. ``opt_state`` or ``nnx.Optimizer.opt_state``). After
    skipped steps its ``backoff`` exponent ``h`` lowers every decision's target range by
    ``2^-h``, so a deterministic overflow cannot repeat every step; its per-weight ``lift``
    exponents ``k`` (``AdaLossConfig.underflow_feedback``) multiply the statistical scale of
    that weight's layer by ``2^k`` after backwards in which the cotangents it scaled reached
    the next layers with more than ``T/2`` of their entries below ``u_min``. Without it
    ``h = k = 0``, and the gradient leaves are :class:`~jax_adaloss.StatelessScaledGrad`,
    which :func:`jax_adaloss.adaloss` refuses at trace time with this remedy (so that a training
    loop cannot skip every step silently); ``adaloss_state=None`` says that there is no state to
    pass (measurements, or training without back-off).
    """
    return _value_and_grad(fun, argnums, has_aux, config=config, allow_int=allow_int,
                           return_report=return_report, capture_cotangents=capture_cotangents,
                           weights=weights, wrt=wrt)


def _value_and_grad(fun: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False, *,
                    config: AdaLossConfig | None = None, allow_int: bool = False,
                    return_report: bool = False, capture_cotangents: bool = False,
                    reference: Reference | None = None, weights: int | Sequence[int] | None = None,
                    wrt: Any = None) -> Callable[..., Any]:
    """:func:`value_and_grad`, or with ``reference`` (:data:`~jax_adaloss.backward.REFERENCES`)
    a backward that is not adaloss's, for measurements: ``"global"`` scales by
    ``config.init_scale`` only (one global loss scale), ``"fp32"`` runs it in fp32 too (the
    low-precision forward's exact gradient)."""
    config = AdaLossConfig() if config is None else config
    if not isinstance(config, AdaLossConfig):
        raise TypeError(f"config must be an AdaLossConfig, got {type(config).__name__}")
    if reference is not None and reference not in REFERENCES:
        raise ValueError(f"reference must be None (adaloss) or one of {REFERENCES}, got {reference!r}")
    nums, filters = _nnx.parse_argnums(argnums, wrt)
    if capture_cotangents and not return_report:
        raise ValueError("capture_cotangents=True needs return_report=True (they are in the report)")
    if config.update_every > 1:
        raise ValueError(
            f"AdaLossConfig.update_every={config.update_every}: jax_adaloss decides every scale at "
            "every call. Reusing a statistical scale saves nothing under jit, where the statistics "
            "would run anyway (a select, not a conditional XLA:GPU reads on the host); it is a PyTorch "
            "setting (AdaLossScaler, decisions op by op). Use update_every=1.")
    single = isinstance(argnums, int) or _nnx.is_diff_state(argnums)

    def core(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             nums_pos: tuple[int, ...], weight_pos: tuple[int, ...], aux_out: bool,
             backoff: Any = None) -> tuple[Any, Any, list[Any], BackwardReport]:
        with_path, treedef = jax.tree_util.tree_flatten_with_path((list(args), kwargs))
        flat = [leaf for _, leaf in with_path]
        dyn: list[int] = []
        origins: list[str | None] = []  # weight name of a dynamic leaf, None for data
        diff: list[bool] = []
        for i, (path, leaf) in enumerate(with_path):
            in_args = path[0].idx == 0
            argi = path[1].idx if in_args else -1
            if in_args and argi in nums_pos:
                leaf = _as_diff_leaf(leaf, path, allow_int)
                flat[i] = leaf
                floating = is_float(leaf.dtype)
                dyn.append(i)
                diff.append(floating)
                origins.append(_leaf_name(argi, path[2:], prefixed=len(nums_pos) > 1)
                               if floating and argi in weight_pos else None)
            elif _is_array(leaf):
                dyn.append(i)
                diff.append(False)
                origins.append(None)

        out_store: dict[str, Any] = {}

        def flat_fun(*dyn_leaves: Any) -> list[Any]:
            full = list(flat)
            for i, x in zip(dyn, dyn_leaves):
                full[i] = x
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
            out = f(*call_args, **call_kwargs)
            aux = None
            if aux_out:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError("has_aux=True requires fun to return a (value, aux) pair")
                out, aux = out
            _check_output(out)
            aux_leaves, out_store["aux"] = jax.tree_util.tree_flatten(aux)
            return [out, *aux_leaves]

        dyn_vals = [flat[i] for i in dyn]
        closed = jax.make_jaxpr(flat_fun)(*dyn_vals)
        backoff_f, lift_f = backoff if backoff is not None else (None, None)
        outs, cts, report, signals, inverses, traces = scaled_backward(
            closed, dyn_vals, diff, origins, config, capture_cotangents, reference,
            backoff_f, lift_f, report=return_report)
        no_layer = None  # a leaf that is no layer's weight: only whether the loss was finite
        aux = jax.tree_util.tree_unflatten(out_store["aux"], outs[1:])
        grad_leaves: list[Any] = list(flat)
        for i, d, ct, inverse, origin in zip(dyn, diff, cts, inverses, origins):
            leaf = flat[i]
            signal = signals.get(origin) if origin is not None else None
            if d and ct is not None and signal is not None:
                signal = _invariant_like(signal, ct[0])
            if d:
                trace = traces.get(origin) if origin is not None else None
                if trace is None:
                    if no_layer is None:
                        no_layer = encode_trace(NO_LAYER, True, jnp.isfinite(outs[0]))
                    trace = no_layer
                if ct is not None:
                    trace = _invariant_like(trace, ct[0], trace=True)
                if ct is None:
                    grad_leaves[i] = ScaledGrad.of(jnp.zeros_like(leaf), jnp.ones((), jnp.float32), signal,
                                                   trace=trace)
                elif reference is None and _narrows_to_fp16(ct[0], leaf):
                    value, scale = _fit_to_leaf(ct[0], ct[1], config, backoff_f)
                    grad_leaves[i] = ScaledGrad.of(value, scale, signal, trace=trace)
                else:
                    grad_leaves[i] = ScaledGrad.of(jnp.asarray(ct[0]).astype(leaf.dtype), ct[1], signal,
                                                   inverse=inverse, trace=trace)
            elif _is_array(leaf) and not is_float(jnp.result_type(leaf)):
                grad_leaves[i] = np.zeros(np.shape(leaf), jax.dtypes.float0)
        grads_args, _ = jax.tree_util.tree_unflatten(treedef, grad_leaves)
        return outs[0], aux, grads_args, report

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if CACHE_KWARG in kwargs:
            raise TypeError("adaloss_cache= is gone with AdaLossConfig.update_every in JAX (every "
                            "scale is decided at every call): drop the argument.")
        told = STATE_KWARG in kwargs  # adaloss_state=None: training without back-off, said so
        backoff = _state_levels(kwargs.pop(STATE_KWARG, None))
        n = len(args)
        for a in nums:
            if not -n <= a < n:
                raise TypeError(f"differentiating with respect to argnums={nums} requires "
                                f"at least {max(nums) + 1} positional arguments, got {n}")
        pos = tuple(a % n for a in nums)
        wpos = _weight_nums(weights, pos, n)
        if _nnx.has_graph_nodes((args, kwargs)):
            value, aux, grads_args, report = _nnx.call(core, fun, args, kwargs, pos, wpos, filters,
                                                       has_aux, backoff)
        else:
            value, aux, grads_args, report = core(fun, args, kwargs, pos, wpos or pos[:1], has_aux, backoff)
        grads = grads_args[pos[0]] if single else tuple(grads_args[a] for a in pos)
        if not told:
            grads = mark_stateless(grads)
        result = ((value, aux), grads) if has_aux else (value, grads)
        return (result, report) if return_report else result

    return wrapped


def grad(fun: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False,
         *, config: AdaLossConfig | None = None, allow_int: bool = False,
         return_report: bool = False, capture_cotangents: bool = False,
         weights: int | Sequence[int] | None = None, wrt: Any = None) -> Callable[..., Any]:
    """Like ``jax.grad``, with adaptive per-layer loss scaling; see :func:`value_and_grad`.

    Returns ``grads`` (``(grads, aux)`` with ``has_aux``), and with
    ``return_report=True`` the pair ``(that, report)``.
    """
    vg = value_and_grad(fun, argnums, has_aux, config=config, allow_int=allow_int,
                        return_report=return_report, capture_cotangents=capture_cotangents,
                        weights=weights, wrt=wrt)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = vg(*args, **kwargs)
        result, report = out if return_report else (out, None)
        (value, grads) = result
        result = (grads, value[1]) if has_aux else grads
        return (result, report) if return_report else result

    return wrapped


def _state_levels(state: Any) -> tuple[jax.Array, dict[str, jax.Array]] | None:
    """``(2^-h, {weight name: 2^k})`` from the ``backoff`` exponent and the per-leaf ``lift``
    exponents of the :class:`AdaLossState` inside ``state`` (``None`` without one). A leaf is
    named as the backward names weights (``a/b/kernel``), from its path in the tree the state
    was initialised with (the parameters)."""
    if state is None:
        return None
    try:
        h = optax.tree.get(state, "backoff")
    except (KeyError, ValueError) as e:  # e.g. several AdaLossStates
        h, why = None, f": {e}"
    else:
        why = ": it holds none"
    if h is None:
        raise TypeError(f"{STATE_KWARG}= must be a pytree holding one jax_adaloss.adaloss() state "
                        f"(e.g. the optimizer state), got {type(state).__name__}{why}")
    lifts = jax.tree_util.tree_flatten_with_path(optax.tree.get(state, "lift"))[0]
    return (solver.backoff_factor(jnp.asarray(h), jnp),
            {_leaf_name(0, path, False): solver.lift_factor(jnp.asarray(k), jnp) for path, k in lifts})


def _as_diff_leaf(leaf: Any, path: Any, allow_int: bool) -> jax.Array:
    """A differentiated leaf as an array, or a clear error (a function or other object in a
    differentiated argument: e.g. an Equinox module's activation, see the README)."""
    if not (_is_array(leaf) or isinstance(leaf, (int, float, bool))):
        where = jax.tree_util.keystr(tuple(path[1:]))
        raise TypeError(
            f"differentiated argument leaf {where} is a {type(leaf).__name__}, not an array. "
            "Differentiate only the array leaves: for Equinox, split the model with "
            "eqx.partition(model, eqx.is_inexact_array) and pass the arrays as the differentiated "
            "argument (see the README).")
    leaf = jnp.asarray(leaf)
    _check_diff_dtype(leaf.dtype, allow_int)
    return leaf


def _check_diff_dtype(dtype: Any, allow_int: bool) -> None:
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"adaptive loss scaling supports real float inputs only, got {dtype}")
    if not is_float(dtype) and not (allow_int and (jnp.issubdtype(dtype, jnp.integer)
                                                    or jnp.issubdtype(dtype, jnp.bool_))):
        raise TypeError(
            "grad requires real-valued inputs (input dtype that is a sub-dtype of np.floating), "
            f"but got {dtype}. If you want to use Boolean- or integer-valued inputs, "
            "set allow_int to True. (An nnx RNG count or key? Pass the nnx Module itself: only its "
            "nnx.Param are differentiated, the rest is written back.)")


def _check_output(out: Any) -> None:
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        out = jnp.asarray(out)
    if out.shape != ():
        raise TypeError("Gradient only defined for scalar-output functions. "
                        f"Output had shape: {out.shape}.")
    if not is_float(out.dtype):
        raise TypeError(f"grad requires real-valued outputs (output dtype that is a sub-dtype "
                        f"of np.floating), but got {out.dtype}.")


def _narrows_to_fp16(ct: Any, leaf: Any) -> bool:
    """Whether a gradient computed wider (a weight's, in fp32) is stored in an fp16 leaf."""
    return jnp.dtype(leaf.dtype) == jnp.float16 and jnp.dtype(jnp.result_type(ct)).itemsize > 2


def _fit_to_leaf(ct: jax.Array, scale: jax.Array, config: AdaLossConfig, backoff: Any
                 ) -> tuple[jax.Array, jax.Array]:
    """An fp16 parameter's gradient, computed in fp32, narrowed into fp16 by a cast decision
    (:func:`adaloss.solver.cast_scale`, fp16's limits): a weight gradient beyond 65504 (a sum over
    a batch of large inputs) gets a scale below 1, one below fp16's range a larger one. Returns
    the fp16 value and the scale it carries."""
    if config.grad_format != "float16":
        config = dataclasses.replace(config, grad_format="float16", u_min=None, u_max=None)
    st = reductions.statistics(ct, logs=True)
    d = solver.cast_scale(config, st.logs._replace(absmax=st.absmax), scale, jnp, backoff=backoff)
    return rescale(ct, d.scale).astype(jnp.float16), scale * d.scale


def _invariant_like(x: jax.Array, ref: jax.Array, trace: bool = False) -> jax.Array:
    """``x`` reduced (max) over the ``shard_map`` axes ``ref`` is invariant over and ``x`` is
    not: a gradient summed over devices in the backward carries the largest device's underflow
    signal, so that every device updates the same state. A ``trace``
    (:func:`~jax_adaloss.scaled_grad.encode_trace`): the minimum of each of its parts."""
    axes = tuple(sorted(_varying(x) - _varying(ref), key=str))
    if not axes:
        return x
    return encode_trace(*jax.lax.pmin(trace_parts(x), axes)) if trace else jax.lax.pmax(x, axes)


def _varying(a: jax.Array) -> frozenset[Any]:
    """The ``shard_map`` axes ``a`` varies over (``check_vma``); empty elsewhere."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax >= 0.10
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


__all__ = ["value_and_grad", "grad", "BackwardReport"]
