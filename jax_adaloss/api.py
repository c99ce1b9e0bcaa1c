"""``value_and_grad`` and ``grad``: jax's calling convention, adaptive loss scaling inside."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaloss.config import AdaLossConfig
from jax_adaloss.backward import _is_float, scaled_backward
from jax_adaloss.report import BackwardReport, ScaleCache
from jax_adaloss.scaled_grad import ScaledGrad

CACHE_KWARG = "adaloss_cache"


def _argnums_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(argnums, int):
        return (argnums,)
    out = tuple(argnums)
    if not out or not all(isinstance(a, int) for a in out):
        raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}")
    return out


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _leaf_name(argi: int, path: Any, prefixed: bool) -> str:
    """``a/b/c`` path of a differentiated leaf (``argN/…`` when several args are differentiated)."""
    rest = jax.tree_util.keystr(path, simple=True, separator="/")
    if not rest:
        return f"arg{argi}"
    return f"arg{argi}/{rest}" if prefixed else rest


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, *, config: AdaLossConfig | None = None,
                   allow_int: bool = False, return_report: bool = False,
                   capture_cotangents: bool = False) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, with adaptive per-layer loss scaling in the backward.

    Every float leaf of the gradient is a :class:`ScaledGrad` (``value / scale``
    is the gradient); unscale with :func:`jax_adaloss.adaloss` (or
    ``ScaledGrad.unscale``). ``fun`` must return a real scalar (or
    ``(scalar, aux)`` with ``has_aux``).

    With ``return_report=True`` the function returns ``((value, grads), report)``,
    a :class:`BackwardReport` with per-layer scales and statistics. With
    ``config.update_every > 1`` pass the previous report's ``cache`` as the
    keyword argument ``adaloss_cache=`` (it is not forwarded to ``fun``).
    ``capture_cotangents=True`` (with ``return_report``) also puts each layer's
    incoming cotangent in ``report.cotangents``, for underflow measurements.
    """
    return _value_and_grad(fun, argnums, has_aux, config, allow_int, return_report, capture_cotangents,
                           adaptive=True)


def _value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int], has_aux: bool,
                    config: AdaLossConfig | None, allow_int: bool, return_report: bool,
                    capture_cotangents: bool, adaptive: bool) -> Callable[..., Any]:
    """:func:`value_and_grad`; ``adaptive=False`` scales by ``config.init_scale`` only
    (a global loss scale, for measurements)."""
    config = AdaLossConfig() if config is None else config
    if not isinstance(config, AdaLossConfig):
        raise TypeError(f"config must be an AdaLossConfig, got {type(config).__name__}")
    nums = _argnums_tuple(argnums)
    if capture_cotangents and not return_report:
        raise ValueError("capture_cotangents=True needs return_report=True (they are in the report)")
    if config.update_every > 1 and not return_report:
        raise ValueError("AdaLossConfig.update_every > 1 needs return_report=True, so that "
                         "report.cache can be passed back as adaloss_cache=")

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cache: ScaleCache | None = kwargs.pop(CACHE_KWARG, None)
        for a in nums:
            if not -len(args) <= a < len(args):
                raise TypeError(f"differentiating with respect to argnums={argnums} requires "
                                f"at least {a + 1} positional arguments, got {len(args)}")
        nums_pos = tuple(a % len(args) for a in nums)
        leaves, treedef = jax.tree_util.tree_flatten(list(args))
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(list(args))[0]]
        dyn: list[int] = []
        names: list[str | None] = []
        flat = list(leaves)
        for i, (path, leaf) in enumerate(zip(paths, leaves)):
            argi = path[0].idx
            if argi in nums_pos:
                leaf = jnp.asarray(leaf)
                _check_diff_dtype(leaf.dtype, allow_int)
                flat[i] = leaf
                name = _leaf_name(argi, path[1:], prefixed=len(nums_pos) > 1)
                dyn.append(i)
                names.append(name if _is_float(leaf.dtype) else None)
            elif _is_array(leaf):
                dyn.append(i)
                names.append(None)

        out_store: dict[str, Any] = {}

        def flat_fun(*dyn_leaves: Any) -> list[Any]:
            full = list(flat)
            for i, x in zip(dyn, dyn_leaves):
                full[i] = x
            out = fun(*jax.tree_util.tree_unflatten(treedef, full), **kwargs)
            aux = None
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError("has_aux=True requires fun to return a (value, aux) pair")
                out, aux = out
            _check_output(out)
            aux_leaves, out_store["aux"] = jax.tree_util.tree_flatten(aux)
            return [out, *aux_leaves]

        dyn_vals = [flat[i] for i in dyn]
        closed = jax.make_jaxpr(flat_fun)(*dyn_vals)
        outs, cts, report = scaled_backward(closed, dyn_vals, names, config, cache,
                                             capture_cotangents, adaptive)
        value = outs[0]
        aux = jax.tree_util.tree_unflatten(out_store["aux"], outs[1:])

        grad_leaves: list[Any] = list(flat)
        for i, name, ct in zip(dyn, names, cts):
            leaf = flat[i]
            if name is not None:
                if ct is None:
                    grad_leaves[i] = ScaledGrad(jnp.zeros_like(leaf), jnp.ones((), jnp.float32))
                else:
                    grad_leaves[i] = ScaledGrad(jnp.asarray(ct[0]).astype(leaf.dtype),
                                                jnp.asarray(ct[1], jnp.float32))
            elif _is_array(leaf) and not _is_float(jnp.result_type(leaf)):
                grad_leaves[i] = np.zeros(np.shape(leaf), jax.dtypes.float0)
        grads_all = jax.tree_util.tree_unflatten(treedef, grad_leaves)
        grads = grads_all[nums[0]] if isinstance(argnums, int) else \
            tuple(grads_all[a] for a in nums)
        result = ((value, aux), grads) if has_aux else (value, grads)
        return (result, report) if return_report else result

    return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
         *, config: AdaLossConfig | None = None, allow_int: bool = False,
         return_report: bool = False, capture_cotangents: bool = False) -> Callable[..., Any]:
    """Like ``jax.grad``, with adaptive per-layer loss scaling; see :func:`value_and_grad`.

    Returns ``grads`` (``(grads, aux)`` with ``has_aux``), and with
    ``return_report=True`` the pair ``(that, report)``.
    """
    vg = value_and_grad(fun, argnums, has_aux, config=config, allow_int=allow_int,
                        return_report=return_report, capture_cotangents=capture_cotangents)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = vg(*args, **kwargs)
        result, report = out if return_report else (out, None)
        (value, grads) = result
        result = (grads, value[1]) if has_aux else grads
        return (result, report) if return_report else result

    return wrapped


def _check_diff_dtype(dtype: Any, allow_int: bool) -> None:
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"adaptive loss scaling supports real float inputs only, got {dtype}")
    if not _is_float(dtype) and not (allow_int and (jnp.issubdtype(dtype, jnp.integer)
                                                    or jnp.issubdtype(dtype, jnp.bool_))):
        raise TypeError(
            "grad requires real-valued inputs (input dtype that is a sub-dtype of np.floating), "
            f"but got {dtype}. If you want to use Boolean- or integer-valued inputs, "
            "set allow_int to True.")


def _check_output(out: Any) -> None:
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        out = jnp.asarray(out)
    if out.shape != ():
        raise TypeError("Gradient only defined for scalar-output functions. "
                        f"Output had shape: {out.shape}.")
    if not _is_float(out.dtype):
        raise TypeError(f"grad requires real-valued outputs (output dtype that is a sub-dtype "
                        f"of np.floating), but got {out.dtype}.")


__all__ = ["value_and_grad", "grad", "BackwardReport", "ScaleCache"]
