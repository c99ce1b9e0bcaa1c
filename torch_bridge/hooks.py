"""The scale-propagating backward in PyTorch: node hooks that follow a :class:`ScalePlan`.

Statistics are fused torch reductions over each cotangent (:mod:`torch_bridge.stats`); the scale
decisions are :mod:`adaloss.solver`'s formulas (the same as ``jax_adaloss``) on
fp32 0-d values: device tensors on an accelerator (nothing is copied to the
host), NumPy scalars for CPU gradients (:mod:`torch_bridge._xp`).

- A layer's pre-hook computes its scale ``s`` from the incoming cotangent ``g``
  (carrying ``P``) and its weight, and hands the node ``s·g``: the input
  gradient carries ``P·s``; so do the weight and bias gradients the node computes
  from ``s·g``: they are not rescaled in fp16 (which would lose their small
  entries) but unscaled once, in fp32, by the scaler (a departure from method.md
  step 4, where they carry ``P``).
- A cast's pre-hook scales the fp32 cotangent by the log-normal rule before the
  node narrows it.
- At a merge point each consumer's post-hook stashes its contribution (the
  first one still flows, to keep autograd's buffer defined; later ones are
  replaced by ``None``), and the producer's pre-hook replaces the buffer by the
  merged sum (method.md step 5).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from adaloss import decisions, solver
from adaloss.config import AdaLossConfig
from adaloss.feedback import Feedback
from adaloss.report import LayerReport, decision_report, weight_of
from torch_bridge import kernels
from torch_bridge._xp import ON_HOST, ON_TENSORS, ScalarMath, scalar_math, xp
from torch_bridge.fused import FusedMath
from torch_bridge.graph import (
    FP8_NODE,
    NO_DECISION,
    NodePlan,
    ScalePlan,
    peek_saved,
    python_number,
    read_saved,
)
from torch_bridge.stats import (
    cotangent_stats,
    fp8_cast_counts,
    log_sums,
    subnormal_counts,
    sum_of_squares,
    tensor_stats,
    weight_stats,
)

_F32 = torch.float32
#: what the hook of a ``torch_bridge.float8`` layer sets on its node: the cotangent in fp8 and
#: the scale its GEMMs multiply by
FP8_COTANGENT = "_adaloss_fp8_cotangent"

# (param, this backward's gradient, its scale, the scale .grad carries now or None: the
# scaler knows) -> (gradient to accumulate, scale .grad then carries)
LeafHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                    tuple[torch.Tensor, torch.Tensor]]


class _Decision(NamedTuple):
    kind: str  # "layer" | "cast"
    d: solver.LayerScale
    spread: Any  # sigma (layer) or LogStats (cast), for the predicted underflow
    incoming: Any
    outgoing: Any
    absmax: Any
    fan_in: int
    held: Any = False  # a cap or bound set a decision behind ``incoming`` below its statistical scale
    fractions: Any = None  # fp8: (flushed, subnormal, saturated) of the incoming cotangent's cast
    current: Any = None  # fp8: the cast's scale was read from its own tensor

    def to_torch(self, sm: ScalarMath) -> _Decision:
        conv = sm.to_torch
        spread = (type(self.spread)(*map(conv, self.spread)) if isinstance(self.spread, tuple)
                  else conv(self.spread))
        return _Decision(self.kind, solver.LayerScale(*map(conv, self.d)), spread, conv(self.incoming),
                         conv(self.outgoing), conv(self.absmax), self.fan_in,
                         torch.as_tensor(bool(self.held)) if not isinstance(self.held, torch.Tensor)
                         else self.held,
                         None if self.fractions is None else tuple(map(conv, self.fractions)),
                         None if self.current is None else torch.as_tensor(bool(self.current)))

    def report(self, config: AdaLossConfig) -> LayerReport:
        """Its :func:`adaloss.report.decision_report` (values of torch: :meth:`to_torch`)."""
        return decision_report(config, self.kind, self.d, self.spread, self.incoming, self.outgoing,
                               self.absmax, self.fan_in, self.held, self.fractions, self.current,
                               torch.special.erf, xp)


@dataclasses.dataclass(frozen=True)
class BackwardRecord:
    """One finished backward: per-layer decisions (forward order), each leaf's gradient
    scale (``id(param) -> (param, scale)``), captured cotangents, statistical scales."""

    config: AdaLossConfig
    decisions: dict[str, _Decision]  # values of ``math``'s namespace
    leaf_scales: dict[int, tuple[torch.Tensor, torch.Tensor]]
    captured: dict[str, torch.Tensor]
    captured_scales: dict[str, torch.Tensor]
    model_scales: dict[str, torch.Tensor]
    spreads: dict[str, Any]  # σ or LogStats, of tensors
    math: ScalarMath = ON_TENSORS
    # per weight: adaloss.solver.underflow_ratio of its layer decisions (fp32 0-d tensors;
    # empty without config.underflow_feedback), for the scaler's lift
    underflow: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    loss: torch.Tensor | None = None  # the scaled output (detached): was it finite?
    # why this backward had one global scale (hooks.global_backward), or None: per-layer scales
    global_reason: str | None = None
    # the shapes of the cotangents the decisions met, in order (the scaler compiles decisions
    # once they hold: FusedMath.steady_after)
    shapes: tuple[Any, ...] = ()

    def reports(self) -> dict[str, LayerReport]:
        return {n: d.to_torch(self.math).report(self.config) for n, d in self.decisions.items()}


def _to_torch_all(tree: Any, sm: ScalarMath) -> Any:
    """``tree`` (values of ``sm``'s namespace in dicts, tuples and NamedTuples) as fp32 0-d
    tensors; NumPy scalars all through one array (one tensor, its views), not one each."""
    def value(v: Any) -> bool:
        return not isinstance(v, (tuple, list, dict))
    if sm is not ON_HOST:
        return _converted(tree, sm.to_torch, value)
    flat: list[Any] = []
    _converted(tree, flat.append, value)
    views = iter(torch.from_numpy(np.asarray(flat, dtype=np.float32).reshape(-1)).unbind() if flat else ())
    return _converted(tree, lambda _: next(views), value)


def _converted(v: Any, conv: Callable[[Any], Any],
               leaf: Callable[[Any], bool] = lambda v: isinstance(v, torch.Tensor)) -> Any:
    """``v`` (in tuples, NamedTuples, lists and dicts) with each ``leaf`` (default: a tensor)
    converted; None stays None."""
    if v is None:
        return v
    if leaf(v):
        return conv(v)
    if isinstance(v, tuple):
        items = [_converted(x, conv, leaf) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    if isinstance(v, list):
        return [_converted(x, conv, leaf) for x in v]
    if isinstance(v, dict):
        return {k: _converted(x, conv, leaf) for k, x in v.items()}
    return v


def rescale(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t · factor`` computed in (at least) fp32, returned in ``t``'s dtype.

    On CPU a 0-d fp32 factor is a CPU scalar, which fp16/bf16 multiplication takes
    in fp32 (one rounding, one kernel); on other devices it would be cast to the
    tensor's dtype first, so the product is formed in fp32 explicitly
    (:func:`torch_bridge.kernels.scaled`).
    """
    if t.device.type == "cpu" and factor.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16):
        return t * factor
    return kernels.scaled(t, factor)


# The hooks run eagerly, never traced by torch.compile: a compiled training step graph-breaks
# at ``scale()`` and ``backward()``, and the backward then calls them with dynamo's frame
# callback still set. ``torch._disable_dynamo`` (what torch.optim uses) imports dynamo on first
# call, not at import; hooks are ``partial``s of these, so no frame of ours is traced.
@torch._disable_dynamo
def _pre_hook(me: weakref.ref[ScaledBackward], i: int, grad_outputs: tuple[Any, ...]) -> Any:
    sb = me()
    return None if sb is None else sb.pre(i, grad_outputs)


@torch._disable_dynamo
def _post_hook(me: weakref.ref[ScaledBackward], i: int, grad_inputs: tuple[Any, ...],
               grad_outputs: tuple[Any, ...]) -> Any:
    sb = me()
    return None if sb is None else sb.post(i, grad_inputs)


@torch._disable_dynamo
def _hidden_hook(me: weakref.ref[ScaledBackward], k: int, grad: torch.Tensor) -> Any:
    sb = me()
    return None if sb is None else sb.hidden_grad(k, grad)


COMPILED_AUTOGRAD = (
    "AdaLossScaler does not support compiled autograd (torch._dynamo.config.compiled_autograd, "
    "torch._dynamo.compiled_autograd._enable): it captures the backward's hooks before running "
    "them, while the scaler's decisions hook the parameters as the backward starts and record "
    "their scales when it ends, so the gradients would keep per-layer scales no one divides "
    "out. Run the scaled backward without it: leave torch._dynamo.config.compiled_autograd False "
    "(the default) or call scaler.scale(loss).backward() outside the compiled function or "
    "context. torch.compile on the model keeps working (its compiled region gets one scale).")


def compiled_autograd() -> bool:
    """Whether a backward run now would be captured by compiled autograd (checked without
    importing torch._dynamo)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def global_backward(plan: ScalePlan) -> str | None:
    """Why the scaled loss's backward cannot carry per-layer scales, or ``None``: it runs with
    ``create_graph=True`` (autograd records the backward, whose decisions are not
    differentiable), or it is ``torch.autograd.grad`` (it returns the gradients, and a caller of
    GradScaler's recipes divides them all by ``get_scale()``). Such a backward gets one global
    scale. Raises for compiled autograd, which captures the hooks before running them."""
    if compiled_autograd():
        raise RuntimeError(COMPILED_AUTOGRAD)
    if torch.is_grad_enabled():  # the engine enables grad mode for create_graph=True only
        return "create_graph"
    leaf = next((node for p, node in zip(plan.order, plan.nodes) if p.leaf), None)
    if leaf is None:
        return None
    try:  # autograd.grad captures the inputs' gradients: the engine refuses to say about a leaf
        torch._C._will_engine_execute_node(leaf)
    except RuntimeError as e:
        if "autograd.grad" not in str(e):
            raise
        return "autograd.grad"
    return None


def u_max(config: AdaLossConfig, dtype: torch.dtype) -> float:
    """The overflow limit of a cotangent of ``dtype`` (:func:`adaloss.decisions.overflow_limit`)."""
    return decisions.overflow_limit(config, dtype.itemsize, torch.finfo(dtype).max)


class ScaledBackward:
    """Hooks on every node of one planned graph; state of the pass in progress.

    The caller must keep this object alive until the backward has run (the hooks
    only hold a weak reference); ``on_done`` receives its :class:`BackwardRecord`.

    ``on_leaf(param, grad, scale, old)`` is called, before autograd accumulates it, for the
    gradient of each parameter that already has a ``.grad`` (accumulation; with
    ``every_leaf``, of every parameter) and returns the tensor to accumulate and the scale
    ``.grad`` will carry. Other parameters need no hook: their scale is read from the plan
    after the pass.
    ``hidden`` parameters are used inside opaque regions (reentrant checkpoints): a
    nested backward reaches them, not the plan; their gradients carry the scale the
    region decided (tensor hooks, registered only while the plan has regions), at least
    ``region_scale(name, device)`` (:mod:`torch_bridge.regions`).
    ``model_scales`` (layer name -> cached statistical scale) and ``spreads`` (its σ,
    or a cast's log-statistics) are used instead of fresh statistics when
    ``recompute`` is False (``update_every``); then only min/max are computed.
    """

    def __init__(self, plan: ScalePlan, config: AdaLossConfig, on_leaf: LeafHook,
                 on_done: Callable[[BackwardRecord], None], *, recompute: bool = True,
                 model_scales: dict[str, torch.Tensor] | None = None,
                 spreads: dict[str, Any] | None = None, capture: bool = False,
                 host_math: bool = True, reference: Literal["global"] | None = None,
                 hidden: Sequence[torch.Tensor] = (),
                 region_scale: Callable[[str, torch.device], torch.Tensor] | None = None,
                 backoff: torch.Tensor | None = None,
                 lift: dict[str, torch.Tensor] | None = None, every_leaf: bool = False,
                 fused: FusedMath | None = None, loss: torch.Tensor | None = None) -> None:
        self.plan, self.config = plan, config
        self.loss = loss  # the output being scaled, detached (the record says if it was finite)
        self.global_reason: str | None = None  # set as the pass begins (global_backward)
        self.fused = fused  # decisions on device tensors: one compiled kernel each
        self.every_leaf = every_leaf  # call on_leaf for every parameter, not only where .grad exists
        self.backoff = backoff  # 2^-h from the scaler's back-off state (fp32 0-d), or None
        self.bo: Any = None  # the same in the pass's scalar namespace
        self.lift = lift or {}  # weight name -> 2^k from the scaler's lift state (fp32 0-d)
        self.region_scale = region_scale or (lambda name, device: torch.ones((), device=device))
        self.on_leaf, self.on_done = on_leaf, on_done
        self.recompute = recompute
        self.cached = model_scales or {}
        self.spreads = spreads or {}
        self.capture = capture
        self.host_math = host_math
        # a reference backward (measurements, "global"): no rule, the seed's scale (init_scale) only
        if reference not in (None, "global"):
            raise ValueError(f"reference must be None (adaloss) or 'global', got {reference!r}")
        self.rules = RULES if reference is None else {}
        self.sm = ON_TENSORS
        self._fuse = False  # this pass runs its decisions as compiled calls (_fusing)
        self.handles: list[Any] = []
        self.leaf_handles: list[Any] = []
        self.active = False
        self._reset()
        # Hooks live on autograd's C++ nodes, which Python's GC cannot see through: they
        # hold only a weak reference to this object and a node index, so that the graph
        # does not keep itself alive. Whoever runs the backward owns this object.
        self._me = weakref.ref(self)
        for i, (p, node) in enumerate(zip(plan.order, plan.nodes)):
            if p.leaf:
                continue  # parameters' AccumulateGrad nodes outlive the graph: hooked per pass
            if i == 0 or p.hooked_before:
                self.handles.append(node.register_prehook(functools.partial(_pre_hook, self._me, i)))
            if p.hooked_after:
                self.handles.append(node.register_hook(functools.partial(_post_hook, self._me, i)))
        self.hidden = list(hidden) if plan.coverage.opaque_regions else []
        self.hidden_handles = [t.register_hook(functools.partial(_hidden_hook, self._me, k))
                               for k, t in enumerate(self.hidden) if t.requires_grad]

    def _hook_leaves(self) -> None:
        """Hook the AccumulateGrad nodes that merge (tied weights) or accumulate into a ``.grad``."""
        self._unhook_leaves()
        plan = self.plan
        self.leaf_handles = [
            node.register_prehook(functools.partial(_pre_hook, self._me, i))
            for i, (p, node) in enumerate(zip(plan.order, plan.nodes))
            if p.leaf and (self.every_leaf or p.merges or plan.params[i].grad is not None)]

    def _unhook_leaves(self) -> None:
        for h in self.leaf_handles:
            h.remove()
        self.leaf_handles = []

    def __del__(self) -> None:
        self._unhook_leaves()
        self._unhook_hidden()

    def _unhook_hidden(self) -> None:
        for h in getattr(self, "hidden_handles", ()):
            h.remove()
        self.hidden_handles = []

    def hidden_grad(self, k: int, grad: torch.Tensor) -> torch.Tensor | None:
        """A hidden parameter's gradient, reached inside the innermost running region."""
        if not self.active or not self.regions:
            return None
        param = self.hidden[k]
        prior = self.leaf_scales.get(id(param))
        grad, carried = self.on_leaf(param, grad, self._leaf_scale(self.regions[-1]),
                                     None if prior is None else prior[1])
        self.leaf_scales[id(param)] = (param, carried)
        return grad

    def _reset(self) -> None:
        self.values: list[torch.Tensor | None] = [None] * self.plan.n_syms
        self.shapes: list[Any] = []  # the cotangents' shapes at the decisions (BackwardRecord.shapes)
        self.stash: dict[tuple[int, int], list[tuple[torch.Tensor, int]]] = {}  # (node, output)
        self.carried: set[tuple[int, int]] = set()
        self.decisions: dict[str, _Decision] = {}
        self.model_scales: dict[str, torch.Tensor] = {}
        self.new_spreads: dict[str, Any] = {}
        self.captured: dict[str, torch.Tensor] = {}
        self.captured_scales: dict[str, Any] = {}
        self.leaf_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._leaf_tensors: dict[int, tuple[Any, torch.Tensor]] = {}  # id(value) -> (value, tensor)
        self.regions: list[Any] = []  # outgoing scales of the opaque regions being run
        # scale symbol -> the layer decisions that set it (merges: those of their parts)
        self.deciders: dict[int, frozenset[str]] = {}
        # what each layer decision heard (values of the scalar namespace)
        self.feedback = Feedback()
        self.fitted: set[int] = set()  # fp8: scale symbols a decision fitted to the format's range
        # node index -> its weight's statistics and size (_weight_stats), for this backward
        self._weights: dict[int, tuple[decisions.Sums, int]] | None = None

    def record(self) -> BackwardRecord:
        """What the pass decided, without references to the graph."""
        order = {p.name: p.rank for p in self.plan.layers()}
        names = sorted(self.decisions, key=lambda n: order.get(n, 0))
        conv = self.sm.to_torch
        model_scales, spreads = _to_torch_all((self.model_scales, self.new_spreads), self.sm)
        return BackwardRecord(self.config, {n: self.decisions[n] for n in names},
                              dict(self.leaf_scales), dict(self.captured),
                              {k: conv(v) for k, v in self.captured_scales.items()},
                              model_scales, spreads, self.sm, self._underflow_signals(), self.loss,
                              self.global_reason, tuple(self.shapes))

    def _underflow_signals(self) -> dict[str, torch.Tensor]:
        """Per weight, :func:`adaloss.solver.underflow_ratio` of its decisions (fp32 0-d tensors)."""
        weights, fractions, limited, _ = self.feedback.signal_arguments(weight_of)
        if not weights:
            return {}
        ratios = self._math(decisions.signals, (self.config, weights), fractions, limited)
        return dict(zip(self.feedback.weights(weight_of), map(self.sm.to_torch, ratios)))

    # -- hooks --------------------------------------------------------------------
    def pre(self, i: int, grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        go = list(grad_outputs)
        if i == 0:
            self._begin(go)
        elif not self.active:
            return None  # a backward of another graph through a shared node
        p = self.plan.order[i]
        if self.global_reason is not None:  # one scale everywhere: nothing to decide or merge
            return self._global(i, p, go)
        self._merge_outputs(p, go)
        if p.kind not in NO_DECISION:
            self.shapes.append(None if go[0] is None else go[0].shape)
            if self.capture and go[0] is not None:
                self.captured[p.name] = go[0]
                self.captured_scales[p.name] = self.values[p.sym]
        rule = self.rules.get(p.kind)
        if rule is not None:
            rule[self.config.fp8](self, p, go)
        elif p.kind != "op":  # a reference backward: every node passes the scale on
            self.values[p.send] = self.values[p.sym]
        elif p.leaf and go[0] is not None and self.values[p.sym] is not None:
            param = self.plan.params[i]
            go[0], carried = self.on_leaf(param, go[0], self._leaf_scale(self.values[p.sym]), None)
            self.leaf_scales[id(param)] = (param, carried)
        return tuple(go)

    def _global(self, i: int, p: NodePlan, go: list[Any]) -> tuple[Any, ...]:
        """A node of a backward with one global scale (:func:`global_backward`): a parameter that
        already has a ``.grad`` brings both to one scale; everything else passes."""
        if p.leaf and go[0] is not None:
            param = self.plan.params[i]
            go[0], carried = self.on_leaf(param, go[0], self._leaf_scale(self.values[0]), None)
            self.leaf_scales[id(param)] = (param, carried)
        return tuple(go)

    def post(self, i: int, grad_inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.active or self.global_reason is not None:  # (autograd sums the branches)
            return None
        p = self.plan.order[i]
        if p.kind == "region" and self.regions:
            self.regions.pop()
        gi = list(grad_inputs)
        for j, key in p.stash_edges.items():
            t = gi[j]
            if t is None:
                continue
            self.stash.setdefault(key, []).append((t, p.edge_syms[j]))
            if key in self.carried:
                gi[j] = None
            else:
                self.carried.add(key)
        return tuple(gi)

    def _begin(self, go: list[Any]) -> None:
        self.global_reason = global_backward(self.plan)
        self._reset()
        self._hook_leaves()
        self.active = True
        g = go[0]
        self.sm = scalar_math(g, self.host_math and self.fused is None)
        self._fuse = self.fused is not None and self.sm is ON_TENSORS and not self.config.fp8
        self.bo = None if self.backoff is None else self.sm.to_xp(self.backoff.to(g.device))
        init = torch.full((), self.config.init_scale, dtype=_F32, device=g.device)
        if self.global_reason is not None and self.backoff is not None:  # the scaler's get_scale()
            init = init * self.backoff.to(g.device)
        self.values[0] = self.sm.to_xp(init)
        if self.config.init_scale != 1.0 or self.global_reason is not None:
            go[0] = rescale(g, init)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self.active = False
        self._unhook_leaves()
        self._unhook_hidden()
        for i, p in enumerate(self.plan.order):
            param = self.plan.params[i]
            if self.global_reason == "autograd.grad":
                break  # the gradients were returned, no .grad written
            value = self.values[0] if self.global_reason is not None else self.values[p.sym]
            if p.leaf and id(param) not in self.leaf_scales and value is not None:
                self.leaf_scales[id(param)] = (param, self._leaf_scale(value))
        self.on_done(self.record())

    def _leaf_scale(self, value: Any) -> torch.Tensor:
        """``value`` (a scale of the scalar namespace) as the 0-d tensor a gradient carries, one
        tensor per value: the parameters that carry one scale (a layer's weight and bias) share
        it, and the scaler unscales them in one call."""
        hit = self._leaf_tensors.get(id(value))
        if hit is None:
            hit = self._leaf_tensors[id(value)] = (value, self.sm.to_torch(value))
        return hit[1]

    def _stats(self, t: solver.TensorStats | solver.LogStats) -> Any:
        """Statistics (0-d tensors) as values of the scalar namespace."""
        return type(t)(*(None if v is None else self.sm.to_xp(v) for v in t))

    def _rescale(self, t: torch.Tensor, factor: Any) -> torch.Tensor:
        if self.sm is ON_HOST and t.device.type == "cpu":  # a Python number: no tensor made for it
            return t * float(factor)  # (the same product: fp16/bf16 take a CPU scalar in fp32)
        return rescale(t, self.sm.to_torch(factor))

    # -- merges -------------------------------------------------------------------
    def _merge(self, parts: list[tuple[torch.Tensor, Any]], dtype: torch.dtype, point: Any,
               summed: bool = False) -> tuple[Any, Any]:
        """Contributions (tensor, the scale it carries) brought to their common scale: their sum
        (``summed``) or each rescaled, and that scale (``point``: where, for
        :meth:`FusedMath.call`)."""
        backed_off = self.bo is not None and dtype.itemsize <= 2
        static = (self.config, u_max(self.config, dtype), backed_off)
        tensors = [t for t, _ in parts]
        if self._fusing(*tensors):
            got = self.fused.call(kernels.merge, (*static, summed), tensors, [s for _, s in parts], self.bo,
                                  point=point)
            if got is not None:
                return got
        extremes = [decisions.Sums(None, None, *torch.aminmax(t)) for t in tensors]
        target, factors = self._math(decisions.merge_of_extremes, static, [s for _, s in parts], extremes,
                                     self.bo)
        rescaled = [self._rescale(t, f) for t, f in zip(tensors, factors)]
        return (sum(rescaled[1:], rescaled[0]) if summed else rescaled), target  # (in order)

    def _merged(self, sym: int, parts: list[int]) -> None:
        """A merged scale was set by the decisions behind its parts."""
        self.deciders[sym] = frozenset().union(*(self.deciders.get(s, frozenset()) for s in parts))

    def _lift_of(self, decision: str, g: torch.Tensor) -> Any:
        """``2^k`` of the decision's weight, in the pass's scalar namespace (None: no lift)."""
        lift = self.lift.get(weight_of(decision))
        if lift is None:
            return None
        return self.sm.to_xp(lift if lift.device == g.device else lift.to(g.device))

    def _merge_outputs(self, p: NodePlan, go: list[Any]) -> None:
        for k, msym in p.merges.items():
            stashed = self.stash.pop((p.index, k), [])
            parts = [(t, self.values[s]) for t, s in stashed]
            if not parts:
                continue
            go[k], self.values[msym] = self._merge(parts, p.out_dtypes[k], f"merge {p.index}:{k}",
                                                   summed=True)
            self._merged(msym, [s for _, s in stashed])
            self.fitted.add(msym)
        if p.cross_merge:
            present = [k for k in p.out_syms if go[k] is not None]
            if not present:
                return
            rescaled, self.values[p.sym] = self._merge(
                [(go[k], self.values[p.out_syms[k]]) for k in present], p.out_dtypes[present[0]],
                f"merge {p.index}")
            self._merged(p.sym, [p.out_syms[k] for k in present])
            self.fitted.add(p.sym)
            for k, t in zip(present, rescaled):
                go[k] = t

    # -- scale decisions ------------------------------------------------------------
    def _cached(self, name: str) -> tuple[Any, Any] | None:
        """(statistical scale, spread or None) of the last recompute to reuse
        (``update_every``), as scalar-namespace values, or None: compute them."""
        if self.recompute or name not in self.cached:
            return None
        spread = self.spreads.get(name)
        if spread is not None:
            spread = self._stats(spread) if isinstance(spread, tuple) else self.sm.to_xp(spread)
        return self.sm.to_xp(self.cached[name]), spread

    def _layer(self, p: NodePlan, go: list[Any]) -> None:
        """The layer's scale decided from its cotangent's and weight's statistics
        (:func:`adaloss.decisions.layer`); the node gets ``s·g``, so both its gradients carry
        ``incoming·s``."""
        g, incoming = go[0], self.values[p.sym]
        if g is None or incoming is None:
            self.values[p.send] = incoming
            return
        cfg = self.config
        cached = self._cached(p.name)
        behind = sorted(self.deciders.get(p.sym, frozenset()))
        limited = self.feedback.flags(behind)
        lift = self._lift_of(p.name, g)
        operand = self._wgrad_operand(p, g)
        got = None
        x = None if operand is None else operand[0]
        ws, w_size = (None, 0) if cfg.model == "gradient" else self._weight_stats(p)
        if self._fusing(g, *(() if x is None else (x,))):  # statistics, math and rescale: one call
            static = (cfg, p.fan_in, w_size, self._wgrad_limit(g), p.act_attr == "_saved_input",
                      p.weight_side)
            got = self.fused.call(kernels.layer, static, g, x, ws, incoming, self.bo, lift,
                                  *((None, None) if cached is None else cached), limited, point=p.name)
        if got is None:
            dec = self._layer_decision(p, g, operand, (ws, w_size), cached, incoming, lift, limited)
            go[0] = self._rescale(g, dec.d.scale)
        else:
            go[0], dec = got
        d = dec.d
        if dec.fraction is not None:
            self.feedback.hear(behind, dec.fraction)
        self.deciders[p.send] = frozenset({p.name})
        self.feedback.decided(p.name, dec.limited)
        self.model_scales[p.name], self.new_spreads[p.name] = d.model_scale, d.sigma
        self.values[p.send] = dec.outgoing
        self.decisions[p.name] = _Decision("layer", d, d.sigma, incoming, dec.outgoing, dec.absmax, p.fan_in,
                                           False if dec.held is None else dec.held)

    def _layer_decision(self, p: NodePlan, g: torch.Tensor, operand: tuple[torch.Tensor, int] | None,
                        weight: tuple[decisions.Sums | None, int], cached: tuple[Any, Any] | None,
                        incoming: Any, lift: Any, limited: list[Any]) -> decisions.LayerDecision:
        """A layer's decision from its cotangent's statistics read op by op (:meth:`_layer`), and
        its weight's (:meth:`_weight_stats`, and its size)."""
        cfg = self.config
        ws, w_size = weight
        norms, rows = (None, 0) if operand is None else self._weight_grad_norms(p, g, operand)
        counts = None
        if cached is None or cached[1] is None:
            gs, counts = cotangent_stats(g, cfg.model == "gradient",
                                         cfg.underflow_limit if cfg.underflow_feedback else None,
                                         self.sm is ON_HOST)
        else:  # only the overflow caps need current statistics
            gs = decisions.Sums(None, None, *torch.aminmax(g))
        if cfg.underflow_feedback and counts is None:
            counts = subnormal_counts(g, cfg.underflow_limit, self.sm is ON_HOST)
        size, root_rows = g.numel(), float(rows) ** 0.5
        if self.sm is ON_TENSORS and self.fused is not None:  # values, not static: no compile per batch
            size = self.fused.constant(size, torch.int64, g.device)
            root_rows = self.fused.constant(root_rows, _F32, g.device)
        return self._math(decisions.layer, (cfg, p.fan_in, w_size, self._wgrad_limit(g)),
                          size, gs, ws, norms, root_rows, incoming, self.bo, lift,
                          None if cached is None else cached[0], None if cached is None else cached[1],
                          counts, limited)

    def _fusing(self, *tensors: torch.Tensor) -> bool:
        """Whether this decision runs as one compiled call (:mod:`torch_bridge.kernels`):
        ``fuse_decisions``, decisions on tensors, plain tensors (not a subclass: a ``DTensor``,
        a ``FakeTensor``), not an fp8 format."""
        return self._fuse and all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)

    def _math(self, fn: Callable[..., Any], static: tuple[Any, ...], *args: Any) -> Any:
        """``fn(*static, xp, *args)`` (a function of :mod:`adaloss.decisions`) in the pass's
        scalar namespace, its 0-d tensor arguments (statistics just read) converted to it:
        compiled into one kernel (:attr:`fused`) where the decisions run on device tensors."""
        if self.sm is ON_TENSORS and self.fused is not None:
            return self.fused(fn, static, *args)
        with np.errstate(all="ignore"):  # a non-finite gradient: inf and NaN, as torch makes them
            return fn(*static, self.sm.xp, *_converted(args, self.sm.to_xp))

    def _cast(self, p: NodePlan, go: list[Any]) -> None:
        """The cotangent narrowed at a scale decided from its log-statistics
        (:func:`adaloss.decisions.cast`); an opaque region's at least its dynamic scale."""
        present = [k for k in range(len(go)) if go[k] is not None]
        incoming = self.values[p.sym]
        if not present or incoming is None:
            self.values[p.send] = incoming
            return
        cfg, sx = self.config, self.sm.xp
        g = go[present[0]]
        cached = self._cached(p.name)
        if cfg.fp8 and p.kind == "cast":  # it reads its tensor anyway: current scaling
            m = self.sm.to_xp(g.abs().amax().to(_F32))
            d = solver.fp8_fit_scale(cfg, m, incoming, sx, self.bo)
            outgoing = incoming * d.scale
            self.values[p.send] = outgoing
            self.fitted.add(p.send)
            for k in present:
                go[k] = self._rescale(go[k], d.scale)
            self.decisions[p.name] = _Decision("cast", d, d.sigma, incoming, outgoing, m, 1)
            return
        region = self.region_scale(p.name, g.device) if p.kind == "region" else None
        cached_scale = None if cached is None or region is not None else cached[0]
        cached_logs = None if cached is None else cached[1]
        got = None
        if self._fusing(*(go[k] for k in present)):
            got = self.fused.call(kernels.cast, (cfg,), [go[k] for k in present], incoming, self.bo,
                                  cached_scale, cached_logs, region, point=p.name)
        if got is None:
            if region is not None or cached_logs is None:
                sums, logs = log_sums(g), None
            else:  # only the overflow cap needs a current statistic: max|g|
                sums, logs = None, cached_logs._replace(absmax=g.abs().amax())
            dec = self._math(decisions.cast, (cfg,), sums, logs, incoming, self.bo, cached_scale, region)
            for k in present:
                go[k] = self._rescale(go[k], dec.d.scale)
        else:
            out, dec = got
            for k, t in zip(present, out):
                go[k] = t
        d, ls, outgoing = dec
        self.model_scales[p.name], self.new_spreads[p.name] = d.model_scale, ls
        self.values[p.send] = outgoing
        self.decisions[p.name] = _Decision("cast", d, ls, incoming, outgoing, ls.absmax, 1)
        if p.kind == "region":  # parameters used inside carry ``outgoing`` (see _hidden_hook)
            self.regions.append(outgoing)

    def _norm(self, p: NodePlan, go: list[Any]) -> None:
        """A normalization's backward: the same scale, not fitted (fp8: the next cast reads its
        tensor's max)."""
        self.values[p.send] = self.values[p.sym]
        self.deciders[p.send] = self.deciders.get(p.sym, frozenset())

    def _factor(self, p: NodePlan, go: list[Any]) -> None:
        """Before ``x·c`` / ``x/c`` (``c`` a scalar) multiplies the 16-bit cotangent by ``|c|`` /
        ``1/|c|`` (:func:`adaloss.solver.amplified_scale`), and before a weight broadcast over it
        gets its gradient summed in 16 bits (:meth:`_reduction_cap`): the cotangent and its
        scale lowered by the power of two that keeps both finite."""
        g, incoming = go[0], self.values[p.sym]
        if g is None or incoming is None:
            self.values[p.send] = incoming
            return
        sx, r = self.sm.xp, None
        node = self.plan.nodes[p.index]
        data = peek_saved(node, p.factor_attr) if p.factor_attr else None
        if data is not None:
            number = python_number(data)
            if number is None:  # a tensor (a 0-d CPU one may multiply a device tensor)
                c = read_saved(node, p.factor_attr).detach().to(device=g.device, dtype=_F32).abs().reshape(())
            else:  # read on the host, no copy to the device
                c = torch.full((), abs(number), dtype=_F32, device=g.device)
            factor = 1.0 / c if p.factor_div else c
            m = g.abs().amax().to(_F32)
            r = solver.amplified_scale(self.config, self.sm.to_xp(m), self.sm.to_xp(factor), sx, self.bo)
        cap = self._reduction_cap(p, g) if p.reduce_shape else None
        if cap is not None:
            r2 = solver.at_most(cap, sx)
            r = r2 if r is None else sx.minimum(r, r2)
        if r is None:
            self.values[p.send] = incoming
            return
        self._lowered(p, go, r)

    def _reduction_cap(self, p: NodePlan, g: torch.Tensor) -> Any:
        """:func:`adaloss.solver.weight_grad_cap` for the gradient of a weight broadcast over
        ``g`` (``p.reduce_shape``): each of its entries sums the entries of ``g`` (times those
        of the saved activation, for a product) it was broadcast to, bounded by Cauchy-Schwarz
        over them. None where the activation is packed by saved-tensor hooks."""
        shape = p.reduce_shape
        rows = g.numel() // max(1, math.prod(shape))
        g_norm = g.to(_F32).square().sum_to_size(shape).amax().sqrt()
        x_norm = torch.zeros((), dtype=_F32, device=g.device)
        if p.reduce_attr:
            x = self._saved(p, p.reduce_attr)
            if x is None:
                return None
            x_norm = x.detach().to(_F32).square().expand(g.shape).sum_to_size(shape).amax().sqrt()
            rows = 0  # no bias term: the bound is the two norms'
        return solver.weight_grad_cap(self.config, self.sm.to_xp(g_norm), self.sm.to_xp(x_norm), rows,
                                      self.sm.xp, self.bo, self._wgrad_limit(g))

    def _input_layer(self, p: NodePlan, go: list[Any]) -> None:
        """A first layer (its input needs no gradient: no decision) computes its weight and bias
        gradients in 16 bits from the cotangent it receives: lowered by the power of two that
        keeps them finite (:func:`adaloss.solver.weight_grad_cap`)."""
        g, incoming = go[0], self.values[p.sym]
        cap = None if g is None or incoming is None else self._weight_grad_cap(p, g)
        if cap is None:
            self.values[p.send] = incoming
            return
        self._lowered(p, go, solver.at_most(cap, self.sm.xp))

    def _lowered(self, p: NodePlan, go: list[Any], r: Any) -> None:
        """The node's cotangent and the scale it passes on, times ``r`` (a power of two ≤ 1)."""
        self.values[p.send] = self.values[p.sym] * r
        self.deciders[p.send] = self.deciders.get(p.sym, frozenset())
        if p.sym in self.fitted:
            self.fitted.add(p.send)
        go[0] = self._rescale(go[0], r)

    def _layer_fp8(self, p: NodePlan, go: list[Any]) -> None:
        """A layer (or first layer) with an fp8 ``grad_format``: the incoming cotangent (carrying
        ``P``) quantized once, saturating (:func:`adaloss.solver.to_fp8`), and handed to the node times the
        decision's scale (:func:`adaloss.solver.fp8_layer_scale`): both its GEMMs read the fp8
        values. Where no decision fitted ``P`` to the format (the first cast after the loss),
        or with ``fp8_rule="current"``, it is fitted to the tensor's own ``max|g|`` first."""
        g, incoming = go[0], self.values[p.sym]
        if g is None or incoming is None:
            self.values[p.send] = incoming
            return
        cfg, sx = self.config, self.sm.xp
        current = cfg.fp8_rule == "current" or p.sym not in self.fitted
        if current:
            fit = solver.fp8_fit_scale(cfg, self.sm.to_xp(g.abs().amax().to(_F32)), incoming, sx, self.bo)
            g, incoming = self._rescale(g, fit.scale), incoming * fit.scale
        behind = self.deciders.get(p.sym, frozenset())
        q, gq, hist, fractions = self._quantize(g, behind)
        q_absmax = hist.absmax
        wcap = self._weight_grad_cap(p, gq)
        if p.kind == "input":  # no decision: only the node's 16-bit weight gradient capped
            r = sx.ones_like(incoming) if wcap is None else solver.at_most(wcap, sx)
            one = sx.ones_like(incoming)
            d = solver.LayerScale(r, one, sx.zeros_like(incoming), r)
            kind = "first"
        else:
            modelled = cfg.fp8_rule != "current" and cfg.layer_rule  # else 1 (decisions.fp8_layer)
            cached = self._cached(p.name) if modelled else None
            # E[g²] from the histogram; for a fresh decision, the largest row's
            # (solver.worst_row_sq_mean): one pass over the rows' sums of squares
            gs = solver.TensorStats(None, hist.sq_sum / gq.numel(), None, None, q_absmax)
            node = self.plan.nodes[p.index]
            ws = (node._forward_cls.weight_statistics(node, self.sm) if node.name() == FP8_NODE
                  else self._stats(tensor_stats(self._weight(p), with_mean=False)))
            row_sq = None
            if modelled and cached is None:
                rows = torch.linalg.vector_norm(gq, dim=p.feature_dim, dtype=_F32)
                row_sq = self.sm.to_xp(rows.amax().square() / gq.shape[p.feature_dim])
            s_model, sigma = (None, None) if cached is None else cached
            dec = decisions.fp8_layer(cfg, p.fan_in, torch.finfo(g.dtype).max, sx, gs, ws, wcap, incoming,
                                      self.bo, self._lift_of(p.name, g), s_model, sigma, row_sq, ())
            d = dec.d
            self.model_scales[p.name], self.new_spreads[p.name] = d.model_scale, d.sigma
            self.deciders[p.send] = frozenset({p.name})
            self.feedback.decided(p.name, dec.limited)
            kind = "layer"
        if kind == "first":
            self.deciders[p.send] = behind
        held = self.feedback.held(behind)
        held = False if held is None else held
        outgoing = incoming * d.scale
        self.values[p.send] = outgoing
        self.fitted.add(p.send)
        node = self.plan.nodes[p.index]
        if node.name() == FP8_NODE:  # its GEMMs read q itself, times the scale; its bias
            setattr(node, FP8_COTANGENT, (q, self.sm.to_torch(d.scale).to(g.device)))
            go[0] = g  # gradient sums the 16-bit cotangent
        else:
            go[0] = self._rescale(gq, d.scale)
        self.decisions[p.name] = _Decision(kind, d, d.sigma, incoming, outgoing, q_absmax,
                                           p.fan_in, held, fractions, current)

    def _quantize(self, g: torch.Tensor, behind: frozenset[str]
                  ) -> tuple[torch.Tensor, torch.Tensor, solver.Fp8Histogram, Any]:
        """``g`` cast to the fp8 format once (:func:`adaloss.solver.to_fp8`): the fp8 values, the
        same in ``g``'s dtype (exactly: what a node's 16-bit GEMMs read), their statistics
        (:func:`fp8_histogram`) and the cast's fractions (:func:`adaloss.solver.quantized_fractions`),
        in the pass's scalar namespace; the decisions ``behind`` the scale hear the fractions'
        signal (:func:`adaloss.solver.fp8_signal`)."""
        cfg, sm = self.config, self.sm
        q = solver.to_fp8(g, getattr(torch, cfg.grad_format), cfg.overflow_limit, xp)
        gq = q.to(g.dtype)  # exact: every fp8 value is a 16-bit one
        hist, fractions = fp8_cast_counts(g, q, cfg, sm)
        if cfg.underflow_feedback:
            if sm.xp is xp:
                erfinv = torch.special.erfinv
            else:  # NumPy scalars
                from scipy.special import erfinv
            with np.errstate(divide="ignore", invalid="ignore"):  # NumPy warns where torch gives ±inf
                signal = solver.fp8_signal(cfg, *fractions, hist.absmax, erfinv, sm.xp)
            self.feedback.hear(behind, signal)
        return q, gq, hist, fractions

    def _saved(self, p: NodePlan, attr: str) -> torch.Tensor | None:
        """The node's saved tensor ``attr``, or None when saved-tensor hooks pack it
        (``torch.utils.checkpoint``: reading it here would leave none for the node's backward)."""
        return read_saved(self.plan.nodes[p.index], attr)

    def _wgrad_operand(self, p: NodePlan, g: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The saved activation ``x`` and the rows :func:`adaloss.solver.weight_grad_cap` sums
        over, for a node that computes its weight (and bias) gradient in ``g``'s 16-bit dtype
        from ``s·g``: a matmul (``nn.Linear``, HF ``Conv1D``, ``bmm``/``matmul`` with a
        parameter, ``torch._grouped_mm`` experts: batch and token dimensions are rows, so the
        bound also holds for a weight expanded over a batch, whose gradient sums them) or a
        convolution (:func:`torch_bridge.kernels.wgrad_columns`); None elsewhere (``mv``, fp32
        gradients, an activation packed by saved-tensor hooks, shapes that do not pair)."""
        if not p.act_attr or g.dtype.itemsize > 2:
            return None
        x = self._saved(p, p.act_attr)
        if x is None or x.dim() < 2 or g.dim() < 2 or g.numel() == 0 or x.numel() == 0:
            return None
        if p.act_attr == "_saved_input":  # rows: batch and positions
            return (x, g.numel() // g.shape[1]) if x.dim() == g.dim() else None
        axis = -2 if p.weight_side == 0 else -1
        rows = g.numel() // g.shape[axis]
        return (x, rows) if rows == x.numel() // x.shape[axis] else None

    def _weight_grad_norms(self, p: NodePlan, g: torch.Tensor, operand: tuple[torch.Tensor, int]
                           ) -> tuple[tuple[Any, Any], int]:
        """The largest squared column norms of ``g`` and of the activation (0-d fp32 tensors)
        and the rows they sum over (:meth:`_wgrad_operand`)."""
        gm, xm = kernels.wgrad_columns(g, operand[0].detach(), p.act_attr == "_saved_input", p.weight_side)
        return (sum_of_squares(gm, 0).amax(), sum_of_squares(xm, 0).amax()), operand[1]

    def _weight_grad_cap(self, p: NodePlan, g: torch.Tensor) -> Any:
        """:func:`adaloss.solver.weight_grad_cap` for a node that computes its weight (and bias)
        gradient in ``g``'s 16-bit dtype from ``s·g`` (:meth:`_weight_grad_norms`), in the
        pass's scalar namespace; None where there is none to bound."""
        operand = self._wgrad_operand(p, g)
        if operand is None:
            return None
        norms, rows = self._weight_grad_norms(p, g, operand)
        return decisions.weight_grad_cap(self.config, self._wgrad_limit(g), self.sm.xp,
                                         tuple(map(self.sm.to_xp, norms)), float(rows) ** 0.5, self.bo)

    def _weight_stats(self, p: NodePlan) -> tuple[decisions.Sums, int]:
        """The layer's weight's statistics (:func:`weight_stats`), batched for all the layers
        at the first one a backward reaches, and its size."""
        if self._weights is None:
            # every layer whose weight is saved in memory now (not packed by saved-tensor
            # hooks, nor freed until FSDP2 gathers it again for the layer's backward)
            layers, weights = [], []
            for q in self.plan.order:
                w = self._saved(q, q.weight_attr) if q.kind == "layer" else None
                if type(w) in (torch.Tensor, torch.nn.Parameter) and w.untyped_storage().nbytes() > 0:
                    layers.append(q)
                    weights.append(w)
            stats = self._weight_sums(weights, "weights")
            self._weights = {q.index: (st, w.numel()) for q, st, w in zip(layers, stats, weights)}
        got = self._weights.get(p.index)
        if got is None:
            w = self._weight(p)
            got = self._weight_sums([w], p.name)[0], w.numel()
        return got

    def _weight_sums(self, weights: list[torch.Tensor], point: str) -> list[decisions.Sums]:
        """:func:`weight_stats` of ``weights``, or one compiled call for them all where the pass
        fuses (:func:`torch_bridge.kernels.weights`)."""
        if weights and self._fusing(*weights):
            got = self.fused.call(kernels.weights, (), weights, point=point)
            if got is not None:
                return got
        return weight_stats(weights)

    def _wgrad_limit(self, g: torch.Tensor) -> float | None:
        """What a node's 16-bit weight gradient must stay below: ``u_max``, or with an fp8
        ``grad_format`` (fp8 is only what the node reads) the 16-bit dtype's max."""
        return torch.finfo(g.dtype).max if self.config.fp8 else None

    def _weight(self, p: NodePlan) -> torch.Tensor:
        """The layer's weight operand: the node's saved copy, or, when saved tensors are packed
        by hooks (``torch.utils.checkpoint``: reading it here would leave none for the node's
        own backward), the same values rebuilt from the parameter (``NodePlan.recipe``)."""
        saved = self._saved(p, p.weight_attr)
        if saved is not None:
            return saved
        if p.recipe is None:
            raise RuntimeError(
                f"adaptive loss scaling: the weight of layer {p.name} is saved through saved-tensor "
                "hooks (torch.utils.checkpoint or torch.autograd.graph.saved_tensors_hooks) and is "
                "computed from its parameter by ops other than casts, moves and scalar factors, so "
                "its statistics cannot be read without consuming the saved copy. Use "
                "AdaLossConfig(model='gradient') (no weight statistics), or keep that layer out of "
                "the checkpointed region.")
        pos, ops = p.recipe
        w = self.plan.params[pos].detach()
        for op, arg in ops:
            if op == "cast":
                w = w.to(arg)
                continue
            v = read_saved(self.plan.nodes[arg[0]], arg[1]).detach()  # this graph's scalar
            w = w * v if op == "mul" else (w / v if op == "div" else v / w)
        return w


#: per node kind, the hook's rule with a 16-bit and with an fp8 ``grad_format``; an ``op`` node
#: passes its cotangent's scale on (a parameter's gradient: to the scaler, :meth:`ScaledBackward.pre`)
RULES: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    "layer": (ScaledBackward._layer, ScaledBackward._layer_fp8),
    "input": (ScaledBackward._input_layer, ScaledBackward._layer_fp8),
    "cast": (ScaledBackward._cast, ScaledBackward._cast),
    "region": (ScaledBackward._cast, ScaledBackward._cast),
    "factor": (ScaledBackward._factor, ScaledBackward._factor),
    "norm": (ScaledBackward._norm, ScaledBackward._norm),
}
