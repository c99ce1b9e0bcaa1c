"""One compiled kernel per scale decision, for decisions on device tensors.

On an accelerator a decision's scalar math (:mod:`adaloss.solver` on 0-d tensors: the
statistical scale, the caps and bounds, the rounding, the underflow fraction) is some fifty
aten ops, each a kernel launch, against a handful for the statistics it reads. A
:class:`FusedMath` traces such a function once per signature into an aten graph
(``make_fx`` on fake tensors: a branch on a value raises instead of being baked in) and
compiles that graph with inductor (one kernel), so that a decision costs one launch.

The function is pure: 0-d fp32 tensors (or ``None``, in any pytree of tuples and
NamedTuples) in, such a pytree out; everything else it reads (the config, a fan-in) is a
*static* argument, part of the cache key, baked into the graph (what follows the batch, a
cotangent's size, is an argument: :meth:`FusedMath.constant`). Compiled code
computes each operation once in fp32, as JAX and NumPy do (eager torch divides a Python number
by a tensor as a reciprocal times the number, two roundings): the scales, powers of two, are
the same; an unrounded statistic may differ from eager device math in its last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_bridge._xp import xp

__all__ = ["BACKENDS", "FusedMath"]

#: what :class:`FusedMath` compiles the traced decision with
BACKENDS = ("inductor", "eager")


class FusedMath:
    """Compiled decision functions, cached by function, static arguments and input signature.

    Args:
      backend: ``"inductor"`` (one kernel per decision, ``torch._inductor.compile``: the
        backward's hooks run with dynamo disabled, so not through ``torch.compile``) or
        ``"eager"`` (the traced graph run op by op: the same ops as eager device math).
    """

    def __init__(self, backend: str = "inductor") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        # key -> (compiled graph, (which output leaves are tensors, the outputs' tree))
        self._compiled: dict[Hashable, tuple[Callable[..., Any], Any]] = {}
        self._constants: dict[tuple[Any, ...], torch.Tensor] = {}

    def constant(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``value`` as a 0-d tensor on ``device``, made once (a size that follows the batch is
        an argument of the compiled decision, not baked into it; on an accelerator, a fresh
        tensor from a Python number would be a copy from the host each time)."""
        key = (value, dtype, device)
        got = self._constants.get(key)
        if got is None:
            got = self._constants[key] = torch.tensor(value, dtype=dtype, device=device)
        return got

    def __len__(self) -> int:
        """How many graphs were compiled."""
        return len(self._compiled)

    def __call__(self, fn: Callable[..., Any], static: tuple[Hashable, ...], *args: Any) -> Any:
        """``fn(*static, xp, *args)`` (``xp``: :data:`torch_bridge._xp.xp`), compiled."""
        leaves, spec = pytree.tree_flatten(args)
        present = tuple(leaf is not None for leaf in leaves)
        tensors = [leaf for leaf in leaves if leaf is not None]
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dim() != 0:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else ""
                raise TypeError(f"{fn.__name__}: a fused decision takes 0-d tensors, got "
                                f"{type(t).__name__}{shape}")
        key = (fn, static, spec, present, tuple((t.dtype, t.device) for t in tensors))
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._compiled[key] = self._compile(fn, static, spec, present, tensors)
        compiled, (out_present, out_spec) = hit
        it = iter(compiled(*tensors))
        return pytree.tree_unflatten([next(it) if p else None for p in out_present], out_spec)

    def _compile(self, fn: Callable[..., Any], static: tuple[Hashable, ...], spec: Any,
                 present: tuple[bool, ...], tensors: list[torch.Tensor]) -> tuple[Callable[..., Any], Any]:
        from torch.fx.experimental.proxy_tensor import make_fx

        out_spec: list[Any] = []

        def flat(*ts: torch.Tensor) -> list[torch.Tensor]:
            it = iter(ts)
            leaves = [next(it) if p else None for p in present]
            out, s = pytree.tree_flatten(fn(*static, xp, *pytree.tree_unflatten(leaves, spec)))
            for o in out:
                if o is not None and not isinstance(o, torch.Tensor):
                    raise TypeError(f"{fn.__name__}: a fused decision returns tensors, "
                                    f"got {type(o).__name__}")
            out_spec.append((tuple(o is not None for o in out), s))
            return [o for o in out if o is not None]

        with torch.no_grad():
            graph = make_fx(flat, tracing_mode="fake")(*tensors)
            if self.backend == "eager":
                return graph, out_spec[0]
            from torch import _inductor  # not through dynamo: the hooks run with it disabled

            return _inductor.compile(graph, tensors), out_spec[0]
