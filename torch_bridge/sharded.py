"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the names of its unsharded parameters, and
the checks a sharded step needs.

FSDP2 all-gathers each sharded parameter into an unsharded ``nn.Parameter`` that the forward
uses; autograd accumulates into that copy, and FSDP2 reduce-scatters its gradient (cast to the
policy's ``reduce_dtype``) into the sharded parameter's ``.grad`` in its post-backward hook. The
scaler names the unsharded copies after the sharded parameters (so that layers are found), and
unscales every gradient as autograd delivers it (``unscale_in_backward``): what FSDP2 reduces
then carries scale 1 on every rank, with its overlap untouched. A rank holds only its shard, so
the inf/NaN check is all-reduced: every rank takes the same skip decision. With fp16
copies (``param_dtype=torch.float16``), whose gradients autograd keeps in fp16, the scaler
unscales each into the fp32 gradient FSDP2 reduce-scatters (``reduce_dtype=torch.float32``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_F16_REDUCE = ("fully_shard with fp16 parameters (MixedPrecisionPolicy(param_dtype=torch.float16)) "
               "needs reduce_dtype=torch.float32: each gradient is unscaled into an fp32 copy that "
               "FSDP2 reduce-scatters; unscaled in fp16 its small entries would flush to zero.")


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """The ``FSDPParam``s ``fully_shard(module)`` manages (none before its first forward)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else list(group.fsdp_params)


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def refuse_fsdp1(model: torch.nn.Module) -> None:
    """FSDP1 (``FullyShardedDataParallel``) flattens parameters into ``FlatParameter`` objects whose
    gradients the scaler cannot name or unscale: refuse it with the remedy."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise NotImplementedError(
            "AdaLossScaler does not support FullyShardedDataParallel (FSDP1): it reduces the "
            "gradients of flattened parameters the scaler cannot name. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard, supported) or DistributedDataParallel.")


def unsharded_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(unsharded parameter) -> name`` of the sharded parameter it was gathered from, for
    every ``fully_shard``-ed module of ``model`` that has run a forward."""
    prefix = {id(m): n for n, m in model.named_modules()}
    names: dict[int, str] = {}
    for module in fsdp2_modules(model):
        for fp in _fsdp_params(module):
            unsharded = getattr(fp, "_unsharded_param", None)
            info = fp._module_info
            owner = prefix.get(id(info.module))
            if unsharded is not None and owner is not None:
                names[id(unsharded)] = f"{owner}.{info.param_name}" if owner else info.param_name
    return names


def fp16_copies(model: torch.nn.Module) -> dict[int, Any]:
    """``id(unsharded parameter) -> FSDPParam`` where the policy gathers fp16 copies
    (``param_dtype=torch.float16``): their gradients are fp16, and autograd refuses a hook that
    changes a gradient's dtype, so each is unscaled into the fp32 gradient FSDP2 reduce-scatters
    (:func:`route_unscaled`). Raises unless ``reduce_dtype`` is fp32 (:data:`_F16_REDUCE`)."""
    copies: dict[int, Any] = {}
    for module in fsdp2_modules(model):
        for fp in _fsdp_params(module):
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is None or unsharded.dtype != torch.float16:
                continue
            if fp.reduce_dtype != torch.float32:
                raise ValueError(_F16_REDUCE)
            copies[id(unsharded)] = fp
    return copies


def route_unscaled(fsdp_param: Any, grad: torch.Tensor, scale: torch.Tensor) -> None:
    """Add ``grad / scale`` (the fp16 gradient of an unsharded copy, carrying ``scale``), in
    fp32, to the reduce-dtype gradient FSDP2 reduce-scatters (``unsharded_accumulated_grad``,
    where it accumulates micro-batches itself), and clear ``.grad``. Exact for power-of-two
    scales: the fp16 values are widened, then divided."""
    unscaled = grad.to(torch.float32) * scale.reciprocal()
    if fsdp_param.unsharded_accumulated_grad is None:
        fsdp_param.unsharded_accumulated_grad = unscaled
    else:
        fsdp_param.unsharded_accumulated_grad += unscaled
    fsdp_param.unsharded_param.grad = None


class Fp16Routes:
    """The fp16 unsharded copies of a ``fully_shard``-ed model (``param_dtype=torch.float16``):
    each hooked once (``register_post_accumulate_grad_hook``) so that, once autograd accumulates
    its fp16 gradient, it is unscaled into the fp32 gradient FSDP2 reduce-scatters
    (:func:`route_unscaled`). ``copies``: ``id(copy) -> FSDPParam``; ``scales``: the scale each
    copy's gradient carries until it is routed; ``routed``: the sharded parameters routed since
    the iteration began (cleared by the scaler's ``update()``). Pickled empty: the hooks and
    copies live in their process."""

    def __init__(self) -> None:
        self.copies: dict[int, Any] = {}
        self.scales: dict[int, torch.Tensor] = {}
        self.hooks: dict[int, Any] = {}
        self.routed: set[int] = set()

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self.copies

    def hook(self, model: torch.nn.Module) -> None:
        """Find ``model``'s fp16 copies (:func:`fp16_copies`) and hook the new ones."""
        self.copies = fp16_copies(model)
        me = weakref.ref(self)
        for key, fp in self.copies.items():
            if key not in self.hooks:
                self.hooks[key] = fp.unsharded_param.register_post_accumulate_grad_hook(
                    lambda param, me=me: me().route(param) if me() is not None else None)

    def route(self, param: torch.Tensor) -> None:
        scale = self.scales.pop(id(param), None)
        if param.grad is None:
            return
        if scale is None:
            raise RuntimeError("AdaLossScaler: an fp16 FSDP2 parameter received a gradient outside a "
                               "scaled backward; call scaler.scale(loss).backward().")
        fp = self.copies[id(param)]
        route_unscaled(fp, param.grad, scale)
        self.routed.add(id(fp.sharded_param))

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


def own_values(t: torch.Tensor) -> torch.Tensor:
    """A sparse gradient's own values (uncoalesced, as GradScaler unscales them: an in-place op
    reaches the gradient; a duplicate index's entries scale alike), a dense one itself."""
    return t._values() if t.is_sparse else t


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` gradient (the same storage), else ``grad``."""
    to_local = getattr(grad, "to_local", None)
    return grad if to_local is None else to_local()


def agree_found_inf(found: dict[torch.device, torch.Tensor]) -> None:
    """All-reduce (max) each device's inf/NaN flag in place across the default group: a rank
    holds only its shard of each gradient, and every rank must skip the same steps."""
    for flag in found.values():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)


__all__ = ["Fp16Routes", "agree_found_inf", "fp16_copies", "fsdp2_modules", "local_grad", "own_values",
           "refuse_fsdp1", "route_unscaled", "unsharded_names"]
