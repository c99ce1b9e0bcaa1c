"""Read an autograd graph and plan which scale every gradient will carry.

PyTorch records the forward pass as a graph of backward nodes
(``loss.grad_fn`` and its ``next_functions``). Before ``backward()`` runs, this
module walks that graph once and decides, in the same terms as
``jax_adaloss``'s reverse sweep:

- a *weight* is a value computed only from parameters (``nn.Parameter`` leaves:
  casts, transposes, views, scalar factors); an *activation* depends on data:
  an input tensor that does not require grad (a ``None`` edge), an
  embedding/index lookup, or a leaf tensor that is not a parameter;
- a *layer* is a matmul (``mm``/``addmm``/``bmm``/``baddbmm``/``mv``/``addmv``,
  ``torch._grouped_mm``) or convolution with exactly one weight operand (or one operand
  gathered from a parameter by data indices: per-token expert weights) and an activation
  operand that needs a gradient; its fan-in ``n`` is the weight's extent along the output
  dimension (a convolution's: :func:`adaloss.fan_in.conv_fan_in`);
- a *cast* is a node that narrows the cotangent for one of its inputs (an
  ``fp16 → fp32`` upcast in forward, explicit or by type promotion);
- a *factor* is a mul/div by a scalar that can amplify a 16-bit cotangent: its hook
  lowers the scale first (:func:`adaloss.solver.amplified_scale`);
- every other node passes its incoming scale through;
- a value consumed by several nodes whose contributions carry different scales
  is a *merge point*; a node whose outputs carry different scales merges them.

Scales are symbols here (small ints); their values are computed in hooks while
the backward runs (:mod:`torch_bridge.hooks`). The plan is index-based and
cached by the graph's structure (node types, edges, parameters), so a training
loop classifies its graph once, not every step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from adaloss.fan_in import conv_fan_in
from adaloss.report import Coverage

FP8_NODE = "_Float8MatmulBackward"  # torch_bridge.float8's layer (a name: no import of it here)

# name -> (operand positions (a, b) of a @ b, saved attribute of each operand)
_MATMUL: dict[str, tuple[tuple[int, int], tuple[str, str]]] = {
    "MmBackward0": ((0, 1), ("_saved_self", "_saved_mat2")),
    "AddmmBackward0": ((1, 2), ("_saved_mat1", "_saved_mat2")),
    "BmmBackward0": ((0, 1), ("_saved_self", "_saved_mat2")),
    "BaddbmmBackward0": ((1, 2), ("_saved_batch1", "_saved_batch2")),
    "MvBackward0": ((0, 1), ("_saved_self", "_saved_vec")),
    "AddmvBackward0": ((1, 2), ("_saved_mat", "_saved_vec")),
    # torch._grouped_mm (transformers' default MoE experts): tokens [T, K] @ experts [E, K, N]
    "GroupedMmBackward0": ((0, 1), ("_saved_self", "_saved_mat2")),
    # torch_bridge.float8's x @ w (its GEMMs torch._scaled_mm, its weight gradient fp32): no
    # saved attribute is read (the weight's statistics come from its fp8 values)
    FP8_NODE: ((0, 1), ("", "")),
}
_CONV = "ConvolutionBackward0"  # edges: input 0, weight 1, bias 2
# nodes whose forward read a tensor by data-dependent indices (the indices are no edge)
_LOOKUP = frozenset({"EmbeddingBackward0", "EmbeddingBagBackward0", "IndexBackward0",
                     "IndexSelectBackward0", "GatherBackward0", "TakeBackward0"})
# elementwise nodes whose non-differentiated operand may be a scalar constant
_VECTOR = ("MvBackward0", "AddmvBackward0")  # no weight-gradient cap for these
_ACCUMULATE = "torch::autograd::AccumulateGrad"
_SCALAR_OPERAND = {"MulBackward0": ("_saved_self", "_saved_other"),
                   "DivBackward0": ("_saved_self", "_saved_other")}
# nodes whose gradient for a broadcast operand is a sum over the broadcast entries: the saved
# operand that multiplies the cotangent in it (None: the cotangent itself)
_BROADCAST = {"AddBackward0": (None, None), "SubBackward0": (None, None),
              "MulBackward0": ("_saved_other", "_saved_self")}
# nodes that move or copy entries without changing them (a weight's statistics are those of
# its parameter): the one edge that carries the weight
_STRUCTURAL = frozenset({
    "TBackward0", "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "CloneBackward0",
    "AliasBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0",
    "ContiguousBackward0", "ViewAsRealBackward0", "ExpandAsBackward0"})
_CAST = "ToCopyBackward0"
# a normalization's backward (fp8: its 16-bit result may exceed what the decisions behind it
# modelled): fused norms, and rsqrt(v) (x·rsqrt(v): a Mul one of whose inputs comes from it)
_NORMS = frozenset({"NativeLayerNormBackward0", "NativeBatchNormBackward0", "NativeGroupNormBackward0",
                    "FusedRmsNormBackward0", "RsqrtBackward0", "SqrtBackward0"})
# opaque regions that use parameters inside: reentrant torch.utils.checkpoint (parameters
# reached by a nested backward, not edges) and torch.compile (AOTAutograd)
_REGIONS = ("CheckpointFunctionBackward", "CompiledFunctionBackward")
# fused RNNs: one node runs every time step's GEMMs (oneDNN's per layer and direction; cuDNN's
# and MIOpen's for the whole stack): a weighted region with one decision (see
# torch_bridge.layers.fused_rnn). Per node kind: its input's edge, the saved weights (an attribute
# per tensor, or one holding the list), whether it runs both directions of a bidirectional RNN
FUSED_RNN: dict[str, tuple[int, tuple[str, ...], bool]] = {
    "MkldnnRnnLayerBackward0": (0, ("_saved_weight0", "_saved_weight1"), False),
    "CudnnRnnBackward0": (0, ("_saved_weight",), True),
    "MiopenRnnBackward0": (0, ("_saved_weight",), True),
}
# the gates of one RNN cell (the rows of its input-to-hidden matrix per hidden unit), by the
# ``mode`` the fused kernels save: RNN_RELU, RNN_TANH, LSTM, GRU
RNN_GATES = {0: 1, 1: 1, 2: 4, 3: 3}
_ACT = None  # origin of activations; a weight's origin is its parameter name
# node kinds that only lower the scale they pass on, where the node would make a 16-bit value
# overflow: a scalar factor, a first layer's weight gradient (no decision, no report)
NO_DECISION = ("op", "factor", "input", "norm")


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


@dataclasses.dataclass(eq=False)
class NodePlan:
    """What the node at position ``index`` of the plan does to scales (``sym``: scale symbols).

    Static: the same for every graph of one structure; the node objects of a
    particular graph are in ``ScalePlan.nodes``.
    """

    index: int
    kind: str = "op"  # "op" | "layer" | "cast" | "region" | "rnn" | "input" | "factor" | "norm"
    name: str = ""
    rank: int = 0  # forward (creation) order
    out_dtypes: tuple[torch.dtype, ...] = ()
    edges: tuple[tuple[int, int] | None, ...] = ()  # per input edge: (producer index, its output k)
    leaf: bool = False  # an AccumulateGrad node (its parameter is ScalePlan.params[index])
    merges: dict[int, int] = dataclasses.field(default_factory=dict)  # output k -> merged symbol
    out_syms: dict[int, int] = dataclasses.field(default_factory=dict)  # output k -> symbol
    cross_merge: bool = False  # outputs carry different symbols: merged into ``sym``
    sym: int = -1  # the scale of the cotangent the node computes with
    send: int = -1  # symbol sent on the activation edge (layer) / every edge (cast)
    edge_syms: dict[int, int] = dataclasses.field(default_factory=dict)  # edge i -> symbol sent
    stash_edges: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    act_edge: int = -1
    weight_attr: str = ""
    # a matmul or convolution layer: the saved activation ``x`` of ``dW = xᵀ·g`` (``g·xᵀ`` with
    # the weight on the left), whose column (channel) norms cap the node's fp16 weight gradient;
    # the weight operand's position (0: left, 1: right)
    act_attr: str = ""
    weight_side: int = 1
    # the weight operand rebuilt from its parameter when the node's saved copy must not be
    # read (saved-tensor hooks: torch.utils.checkpoint): (leaf position, ops in forward order:
    # ("cast", dtype) or ("mul" | "div" | "rdiv", (node position, attribute of the scalar)))
    recipe: tuple[int, tuple[tuple[str, Any], ...]] | None = None
    fan_in: int = 1
    feature_dim: int = -1  # a layer's output dimension that comes from its weight (its features)
    narrow_dtype: torch.dtype | None = None  # a cast's: the dtype its cotangent is narrowed to
    what: str = ""  # a cast's: what it casts (dtypes, the widened tensor's shape, its node), for people
    # a "factor" node (``x·c``, ``x/c`` with ``c`` a scalar, on a 16-bit cotangent): the saved
    # attribute holding ``c``, and whether the node divides by it
    factor_attr: str = ""
    factor_div: bool = False
    # a "factor" node that adds (multiplies) a weight broadcast over the 16-bit cotangent (a bias
    # added apart from its matmul, a per-channel scale): its gradient, a sum over the broadcast
    # entries, is reduced in 16 bits; the weight operand's shape, and (a multiplication) the
    # saved activation operand it is multiplied with
    reduce_shape: tuple[int, ...] = ()
    reduce_attr: str = ""

    @property
    def hooked_before(self) -> bool:
        return self.leaf or bool(self.merges) or self.cross_merge or self.kind != "op"

    @property
    def hooked_after(self) -> bool:
        return self.kind == "region" or bool(self.stash_edges)


@dataclasses.dataclass(frozen=True)
class _Template:
    order: tuple[NodePlan, ...]  # consumers before producers; order[0] is the root
    walk_to_order: tuple[int, ...]  # position in the walk -> position in ``order``
    n_syms: int  # symbol 0: the seed (init_scale)
    coverage: Coverage
    missed: tuple[str, ...]  # why weighted ops with a weight operand got no scale
    no_layer: bool  # weighted ops beyond first layers, none of them a layer


class _Walk:
    """One pass over a graph: nodes (breadth first from the root) and a structural key.

    The key is the node types, the edges and the parameters; dtypes and shapes
    are left out (reading them costs as much as the rest of the walk): a change
    of dtype that adds or removes a cast changes the node types, and layers'
    fan-ins come from parameter shapes."""

    def __init__(self, root: Any, param_names: Mapping[int, str]) -> None:
        self.nodes = [root]
        index = {root: 0}
        self.edges: list[tuple[tuple[int, int] | None, ...]] = []
        key: list[Any] = []
        i = 0
        nodes, all_edges = self.nodes, self.edges
        while i < len(nodes):
            node = nodes[i]
            edges = []
            for nxt, k in node.next_functions:
                if nxt is None:
                    edges.append(None)
                    continue
                j = index.get(nxt)
                if j is None:
                    j = index[nxt] = len(nodes)
                    nodes.append(nxt)
                edges.append((j, k))
            edges_t = tuple(edges)
            all_edges.append(edges_t)
            name = node.name()
            if name == _ACCUMULATE:
                var = node.variable
                key.append((name, edges_t, (id(var), param_names.get(id(var))), ()))
            elif name in _SCALAR_OPERAND:
                key.append((name, edges_t, None, tuple(f[3] for f in _scalar_factors(node, name))))
            else:
                key.append((name, edges_t, None, ()))
            i += 1
        self.key = tuple(key)


class ScalePlan:
    """The scale symbols of one backward pass, planned from ``root`` (``loss.grad_fn``).

    ``cache`` (a dict the caller keeps) maps graph structures to their plans.
    """

    def __init__(self, root: Any, param_names: Mapping[int, str], cast_rule: bool = True,
                 cache: OrderedDict[Any, _Template] | None = None, cache_size: int = 8,
                 grad_dtype: torch.dtype | None = None, fp8: bool = False) -> None:
        walk = _Walk(root, param_names)
        key = (walk.key, cast_rule, fp8)
        template = cache.get(key) if cache is not None else None
        #: whether this structure was classified now (not taken from the cache)
        self.fresh = template is None
        if template is None:
            template = _Builder(walk, param_names, cast_rule, fp8).template()
            if cache is not None:
                cache[key] = template
                while len(cache) > cache_size:
                    cache.popitem(last=False)
        elif cache is not None:
            cache.move_to_end(key)
        self.root = root
        self.order = template.order
        self.n_syms = template.n_syms
        self.nodes: list[Any] = [None] * len(walk.nodes)
        for w, o in enumerate(template.walk_to_order):
            self.nodes[o] = walk.nodes[w]
        self.params: list[torch.Tensor | None] = [
            getattr(n, "variable", None) if p.leaf else None for n, p in zip(self.nodes, self.order)]
        self.coverage, self.missed, self.no_layer = template.coverage, template.missed, template.no_layer
        if grad_dtype is not None:
            _check_format(template.order, grad_dtype)

    @property
    def opaque(self) -> bool:
        """Whether the plan has opaque regions whose parameters are reached by a nested backward
        (kind ``region``; a fused RNN's are its node's edges)."""
        return any(p.kind == "region" for p in self.order)

    def layers(self) -> list[NodePlan]:
        """Layer, cast and region nodes in forward order."""
        return sorted((p for p in self.order if p.kind not in NO_DECISION), key=lambda p: p.rank)


def _check_format(order: tuple[NodePlan, ...], grad_dtype: torch.dtype) -> None:
    """Every 16-bit (or narrower) cotangent a decision governs must be in ``grad_dtype``."""
    for p in order:
        if p.kind in ("layer", "rnn"):
            dtype, what = p.out_dtypes[0], f"layer {p.name}"
        elif p.kind == "cast":
            dtype, what = p.narrow_dtype, f"{p.name} (a cotangent cast)"
        else:
            continue
        if _is_float(dtype) and dtype.itemsize <= 2 and dtype != grad_dtype:
            name = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"AdaLossConfig.grad_format={str(grad_dtype).removeprefix('torch.')!r}, but the "
                f"cotangent of {what} is {name}: its limits (u_min, u_max) would be wrong. Set "
                f"AdaLossConfig(grad_format={name!r}).")


class _Builder:
    """Classifies the nodes of a walk and assigns scale symbols."""

    def __init__(self, walk: _Walk, param_names: Mapping[int, str], cast_rule: bool,
                 fp8: bool = False) -> None:
        self.walk, self.param_names, self.cast_rule, self.fp8 = walk, param_names, cast_rule, fp8
        n = len(walk.nodes)
        # Kahn's topological order over walk positions
        deps = [0] * n
        for edges in walk.edges:
            for e in edges:
                if e is not None:
                    deps[e[0]] += 1
        order: list[int] = []
        ready = [0]
        while ready:
            w = ready.pop()
            order.append(w)
            for e in walk.edges[w]:
                if e is not None:
                    deps[e[0]] -= 1
                    if deps[e[0]] == 0:
                        ready.append(e[0])
        self.walk_pos = order  # order position -> walk position
        self.pos = {w: o for o, w in enumerate(order)}  # walk position -> order position
        self.nodes = [walk.nodes[w] for w in order]
        seqs = sorted(range(len(order)), key=lambda o: self.nodes[o]._sequence_nr())
        rank = {o: r for r, o in enumerate(seqs)}
        self.plans = [
            NodePlan(o, rank=rank[o],
                     out_dtypes=tuple(m.dtype for m in self.nodes[o]._input_metadata),
                     edges=tuple(None if e is None else (self.pos[e[0]], e[1]) for e in walk.edges[w]),
                     leaf=hasattr(self.nodes[o], "variable"))
            for o, w in enumerate(order)]
        self.origin: list[str | None] = [_ACT] * len(order)
        self.n_syms = 1

    def template(self) -> _Template:
        self._classify()
        self._assign()
        walk_to_order = tuple(self.pos[w] for w in range(len(self.walk_pos)))
        scaled = sum(p.kind == "layer" for p in self.plans)
        first = sum(p.kind == "input" for p in self.plans)
        rnns = sum(p.kind == "rnn" for p in self.plans)
        regions = sum(p.kind == "region" for p in self.plans) + rnns
        # one entry per layer report: with an fp8 grad_format a first layer quantizes the
        # cotangent of its weight gradient and reports it; a fused RNN's one decision is reported
        layers = scaled + rnns + (first if self.fp8 else 0)
        no_layer = scaled == 0 and self.weighted_ops - self.unruled > first
        return _Template(tuple(self.plans), walk_to_order, self.n_syms,
                         Coverage(self.weighted_ops, layers, regions), tuple(self.missed), no_layer)

    # -- classification -------------------------------------------------------------
    def _classify(self) -> None:
        for o in reversed(range(len(self.plans))):  # producers first
            self.origin[o] = self._node_origin(o)
        self.weighted_ops = self.unruled = 0
        self.missed: list[str] = []
        names: dict[str, int] = defaultdict(int)
        casts = regions = factors = norms = 0
        for plan in sorted(self.plans, key=lambda p: p.rank):  # forward order
            if self._as_layer(plan) or self._as_rnn(plan):
                k = names[plan.name]
                names[plan.name] += 1
                plan.name = plan.name if k == 0 else f"{plan.name}@{k}"
            elif self._is_region(plan):
                plan.kind, plan.name = "region", f"region:{regions}"
                regions += 1
            elif self.cast_rule and self._narrows(plan):
                plan.kind, plan.name = "cast", f"cast:{casts}"
                plan.what = self._cast_site(plan)
                casts += 1
            elif plan.kind == "input":  # named after its weight, as a layer is
                k = names[plan.name]
                names[plan.name] += 1
                plan.name = plan.name if k == 0 else f"{plan.name}@{k}"
            elif self._amplifies(plan):
                plan.kind, plan.name = "factor", f"factor:{factors}"
                factors += 1
            elif self.fp8 and self._normalizes(plan):
                plan.kind, plan.name = "norm", f"norm:{norms}"
                norms += 1
            else:
                self._unruled(plan)

    def _node_origin(self, o: int) -> str | None:
        node, plan = self.nodes[o], self.plans[o]
        if plan.leaf:
            var = node.variable
            name = self.param_names.get(id(var))
            if name is None and isinstance(var, torch.nn.Parameter):
                name = f"<parameter {tuple(var.shape)} at {id(var):#x}>"  # not in the scaler's model
            return _ACT if name is None else name
        if node.name() in _LOOKUP:
            return _ACT
        names = []
        for i, e in enumerate(plan.edges):
            if e is None:
                if not _scalar_operand(node, i):
                    return _ACT
                continue
            origin = self.origin[e[0]]
            if origin is _ACT:
                return _ACT
            names.append(origin)
        return names[0] if names else _ACT

    def _as_layer(self, plan: NodePlan) -> bool:
        node = self.nodes[plan.index]
        kind = node.name()
        if kind in _MATMUL:
            operands, attrs = _MATMUL[kind]
        elif kind == _CONV:
            operands, attrs = (0, 1), ("", "_saved_weight")
        else:
            return False
        self.weighted_ops += 1
        edges = plan.edges
        origins = [_ACT if edges[i] is None else self.origin[edges[i][0]] for i in operands]
        weights = [j for j in (0, 1) if origins[j] is not _ACT]
        if not weights:  # a parameter gathered by data indices (per-token expert weights)?
            gathered = {j: self._gathered(edges[i]) for j, i in enumerate(operands) if edges[i] is not None}
            weights = [j for j, name in gathered.items() if name is not None]
            for j in weights:
                origins[j] = gathered[j]
        if len(weights) != 1:
            return False  # activation·activation (attention) or weight·weight
        w = weights[0]
        act = operands[1 - w]
        if kind == _CONV and w != 1:
            self.missed.append("a convolution whose weight is its input operand")
            return False
        if kind == _CONV:
            plan.act_attr = "_saved_input"
        elif kind not in _VECTOR:
            plan.act_attr, plan.weight_side = attrs[1 - w], w
        if edges[act] is None:  # the first layer: its input needs no gradient, nothing to scale;
            # its fp16 weight gradient is still guarded (see torch_bridge.layers.input_layer), an fp8
            # layer's cotangent still cast
            if (plan.act_attr or kind == FP8_NODE) and edges[operands[w]] is not None:
                plan.kind, plan.name = "input", origins[w]
            return False
        producer = edges[operands[w]]
        shape = tuple(self.nodes[producer[0]]._input_metadata[producer[1]].shape)
        plan.kind, plan.name = "layer", origins[w]
        plan.act_edge, plan.weight_attr = act, attrs[w]
        plan.recipe = self._recipe(producer)
        plan.fan_in = _fan_in(kind, w, shape, node)
        # the output's features: a convolution's channels; a matmul's last dimension, or with the
        # weight on the left (W @ x) its rows
        plan.feature_dim = 1 if kind == _CONV else (-2 if w == 0 and kind not in _VECTOR else -1)
        return True

    def _as_rnn(self, plan: NodePlan) -> bool:
        """A fused RNN (:data:`FUSED_RNN`) with a parameter among its weights: a weighted region
        named for its first parameter, its fan-in the gates times the hidden size (times the
        directions a node runs): the terms summed into an entry of its input's gradient."""
        node = self.nodes[plan.index]
        rule = FUSED_RNN.get(node.name())
        if rule is None:
            return False
        self.weighted_ops += 1
        act, _, both = rule
        weights = [self.origin[e[0]] for i, e in enumerate(plan.edges)
                   if i != act and e is not None and self.origin[e[0]] is not _ACT]
        if not weights:
            return False  # frozen weights: the region is data
        directions = 2 if both and bool(getattr(node, "_saved_bidirectional", False)) else 1
        plan.kind, plan.name = "rnn", weights[0]
        plan.act_edge, plan.act_attr = act, "_saved_input"
        plan.fan_in = RNN_GATES[int(node._saved_mode)] * int(node._saved_hidden_size) * directions
        return True

    def _unruled(self, plan: NodePlan) -> None:
        """A node no rule knows that combines a parameter with data into a result of another
        shape (a contraction: ``nn.Bilinear``'s ``_trilinear``, a fused kernel of a library): a
        weighted op that gets no decision, said in the coverage warning. An elementwise node
        (every operand broadcasts to its result: a bias, a norm's affine weight, PReLU) passes its
        scale on, as the method's rule for ops without a weight operand says."""
        node = self.nodes[plan.index]
        if plan.leaf or not plan.out_dtypes or node.name() in _NORMS:
            return
        params, data = [], False
        for e in plan.edges:
            if e is None:
                continue
            if self.origin[e[0]] is _ACT:
                data = True
            else:
                params.append((self.origin[e[0]], self._shape(e)))
        if not params or not data:
            return
        out = list(node._input_metadata[0].shape)
        if all(_broadcasts(shape, out) for _, shape in params):
            return
        self.weighted_ops += 1
        self.unruled += 1
        self.missed.append(f"{node.name()} (no rule for it: it contracts the parameter {params[0][0]} "
                           "with data; the scale entering it passes through)")

    def _gathered(self, edge: tuple[int, int]) -> str | None:
        """The parameter whose slices arrive on ``edge`` as a matmul operand, gathered by data
        indices (``W[expert_ids]``: transformers' ``batched_mm`` experts) through casts and moves;
        None otherwise. The node's saved operand holds the gathered weights: their statistics
        are the experts', weighted by how many tokens each received."""
        o = edge[0]
        while True:
            node, plan = self.nodes[o], self.plans[o]
            live = [e for e in plan.edges if e is not None]
            if len(live) != 1:
                return None
            kind = node.name()
            if kind in ("IndexBackward0", "IndexSelectBackward0"):
                origin = self.origin[live[0][0]]
                return None if origin is _ACT else origin
            if kind != _CAST and kind not in _STRUCTURAL:
                return None
            o = live[0][0]

    def _recipe(self, edge: tuple[int, int]) -> tuple[int, tuple[tuple[str, Any], ...]] | None:
        """How the weight operand arriving on ``edge`` is computed from one parameter: casts and
        scalar factors in forward order (moves and copies leave its statistics as they are),
        or ``None`` if other ops are involved."""
        ops: list[tuple[str, Any]] = []
        o = edge[0]
        while True:
            node, plan = self.nodes[o], self.plans[o]
            if plan.leaf:
                return o, tuple(reversed(ops))
            kind = node.name()
            live = [e for e in plan.edges if e is not None]
            if len(live) != 1:
                return None
            if kind == _CAST:
                ops.append(("cast", plan.out_dtypes[0]))
            elif kind in _SCALAR_OPERAND:
                i = plan.edges.index(live[0])
                if i > 1 or not _scalar_operand(node, 1 - i):
                    return None
                op = "mul" if kind == "MulBackward0" else ("div" if i == 0 else "rdiv")
                ops.append((op, (o, _SCALAR_OPERAND[kind][1 - i])))  # read in each backward
            elif kind not in _STRUCTURAL:
                return None
            o = live[0][0]

    def _is_region(self, plan: NodePlan) -> bool:
        """An opaque region that uses parameters inside (see ``_REGIONS``), or any custom
        autograd Function with a parameter among its inputs."""
        node = self.nodes[plan.index]
        if node.name().startswith(_REGIONS):
            return True
        if node.name() == FP8_NODE or not isinstance(node, torch.autograd.function.BackwardCFunction):
            return False
        return any(e is not None and self.plans[e[0]].leaf and self.origin[e[0]] is not _ACT
                   for e in plan.edges)

    def _amplifies(self, plan: NodePlan) -> bool:
        """A node whose 16-bit backward can overflow where the decisions before it cannot see:
        a mul/div by a scalar that may multiply the cotangent by more than 1 (see
        :func:`_scalar_factors`; :func:`adaloss.solver.amplified_scale`), or an add/mul with a
        weight broadcast over the cotangent, whose gradient sums it (see ``_BROADCAST``;
        :func:`adaloss.solver.weight_grad_cap`). Its hook lowers the scale first."""
        if not plan.out_dtypes or not _is_float(plan.out_dtypes[0]) or plan.out_dtypes[0].itemsize > 2:
            return False
        node = self.nodes[plan.index]
        for edge, attr, div, amplifies in _scalar_factors(node):
            e = plan.edges[edge]
            if e is None or amplifies is False:
                continue
            if math.prod(self._shape(e)) == 1:
                continue  # a scalar times a scalar
            plan.factor_attr, plan.factor_div = attr, div
            break
        attrs = _BROADCAST.get(node.name())
        if attrs is not None:
            out = math.prod(node._input_metadata[0].shape)
            for i, e in enumerate(plan.edges[:2]):
                if e is None or self.origin[e[0]] is _ACT or math.prod(self._shape(e)) >= out:
                    continue
                plan.reduce_shape, plan.reduce_attr = tuple(self._shape(e)), attrs[i] or ""
                break
        return bool(plan.factor_attr or plan.reduce_shape)

    def _normalizes(self, plan: NodePlan) -> bool:
        """A normalization's backward computed in 16 bits (in fp32 a cast narrows its result, and
        a cast reads its tensor anyway): a fused norm, ``rsqrt``/``sqrt`` of data, or a ``Mul``
        by (a moved or cast copy of) a data ``rsqrt``, as ``jax_adaloss`` finds them."""
        dtypes = [d for d in plan.out_dtypes if _is_float(d)]
        if not dtypes or max(d.itemsize for d in dtypes) > 2:
            return False
        kind = self.nodes[plan.index].name()
        if kind in _NORMS:
            return kind not in ("RsqrtBackward0", "SqrtBackward0") or self.origin[plan.index] is _ACT
        if kind != "MulBackward0":
            return False
        for e in plan.edges:
            while e is not None and self.nodes[e[0]].name() in _STRUCTURAL | {_CAST}:
                e = self.plans[e[0]].edges[0] if self.plans[e[0]].edges else None
            if e is not None and self.nodes[e[0]].name() == "RsqrtBackward0" and self.origin[e[0]] is _ACT:
                return True
        return False

    def _shape(self, edge: tuple[int, int]) -> list[int]:
        """The shape of the value on ``edge`` (its gradient's)."""
        return list(self.nodes[edge[0]]._input_metadata[edge[1]].shape)

    def _cast_site(self, plan: NodePlan) -> str:
        """``float16 → float32 (8, 16, 40) at LogSoftmaxBackward0``: the dtypes, the shape of
        the widened tensor and the autograd node that widened it (the first graph's shape)."""
        node = self.nodes[plan.index]
        wide = max((m for m in node._input_metadata if _is_float(m.dtype)), key=lambda m: m.dtype.itemsize)
        narrow = str(plan.narrow_dtype).removeprefix("torch.")
        return f"{narrow} → {str(wide.dtype).removeprefix('torch.')} {tuple(wide.shape)} at {node.name()}"

    def _narrows(self, plan: NodePlan) -> bool:
        wide = [d.itemsize for d in plan.out_dtypes if _is_float(d)]
        if not wide:
            return False
        widest = max(wide)
        for e in plan.edges:
            if e is None:
                continue
            d = self.plans[e[0]].out_dtypes[e[1]]
            if _is_float(d) and d.itemsize <= 2 and d.itemsize < widest:
                plan.narrow_dtype = d
                return True
        return False

    # -- symbols --------------------------------------------------------------------
    def _new(self) -> int:
        self.n_syms += 1
        return self.n_syms - 1

    def _assign(self) -> None:
        # per producer: output k -> contributions (consumer index, consumer edge, symbol)
        contribs: list[dict[int, list[tuple[int, int, int]]]] = [defaultdict(list) for _ in self.plans]
        contribs[0][0].append((0, -1, 0))  # the seed
        for plan in self.plans:
            for k, parts in sorted(contribs[plan.index].items()):
                if len({s for _, _, s in parts}) == 1:
                    plan.out_syms[k] = parts[0][2]
                else:
                    plan.out_syms[k] = plan.merges[k] = self._new()
                    for consumer, i, _ in parts:
                        self.plans[consumer].stash_edges[i] = (plan.index, k)
            present = set(plan.out_syms.values())
            if len(present) > 1:
                plan.cross_merge, plan.sym = True, self._new()
            elif present:
                plan.sym = present.pop()
            else:
                continue  # reached only through undefined gradients
            if plan.kind != "op":
                plan.send = self._new()
            for i, e in enumerate(plan.edges):
                if e is None:
                    continue
                # a layer's weight and bias gradients are computed by the node from s·g in
                # fp16: they carry P·s too (rescaling them by 1/s in fp16 would lose the
                # small entries; they are unscaled once, in fp32)
                sym = plan.send if plan.kind != "op" else plan.sym
                plan.edge_syms[i] = sym
                contribs[e[0]][e[1]].append((plan.index, i, sym))


def _broadcasts(shape: list[int], out: list[int]) -> bool:
    """Whether an operand of ``shape`` broadcasts to a result of shape ``out``, or is a vector
    along one of its dimensions (a per-channel weight of an NCHW result)."""
    if len(shape) == 1 and shape[0] in out:
        return True
    if len(shape) > len(out):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(out)))


def _offloaded(raw: Any) -> bool:
    """Whether a saved tensor is packed by ``torch.autograd.graph.save_on_cpu``, whose unpack
    copies the CPU copy back to the device and leaves it in place (it can be read again)."""
    hook = getattr(raw, "unpack_hook", None)
    return (getattr(hook, "__module__", None) == "torch.autograd.graph"
            and getattr(hook, "__qualname__", "").startswith("save_on_cpu."))


def peek_saved(node: Any, attr: str) -> torch.Tensor | None:
    """The data of ``node``'s saved tensor ``attr`` (``"_saved_other"``, ...), read without
    unpacking it: as saved, or the CPU copy ``save_on_cpu`` keeps. None where other
    saved-tensor hooks pack it: under ``torch.utils.checkpoint`` an unpack recomputes the
    region, and a second one in the backward fails."""
    raw = getattr(node, "_raw" + attr, None)
    data = getattr(raw, "data", None)
    if isinstance(data, torch.Tensor):
        return data
    if _offloaded(raw) and isinstance(data, tuple) and isinstance(data[-1], torch.Tensor):
        return data[-1]
    return None


def read_saved(node: Any, attr: str) -> torch.Tensor | None:
    """``node``'s saved tensor ``attr`` on its device, where reading it leaves it for the node's
    own backward (see :func:`peek_saved`), else None: the data as saved (an unpack would make
    a second tensor of the same values, a few µs each), or ``save_on_cpu``'s unpacked copy."""
    data = peek_saved(node, attr)
    if data is None or not _offloaded(getattr(node, "_raw" + attr, None)):
        return data
    return getattr(node, attr)


def _scalar_operand(node: Any, i: int) -> bool:
    """Whether the non-differentiated operand ``i`` of a mul/div node is a scalar constant
    (read without unpacking it; one packed by saved-tensor hooks is not known to be one)."""
    attrs = _SCALAR_OPERAND.get(node.name())
    if attrs is None or i > 1:
        return False
    data = peek_saved(node, attrs[i])
    return data is not None and data.numel() == 1


def _scalar_factors(node: Any, kind: str | None = None) -> tuple[tuple[int, str, bool, bool | None], ...]:
    """The scalar factors of a ``MulBackward0`` / ``DivBackward0`` node: ``(edge, saved attribute
    of the scalar, divides, amplifies)`` for each operand ``x`` multiplied (``x·c``, ``c·x``) or
    divided (``x/c``) by a saved one-element ``c``; ``amplifies`` says whether ``|c| > 1`` (a
    divisor's ``|c| < 1``) where ``c`` is a Python number (read without a device sync), None
    for a tensor (its hook decides on the device). ``c/x`` is data-dependent: not listed.
    Saved operands packed by saved-tensor hooks are not read. ``kind``: ``node.name()``, if read."""
    kind = node.name() if kind is None else kind
    attrs = _SCALAR_OPERAND.get(kind)
    if attrs is None:
        return ()
    out = []
    for edge in ((0,) if kind == "DivBackward0" else (0, 1)):
        attr = attrs[1 - edge]
        data = peek_saved(node, attr)
        if data is None or data.numel() != 1:
            continue
        div = kind == "DivBackward0"
        amplifies = None
        c = python_number(data)
        if c is not None:
            amplifies = (abs(c) < 1.0) if div else (abs(c) > 1.0)
        out.append((edge, attr, div, amplifies))
    return tuple(out)


def python_number(t: torch.Tensor) -> float | None:
    """The value of a Python number autograd saved as an operand, else None. PyTorch wraps such
    a number in a 0-d CPU tensor of float64 or int64, on every device's graph. It is read with
    ``tolist()``, which copies the value without dispatching an operator: a ``TorchDispatchMode``
    (``FlopCounterMode``, ...) hands a wrapped number to its ops as a Python float, so ``detach``,
    ``item`` or ``float(t)`` under one fail."""
    if t.device.type == "cpu" and t.dim() == 0 and t.dtype in (torch.float64, torch.int64):
        return float(t.tolist())
    return None


def _fan_in(kind: str, w: int, shape: tuple[int, ...], node: Any) -> int:
    """Terms summed into each entry of the activation's gradient."""
    if kind == _CONV:  # weight [out, in/groups, *k]; transposed: [in, out/groups, *k]
        groups = int(getattr(node, "_saved_groups", 1))
        stride, dilation = tuple(node._saved_stride), tuple(node._saved_dilation)
        if bool(getattr(node, "_saved_transposed", False)):  # dx: a strided conv of g, every tap
            return conv_fan_in(shape[1] * groups, groups, shape[2:], dilation=dilation,
                               lhs_dilation=stride)
        return conv_fan_in(shape[0], groups, shape[2:], strides=stride, dilation=dilation)
    if len(shape) == 1:  # a vector weight of mv: each input-gradient entry is one product
        return 1 if w == 1 else shape[0]
    return shape[-1] if w == 1 else shape[-2]


def parameter_names(module: torch.nn.Module | None) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``module`` (tied ones under their first name)."""
    if module is None:
        return {}
    return {id(p): n for n, p in module.named_parameters()}
