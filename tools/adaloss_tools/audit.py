"""Where an fp8 cast's scale comes from, read off a jaxpr.

Per-tensor *current* scaling must finish a reduction over a tensor (its ``max|g|``) before
it can cast it, so the cast cannot fuse with the op that produces the tensor; a scale decided
before the GEMM that produces the tensor can. :func:`fp8_casts` finds every conversion to an
fp8 dtype in a traced function and says which kind each is, from the data flow alone: a cast
*reads its own max* when a full reduction (one number out) of data that reached it from the
GEMMs producing it lies on its input's path (a GEMM whose output reaches the cast only through
a scalar, a scale decided from an earlier tensor, is not one of those). Per-row reductions (a
LayerNorm's or softmax's backward) are the ops' own arithmetic and do not count.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from adaloss_tools.jaxpr_walk import walk

_GEMMS = ("dot_general", "conv_general_dilated", "ragged_dot_general")


class Fp8Cast(NamedTuple):
    """One conversion to an fp8 dtype: the converted tensor's ``shape`` and fp8 ``dtype``
    name, and ``reads_own_max``: its scale depends on a full reduction of data it converts."""

    shape: tuple[int, ...]
    dtype: str
    reads_own_max: bool


class _Eqn(NamedTuple):
    prim: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    params: dict[str, Any]
    in_dtypes: tuple[Any, ...]
    out_avals: tuple[Any, ...]


def _flatten(closed: jcore.ClosedJaxpr) -> list[_Eqn]:
    """The equations of ``closed``, calls inlined (:func:`adaloss_tools.jaxpr_walk.walk`), each
    value a global id."""
    out: list[_Eqn] = []
    ids = itertools.count()

    def visit(eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
        outs = [next(ids) for _ in eqn.outvars]
        out.append(_Eqn(eqn.primitive.name, tuple(ins), tuple(outs), eqn.params,
                        tuple(getattr(a.aval, "dtype", None) for a in eqn.invars),
                        tuple(v.aval for v in eqn.outvars)))
        return outs

    def fresh(_: Any) -> int:
        return next(ids)
    jaxpr = closed.jaxpr
    walk(jaxpr, [next(ids) for _ in jaxpr.constvars], [next(ids) for _ in jaxpr.invars], visit, fresh, fresh)
    return out


def _is_fp8(dtype: Any) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def _full_reduction(e: _Eqn) -> bool:
    is_reduce = e.prim.startswith("reduce_") or e.prim in ("argmax", "argmin")
    return is_reduce and all(math.prod(a.shape) <= 1 for a in e.out_avals)


def _scalar(eqns: list[_Eqn], producer: dict[int, int], v: int) -> bool:
    """Value ``v`` holds one number (a scale), by its producer's output type."""
    p = producer.get(v)
    if p is None:
        return False
    e = eqns[p]
    return math.prod(e.out_avals[e.outs.index(v)].shape) <= 1


def fp8_casts(fun: Callable[..., Any] | jcore.ClosedJaxpr, *args: Any, **kwargs: Any) -> list[Fp8Cast]:
    """Every conversion to an fp8 dtype in ``fun(*args, **kwargs)`` (traced with
    ``jax.make_jaxpr``; or a ``ClosedJaxpr``), in program order, each with whether its scale
    reads a full reduction of the data it converts (see the module docstring)."""
    closed = fun if isinstance(fun, jcore.ClosedJaxpr) else jax.make_jaxpr(fun)(*args, **kwargs)
    eqns = _flatten(closed)
    producer = {o: k for k, e in enumerate(eqns) for o in e.outs}
    found = []
    for e in eqns:
        if e.prim != "convert_element_type" or not _is_fp8(e.params.get("new_dtype")) \
                or _is_fp8(e.in_dtypes[0]):
            continue
        # the ops between the GEMMs that produced this tensor's data and the cast; a GEMM
        # reached only through a scalar (a scale: a decision made from an earlier tensor) is
        # not one of them
        region, sources, seen, stack = set(), set(), set(), [(e.ins[0], True)]
        while stack:
            v, data = stack.pop()
            p = producer.get(v)
            if p is None or (p, data) in seen:
                continue
            seen.add((p, data))
            if eqns[p].prim in _GEMMS:
                if data:
                    sources.update(eqns[p].outs)
                continue
            region.add(p)
            stack.extend((i, data and not _scalar(eqns, producer, i)) for i in eqns[p].ins)
        tainted, own = set(sources), False
        for p in sorted(region):
            if any(i in tainted for i in eqns[p].ins):
                tainted.update(eqns[p].outs)
                own = own or _full_reduction(eqns[p])
        aval = e.out_avals[0]
        found.append(Fp8Cast(tuple(aval.shape), jnp.dtype(aval.dtype).name, own))
    return found
