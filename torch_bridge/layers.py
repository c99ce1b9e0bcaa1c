"""The hook's rules at decision nodes (:data:`RULES`): a layer, a first layer, a cast, an opaque
region, a scalar factor and a normalization each decide (:mod:`adaloss.decisions`) and apply a
scale, reading the pass's state (:class:`torch_bridge.hooks.ScaledBackward`): the scale each
cotangent carries (``values``), who decided it, whether it was fitted to the fp8 format, the
feedback the decisions hear.

- a layer's pre-hook computes its scale ``s`` from the incoming cotangent ``g`` (carrying ``P``)
  and its weight, and hands the node ``s·g``: the input, weight and bias gradients carry
  ``P·s`` (:func:`layer`);
- a cast's pre-hook scales the fp32 cotangent by the log-normal rule before the node narrows it
  (:func:`cast`);
- with an fp8 ``grad_format`` a layer quantizes its cotangent once and both GEMMs read it
  (:func:`layer_fp8`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from adaloss import decisions, solver
from adaloss.config import AdaLossConfig
from adaloss.report import LayerReport, decision_report, weight_of
from torch_bridge import kernels
from torch_bridge._xp import ON_HOST, ON_TENSORS, ScalarMath, xp
from torch_bridge.graph import FP8_NODE, FUSED_RNN, NodePlan, peek_saved, python_number, read_saved
from torch_bridge.stats import (
    cotangent_stats,
    fp8_cast_counts,
    log_sums,
    subnormal_counts,
    sum_of_squares,
    tensor_stats,
)
from torch_bridge.stats import (
    weight_stats as weight_sums_of,
)

if TYPE_CHECKING:
    from torch_bridge.hooks import ScaledBackward

_F32 = torch.float32
#: what the hook of a ``torch_bridge.float8`` layer sets on its node: the cotangent in fp8 and
#: the scale its GEMMs multiply by
FP8_COTANGENT = "_adaloss_fp8_cotangent"


class Decision(NamedTuple):
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

    def to_torch(self, sm: ScalarMath) -> Decision:
        conv = sm.to_torch
        spread = (type(self.spread)(*map(conv, self.spread)) if isinstance(self.spread, tuple)
                  else conv(self.spread))
        return Decision(self.kind, solver.LayerScale(*map(conv, self.d)), spread, conv(self.incoming),
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


def cached_statistics(bw: ScaledBackward, name: str) -> tuple[Any, Any] | None:
    """(statistical scale, spread or None) of the last recompute to reuse
    (``update_every``), as scalar-namespace values, or None: compute them."""
    if bw.recompute or name not in bw.cached:
        return None
    spread = bw.spreads.get(name)
    if spread is not None:
        spread = bw.to_scalars(spread) if isinstance(spread, tuple) else bw.sm.to_xp(spread)
    return bw.sm.to_xp(bw.cached[name]), spread


def layer(bw: ScaledBackward, p: NodePlan, go: list[Any]) -> None:
    """The layer's scale decided from its cotangent's and weight's statistics
    (:func:`adaloss.decisions.layer`); the node gets ``s·g``, so both its gradients carry
    ``incoming·s``."""
    g, incoming = go[0], bw.now.values[p.sym]
    if g is None or incoming is None:
        bw.now.values[p.send] = incoming
        return
    cfg = bw.config
    cached = cached_statistics(bw, p.name)
    behind = sorted(bw.now.deciders.get(p.sym, frozenset()))
    limited = bw.now.feedback.flags(behind)
    lift = lift_of(bw, p.name, g)
    operand = wgrad_operand(bw, p, g)
    got = None
    x = None if operand is None else operand[0]
    ws, w_size = (None, 0) if cfg.model == "gradient" else weight_stats(bw, p)
    if bw.fusing(g, *(() if x is None else (x,))):  # statistics, math and rescale: one call
        static = (cfg, p.fan_in, w_size, wgrad_limit(bw, g), p.act_attr == "_saved_input",
                  p.weight_side)
        got = bw.fused.call(kernels.layer, static, g, x, ws, incoming, bw.bo, lift,
                              *((None, None) if cached is None else cached), limited, point=p.name)
    if got is None:
        dec = layer_decision(bw, p, g, operand, (ws, w_size), cached, incoming, lift, limited)
        go[0] = bw.rescale(g, dec.d.scale)
    else:
        go[0], dec = got
    if dec.fraction is not None:
        bw.now.feedback.hear(behind, dec.fraction)
    keep(bw, p, dec, incoming)


def keep(bw: ScaledBackward, p: NodePlan, dec: decisions.LayerDecision, incoming: Any) -> None:
    """A layer decision into the pass's state: who decided the scale it sends, the feedback's
    bookkeeping, its statistical scale and spread, its outgoing scale and its report."""
    d = dec.d
    bw.now.deciders[p.send] = frozenset({p.name})
    bw.now.feedback.decided(p.name, dec.limited)
    bw.now.model_scales[p.name], bw.now.spreads[p.name] = d.model_scale, d.sigma
    bw.now.values[p.send] = dec.outgoing
    bw.now.decisions[p.name] = Decision("layer", d, d.sigma, incoming, dec.outgoing, dec.absmax, p.fan_in,
                                       False if dec.held is None else dec.held)


def layer_decision(bw: ScaledBackward, p: NodePlan, g: torch.Tensor, operand: tuple[torch.Tensor, int] | None,
                    weight: tuple[decisions.Sums | None, int], cached: tuple[Any, Any] | None,
                    incoming: Any, lift: Any, limited: list[Any]) -> decisions.LayerDecision:
    """A layer's decision from its cotangent's statistics read op by op (:func:`layer`), and
    its weight's (:func:`weight_stats`, and its size)."""
    cfg = bw.config
    ws, w_size = weight
    norms, rows = (None, 0) if operand is None else weight_grad_norms(bw, p, g, operand)
    counts = None
    if cached is None or cached[1] is None:
        gs, counts = cotangent_stats(g, cfg.model == "gradient",
                                     cfg.underflow_limit if cfg.underflow_feedback else None,
                                     bw.sm is ON_HOST)
    else:  # only the overflow caps need current statistics
        gs = decisions.Sums(None, None, *torch.aminmax(g))
    if cfg.underflow_feedback and counts is None:
        counts = subnormal_counts(g, cfg.underflow_limit, bw.sm is ON_HOST)
    size, root_rows = g.numel(), float(rows) ** 0.5
    if bw.sm is ON_TENSORS and bw.fused is not None:  # values, not static: no compile per batch
        size = bw.fused.constant(size, torch.int64, g.device)
        root_rows = bw.fused.constant(root_rows, _F32, g.device)
    return bw.compute(decisions.layer, (cfg, p.fan_in, w_size, wgrad_limit(bw, g)),
                      size, gs, ws, norms, root_rows, incoming, bw.bo, lift,
                      None if cached is None else cached[0], None if cached is None else cached[1],
                      counts, limited)


def cast(bw: ScaledBackward, p: NodePlan, go: list[Any]) -> None:
    """The cotangent narrowed at a scale decided from its log-statistics
    (:func:`adaloss.decisions.cast`); an opaque region's at least its dynamic scale."""
    present = [k for k in range(len(go)) if go[k] is not None]
    incoming = bw.now.values[p.sym]
    if not present or incoming is None:
        bw.now.values[p.send] = incoming
        return
    cfg, sx = bw.config, bw.sm.xp
    g = go[present[0]]
    cached = cached_statistics(bw, p.name)
    if cfg.fp8 and p.kind == "cast":  # it reads its tensor anyway: current scaling
        m = bw.sm.to_xp(g.abs().amax().to(_F32))
        d = solver.fp8_fit_scale(cfg, m, incoming, sx, bw.bo)
        outgoing = incoming * d.scale
        bw.now.values[p.send] = outgoing
        bw.now.fitted.add(p.send)
        for k in present:
            go[k] = bw.rescale(go[k], d.scale)
        bw.now.decisions[p.name] = Decision("cast", d, d.sigma, incoming, outgoing, m, 1)
        return
    region = bw.region_scale(p.name, g.device) if p.kind == "region" else None
    cached_scale = None if cached is None or region is not None else cached[0]
    cached_logs = None if cached is None else cached[1]
    got = None
    if bw.fusing(*(go[k] for k in present)):
        got = bw.fused.call(kernels.cast, (cfg,), [go[k] for k in present], incoming, bw.bo,
                              cached_scale, cached_logs, region, point=p.name)
    if got is None:
        if region is not None or cached_logs is None:
            sums, logs = log_sums(g), None
        else:  # only the overflow cap needs a current statistic: max|g|
            sums, logs = None, cached_logs._replace(absmax=g.abs().amax())
        dec = bw.compute(decisions.cast, (cfg,), sums, logs, incoming, bw.bo, cached_scale, region)
        for k in present:
            go[k] = bw.rescale(go[k], dec.d.scale)
    else:
        out, dec = got
        for k, t in zip(present, out):
            go[k] = t
    d, ls, outgoing = dec
    bw.now.model_scales[p.name], bw.now.spreads[p.name] = d.model_scale, ls
    bw.now.values[p.send] = outgoing
    bw.now.decisions[p.name] = Decision("cast", d, ls, incoming, outgoing, ls.absmax, 1)
    if p.kind == "region":  # parameters used inside carry ``outgoing`` (see _hidden_hook)
        bw.now.regions.append(outgoing)


def norm(bw: ScaledBackward, p: NodePlan, go: list[Any]) -> None:
    """A normalization's backward: the same scale, not fitted (fp8: the next cast reads its
    tensor's max)."""
    bw.now.values[p.send] = bw.now.values[p.sym]
    bw.now.deciders[p.send] = bw.now.deciders.get(p.sym, frozenset())


def factor(bw: ScaledBackward, p: NodePlan, go: list[Any]) -> None:
    """Before ``x·c`` / ``x/c`` (``c`` a scalar) multiplies the 16-bit cotangent by ``|c|`` /
    ``1/|c|`` (:func:`adaloss.solver.amplified_scale`), and before a weight broadcast over it
    gets its gradient summed in 16 bits (:func:`reduction_cap`): the cotangent and its
    scale lowered by the power of two that keeps both finite."""
    g, incoming = go[0], bw.now.values[p.sym]
    if g is None or incoming is None:
        bw.now.values[p.send] = incoming
        return
    sx, r = bw.sm.xp, None
    node = bw.plan.nodes[p.index]
    data = peek_saved(node, p.factor_attr) if p.factor_attr else None
    if data is not None:
        number = python_number(data)
        if number is None:  # a tensor (a 0-d CPU one may multiply a device tensor)
            c = read_saved(node, p.factor_attr).detach().to(device=g.device, dtype=_F32).abs().reshape(())
        else:  # read on the host, no copy to the device
            c = torch.full((), abs(number), dtype=_F32, device=g.device)
        factor = 1.0 / c if p.factor_div else c
        m = g.abs().amax().to(_F32)
        r = solver.amplified_scale(bw.config, bw.sm.to_xp(m), bw.sm.to_xp(factor), sx, bw.bo)
    cap = reduction_cap(bw, p, g) if p.reduce_shape else None
    if cap is not None:
        r2 = solver.at_most(cap, sx)
        r = r2 if r is None else sx.minimum(r, r2)
    if r is None:
        bw.now.values[p.send] = incoming
        return
    lowered(bw, p, go, r)


def reduction_cap(bw: ScaledBackward, p: NodePlan, g: torch.Tensor) -> Any:
    """:func:`adaloss.solver.weight_grad_cap` for the gradient of a weight broadcast over
    ``g`` (``p.reduce_shape``): each of its entries sums the entries of ``g`` (times those
    of the saved activation, for a product) it was broadcast to, bounded by Cauchy-Schwarz
    over them. None where the activation is packed by saved-tensor hooks."""
    shape = p.reduce_shape
    rows = g.numel() // max(1, math.prod(shape))
    g_norm = g.to(_F32).square().sum_to_size(shape).amax().sqrt()
    x_norm = torch.zeros((), dtype=_F32, device=g.device)
    if p.reduce_attr:
        x = saved_tensor(bw, p, p.reduce_attr)
        if x is None:
            return None
        x_norm = x.detach().to(_F32).square().expand(g.shape).sum_to_size(shape).amax().sqrt()
        rows = 0  # no bias term: the bound is the two norms'
    return solver.weight_grad_cap(bw.config, bw.sm.to_xp(g_norm), bw.sm.to_xp(x_norm), rows,
                                  bw.sm.xp, bw.bo, wgrad_limit(bw, g))


def fused_rnn(bw: ScaledBackward, p: NodePlan, go: list[Any]) -> None:
    """A fused RNN's node (every time step's GEMMs in one kernel: oneDNN, cuDNN, MIOpen) as one
    weighted region: its cotangents (the output sequence's, the last hidden and cell states')
    get one layer decision (:func:`adaloss.decisions.layer`) from their joint statistics and its
    weight matrices', with the region's fan-in (gates × hidden: the terms of its input's gradient)
    and, where the node computes its weight gradients in 16 bits, the cap of a weight gradient
    summed over every time step and batch entry (the cotangent's and the saved input's column
    norms over those rows, Cauchy-Schwarz as for a matmul). Everything the node computes from
    the scaled cotangents (its input's, weights', biases' and initial states' gradients)
    carries ``incoming · s``."""
    present = [k for k in range(len(go)) if go[k] is not None]
    incoming = bw.now.values[p.sym]
    if not present or incoming is None:
        bw.now.values[p.send] = incoming
        return
    cfg, node = bw.config, bw.plan.nodes[p.index]
    gs = [go[k] for k in present]
    g = gs[0]
    sums = _joint([cotangent_stats(t, cfg.model == "gradient", None, bw.sm is ON_HOST)[0] for t in gs])
    size = sum(t.numel() for t in gs)
    ws, w_size = None, 0
    if cfg.model != "gradient":
        weights = rnn_weights(node)
        ws, w_size = _joint(weight_sums_of(weights)), sum(w.numel() for w in weights)
    norms, root_rows = None, 0.0
    x = read_saved(node, p.act_attr) if g.dtype.itemsize <= 2 else None
    if x is not None and x.numel() and g.numel():
        g2, x2 = g.reshape(-1, g.shape[-1]), x.detach().reshape(-1, x.shape[-1])
        norms = (sum_of_squares(g2, 0).amax(), sum_of_squares(x2, 0).amax())
        root_rows = float(x2.shape[0]) ** 0.5  # time steps × batch: the terms of a weight gradient
    if bw.sm is ON_TENSORS and bw.fused is not None:  # values, not static: no compile per batch
        size = bw.fused.constant(size, torch.int64, g.device)
        root_rows = bw.fused.constant(root_rows, _F32, g.device)
    behind = sorted(bw.now.deciders.get(p.sym, frozenset()))
    limited = bw.now.feedback.flags(behind)
    dec = bw.compute(decisions.layer, (cfg, p.fan_in, w_size, wgrad_limit(bw, g)), size, sums, ws, norms,
                     root_rows, incoming, bw.bo, None, None, None, None, limited)
    for k in present:
        go[k] = bw.rescale(go[k], dec.d.scale)
    keep(bw, p, dec, incoming)


def rnn_weights(node: Any) -> list[torch.Tensor]:
    """The weight matrices a fused RNN node saved (:data:`torch_bridge.graph.FUSED_RNN`; biases
    left out: a bias multiplies no cotangent)."""
    out: list[torch.Tensor] = []
    for attr in FUSED_RNN[node.name()][1]:
        saved = peek_saved(node, attr)
        saved = getattr(node, attr) if saved is None else saved
        for w in saved if isinstance(saved, (list, tuple)) else (saved,):
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                out.append(w.detach())
    return out


def _joint(parts: list[decisions.Sums]) -> decisions.Sums:
    """The :class:`~adaloss.decisions.Sums` of several tensors taken as one: the sums added
    (None where any is), the extremes of their extremes (fp32)."""
    if len(parts) == 1:
        return parts[0]

    def added(xs: list[Any]) -> Any:
        return None if any(x is None for x in xs) else functools.reduce(operator.add, xs)

    return decisions.Sums(added([p.total for p in parts]), added([p.sq_total for p in parts]),
                          torch.stack([p.lo.to(_F32) for p in parts]).amin(),
                          torch.stack([p.hi.to(_F32) for p in parts]).amax())


def input_layer(bw: ScaledBackward, p: NodePlan, go: list[Any]) -> None:
    """A first layer (its input needs no gradient: no decision) computes its weight and bias
    gradients in 16 bits from the cotangent it receives: lowered by the power of two that
    keeps them finite (:func:`adaloss.solver.weight_grad_cap`)."""
    g, incoming = go[0], bw.now.values[p.sym]
    cap = None if g is None or incoming is None else weight_grad_cap(bw, p, g)
    if cap is None:
        bw.now.values[p.send] = incoming
        return
    lowered(bw, p, go, solver.at_most(cap, bw.sm.xp))


def lowered(bw: ScaledBackward, p: NodePlan, go: list[Any], r: Any) -> None:
    """The node's cotangent and the scale it passes on, times ``r`` (a power of two ≤ 1)."""
    bw.now.values[p.send] = bw.now.values[p.sym] * r
    bw.now.deciders[p.send] = bw.now.deciders.get(p.sym, frozenset())
    if p.sym in bw.now.fitted:
        bw.now.fitted.add(p.send)
    go[0] = bw.rescale(go[0], r)


def layer_fp8(bw: ScaledBackward, p: NodePlan, go: list[Any]) -> None:
    """A layer (or first layer) with an fp8 ``grad_format``: the incoming cotangent (carrying
    ``P``) quantized once, saturating (:func:`adaloss.solver.to_fp8`), and handed to the node times the
    decision's scale (:func:`adaloss.solver.fp8_layer_scale`): both its GEMMs read the fp8
    values. Where no decision fitted ``P`` to the format (the first cast after the loss),
    or with ``fp8_rule="current"``, it is fitted to the tensor's own ``max|g|`` first."""
    g, incoming = go[0], bw.now.values[p.sym]
    if g is None or incoming is None:
        bw.now.values[p.send] = incoming
        return
    cfg, sx = bw.config, bw.sm.xp
    current = cfg.fp8_rule == "current" or p.sym not in bw.now.fitted
    if current:
        fit = solver.fp8_fit_scale(cfg, bw.sm.to_xp(g.abs().amax().to(_F32)), incoming, sx, bw.bo)
        g, incoming = bw.rescale(g, fit.scale), incoming * fit.scale
    behind = bw.now.deciders.get(p.sym, frozenset())
    q, gq, hist, fractions = quantize(bw, g, behind)
    q_absmax = hist.absmax
    wcap = weight_grad_cap(bw, p, gq)
    if p.kind == "input":  # no decision: only the node's 16-bit weight gradient capped
        r = sx.ones_like(incoming) if wcap is None else solver.at_most(wcap, sx)
        one = sx.ones_like(incoming)
        d = solver.LayerScale(r, one, sx.zeros_like(incoming), r)
        kind = "first"
    else:
        modelled = cfg.fp8_rule != "current" and cfg.layer_rule  # else 1 (decisions.fp8_layer)
        cached = cached_statistics(bw, p.name) if modelled else None
        # E[g²] from the histogram; for a fresh decision, the largest row's
        # (solver.worst_row_sq_mean): one pass over the rows' sums of squares
        gs = solver.TensorStats(None, hist.sq_sum / gq.numel(), None, None, q_absmax)
        node = bw.plan.nodes[p.index]
        ws = (node._forward_cls.weight_statistics(node, bw.sm) if node.name() == FP8_NODE
              else bw.to_scalars(tensor_stats(weight_operand(bw, p), with_mean=False)))
        row_sq = None
        if modelled and cached is None:
            rows = torch.linalg.vector_norm(gq, dim=p.feature_dim, dtype=_F32)
            row_sq = bw.sm.to_xp(rows.amax().square() / gq.shape[p.feature_dim])
        s_model, sigma = (None, None) if cached is None else cached
        dec = decisions.fp8_layer(cfg, p.fan_in, torch.finfo(g.dtype).max, sx, gs, ws, wcap, incoming,
                                  bw.bo, lift_of(bw, p.name, g), s_model, sigma, row_sq, ())
        d = dec.d
        bw.now.model_scales[p.name], bw.now.spreads[p.name] = d.model_scale, d.sigma
        bw.now.deciders[p.send] = frozenset({p.name})
        bw.now.feedback.decided(p.name, dec.limited)
        kind = "layer"
    if kind == "first":
        bw.now.deciders[p.send] = behind
    held = bw.now.feedback.held(behind)
    held = False if held is None else held
    outgoing = incoming * d.scale
    bw.now.values[p.send] = outgoing
    bw.now.fitted.add(p.send)
    node = bw.plan.nodes[p.index]
    if node.name() == FP8_NODE:  # its GEMMs read q itself, times the scale; its bias
        setattr(node, FP8_COTANGENT, (q, bw.sm.to_torch(d.scale).to(g.device)))
        go[0] = g  # gradient sums the 16-bit cotangent
    else:
        go[0] = bw.rescale(gq, d.scale)
    bw.now.decisions[p.name] = Decision(kind, d, d.sigma, incoming, outgoing, q_absmax,
                                       p.fan_in, held, fractions, current)


def quantize(bw: ScaledBackward, g: torch.Tensor, behind: frozenset[str]
              ) -> tuple[torch.Tensor, torch.Tensor, solver.Fp8Histogram, Any]:
    """``g`` cast to the fp8 format once (:func:`adaloss.solver.to_fp8`): the fp8 values, the
    same in ``g``'s dtype (exactly: what a node's 16-bit GEMMs read), their statistics
    (:func:`fp8_histogram`) and the cast's fractions (:func:`adaloss.solver.quantized_fractions`),
    in the pass's scalar namespace; the decisions ``behind`` the scale hear the fractions'
    signal (:func:`adaloss.solver.fp8_signal`)."""
    cfg, sm = bw.config, bw.sm
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
        bw.now.feedback.hear(behind, signal)
    return q, gq, hist, fractions


def saved_tensor(bw: ScaledBackward, p: NodePlan, attr: str) -> torch.Tensor | None:
    """The node's saved tensor ``attr``, or None when saved-tensor hooks pack it
    (``torch.utils.checkpoint``: reading it here would leave none for the node's backward)."""
    return read_saved(bw.plan.nodes[p.index], attr)


def wgrad_operand(bw: ScaledBackward, p: NodePlan, g: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The saved activation ``x`` and the rows :func:`adaloss.solver.weight_grad_cap` sums
    over, for a node that computes its weight (and bias) gradient in ``g``'s 16-bit dtype
    from ``s·g``: a matmul (``nn.Linear``, HF ``Conv1D``, ``bmm``/``matmul`` with a
    parameter, ``torch._grouped_mm`` experts: batch and token dimensions are rows, so the
    bound also holds for a weight expanded over a batch, whose gradient sums them) or a
    convolution (:func:`torch_bridge.kernels.wgrad_columns`); None elsewhere (``mv``, fp32
    gradients, an activation packed by saved-tensor hooks, shapes that do not pair)."""
    if not p.act_attr or g.dtype.itemsize > 2:
        return None
    x = saved_tensor(bw, p, p.act_attr)
    if x is None or x.dim() < 2 or g.dim() < 2 or g.numel() == 0 or x.numel() == 0:
        return None
    if p.act_attr == "_saved_input":  # rows: batch and positions
        return (x, g.numel() // g.shape[1]) if x.dim() == g.dim() else None
    axis = -2 if p.weight_side == 0 else -1
    rows = g.numel() // g.shape[axis]
    return (x, rows) if rows == x.numel() // x.shape[axis] else None


def weight_grad_norms(bw: ScaledBackward, p: NodePlan, g: torch.Tensor, operand: tuple[torch.Tensor, int]
                       ) -> tuple[tuple[Any, Any], int]:
    """The largest squared column norms of ``g`` and of the activation (0-d fp32 tensors)
    and the rows they sum over (:func:`wgrad_operand`)."""
    gm, xm = kernels.wgrad_columns(g, operand[0].detach(), p.act_attr == "_saved_input", p.weight_side)
    return (sum_of_squares(gm, 0).amax(), sum_of_squares(xm, 0).amax()), operand[1]


def weight_grad_cap(bw: ScaledBackward, p: NodePlan, g: torch.Tensor) -> Any:
    """:func:`adaloss.solver.weight_grad_cap` for a node that computes its weight (and bias)
    gradient in ``g``'s 16-bit dtype from ``s·g`` (:func:`weight_grad_norms`), in the
    pass's scalar namespace; None where there is none to bound."""
    operand = wgrad_operand(bw, p, g)
    if operand is None:
        return None
    norms, rows = weight_grad_norms(bw, p, g, operand)
    return decisions.weight_grad_cap(bw.config, wgrad_limit(bw, g), bw.sm.xp,
                                     tuple(map(bw.sm.to_xp, norms)), float(rows) ** 0.5, bw.bo)


def weight_stats(bw: ScaledBackward, p: NodePlan) -> tuple[decisions.Sums, int]:
    """The layer's weight's statistics (:func:`torch_bridge.stats.weight_stats`), batched for all the layers
    at the first one a backward reaches, and its size."""
    if bw.now.weights is None:
        # every layer whose weight is saved in memory now (not packed by saved-tensor
        # hooks, nor freed until FSDP2 gathers it again for the layer's backward)
        layers, weights = [], []
        for q in bw.plan.order:
            w = saved_tensor(bw, q, q.weight_attr) if q.kind == "layer" else None
            if type(w) in (torch.Tensor, torch.nn.Parameter) and w.untyped_storage().nbytes() > 0:
                layers.append(q)
                weights.append(w)
        stats = weight_sums(bw, weights, "weights")
        bw.now.weights = {q.index: (st, w.numel()) for q, st, w in zip(layers, stats, weights)}
    got = bw.now.weights.get(p.index)
    if got is None:
        w = weight_operand(bw, p)
        got = weight_sums(bw, [w], p.name)[0], w.numel()
    return got


def weight_sums(bw: ScaledBackward, weights: list[torch.Tensor], point: str) -> list[decisions.Sums]:
    """:func:`torch_bridge.stats.weight_stats` of ``weights``, or one compiled call for them all
    where the pass fuses (:func:`torch_bridge.kernels.weights`)."""
    if weights and bw.fusing(*weights):
        got = bw.fused.call(kernels.weights, (), weights, point=point)
        if got is not None:
            return got
    return weight_sums_of(weights)


def wgrad_limit(bw: ScaledBackward, g: torch.Tensor) -> float | None:
    """What a node's 16-bit weight gradient must stay below: ``u_max``, or with an fp8
    ``grad_format`` (fp8 is only what the node reads) the 16-bit dtype's max."""
    return torch.finfo(g.dtype).max if bw.config.fp8 else None


def weight_operand(bw: ScaledBackward, p: NodePlan) -> torch.Tensor:
    """The layer's weight operand: the node's saved copy, or, when saved tensors are packed
    by hooks (``torch.utils.checkpoint``: reading it here would leave none for the node's
    own backward), the same values rebuilt from the parameter (``NodePlan.recipe``)."""
    saved = saved_tensor(bw, p, p.weight_attr)
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
    w = bw.plan.params[pos].detach()
    for op, arg in ops:
        if op == "cast":
            w = w.to(arg)
            continue
        v = read_saved(bw.plan.nodes[arg[0]], arg[1]).detach()  # this graph's scalar
        w = w * v if op == "mul" else (w / v if op == "div" else v / w)
    return w


def lift_of(bw: ScaledBackward, decision: str, g: torch.Tensor) -> Any:
    """``2^k`` of the decision's weight, in the pass's scalar namespace (None: no lift)."""
    lift = bw.lift.get(weight_of(decision))
    if lift is None:
        return None
    return bw.sm.to_xp(lift if lift.device == g.device else lift.to(g.device))


#: per node kind, the hook's rule with a 16-bit and with an fp8 ``grad_format``; an ``op`` node
#: passes its cotangent's scale on (a parameter's gradient: to the scaler,
#: :meth:`torch_bridge.hooks.ScaledBackward.pre`)
RULES: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    "layer": (layer, layer_fp8),
    "input": (input_layer, layer_fp8),
    "cast": (cast, cast),
    "region": (cast, cast),
    "rnn": (fused_rnn, cast),  # fp8: the region computes in 16 bits; its boundary a cast
    "factor": (factor, factor),
    "norm": (norm, norm),
}
