"""The scale-propagating backward in PyTorch: node hooks that follow a :class:`ScalePlan`, and
the state of one pass (:class:`ScaledBackward`). At each decision node the hook applies the
rule of :data:`torch_bridge.layers.RULES`.

Statistics are fused torch reductions over each cotangent (:mod:`torch_bridge.stats`); the scale
decisions are :mod:`adaloss.decisions` (the same as ``jax_adaloss``) on
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
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from adaloss import decisions, solver
from adaloss.config import AdaLossConfig
from adaloss.feedback import Feedback
from adaloss.report import LayerReport, weight_of
from torch_bridge import kernels
from torch_bridge._xp import ON_HOST, ON_TENSORS, ScalarMath, scalar_math
from torch_bridge.fused import FusedMath
from torch_bridge.graph import NO_DECISION, NodePlan, ScalePlan
from torch_bridge.layers import RULES, Decision
from torch_bridge.regions import GLOBAL

_F32 = torch.float32

# (param, this backward's gradient, its scale, the scale .grad carries now or None: the
# scaler knows) -> (gradient to accumulate, scale .grad then carries)
LeafHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                    tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class BackwardRecord:
    """One finished backward: per-layer decisions (forward order), each leaf's gradient
    scale (``id(param) -> (param, scale)``), captured cotangents, statistical scales."""

    config: AdaLossConfig
    decisions: dict[str, Decision]  # values of ``math``'s namespace
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


#: autograd graph task id -> the scaled backward whose root started it (while it runs)
_RUNNING: dict[int, weakref.ref[ScaledBackward]] = {}

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


#: the reason a backward through a recorded backward (a gradient penalty's
#: ``scaler.scale(loss + penalty).backward()``) has one global scale: its cotangents meet values
#: the recorded backward computed at the global scale (the gradients themselves), and a product
#: with them would leave the range the per-layer decisions keep
THROUGH_RECORDED = "a backward through a create_graph backward"


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


class PassState:
    """What one backward pass has met and decided so far; :class:`ScaledBackward` starts a fresh
    one as each pass begins. Scales are values of the pass's scalar namespace, indexed by the
    plan's scale symbols."""

    def __init__(self, n_syms: int) -> None:
        self.values: list[Any] = [None] * n_syms  # scale symbol -> the scale it stands for
        self.shapes: list[Any] = []  # the cotangents' shapes at the decisions (BackwardRecord.shapes)
        self.stash: dict[tuple[int, int], list[tuple[torch.Tensor, int]]] = {}  # (node, output)
        self.carried: set[tuple[int, int]] = set()
        self.decisions: dict[str, Decision] = {}
        # per decision, its statistical scale and spread (update_every)
        self.model_scales: dict[str, Any] = {}
        self.spreads: dict[str, Any] = {}
        self.captured: dict[str, torch.Tensor] = {}
        self.captured_scales: dict[str, Any] = {}
        self.leaf_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.leaf_tensors: dict[int, tuple[Any, torch.Tensor]] = {}  # id(value) -> (value, tensor)
        self.regions: list[Any] = []  # outgoing scales of the opaque regions being run
        # scale symbol -> the layer decisions that set it (merges: those of their parts)
        self.deciders: dict[int, frozenset[str]] = {}
        # what each layer decision heard (values of the scalar namespace)
        self.feedback = Feedback()
        self.fitted: set[int] = set()  # fp8: scale symbols a decision fitted to the format's range
        # node index -> its weight's statistics and size (layers.weight_stats), for this backward
        self.weights: dict[int, tuple[decisions.Sums, int]] | None = None


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
    ``region_scale(name, device)`` (``torch_bridge.regions``).
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
        self._task = -1  # the autograd graph task its current pass runs in
        # set by the scaler where the graph runs through a recorded (create_graph) backward: then
        # the whole pass has one global scale (THROUGH_RECORDED)
        self.through_recorded: str | None = None
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
        self.hidden = list(hidden) if plan.opaque else []
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
        if not self.active or not self.now.regions:
            return None
        param = self.hidden[k]
        prior = self.now.leaf_scales.get(id(param))
        grad, carried = self.on_leaf(param, grad, self._leaf_scale(self.now.regions[-1]),
                                     None if prior is None else prior[1])
        self.now.leaf_scales[id(param)] = (param, carried)
        return grad

    def _reset(self) -> None:
        self.now = PassState(self.plan.n_syms)

    def record(self) -> BackwardRecord:
        """What the pass decided, without references to the graph."""
        order = {p.name: p.rank for p in self.plan.layers()}
        names = sorted(self.now.decisions, key=lambda n: order.get(n, 0))
        conv = self.sm.to_torch
        model_scales, spreads = _to_torch_all((self.now.model_scales, self.now.spreads), self.sm)
        return BackwardRecord(self.config, {n: self.now.decisions[n] for n in names},
                              dict(self.now.leaf_scales), dict(self.now.captured),
                              {k: conv(v) for k, v in self.now.captured_scales.items()},
                              model_scales, spreads, self.sm, self._underflow_signals(), self.loss,
                              self.global_reason, tuple(self.now.shapes))

    def _underflow_signals(self) -> dict[str, torch.Tensor]:
        """Per weight, :func:`adaloss.solver.underflow_ratio` of its decisions (fp32 0-d tensors)."""
        weights, fractions, limited, _ = self.now.feedback.signal_arguments(weight_of)
        if not weights:
            return {}
        ratios = self.compute(decisions.signals, (self.config, weights), fractions, limited)
        return dict(zip(self.now.feedback.weights(weight_of), map(self.sm.to_torch, ratios)))

    # -- hooks --------------------------------------------------------------------
    def pre(self, i: int, grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        go = list(grad_outputs)
        if i == 0:
            task = torch._C._current_graph_task_id()
            owner = _RUNNING.get(task)
            running = None if owner is None else owner()
            root = self.plan.nodes[0]
            if running not in (None, self) and any(n is root for n in running.plan.nodes):
                # this root reached inside another scaled backward whose plan holds it: a
                # gradient penalty's ``scaler.scale(loss + penalty).backward()`` runs through
                # ``loss``'s graph, whose first (global) backward hooked it; that plan decides here
                return None
            _RUNNING[task] = weakref.ref(self)
            self._task = task
            self._begin(go)
        elif not self.active:
            return None  # a backward of another graph through a shared node
        p = self.plan.order[i]
        if self.global_reason is not None:  # one scale everywhere: nothing to decide or merge
            return self._global(i, p, go)
        self._merge_outputs(p, go)
        if p.kind not in NO_DECISION:
            self.now.shapes.append(None if go[0] is None else go[0].shape)
            if self.capture and go[0] is not None:
                self.now.captured[p.name] = go[0]
                self.now.captured_scales[p.name] = self.now.values[p.sym]
        rule = self.rules.get(p.kind)
        if rule is not None:
            rule[self.config.fp8](self, p, go)
        elif p.kind != "op":  # a reference backward: every node passes the scale on
            self.now.values[p.send] = self.now.values[p.sym]
        elif p.leaf and go[0] is not None and self.now.values[p.sym] is not None:
            param = self.plan.params[i]
            go[0], carried = self.on_leaf(param, go[0], self._leaf_scale(self.now.values[p.sym]), None)
            self.now.leaf_scales[id(param)] = (param, carried)
        return tuple(go)

    def _global(self, i: int, p: NodePlan, go: list[Any]) -> tuple[Any, ...]:
        """A node of a backward with one global scale (:func:`global_backward`): a parameter that
        already has a ``.grad`` brings both to one scale; everything else passes."""
        if p.leaf and go[0] is not None:
            param = self.plan.params[i]
            go[0], carried = self.on_leaf(param, go[0], self._leaf_scale(self.now.values[0]), None)
            self.now.leaf_scales[id(param)] = (param, carried)
        return tuple(go)

    def post(self, i: int, grad_inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.active or self.global_reason is not None:  # (autograd sums the branches)
            return None
        p = self.plan.order[i]
        if p.kind == "region" and self.now.regions:
            self.now.regions.pop()
        gi = list(grad_inputs)
        for j, key in p.stash_edges.items():
            t = gi[j]
            if t is None:
                continue
            self.now.stash.setdefault(key, []).append((t, p.edge_syms[j]))
            if key in self.now.carried:
                gi[j] = None
            else:
                self.now.carried.add(key)
        return tuple(gi)

    def _begin(self, go: list[Any]) -> None:
        self.global_reason = self.through_recorded or global_backward(self.plan)
        self._reset()
        self._hook_leaves()
        self.active = True
        g = go[0]
        self.sm = scalar_math(g, self.host_math and self.fused is None)
        self._fuse = self.fused is not None and self.sm is ON_TENSORS and not self.config.fp8
        self.bo = None if self.backoff is None else self.sm.to_xp(self.backoff.to(g.device))
        if self.global_reason is not None:  # one dynamic scale, GradScaler's (the scaler's get_scale())
            init = self.region_scale(GLOBAL, g.device).clone()
        else:
            init = torch.full((), self.config.init_scale, dtype=_F32, device=g.device)
        self.now.values[0] = self.sm.to_xp(init)
        if self.config.init_scale != 1.0 or self.global_reason is not None:
            go[0] = rescale(g, init)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self.active = False
        _RUNNING.pop(self._task, None)
        self._unhook_leaves()
        self._unhook_hidden()
        for i, p in enumerate(self.plan.order):
            param = self.plan.params[i]
            if self.global_reason == "autograd.grad":
                break  # the gradients were returned, no .grad written
            value = self.now.values[0] if self.global_reason is not None else self.now.values[p.sym]
            if p.leaf and id(param) not in self.now.leaf_scales and value is not None:
                self.now.leaf_scales[id(param)] = (param, self._leaf_scale(value))
        self.on_done(self.record())

    def _leaf_scale(self, value: Any) -> torch.Tensor:
        """``value`` (a scale of the scalar namespace) as the 0-d tensor a gradient carries, one
        tensor per value: the parameters that carry one scale (a layer's weight and bias) share
        it, and the scaler unscales them in one call."""
        hit = self.now.leaf_tensors.get(id(value))
        if hit is None:
            hit = self.now.leaf_tensors[id(value)] = (value, self.sm.to_torch(value))
        return hit[1]

    def to_scalars(self, t: solver.TensorStats | solver.LogStats) -> Any:
        """Statistics (0-d tensors) as values of the scalar namespace."""
        return type(t)(*(None if v is None else self.sm.to_xp(v) for v in t))

    def rescale(self, t: torch.Tensor, factor: Any) -> torch.Tensor:
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
        if self.fusing(*tensors):
            got = self.fused.call(kernels.merge, (*static, summed), tensors, [s for _, s in parts], self.bo,
                                  point=point)
            if got is not None:
                return got
        extremes = [decisions.Sums(None, None, *torch.aminmax(t)) for t in tensors]
        target, factors = self.compute(decisions.merge_of_extremes, static, [s for _, s in parts], extremes,
                                     self.bo)
        rescaled = [self.rescale(t, f) for t, f in zip(tensors, factors)]
        return (sum(rescaled[1:], rescaled[0]) if summed else rescaled), target  # (in order)

    def _merged(self, sym: int, parts: list[int]) -> None:
        """A merged scale was set by the decisions behind its parts."""
        self.now.deciders[sym] = frozenset().union(*(self.now.deciders.get(s, frozenset()) for s in parts))

    def _merge_outputs(self, p: NodePlan, go: list[Any]) -> None:
        for k, msym in p.merges.items():
            stashed = self.now.stash.pop((p.index, k), [])
            parts = [(t, self.now.values[s]) for t, s in stashed]
            if not parts:
                continue
            go[k], self.now.values[msym] = self._merge(parts, p.out_dtypes[k], f"merge {p.index}:{k}",
                                                   summed=True)
            self._merged(msym, [s for _, s in stashed])
            self.now.fitted.add(msym)
        if p.cross_merge:
            present = [k for k in p.out_syms if go[k] is not None]
            if not present:
                return
            rescaled, self.now.values[p.sym] = self._merge(
                [(go[k], self.now.values[p.out_syms[k]]) for k in present], p.out_dtypes[present[0]],
                f"merge {p.index}")
            self._merged(p.sym, [p.out_syms[k] for k in present])
            self.now.fitted.add(p.sym)
            for k, t in zip(present, rescaled):
                go[k] = t

    # -- scale decisions ------------------------------------------------------------
    def fusing(self, *tensors: torch.Tensor) -> bool:
        """Whether this decision runs as one compiled call (:mod:`torch_bridge.kernels`):
        ``fuse_decisions``, decisions on tensors, plain tensors (not a subclass: a ``DTensor``,
        a ``FakeTensor``), not an fp8 format."""
        return self._fuse and all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)

    def compute(self, fn: Callable[..., Any], static: tuple[Any, ...], *args: Any) -> Any:
        """``fn(*static, xp, *args)`` (a function of :mod:`adaloss.decisions`) in the pass's
        scalar namespace, its 0-d tensor arguments (statistics just read) converted to it:
        compiled into one kernel (:attr:`fused`) where the decisions run on device tensors."""
        if self.sm is ON_TENSORS and self.fused is not None:
            return self.fused(fn, static, *args)
        with np.errstate(all="ignore"):  # a non-finite gradient: inf and NaN, as torch makes them
            return fn(*static, self.sm.xp, *_converted(args, self.sm.to_xp))
