"""Weight gradients in fp32: cotangents on the weight path never pass through fp16.

A layer's activation cotangent stays in the gradient format (that is what the
per-layer scale protects), but its weight cotangent is a sum over the whole
batch and can exceed fp16's 65504 long before any activation cotangent does. So:

- the weight gradient of a ``dot_general`` layer is one ``dot_general`` of the
  fp16 cotangent and the fp16 activation with ``preferred_element_type=float32``
  (fp16 operands, fp32 accumulation and result: what tensor cores do anyway,
  without the final rounding to fp16); the same transpose gives a layer's input
  cotangent in fp32, which the backward scales and then rounds to 16 bits;
- every other equation whose differentiated input comes from the weights (the
  fp32→fp16 cast of a master weight, transposes, reshapes, bias broadcasts, a
  convolution's weight, an embedding gather) is transposed with its 16-bit float
  inputs widened to fp32, so the cotangent reaches the parameter in fp32.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

_F32 = jnp.float32


def is_float(dtype: Any) -> bool:
    """A floating-point dtype (an fp8 format included)."""
    return jnp.issubdtype(dtype, jnp.floating)


def is_narrow_float(dtype: Any) -> bool:
    """A float format narrower than fp32 (fp16, bf16)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def dtype_of(x: Any) -> Any:
    """``x``'s own dtype (``jnp.result_type`` reports a weakly typed fp16 value as fp32)."""
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def widen(x: Any) -> Any:
    """``x`` in fp32 if it is a narrower float, else unchanged."""
    return x.astype(_F32) if is_narrow_float(dtype_of(x)) else x


def dot_operand_grad(g: Any, act: Any, weight: Any, dimension_numbers: Any, w: int,
                     precision: Any = None, out_dtype: Any = _F32) -> jax.Array:
    """The cotangent of operand ``w`` (0: lhs, 1: rhs) of ``dot_general(lhs, rhs)`` for the
    output cotangent ``g``, with ``act`` the other operand, accumulated and returned in fp32:
    a weight's gradient (``weight`` the weight, ``act`` the layer's input), or a layer's input
    cotangent before its scale and its rounding to 16 bits (the roles swapped).

    The transpose of a ``dot_general`` with respect to one operand is a ``dot_general`` of
    the output cotangent with the other operand: contract ``g``'s dimensions that came from
    ``act``'s kept (free) dimensions with those, keep the batch dimensions batched, and
    permute the result to ``w``'s axis order. Under a mesh with explicit axes the result is
    sharded like ``weight``. ``out_dtype``: the result's (an FP8 GEMM may return 16 bits; its
    accumulation stays fp32).
    """
    w_ndim = np.ndim(weight)
    (lc, rc), (lb, rb) = dimension_numbers
    wc, ac = (lc, rc) if w == 0 else (rc, lc)
    wb, ab = (lb, rb) if w == 0 else (rb, lb)
    a_kept = [d for d in range(np.ndim(act)) if d not in ac and d not in ab]
    w_kept = [d for d in range(w_ndim) if d not in wc and d not in wb]
    nb = len(wb)
    # g's layout: batch dims, lhs's kept dims, rhs's kept dims
    first = nb if w == 1 else nb + len(w_kept)
    g_act = list(range(first, first + len(a_kept)))
    from_act = [int(d) for d in np.take(wc, np.argsort(ac))]  # w's dims matched by act's, in act's order
    batch = (list(range(nb)), list(ab))
    if w == 1:
        # act first (jax's transpose puts g first): the result comes in a dense kernel's axis
        # order, and XLA:CPU hands the dot to its fast matmul (g first: Eigen, both operands transposed)
        operands, dims, unsorted = (act, g), ((a_kept, g_act), batch[::-1]), [*wb, *from_act, *w_kept]
    else:
        operands, dims, unsorted = (g, act), ((g_act, a_kept), batch), [*wb, *w_kept, *from_act]
    if _cpu_lacks_bf16_dot(operands):
        operands = tuple(widen(o) for o in operands)
    out = lax.dot_general(*operands, dims, precision=precision, preferred_element_type=out_dtype,
                          out_sharding=_permuted_sharding(weight, unsorted))
    return jnp.transpose(out, tuple(int(i) for i in np.argsort(unsorted)))


_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("adaloss_target_platform",
                                                                             default=None)


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace for ``platform`` rather than JAX's default backend (a GPU program compiled on a
    machine whose backend is the CPU: :mod:`adaloss_tools.gpu_program`)."""
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def target_platform() -> str:
    """The platform this trace compiles for: :func:`compiling_for`'s, else JAX's default backend."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


def _cpu_lacks_bf16_dot(operands: Sequence[Any]) -> bool:
    """XLA:CPU has no bf16 × bf16 → fp32 dot outside its plain matmuls ("Unsupported element
    type for DotThunk"): there the operands are widened first, which is exact (a product of two
    bf16 values is exact in fp32; the fp32 accumulation is the same)."""
    return target_platform() == "cpu" and any(jnp.dtype(dtype_of(o)) == jnp.bfloat16 for o in operands)


def widenable(params: dict[str, Any]) -> bool:
    """Whether an equation can be re-bound on fp32 inputs: none of its params is a jaxpr
    (whose types are fixed)."""
    def typed(v: Any) -> bool:
        if isinstance(v, (tuple, list)):
            return any(typed(x) for x in v)
        return isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))
    return not any(typed(v) for v in params.values())


def _permuted_sharding(x: Any, axes: Sequence[int]) -> Any:
    """``x``'s sharding with its axes taken in the order ``axes`` (None: no mesh)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    spec = tuple(sharding.spec) + (None,) * (np.ndim(x) - len(sharding.spec))
    return sharding.update(spec=P(*(spec[a] for a in axes)))


def wide_vjp(prim: Any, params: dict[str, Any], vals: Sequence[Any], diff: Sequence[int]
             ) -> Callable[[list[Any]], tuple[Any, ...]]:
    """The vjp of one equation evaluated with its 16-bit float inputs widened to fp32.

    ``params`` are the equation's bind parameters; a 16-bit ``preferred_element_type`` is
    dropped (the widened operation computes in fp32). Its cotangents are fp32 where the
    input was a 16-bit float. A ``convert_element_type`` is the identity on the widened
    cotangent: its transpose is a cast back to its input's dtype, at least fp32. Equations
    with sub-jaxprs (typed bodies: ``scan``, ``cond``, custom rules) must not be widened:
    see :func:`widenable`.
    """
    if prim.name == "convert_element_type":
        dtype = jnp.promote_types(dtype_of(vals[0]), _F32)
        return lambda cts: (cts[0].astype(dtype),)
    params = dict(params)
    pet = params.get("preferred_element_type")
    if pet is not None and is_narrow_float(pet):
        params["preferred_element_type"] = None
    wide = [widen(v) for v in vals]

    def f(*dx: Any) -> list[Any]:
        xs = list(wide)
        for i, x in zip(diff, dx):
            xs[i] = x
        out = prim.bind(*xs, **params)
        return list(out) if prim.multiple_results else [out]

    outs, vjp = jax.vjp(f, *[wide[i] for i in diff])
    return lambda cts: vjp([c.astype(dtype_of(o)) if is_narrow_float(dtype_of(c)) else c
                            for c, o in zip(cts, outs)])
