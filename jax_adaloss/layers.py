"""The sweep's rules at decision nodes (:data:`SWEEP`): a layer, a first layer (fp8) and a cast
each decide a scale (:mod:`adaloss.decisions`) and apply it, reading the sweep's state
(:class:`jax_adaloss.backward._Sweep`): the scale a cotangent carries, who decided it, whether
it was fitted to the fp8 format, the feedback the decisions hear.

- a layer ``y = x·W`` with incoming cotangent ``g`` (scale ``P``) sends ``vjp_x(s·g)``
  (scale ``P·s``) to ``x`` and ``vjp_W(g)`` (scale ``P``) to ``W`` (:func:`layer`);
- with an fp8 ``grad_format`` it quantizes ``g`` once and both GEMMs read it
  (:func:`layer_fp8`);
- a narrowing cast of the cotangent gets its scale from the log-normal model before
  narrowing, unless every entry is already a value of the narrow format (:func:`cast`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from adaloss import decisions, solver
from adaloss.report import decision_report, weight_of
from jax_adaloss import reductions
from jax_adaloss.cotangents import _absmax, _like
from jax_adaloss.fp8_gemm import gemm_out
from jax_adaloss.scaled_grad import rescale as _rescale
from jax_adaloss.trace import Node
from jax_adaloss.weight_grads import dot_operand_grad, dtype_of, wide_vjp

if TYPE_CHECKING:
    from jax_adaloss.backward import _Sweep as Sweep

_F32 = jnp.float32


def layer(sw: Sweep, node: Node, g: Any, incoming: Any) -> None:
    """The layer's scale decided from its cotangent's and weight's statistics
    (:func:`adaloss.decisions.layer_of_stats`); its input gets ``vjp_x(s·g)``, carrying
    ``incoming·s``, its weight ``vjp_W(g)``, carrying ``incoming``."""
    cfg = sw.config
    weight = None if cfg.model == "gradient" else node.weight

    # every reduction of g (and of W) the decision reads: one pass each on a GPU
    gs = reductions.statistics(g, sq_mean=True, mean=cfg.model == "gradient",
                               below=cfg.underflow_limit if cfg.underflow_feedback else None)
    ws = None if weight is None else reductions.statistics(weight, sq_mean=True)
    g_ext, w_ext = gs.magnitude(), None if ws is None else ws.magnitude()

    sigma = solver.model_sigma(cfg, g_ext, w_ext, node.fan_in, jnp)
    s_model = solver.model_scale(cfg, sigma, jnp, sw.backoff, sw.lift_of(node.name))
    # the caps use current statistics on every call
    behind = sorted(sw.book.decided_by(incoming))
    counts = (gs.nonzero, gs.below) if cfg.underflow_feedback else None
    dec = decisions.layer_of_stats(cfg, node.fan_in, jnp, gs.size, g_ext, w_ext, None, incoming,
                                   sw.backoff, None, s_model, sigma, counts,
                                   sw.feedback.flags(behind))
    if dec.fraction is not None:
        sw.feedback.hear(behind, dec.fraction)
    checked(sw, node.name, dec.absmax)
    scale, outgoing = sw.book.settle((dec.d.scale, dec.outgoing))
    d = dec.d._replace(scale=scale)
    sw.book.decided(outgoing, frozenset({node.name}))
    sw.feedback.decided(node.name, dec.limited)
    act_ct = input_grad(sw, node, g, d.scale)
    sw.cts[node.ins[node.diff[node.act]]].append((act_ct, outgoing))
    if node.wgt >= 0:
        w_ct = weight_grad(sw, node, g)
        sw.cts[node.ins[node.diff[node.wgt]]].append((w_ct, incoming))
    if sw.reporting:
        report(sw, node, d, None, incoming, outgoing, dec.absmax, dec.held)

def input_grad(sw: Sweep, node: Node, g: Any, scale: Any, q: Any = None) -> Any:
    """The layer's input cotangent ``vjp_x(s·g)``. For a ``dot_general`` with power-of-two
    scales, ``s·vjp_x(g)`` instead: the dot accumulated in fp32 (as a 16-bit dot is), times
    ``s``, rounded once to the input's dtype. Bitwise the same where the input is the dot's
    lhs (a power of two commutes with fp32's rounding; the caps keep every product finite;
    an rhs input's dot takes its operands in the other order, whose sums may round
    differently), without a pass over ``g``: the scale rides on the dot's output, whose
    conversion to 16 bits reads it anyway."""
    prim, params, vals = node.eqn
    x = node.diff[node.act]
    if q is not None and node.fp8_operands is not None:  # an FP8 GEMM: q times the weight's fp8
        (qw, w_scale), (qx, _) = node.fp8_operands[1 - x], node.fp8_operands[x]
        out = dot_operand_grad(q, qw, qx, params["dimension_numbers"], x, params.get("precision"),
                               gemm_out(dtype_of(vals[x]), sw.config.power_of_two))
        return (out * (scale / w_scale).astype(out.dtype)).astype(dtype_of(vals[x]))
    if prim.name != "dot_general" or not sw.config.power_of_two:
        return node.vjp([_rescale(g, scale)])[node.act]
    out = dot_operand_grad(_like(g, sw.tape.values[node.outs[0]]), vals[1 - x], vals[x],
                           params["dimension_numbers"], x, params.get("precision"))
    return (out * scale).astype(dtype_of(vals[x]))

def fit_current(sw: Sweep, g: Any, incoming: Any) -> tuple[Any, Any]:
    """Per-tensor current scaling where no decision fitted ``incoming`` to the fp8 format
    (:func:`adaloss.solver.fp8_fit_scale`): ``g`` rescaled and the scale it then carries."""
    fit = solver.fp8_fit_scale(sw.config, _absmax(g), incoming, jnp,
                               sw.backoff)
    r = sw.book.settle(fit.scale)
    g, incoming = _rescale(g, r), sw.book.settle(incoming * r)
    sw.book.fit(incoming)
    return g, incoming

def quantize(sw: Sweep, g: Any, behind: frozenset[str]) -> tuple[Any, Any, Any, Any]:
    """``g`` cast to the fp8 format once (:func:`adaloss.solver.to_fp8`): the fp8 values, the
    same in ``g``'s dtype (exactly), their ``max|q|`` statistics and the cast's fractions
    (``None`` unless reported); the decisions ``behind`` the scale hear the fractions'
    signal (:func:`adaloss.solver.fp8_signal`). The fp8 tensor passes an optimization
    barrier: XLA:GPU, allowed excess precision, folds a cast to fp8 and back to 16 bits
    away (the GEMMs and statistics would read the unquantized values); XLA:CPU removes the
    barrier, and keeps the cast anyway."""
    cfg = sw.config
    q = jax.lax.optimization_barrier(solver.to_fp8(g, sw.tape.grad_dtype, cfg.overflow_limit, jnp))
    gq = q.astype(jnp.result_type(g))  # exact: every fp8 value is a 16-bit one
    fractions = None
    counted = sw.reporting or (cfg.underflow_feedback and behind)
    if reductions.fused():  # one pass over q (and E[q²] for the decision), one over g
        qs = reductions.statistics(gq, sq_mean=True, below=cfg.underflow_limit)
        q_ext = qs.magnitude()
        if counted:
            gs = reductions.statistics(g, absmax=False, nonzero=True, above=cfg.overflow_limit)
            f32 = [jnp.asarray(c, _F32) for c in (gs.nonzero, qs.nonzero, qs.below, gs.above)]
            held = f32[2] - (qs.size - f32[1])
            fractions = solver.fractions_of_counts(f32[0], f32[1], held, f32[3], jnp)
    else:
        q_ext = solver.magnitude_stats(gq, jnp, moments=False)
        if counted:
            fractions = solver.quantized_fractions(g, q, cfg, jnp)
    if cfg.underflow_feedback and behind:
        signal = solver.fp8_signal(cfg, *fractions, solver.absmax(q_ext, jnp), jax.scipy.special.erfinv,
                                   jnp)
        sw.feedback.hear(behind, signal)
    return q, gq, q_ext, fractions

def layer_fp8(sw: Sweep, node: Node, g: Any, incoming: Any) -> None:
    """The cotangent quantized to fp8 once, and the scale of the output decided before the
    GEMM computes it. A layer (or first layer) with an fp8 ``grad_format``: ``g`` (carrying
    ``incoming``) quantized once, saturating (:func:`quantize`); both GEMMs read it; the
    decision (:func:`adaloss.solver.fp8_layer_scale`) sets the scale of the output it sends on."""
    cfg = sw.config
    current = cfg.fp8_rule == "current" or not sw.book.is_fitted(incoming)
    if current:  # no decision fitted this scale to the format
        g, incoming = fit_current(sw, g, incoming)
    behind = sw.book.decided_by(incoming)
    q, gq, q_ext, fractions = quantize(sw, g, behind)
    if node.wgt >= 0:
        sw.cts[node.ins[node.diff[node.wgt]]].append((weight_grad(sw, node, gq, q), incoming))
    if node.kind == "first":
        if sw.reporting:
            one = jnp.ones((), _F32)
            d = solver.LayerScale(one, one, jnp.zeros((), _F32), one)
            report(sw, node, d, None, incoming, incoming, solver.absmax(q_ext, jnp), None, fractions,
                         current)
        return
    weight = node.weight
    checked(sw, node.name, solver.absmax(q_ext, jnp))

    modelled = cfg.fp8_rule != "current" and cfg.layer_rule
    ws = reductions.statistics(weight, sq_mean=modelled).magnitude()

    # "current": the next cast fits its own tensor; no layer_rule: one global scale, the loss
    # cotangent's (the cast-only ablation); the caps still hold (decisions.fp8_layer)
    s_model = sigma = None
    if modelled:
        gs = q_ext if q_ext.sq_mean is not None else solver.magnitude_stats(gq, jnp)
        sigma = solver.output_sigma(gs, ws, node.fan_in, jnp,
                                    solver.worst_row_sq_mean(gq, node.feature_axes, jnp))
        s_model = solver.fp8_model_scale(cfg, sigma, jnp, sw.backoff, sw.lift_of(node.name))
    carrier_max = float(jnp.finfo(jnp.result_type(g)).max)
    dec = decisions.fp8_layer(cfg, node.fan_in, carrier_max, jnp, q_ext, ws, None, incoming, sw.backoff,
                              None, s_model, sigma, None, sw.feedback.flags(behind))
    scale, outgoing = sw.book.settle((dec.d.scale, dec.outgoing))
    d = dec.d._replace(scale=scale)
    sw.book.decided(outgoing, frozenset({node.name}))
    sw.book.fit(outgoing)
    sw.feedback.decided(node.name, dec.limited)
    act_ct = input_grad(sw, node, gq, d.scale, q)
    sw.cts[node.ins[node.diff[node.act]]].append((act_ct, outgoing))
    if sw.reporting:
        report(sw, node, d, None, incoming, outgoing, dec.absmax, dec.held, fractions, current)

def weight_grad(sw: Sweep, node: Node, g: Any, q: Any = None) -> Any:
    """The layer's weight cotangent (carrying the incoming scale); in fp32 for a 16-bit
    weight: a ``dot_general`` accumulates in fp32, a convolution runs widened. With fp8
    operands (``node.fp8_operands``) and ``q``, ``g`` in fp8, an FP8 GEMM of ``q`` and the
    other operand's fp8 values, divided by that operand's scale."""
    if q is not None and node.fp8_operands is not None:
        _, params, vals = node.eqn
        w = node.diff[node.wgt]
        (qa, sa), (qw, _) = node.fp8_operands[1 - w], node.fp8_operands[w]
        out = dot_operand_grad(q, qa, qw, params["dimension_numbers"], w, params.get("precision"))
        out = out / sa
        return out if node.wgt in node.wide else out.astype(dtype_of(vals[w]))
    if node.wgt not in node.wide:
        return node.vjp([g])[node.wgt]
    prim, params, vals = node.eqn
    w = node.diff[node.wgt]
    x = 1 - w  # the other operand (the group sizes of a ragged dot come third)
    if prim.name == "dot_general":
        return dot_operand_grad(g, vals[x], vals[w], params["dimension_numbers"], w,
                                params.get("precision"))
    return wide_vjp(prim, params, vals, (w,))([g])[0]

def cast(sw: Sweep, node: Node, g: Any, incoming: Any) -> None:
    """The cotangent narrowed at a scale decided from its log-statistics
    (:func:`adaloss.decisions.cast_of_logs`); none where it holds widened 16-bit values
    only, the fp8 format's fit where the gradient format is fp8."""
    cfg = sw.config
    if sw.exact_dtype(g) == jnp.dtype(jnp.result_type(node.eqn[2][0])):
        # every entry is a value of the cast's 16-bit dtype (``_Sweep.exact_dtype``): narrowing
        # it loses nothing, and the cotangent keeps the scale it carries
        (ct,) = node.vjp([g])
        sw.cts[node.ins[0]].append((ct, incoming))
        return
    if cfg.fp8:  # it reads its tensor anyway: per-tensor current scaling, no entry saturates
        m = jnp.max(jnp.abs(g)).astype(_F32)
        d = solver.fp8_fit_scale(cfg, m, incoming, jnp, sw.backoff)
        scale, outgoing = sw.book.settle((d.scale, incoming * d.scale))
        d = d._replace(scale=scale)
        (ct,) = node.vjp([_rescale(g, d.scale)])
        sw.cts[node.ins[0]].append((ct, outgoing))
        sw.book.fit(outgoing)
        if sw.reporting:
            report(sw, node, d, None, incoming, outgoing, m)
        return

    st = reductions.statistics(g, logs=True)

    s_model = solver.cast_model_scale(cfg, st.logs, jnp, sw.backoff)
    ls = st.logs._replace(absmax=st.absmax)  # the cap: current max|g|
    dec = decisions.cast_of_logs(cfg, jnp, ls, incoming, sw.backoff, s_model)
    scale, outgoing = sw.book.settle((dec.d.scale, dec.outgoing))
    d = dec.d._replace(scale=scale)
    (ct,) = node.vjp([_rescale(g, d.scale)])
    sw.cts[node.ins[0]].append((ct, outgoing))
    if sw.reporting:
        report(sw, node, d, ls, incoming, outgoing, ls.absmax)

def report(sw: Sweep, node: Node, d: solver.LayerScale, spread: Any, incoming: Any, outgoing: Any,
            absmax: Any, held: Any = None, fractions: Any = None, current: Any = None) -> None:
    """The node's :func:`adaloss.report.decision_report` (``held`` None: no decision behind)."""
    sw.layers[node.name] = decision_report(
        sw.config, node.kind, d, spread, incoming, outgoing, absmax, node.fan_in,
        False if held is None else held, fractions, current, jax.scipy.special.erf, jnp)

def checked(sw: Sweep, decision: str, g_absmax: Any) -> None:
    """Record that the sweep reached ``decision`` with a cotangent whose ``max|g|`` is this."""
    sw.health.append((weight_of(decision), len(sw.health), jnp.isfinite(g_absmax)))

#: per decision node's kind, the sweep's rule with a 16-bit and with an fp8 ``grad_format``
SWEEP: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    "layer": (layer, layer_fp8),
    "first": (layer_fp8, layer_fp8),  # fp8 only: its weight gradient's cast
    "cast": (cast, cast),
}
