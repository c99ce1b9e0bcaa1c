"""``ScaledGrad``: a gradient that carries the loss scale it was computed under."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class _Fields(NamedTuple):
    value: jax.Array
    scale: jax.Array
    underflow: jax.Array | None = None
    inverse: jax.Array | None = None
    marker: jax.Array | None = None
    trace: jax.Array | None = None


class _NamesTheRemedy(type):
    """The type's repr is what JAX's pytree-structure errors print for a leaf whose type differs
    (a ``ScaledGrad`` fed to ``optax.adam`` whose moments are arrays): it says what to do."""

    def __repr__(cls) -> str:
        return (f"<class 'jax_adaloss.{cls.__qualname__}'> (a gradient that carries its own loss "
                "scale: unscale it with jax_adaloss.adaloss before an optax optimizer, "
                "tx = jax_adaloss.adaloss(inner=optax.adam(lr)))")


class ScaledGrad(_Fields, metaclass=_NamesTheRemedy):
    """A scaled gradient: the true gradient is ``value / scale``.

    Attributes:
      value: the scaled gradient, in the dtype of the parameter it belongs to.
      scale: fp32 scalar, the product of every scale applied downstream of it.
      underflow: fp32 scalar or ``None``: the largest fraction of non-zero entries below
        ``u_min`` among the cotangents entering the layers of the backward that produced it
        (:func:`adaloss.solver.subnormal_fraction`), divided by ``T``; :func:`jax_adaloss.adaloss`
        feeds it to its lift (``AdaLossConfig.underflow_feedback``). The same on every leaf of
        one backward.
      inverse: fp32 scalar ``1 / scale`` (or ``None``: unchecked), set by the backward and kept
        by :func:`jax_adaloss.pmean` / :func:`jax_adaloss.psum` / :func:`jax_adaloss.tree_add`.
        A tree operation that combines scales as if they were values and keeps the marker an
        integer (``jax.lax.psum`` over devices, ``jax.tree.map(jnp.add, ...)`` over
        micro-batches) breaks ``scale · inverse = 1``, and
        :func:`jax_adaloss.adaloss` skips and counts that step (``mixed_scales``) instead of
        applying a wrong gradient.
      marker: boolean scalar ``False`` (or ``None``: unchecked), set with ``inverse``. A
        transformation that rescales or sums the tree as if its fields were values
        (``optax.clip_by_global_norm``, whose norm squares every leaf; ``optax.scale``,
        dividing by a count, ``jax.lax.pmean``/``psum``, a cast) makes it a number, and
        rebuilding the ``ScaledGrad`` raises at trace time, naming the remedy: a misplaced
        transformation is loud under ``jit`` too, instead of skipping every step. (``jnp.add``
        of two booleans is a boolean: a ``jax.tree.map(jnp.add, ...)`` is caught by
        ``inverse``.)
      trace: fp32 scalar or ``None``: what :func:`jax_adaloss.adaloss` keeps of a skipped step to
        say why (:mod:`adaloss.skips`): ``encode_trace`` of the backward position of this
        leaf's layer (the first, from the loss, whose incoming cotangent was not finite if any
        was; ``NO_LAYER`` for a leaf that is no layer's weight), whether that cotangent was
        finite, and whether the loss was.

    A ``NamedTuple`` (``_replace``, ``_fields``) and a pytree node. Given to an optax optimizer
    instead of :func:`jax_adaloss.adaloss`, its tree does not match the optimizer's state, and
    JAX's structure error names this type with that remedy.
    """

    __slots__ = ()

    @classmethod
    def of(cls, value: jax.Array, scale: jax.Array, underflow: jax.Array | None = None,
           mismatch: jax.Array | None = None, inverse: jax.Array | None = None,
           trace: jax.Array | None = None) -> ScaledGrad:
        """A checked ``ScaledGrad`` (``inverse = 1 / scale``: the given one, computed with the
        scale, or here); ``mismatch`` (``|scale · inverse − 1|`` of the gradients it was reduced
        from) carries their inconsistency over."""
        scale = jnp.asarray(scale, jnp.float32)
        if mismatch is not None:
            inverse = (1.0 + mismatch) / scale
        elif inverse is None:
            inverse = 1.0 / scale
        return cls(value, scale, underflow, inverse, jnp.zeros((), jnp.bool_), trace)

    def mismatch(self) -> jax.Array:
        """``|scale · inverse − 1|``: 0 for a gradient as the backward made it (0 if unchecked)."""
        if self.inverse is None:
            return jnp.zeros((), jnp.float32)
        return jnp.abs(jnp.asarray(self.scale, jnp.float32) * self.inverse - 1.0)

    def unscale(self, dtype: Any = None) -> jax.Array:
        """``value / scale`` computed in fp32 (or wider if ``value`` is wider), cast to ``dtype``."""
        wide = jnp.promote_types(self.value.dtype, jnp.float32)
        out = self.value.astype(wide) / self.scale.astype(wide)
        return out if dtype is None else out.astype(dtype)


class StatelessScaledGrad(ScaledGrad):
    """A :class:`ScaledGrad` from a backward given no ``adaloss_state``: its decisions could not
    see :func:`jax_adaloss.adaloss`'s back-off, so an overflow that repeats would skip every step.
    :func:`jax_adaloss.adaloss` refuses it at trace time, with the remedy; pass
    ``adaloss_state=opt_state`` to the backward (or ``adaloss_state=None`` to say that training
    runs without back-off). Tree operations and :func:`jax_adaloss.tree_add` /
    :func:`jax_adaloss.pmean` keep the type."""

    __slots__ = ()


MISPLACED = (
    "a transformation rescaled a tree of jax_adaloss.ScaledGrad gradients as if their scales "
    "were values ({what}). Each ScaledGrad carries its own loss scale: unscale them first. "
    "Put adaloss first and everything else inside it: "
    "adaloss(inner=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))), "
    "adaloss(inner=optax.MultiSteps(optax.adam(lr), k)); reduce across devices or micro-batches "
    "with jax_adaloss.pmean, jax_adaloss.psum, jax_adaloss.tree_add and jax_adaloss.tree_scale; or "
    "read plain gradients with "
    "jax_adaloss.unscale_tree(grads).")


def _check_marker(marker: Any) -> None:
    dtype = getattr(marker, "dtype", None)  # (a tangent's float0 is no number: left alone)
    if dtype is not None and jnp.issubdtype(dtype, jnp.number):
        raise ValueError(MISPLACED.format(what=f"its boolean marker came back as {dtype}"))


def _register(cls: type) -> None:
    keys = tuple(jax.tree_util.GetAttrKey(f) for f in ScaledGrad._fields)

    def flatten_with_keys(g: ScaledGrad) -> tuple[Any, None]:
        return tuple(zip(keys, g)), None

    def unflatten(_: None, children: Any) -> ScaledGrad:
        _check_marker(children[_MARKER])
        return cls(*children)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten,
                                            flatten_func=lambda g: (tuple(g), None))


_MARKER = ScaledGrad._fields.index("marker")

#: The position :func:`encode_trace` gives a leaf that is no layer's weight (after every layer).
NO_LAYER = 2**20


def encode_trace(position: Any, cotangent_finite: Any, loss_finite: Any) -> jax.Array:
    """``4·position + 2·cotangent_finite + loss_finite`` as an fp32 scalar (exact: positions
    up to :data:`NO_LAYER`)."""
    f32 = jnp.float32
    return (jnp.asarray(position, f32) * 4 + jnp.asarray(cotangent_finite, f32) * 2
            + jnp.asarray(loss_finite, f32))


def trace_parts(code: jax.Array) -> jax.Array:
    """``[position, cotangent_finite, loss_finite]`` (fp32) of :func:`encode_trace`'s ``code``, in
    the program: reductions over devices or micro-batches take each part's minimum (the
    earliest non-finite layer, any non-finite value) and encode them again."""
    code = jnp.asarray(code, jnp.float32)
    position = jnp.floor(code / 4)
    return jnp.stack([position, jnp.floor(code / 2) - 2 * position, jnp.mod(code, 2)])


def combine_traces(traces: list[Any]) -> jax.Array | None:
    """The parts' minimum of several :func:`encode_trace` codes (``None`` if none is given)."""
    traces = [t for t in traces if t is not None]
    if not traces:
        return None
    parts = jnp.min(jnp.stack([trace_parts(t) for t in traces]), axis=0)
    return encode_trace(*parts)


def decode_trace(code: Any) -> tuple[int, bool, bool]:
    """``(position, cotangent_finite, loss_finite)`` of a host value of :func:`encode_trace`."""
    code = int(code)
    return code // 4, bool(code & 2), bool(code & 1)


def kind_of(*grads: ScaledGrad) -> type[ScaledGrad]:
    """The type a combination of ``grads`` keeps: stateless if any of them is."""
    return StatelessScaledGrad if any(isinstance(g, StatelessScaledGrad) for g in grads) else ScaledGrad


_register(ScaledGrad)
_register(StatelessScaledGrad)


def mark_stateless(tree: Any) -> Any:
    """``tree`` with every :class:`ScaledGrad` made a :class:`StatelessScaledGrad`."""
    return jax.tree.map(lambda g: StatelessScaledGrad(*g) if isinstance(g, ScaledGrad) else g, tree,
                        is_leaf=is_scaled_grad)


def rescale(x: Any, factor: Any) -> Any:
    """``x · factor`` computed in (at least) fp32, returned in ``x``'s dtype (non-float ``x``
    unchanged)."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return x
    wide = jnp.promote_types(dtype, jnp.float32)
    return (x.astype(wide) * jnp.asarray(factor).astype(wide)).astype(dtype)


def is_scaled_grad(x: Any) -> bool:
    """``is_leaf`` predicate that stops tree traversal at ``ScaledGrad`` nodes."""
    return isinstance(x, ScaledGrad)


def unscale_tree(grads: Any) -> Any:
    """Replace every ``ScaledGrad`` in ``grads`` by its fp32 unscaled value; other leaves pass through."""
    return jax.tree.map(lambda g: g.unscale() if isinstance(g, ScaledGrad) else g,
                        grads, is_leaf=is_scaled_grad)
