"""Flax nnx Modules as arguments, with ``nnx.value_and_grad``'s meaning.

A Module argument (anywhere in the positional or keyword arguments) is split
into the state that is differentiated (its ``wrt`` filter, default
``nnx.Param``, for a differentiated argument) and the rest (BatchNorm
statistics, RNG keys and counts, or everything for an argument that is not
differentiated). The function runs on Modules merged from those states, the
rest as it is after the call is written back into the caller's Modules with
``nnx.update`` (inside ``nnx.jit`` too), and the gradient of a Module is an
``nnx.State`` of its ``wrt`` variables, what ``nnx.Optimizer.update`` takes.

``flax.nnx`` is looked up in ``sys.modules``: if nobody imported it, no
argument can be a Module, and nothing here imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def is_diff_state(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.DiffState)


def parse_argnums(argnums: Any, wrt: Any) -> tuple[tuple[int, ...], dict[int, Any]]:
    """``argnums`` (ints or ``nnx.DiffState``s) as positions, and each position's nnx filter
    (``wrt``, default ``nnx.Param``; a ``DiffState``'s own filter wins)."""
    items: Sequence[Any] = (argnums,) if isinstance(argnums, int) or is_diff_state(argnums) else argnums
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"argnums must be an int, an nnx.DiffState or a non-empty sequence of them, "
                        f"got {argnums!r}") from None
    nums: list[int] = []
    filters: dict[int, Any] = {}
    for a in items:
        if is_diff_state(a):
            nums.append(a.argnum)
            filters[a.argnum] = a.filter
        elif isinstance(a, int) and not isinstance(a, bool):
            nums.append(a)
            if wrt is not None:
                filters[a] = wrt
        else:
            raise TypeError(f"argnums must be an int, an nnx.DiffState or a non-empty sequence of them, "
                            f"got {argnums!r}")
    if not nums:
        raise TypeError(f"argnums must not be empty, got {argnums!r}")
    if len(set(nums)) != len(nums):
        raise ValueError(f"argnums {argnums!r} repeats an argument")
    return tuple(nums), filters


def _is_slot(x: Any) -> bool:
    nnx = _nnx()
    return nnx.graph.is_graph_node(x) or isinstance(x, nnx.State)


def has_graph_nodes(tree: Any) -> bool:
    nnx = _nnx()
    if nnx is None:
        return False
    return any(nnx.graph.is_graph_node(x) for x in jax.tree.leaves(tree, is_leaf=nnx.graph.is_graph_node))


class _Slot:
    """One Module of the arguments: how it was split and where its state goes."""

    def __init__(self, module: Any, flt: Any) -> None:
        nnx = _nnx()
        self.module, self.filter = module, flt
        if flt is None:
            self.graphdef, self.rest = nnx.split(module)
            self.diff = nnx.State({})
        else:
            self.graphdef, self.diff, self.rest = nnx.split(module, flt, ...)

    def merge(self, diff: Any, rest: Any) -> Any:
        nnx = _nnx()
        return nnx.merge(self.graphdef, rest) if self.filter is None else \
            nnx.merge(self.graphdef, diff, rest)

    def rest_of(self, module: Any) -> Any:
        nnx = _nnx()
        return nnx.split(module)[1] if self.filter is None else nnx.split(module, self.filter, ...)[2]


def _split_tree(tree: Any, flt: Any, slots: list[_Slot], seen: set[int]) -> tuple[Any, list[int]]:
    """``tree`` with each Module replaced by its differentiated state (an empty State if
    ``flt`` is None), and the leaf positions of those replacements; the Modules' splits
    are appended to ``slots``."""
    nnx = _nnx()
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_slot)
    positions = []
    for j, leaf in enumerate(leaves):
        if nnx.graph.is_graph_node(leaf):
            if id(leaf) in seen:
                raise ValueError("the same nnx Module is passed twice; pass it once (its state would "
                                 "be split and written back twice)")
            seen.add(id(leaf))
            slots.append(_Slot(leaf, flt))
            leaves[j] = slots[-1].diff
            positions.append(j)
    return jax.tree_util.tree_unflatten(treedef, leaves), positions


def _merge_tree(tree: Any, positions: list[int], slots: list[_Slot], rests: list[Any],
                merged: list[Any]) -> Any:
    """Inverse of :func:`_split_tree` on traced states: Modules merged from (diff, rest),
    appended to ``merged`` in slot order."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_slot)
    for j in positions:
        k = len(merged)
        merged.append(slots[k].merge(leaves[j], rests[k]))
        leaves[j] = merged[-1]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def call(core: Callable[..., Any], fun: Callable[..., Any], args: tuple[Any, ...],
         kwargs: dict[str, Any], pos: tuple[int, ...], weight_pos: tuple[int, ...] | None,
         filters: dict[int, Any], has_aux: bool, backoff: Any = None
         ) -> tuple[Any, Any, list[Any], Any]:
    """Run ``core`` on ``fun`` with every Module of the arguments split into states; write
    the Modules' new non-differentiated state back. Returns ``core``'s results."""
    nnx = _nnx()
    slots: list[_Slot] = []
    seen: set[int] = set()
    pure_args, where, module_args = [], [], []
    for i, a in enumerate(args):
        flt = filters.get(i, nnx.Param) if i in pos else None
        tree, positions = _split_tree(a, flt, slots, seen)
        pure_args.append(tree)
        where.append(positions)
        if i in pos and positions:
            module_args.append(i)
    pure_kwargs, kw_where = _split_tree(kwargs, None, slots, seen)
    n_args = len(args)

    def pure(*pa: Any, **pk: Any) -> Any:
        *pa, rests = pa
        merged: list[Any] = []
        real_args = [_merge_tree(a, w, slots, rests, merged) for a, w in zip(pa, where)]
        real_kwargs = _merge_tree(pk, kw_where, slots, rests, merged)
        out = fun(*real_args, **real_kwargs)
        if has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("has_aux=True requires fun to return a (value, aux) pair")
        value, aux = out if has_aux else (out, None)
        return value, (aux, [s.rest_of(m) for s, m in zip(slots, merged)])

    weights = weight_pos if weight_pos is not None else (tuple(module_args) or pos[:1])
    value, (aux, new_rests), grads_args, report = core(
        pure, (*pure_args, [s.rest for s in slots]), pure_kwargs, pos, weights, True, backoff)
    for s, r in zip(slots, new_rests):
        nnx.update(s.module, r)
    return value, aux, grads_args[:n_args], report
