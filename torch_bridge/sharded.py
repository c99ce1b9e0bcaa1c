"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the names of its unsharded parameters, and
the checks a sharded step needs.

FSDP2 all-gathers each sharded parameter into an unsharded ``nn.Parameter`` that the forward
uses; autograd accumulates into that copy, and FSDP2 reduce-scatters its gradient (cast to the
policy's ``reduce_dtype``) into the sharded parameter's ``.grad`` in its post-backward hook. The
scaler names the unsharded copies after the sharded parameters (so that layers are found), and
unscales every gradient as autograd delivers it (``unscale_in_backward``): what FSDP2 reduces
then carries scale 1 on every rank, with its overlap untouched. A rank holds only its shard, so
the inf/NaN check is all-reduced: every rank takes the same skip decision.
"""

from __future__ import annotations

from typing import Any

import torch

_F16_PARAMS = ("fully_shard with MixedPrecisionPolicy(param_dtype=torch.float16): the unsharded "
               "parameters, and so the gradients FSDP2 reduce-scatters, are fp16; unscaling them to "
               "one common scale in fp16 would flush their small entries, which is what per-layer "
               "scales avoid. Keep param_dtype=None (or torch.float32), reduce_dtype=torch.float32, "
               "and run the forward under torch.autocast(dtype=torch.float16): the GEMMs still run "
               "in fp16 and the gradients reach FSDP2 unscaled in fp32.")


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
    every ``fully_shard``-ed module of ``model`` that has run a forward. Raises for an fp16
    ``param_dtype`` (:data:`_F16_PARAMS`)."""
    prefix = {id(m): n for n, m in model.named_modules()}
    names: dict[int, str] = {}
    for module in fsdp2_modules(model):
        for fp in _fsdp_params(module):
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is None:
                continue
            if unsharded.dtype == torch.float16:
                raise ValueError(_F16_PARAMS)
            info = fp._module_info
            owner = prefix.get(id(info.module))
            if owner is not None:
                names[id(unsharded)] = f"{owner}.{info.param_name}" if owner else info.param_name
    return names


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` gradient (the same storage), else ``grad``."""
    to_local = getattr(grad, "to_local", None)
    return grad if to_local is None else to_local()


def agree_found_inf(found: dict[torch.device, torch.Tensor]) -> None:
    """All-reduce (max) each device's inf/NaN flag in place across the default group: a rank
    holds only its shard of each gradient, and every rank must skip the same steps."""
    for flag in found.values():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)


__all__ = ["agree_found_inf", "fsdp2_modules", "local_grad", "refuse_fsdp1", "unsharded_names"]
