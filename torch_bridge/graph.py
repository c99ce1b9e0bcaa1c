"""Read an autograd graph and plan which scale every gradient will carry.

PyTorch records the forward pass as a graph of backward nodes
(``loss.grad_fn`` and its ``next_functions``). Before ``backward()`` runs, this
module walks that graph once and decides, in the same terms as
``jax_adaloss``'s reverse sweep:

- a *weight* is a value computed only from model parameters (casts, transposes,
  views, scalar factors); an *activation* depends on data: an input tensor that
  does not require grad (a ``None`` edge), an embedding/index lookup, or a leaf
  tensor that is not a parameter;
- a *layer* is a matmul (``mm``/``addmm``/``bmm``/``baddbmm``/``mv``/``addmv``)
  or convolution with exactly one weight operand and an activation operand that
  needs a gradient; its fan-in ``n`` is the weight's extent along the output
  dimension (out_channels·kh·kw/groups for a convolution);
- a *cast* is a node that narrows the cotangent for one of its inputs (an
  ``fp16 → fp32`` upcast in forward, explicit or by type promotion);
- every other node passes its incoming scale through;
- a value consumed by several nodes whose contributions carry different scales
  is a *merge point*; a node whose outputs carry different scales merges them.

Scales are symbols here (small ints); their values are computed in hooks while
the backward runs (:mod:`torch_bridge.hooks`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

# name -> (operand positions (a, b) of a @ b, saved attribute of each operand)
_MATMUL: dict[str, tuple[tuple[int, int], tuple[str, str]]] = {
    "MmBackward0": ((0, 1), ("_saved_self", "_saved_mat2")),
    "AddmmBackward0": ((1, 2), ("_saved_mat1", "_saved_mat2")),
    "BmmBackward0": ((0, 1), ("_saved_self", "_saved_mat2")),
    "BaddbmmBackward0": ((1, 2), ("_saved_batch1", "_saved_batch2")),
    "MvBackward0": ((0, 1), ("_saved_self", "_saved_vec")),
    "AddmvBackward0": ((1, 2), ("_saved_mat", "_saved_vec")),
}
_CONV = "ConvolutionBackward0"  # edges: input 0, weight 1, bias 2
# nodes whose forward read a tensor by data-dependent indices (the indices are no edge)
_LOOKUP = frozenset({"EmbeddingBackward0", "EmbeddingBagBackward0", "IndexBackward0",
                     "IndexSelectBackward0", "GatherBackward0", "TakeBackward0"})
# elementwise nodes whose non-differentiated operand may be a scalar constant
_SCALAR_OPERAND = {"MulBackward0": ("_saved_self", "_saved_other"),
                   "DivBackward0": ("_saved_self", "_saved_other")}
_ACT = None  # origin of activations; a weight's origin is its parameter name


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


@dataclasses.dataclass(eq=False)
class NodePlan:
    """What one backward node does to scales. ``sym`` values are scale symbols."""

    node: Any
    kind: str = "op"  # "op" | "layer" | "cast"
    name: str = ""
    seq: int = 0
    out_dtypes: tuple[torch.dtype, ...] = ()
    # per output k: contributions (consumer plan, consumer edge index, symbol)
    contribs: dict[int, list[tuple[NodePlan, int, int]]] = dataclasses.field(
        default_factory=lambda: defaultdict(list))
    merges: dict[int, int] = dataclasses.field(default_factory=dict)  # output k -> merged symbol
    out_syms: dict[int, int] = dataclasses.field(default_factory=dict)  # output k -> symbol
    cross_merge: bool = False  # outputs carry different symbols: merge them into ``sym``
    sym: int = -1  # the scale of the cotangent the node computes with
    send: int = -1  # symbol sent on the activation edge (layer) / every edge (cast)
    edge_syms: dict[int, int] = dataclasses.field(default_factory=dict)  # edge i -> symbol sent
    stash_edges: dict[int, tuple[NodePlan, int]] = dataclasses.field(default_factory=dict)
    # layers
    act_edge: int = -1
    weight_attr: str = ""
    fan_in: int = 1
    param: torch.Tensor | None = None  # AccumulateGrad: the leaf


class ScalePlan:
    """The scale symbols of one backward pass, planned from ``root`` (``loss.grad_fn``)."""

    def __init__(self, root: Any, param_names: Mapping[int, str], cast_rule: bool = True) -> None:
        self.root = root
        self.param_names = param_names
        self.cast_rule = cast_rule
        self.plans: dict[Any, NodePlan] = {}
        self.order: list[NodePlan] = []  # consumers before producers
        self.n_syms = 1  # symbol 0: the seed (init_scale)
        self._origin: dict[Any, str | None] = {}
        self._collect()
        self._classify()
        self._assign()

    # -- graph --------------------------------------------------------------------
    def _collect(self) -> None:
        """Nodes in topological order (Kahn), ties broken by latest-created first."""
        deps: dict[Any, int] = defaultdict(int)
        seen = {self.root}
        stack = [self.root]
        while stack:
            node = stack.pop()
            self.plans[node] = NodePlan(node, seq=node._sequence_nr(),
                                        out_dtypes=tuple(m.dtype for m in node._input_metadata))
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                deps[nxt] += 1
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        ready = [self.root]
        while ready:
            node = ready.pop()
            self.order.append(self.plans[node])
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    ready.append(nxt)

    def origin(self, node: Any) -> str | None:
        """Parameter name if ``node``'s output is computed from parameters only, else ``None``."""
        return self._origin[node]

    def _classify(self) -> None:
        for plan in reversed(self.order):  # producers first
            node = plan.node
            self._origin[node] = self._node_origin(plan)
        names: dict[str, int] = defaultdict(int)
        casts = 0
        for plan in sorted(self.order, key=lambda p: p.seq):  # forward order
            if self._as_layer(plan):
                k = names[plan.name]
                names[plan.name] += 1
                plan.name = plan.name if k == 0 else f"{plan.name}@{k}"
            elif self.cast_rule and self._narrows(plan):
                plan.kind, plan.name = "cast", f"cast:{casts}"
                casts += 1

    def _node_origin(self, plan: NodePlan) -> str | None:
        node = plan.node
        if hasattr(node, "variable"):  # AccumulateGrad
            plan.param = node.variable
            return self.param_names.get(id(node.variable), _ACT)
        if node.name() in _LOOKUP:
            return _ACT
        names = []
        for i, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                if not self._scalar_operand(node, i):
                    return _ACT
                continue
            o = self._origin[nxt]
            if o is _ACT:
                return _ACT
            names.append(o)
        return names[0] if names else _ACT

    @staticmethod
    def _scalar_operand(node: Any, i: int) -> bool:
        attrs = _SCALAR_OPERAND.get(node.name())
        if attrs is None or i > 1:
            return False
        saved = getattr(node, attrs[i], None)
        return isinstance(saved, torch.Tensor) and saved.numel() == 1

    def _as_layer(self, plan: NodePlan) -> bool:
        node = plan.node
        kind = node.name()
        edges = node.next_functions
        if kind in _MATMUL:
            (ia, ib), attrs = _MATMUL[kind]
            operands = (ia, ib)
        elif kind == _CONV:
            operands, attrs = (0, 1), ("", "_saved_weight")
        else:
            return False
        origins = [_ACT if edges[i][0] is None else self._origin[edges[i][0]] for i in operands]
        weights = [j for j in (0, 1) if origins[j] is not _ACT]
        if len(weights) != 1 or (kind == _CONV and weights[0] != 1):
            return False
        w = weights[0]
        act = operands[1 - w]
        if edges[act][0] is None:
            return False  # the activation needs no gradient (first layer)
        weight = getattr(node, attrs[w])
        plan.kind, plan.name = "layer", origins[w]
        plan.act_edge, plan.weight_attr = act, attrs[w]
        plan.fan_in = _fan_in(kind, w, tuple(weight.shape), node)
        return True

    def _narrows(self, plan: NodePlan) -> bool:
        wide = [d.itemsize for d in plan.out_dtypes if _is_float(d)]
        if not wide:
            return False
        widest = max(wide)
        for nxt, k in plan.node.next_functions:
            if nxt is None:
                continue
            d = self.plans[nxt].out_dtypes[k]
            if _is_float(d) and d.itemsize <= 2 and d.itemsize < widest:
                return True
        return False

    # -- symbols ------------------------------------------------------------------
    def _new(self) -> int:
        self.n_syms += 1
        return self.n_syms - 1

    def _assign(self) -> None:
        root = self.plans[self.root]
        root.contribs[0].append((root, -1, 0))  # the seed
        for plan in self.order:
            for k, parts in plan.contribs.items():
                syms = {s for _, _, s in parts}
                if len(syms) == 1:
                    plan.out_syms[k] = parts[0][2]
                else:
                    plan.out_syms[k] = plan.merges[k] = self._new()
                    for consumer, i, _ in parts:
                        consumer.stash_edges[i] = (plan, k)
            present = set(plan.out_syms.values())
            if len(present) > 1:
                plan.cross_merge, plan.sym = True, self._new()
            elif present:
                plan.sym = present.pop()
            else:
                continue  # reached only through undefined gradients
            if plan.kind in ("layer", "cast"):
                plan.send = self._new()
            for i, (nxt, k) in enumerate(plan.node.next_functions):
                if nxt is None:
                    continue
                sym = plan.send if plan.kind == "cast" or i == plan.act_edge else plan.sym
                plan.edge_syms[i] = sym
                self.plans[nxt].contribs[k].append((plan, i, sym))

    # -- queries ------------------------------------------------------------------
    def layers(self) -> list[NodePlan]:
        """Layer and cast nodes in forward order."""
        return sorted((p for p in self.order if p.kind != "op"), key=lambda p: p.seq)

    def leaves(self) -> list[NodePlan]:
        return [p for p in self.order if p.param is not None]


def _fan_in(kind: str, w: int, shape: tuple[int, ...], node: Any) -> int:
    """Terms summed into each entry of the activation's gradient."""
    if kind == _CONV:
        groups = int(getattr(node, "_saved_groups", 1))
        total = 1
        for d in shape:
            total *= d
        return total // shape[1] // groups
    if len(shape) == 1:  # a vector weight of mv: each input-gradient entry is one product
        return 1 if w == 1 else shape[0]
    return shape[-1] if w == 1 else shape[-2]


def parameter_names(module: torch.nn.Module | None) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``module`` (tied ones under their first name)."""
    if module is None:
        return {}
    return {id(p): n for n, p in module.named_parameters()}
