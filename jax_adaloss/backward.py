"""The reverse sweep of the scale-propagating backward over unmodified JAX functions.

The forward pass (:mod:`jax_adaloss.trace`) re-binds each equation of the traced function
with its ``jax.vjp`` and classifies it; the sweep here runs the vjps in reverse, carrying with
each cotangent the scale it holds, and at each decision node applies the rule of
:data:`jax_adaloss.layers.SWEEP` (the decisions themselves: :mod:`adaloss.decisions`), and at
each region the rule of :data:`jax_adaloss.regions.REGIONS`:

- a layer ``y = x·W`` with incoming cotangent ``g`` (scale ``P``) sends ``vjp_x(s·g)``
  (scale ``P·s``) to ``x`` and ``vjp_W(g)`` (scale ``P``) to ``W`` (:func:`jax_adaloss.layers.layer`);
- a narrowing cast of the cotangent gets its scale from the log-normal model before
  narrowing, unless every entry is already a value of the narrow format
  (:func:`jax_adaloss.layers.cast`);
- every other equation is linear in its cotangent and passes the scale through; a
  multiplication by a scalar that can amplify a 16-bit cotangent lowers it first
  (:func:`adaloss.solver.amplified_scale`);
- a ``scan`` with layers inside is swept per iteration by a reverse ``scan`` that re-runs the
  body (:class:`~jax_adaloss.trace.ScanRegion`); a ``jax.checkpoint`` region is re-run in the
  backward (rematerialised) and swept like inline code;
- every decided scale and every merged 16-bit cotangent is materialised
  (:mod:`jax_adaloss.cotangents`), so that XLA does not recompute the chain of decisions above
  each point: the compiled backward grows linearly with depth;
- contributions to one value that carry different scales (residual stream, q/k/v fan-out,
  tied weights) are merged (:func:`adaloss.decisions.merge`);
- with ``config.underflow_feedback`` each layer counts the fraction of its incoming
  cotangent below u_min and reports it to the layer decisions that set the scale it carries
  (through merges, :class:`adaloss.feedback.Feedback`); the optax state's per-weight lift
  answers on the next step;
- with an fp8 ``config.grad_format`` every layer (and every first layer, whose input needs no
  gradient) quantizes its incoming cotangent to the format once, saturating, at the scale it
  carries, and both backward GEMMs read that tensor (converted back, times the layer's scale,
  then the dot: the pattern XLA's GPU rewriter makes FP8 GEMMs of); the layer's decision sets
  its output's scale for the next layer's cast from statistics it has before the dgrad GEMM
  runs. Only a cast no decision fitted (the first after the loss, one after a
  normalization's 16-bit backward) reads its tensor's ``max|g|`` first (per-tensor current
  scaling); a merge fits the sum of its branches from their maxima.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from adaloss import decisions, solver
from adaloss.config import AdaLossConfig
from adaloss.feedback import Feedback
from adaloss.report import AdaLossCoverageWarning, weight_of
from jax_adaloss.cotangents import (
    ScaleBook,
    _absmax,
    _absmaxes,
    _like,
    _materialized,
    _settled,
    _stored,
    _sum,
    _zero_ct,
)
from jax_adaloss.layers import SWEEP
from jax_adaloss.regions import REGIONS
from jax_adaloss.report import BackwardReport, CastSites, LayerReport
from jax_adaloss.scaled_grad import NO_LAYER, encode_trace
from jax_adaloss.scaled_grad import rescale as _rescale
from jax_adaloss.trace import EXACT_MOVES, Node, Tape, chains
from jax_adaloss.weight_grads import dtype_of, is_float, wide_vjp

#: the backwards that are not adaloss's, for measurements (:func:`scaled_backward`): one global
#: loss scale (``config.init_scale``), no decision; and the same computed in fp32
Reference = Literal["global", "fp32"]
REFERENCES = get_args(Reference)

_F32 = jnp.float32


class _Wide(NamedTuple):
    """A cotangent inside a chain of elementwise 16-bit math (:meth:`_Sweep._elementwise`): as
    the 16-bit backward computes it, and the same in fp32."""

    narrow: Any
    wide: Any


def _narrow_part(ct: Any) -> Any:
    return ct.narrow if isinstance(ct, _Wide) else ct



class _Sweep:
    """Reverse sweep over a ``Tape``: cotangents with the scales they carry.

    Elementwise 16-bit math (an activation's ``x·Φ(x)``, GELU's ``x³`` and ``tanh``) is
    differentiated one equation at a time, and its 16-bit intermediates can overflow where the
    result would not: GELU's ``3x²`` beyond ``|x| ≈ 148`` makes ``0·inf = NaN`` at any loss scale,
    ``g·x`` overflows for a large ``x`` while ``g·Φ'(x)·x`` is small. PyTorch computes such ops
    in fp32 inside one kernel. Here each chain of elementwise equations whose values have no
    other use, holding a nonlinear one (:func:`_chains`), is differentiated twice, in 16 bits
    (as ``jax.grad``) and in fp32, and where the chain hands its cotangent on the 16-bit one is
    kept wherever it is finite, the fp32 one (rounded) elsewhere: bitwise ``jax.grad``'s
    arithmetic on finite values, PyTorch's where 16 bits overflow. On a GPU both run in the
    chain's one fused kernel.
    """

    def __init__(self, tape: Tape, config: AdaLossConfig, capture: bool = False,
                 reference: Reference | None = None, backoff: Any = None, lift: Any = None,
                 reporting: bool = True) -> None:
        self.tape, self.config = tape, config
        # a reference backward (measurements) makes no decision: no rule for decision nodes
        adaptive = reference is None
        self.rules = SWEEP if adaptive else {}
        self.fp32 = reference == "fp32"
        # per-layer reports (predicted underflow, held flags...): traced only when asked for
        self.reporting = reporting
        self.backoff = backoff  # 2^-h (fp32) from the back-off state, or None
        self.lift = lift or {}  # weight name -> 2^k (fp32) from the lift state
        self.book = ScaleBook()  # who decided each scale, whether it was fitted, its inverse
        self.feedback = Feedback()  # what each layer decision heard, and scans' ratios per weight
        self.unlifted: list[str] = []  # layer decisions whose weight the lift state lacks
        # layer decisions in the order the sweep reaches them: (weight, position, whether the
        # incoming cotangent was finite), for the trace of a skipped step (traces)
        self.health: list[tuple[str, int, Any]] = []
        self.capture, self.adaptive = capture, adaptive
        self.captured: dict[str, Any] = {}
        self.captured_scales: dict[str, Any] = {}
        self.cts: dict[int, list[tuple[Any, Any]]] = defaultdict(list)
        self.layers: dict[str, LayerReport] = {}
        # id(cotangent) -> (cotangent, a 16-bit dtype): a wider cotangent all of whose entries are
        # values of that dtype (:meth:`exact_dtype`)
        self.exact: dict[int, tuple[Any, Any]] = {}
        # chains of elementwise 16-bit math with a nonlinear op (_chains): their equations, and
        # the slots inside them (computed by one of them and used by one: a fan-out merges its
        # parts in 16 bits); none in a reference backward (measurements)
        self.dual: set[int] = set()  # id(node)
        self.chained: set[int] = set()
        if adaptive:
            self.dual, self.chained = chains(tape)

    def exact_dtype(self, ct: Any) -> Any:
        """The 16-bit float dtype all of ``ct``'s entries are values of, or ``None``: its own, or,
        for a wider cotangent, the one it was widened from (through :data:`EXACT_MOVES`).

        ``jnp.sum`` of a 16-bit array widens it to fp32, sums and narrows the result back
        (``jax.nn.softmax``'s denominator, a mean, a LayerNorm's moments); in the backward the
        16-bit cotangent is widened, broadcast, and reaches the forward's widening cast, whose
        narrowing is then exact: no entry underflows or overflows, and no decision is needed."""
        dtype = jnp.dtype(jnp.result_type(ct))
        if is_float(dtype) and dtype.itemsize <= 2:
            return dtype
        got = self.exact.get(id(ct))
        return got[1] if got is not None and got[0] is ct else None

    def _mark_exact(self, node: Node, out_cts: list[Any], cts: Sequence[Any]) -> None:
        """Record the input cotangent of a move or cast (:data:`EXACT_MOVES`) as exact in the
        16-bit dtype its output cotangent is exact in."""
        prim, _, vals = node.eqn
        if prim.name not in EXACT_MOVES or len(node.diff) != 1 or len(out_cts) != 1:
            return
        dtype = self.exact_dtype(out_cts[0])
        ct = cts[0]
        into = jnp.dtype(jnp.result_type(ct)) if is_float(jnp.result_type(ct)) else None
        if dtype is None or into is None or (into != dtype and into.itemsize < 4):
            return
        if prim.name == "broadcast_in_dim" and np.size(vals[0]) != np.size(self.tape.values[node.outs[0]]):
            return  # its transpose sums several entries
        if into.itemsize > 2:
            self.exact[id(ct)] = (ct, dtype)

    # -- merging ----------------------------------------------------------------
    def u_max(self, dtype: Any) -> Any:
        """:func:`adaloss.decisions.overflow_limit` of ``dtype``, backed off."""
        dtype = jnp.dtype(dtype)
        return decisions.overflow_limit(self.config, dtype.itemsize, float(jnp.finfo(dtype).max),
                                        self.backoff)

    def merge(self, parts: list[tuple[Any, Any]]) -> tuple[Any, Any]:
        """Sum contributions, bringing different scales to one (method.md step 5)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0][1]
        if all(p[1] is first for p in parts):
            return _sum([p[0] for p in parts]), first
        dtype = jnp.result_type(*[p[0] for p in parts])
        scales = [p[1] for p in parts]
        if not self.config.fp8 and all(jnp.dtype(jnp.result_type(p[0])).itemsize > 2 for p in parts):
            target = self.book.settle(decisions.wide_merge([jnp.asarray(s, _F32) for s in scales], jnp))
        else:
            absmax = _absmaxes([p[0] for p in parts])  # one kernel for all on a GPU
            target, _ = decisions.merge(self.config, self.u_max(dtype), False, jnp, scales, absmax,
                                        self.backoff)
            target = self.book.settle(target)
        self.book.decided(target, frozenset().union(*(self.book.decided_by(s) for _, s in parts)))
        self.book.fit(target)
        return _stored(_sum([_rescale(ct, target / s) for ct, s in parts])), target

    def lift_of(self, decision: str) -> Any:
        """``2^k`` of the decision's weight (``argN/…`` names match unprefixed state leaves)."""
        w = weight_of(decision)
        got = self.lift.get(w)
        if got is None and w.startswith("arg") and "/" in w:
            got = self.lift.get(w.split("/", 1)[1])
        if got is None and self.lift:
            self.unlifted.append(w)
        return got

    def take(self, slot: int) -> tuple[Any, Any] | None:
        parts = self.cts.pop(slot, None)
        return self.merge(parts) if parts else None

    # -- the sweep --------------------------------------------------------------
    def run(self, seeds: Sequence[tuple[int, Any, Any]], fitted: Sequence[bool] = ()) -> None:
        """Sweep back from ``(slot, cotangent, scale)`` seeds; ``fitted[i]``: seed ``i``'s
        scale was fitted to the fp8 range by a decision (a scan's carry: the outer one's)."""
        for i, (slot, seed, seed_scale) in enumerate(seeds):
            self.chained.discard(slot)  # (a seed is one more part)
            self.cts[slot].append((seed, seed_scale))
            self.book.fit(seed_scale, i < len(fitted) and fitted[i])
        self.sweep_nodes(self.tape.nodes)

    def sweep_nodes(self, nodes: list[Node]) -> None:
        for node in reversed(nodes):
            got = [self.take(s) for s in node.outs]
            present = [g for g in got if g is not None]
            if not present:
                continue
            region = REGIONS.get(node.kind)
            if region is not None:  # each output keeps its scale
                region(self, node, got)
                continue
            if len(present) > 1:
                _, scale = self.merge(present)  # common scale for a multi-output op
                got = [None if g is None else (_rescale(g[0], scale / g[1]) if g[1] is not scale
                                               else g[0], scale) for g in got]
            else:
                scale = present[0][1]
            out_cts = [g[0] if g is not None else _zero_ct(self.tape.values[s])
                       for g, s in zip(got, node.outs)]
            if node.kind != "op" and self.capture:
                self.captured[node.name] = out_cts[0]
                self.captured_scales[node.name] = scale
            rule = self.rules.get(node.kind)
            if rule is not None:
                rule[self.config.fp8](self, node, out_cts[0], scale)
            else:
                if node.axes:
                    out_cts, scale = self._agree(out_cts, scale, node.axes)
                if node.factor is not None and self.adaptive:
                    out_cts, scale = self._amplified(out_cts, scale, node.factor)
                if node.norm and self.config.fp8 and self.adaptive:
                    scale = self.book.unfitted(scale)
                chain = id(node) in self.dual
                cts = self._elementwise(node, out_cts) if chain else self._transpose(node, out_cts)
                if not chain and node.factor is None and not node.axes:
                    self._mark_exact(node, out_cts, cts)
                for pos, ct in zip(node.diff, cts):
                    self.cts[node.ins[pos]].append((ct, scale))

    def _agree(self, cts: list[Any], scale: Any, axes: tuple[Any, ...]) -> tuple[list[Any], Any]:
        """:func:`agree_across`, the common scale decided by whoever decided ``scale``."""
        floats = [c for c in cts if is_float(jnp.result_type(c))]
        cts, target = agree_across(cts, scale, axes, self.u_max(jnp.result_type(*floats)))
        self.book.decided(target, self.book.decided_by(scale))
        self.book.fit(target, self.book.is_fitted(scale))
        return cts, target

    def _amplified(self, cts: list[Any], scale: Any, factor: Any) -> tuple[list[Any], Any]:
        """:func:`adaloss.solver.amplified_scale` before a scalar factor's transpose: the
        cotangent (and its scale) lowered by the power of two that keeps ``factor·s·g`` finite."""
        g = cts[0]
        r = solver.amplified_scale(self.config, _absmax(_narrow_part(g)), factor, jnp, self.backoff)
        target = self.book.settle(scale * r)
        self.book.decided(target, self.book.decided_by(scale))
        self.book.fit(target, self.book.is_fitted(scale))
        if isinstance(g, _Wide):
            return [_Wide(_rescale(g.narrow, r), g.wide * r)], target
        return [_rescale(g, r)], target

    def _elementwise(self, node: Node, out_cts: list[Any]) -> list[Any]:
        """An elementwise 16-bit equation's input cotangents, in 16 bits and in fp32 (see the
        class docstring): a pair into the chain, the 16-bit one where finite out of it."""
        narrow = self._transpose(node, [_narrow_part(c) for c in out_cts])
        wide = wide_vjp(*node.eqn, node.diff)([c.wide if isinstance(c, _Wide) else c for c in out_cts])
        out = []
        for pos, n, w in zip(node.diff, narrow, wide):
            if node.ins[pos] in self.chained:
                out.append(_Wide(n, w))
            else:
                out.append(jnp.where(jnp.isfinite(n), n, w.astype(dtype_of(n))))
        return out

    def _transpose(self, node: Node, out_cts: list[Any]) -> Sequence[Any]:
        """The node's input cotangents; those going to a weight in (at least) fp32
        (:mod:`jax_adaloss.weight_grads`), the others in their primal's dtype."""
        if self.fp32 and node.widenable:
            return wide_vjp(*node.eqn, node.diff)(out_cts)
        narrow = [_like(c, self.tape.values[s]) for c, s in zip(out_cts, node.outs)]
        if not node.wide:
            dense = _take_along_transpose(node, narrow) if node.eqn[0].name == "gather" else None
            return node.vjp(narrow) if dense is None else dense
        wide = wide_vjp(*node.eqn, node.diff)(out_cts)
        if len(node.wide) == len(node.diff):
            return wide
        cts = list(node.vjp(narrow))
        for k in node.wide:
            cts[k] = wide[k]
        return cts

    def traces(self, loss: Any) -> dict[str, Any]:
        """Per weight, :func:`~jax_adaloss.scaled_grad.encode_trace` of its layer decisions: the
        position of the first whose incoming cotangent was not finite (else of its first), whether
        it was finite, and whether ``loss`` is (one kernel per 16 weights on a GPU)."""
        uses: dict[str, list[tuple[int, Any]]] = defaultdict(list)
        for w, position, ok in self.health:
            uses[w].append((position, ok))
        loss_ok = jnp.isfinite(loss)
        out = {}
        for w, found in uses.items():
            bad = functools.reduce(jnp.minimum, [jnp.where(ok, NO_LAYER, p) for p, ok in found])
            first = min(p for p, _ in found)
            out[w] = encode_trace(jnp.where(bad < NO_LAYER, bad, first), bad >= NO_LAYER, loss_ok)
        return _materialized(out)

    def underflow_signals(self) -> dict[str, Any]:
        """Per weight: :func:`adaloss.solver.underflow_ratio` of its layer decisions (the
        largest over a weight's uses), for the lift of :func:`jax_adaloss.adaloss`."""
        weights, fractions, limited, ratios = self.feedback.signal_arguments(weight_of)
        values = decisions.signals(self.config, weights, jnp, fractions, limited, ratios,
                                   self.feedback.branches)
        return _materialized(dict(zip(self.feedback.weights(weight_of), values)))

    def report(self) -> BackwardReport:
        sites = CastSites(tuple((n.name, n.what) for n in self.tape.nodes if n.kind == "cast" and n.what))
        return BackwardReport(self.layers, self.captured, self.captured_scales, self.tape.coverage(), sites)


#: per decision node's kind, the sweep's rule with a 16-bit and with an fp8 ``grad_format``


def _take_along_transpose(node: Node, cts: list[Any]) -> list[Any] | None:
    """The operand's cotangent of a ``gather`` that takes one entry per row along one axis
    (``jnp.take_along_axis`` with one index per row: a cross-entropy's label logit), as a dense
    select, ``where(iota == index, g, 0)``, instead of the transpose's scatter-add into zeros;
    ``None`` for any other gather. The same values (an index out of range matches no entry, as
    ``FILL_OR_DROP`` drops it), but elementwise: XLA fuses it with the rest of the cotangent's
    math, and a decision's statistics of the sum into the kernel that writes it (no reduction
    fuses into a scatter)."""
    _, params, vals = node.eqn
    if node.diff != (0,) or len(vals) != 2:
        return None
    dn, operand, indices = params["dimension_numbers"], vals[0], vals[1]
    shape, rank = np.shape(operand), np.ndim(operand)
    if dn.offset_dims or len(dn.collapsed_slice_dims) != 1 or dn.start_index_map != dn.collapsed_slice_dims:
        return None
    (k,) = dn.collapsed_slice_dims
    batch = tuple(d for d in range(rank) if d != k)
    modes = (jax.lax.GatherScatterMode.FILL_OR_DROP, jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    if (tuple(dn.operand_batching_dims) != batch
            or tuple(dn.start_indices_batching_dims) != tuple(range(rank - 1))
            or any(n != 1 for n in params["slice_sizes"]) or params.get("mode") not in modes):
        return None
    rows = tuple(shape[d] for d in batch)
    extra = np.shape(indices)[rank - 1:]
    if (extra not in ((1,), (1, 1)) or np.shape(indices)[:rank - 1] != rows
            or np.shape(cts[0]) != rows + extra[:-1]):
        return None
    index = jnp.expand_dims(jnp.reshape(indices, rows), k)
    g = jnp.expand_dims(jnp.reshape(cts[0], rows), k)
    hit = jax.lax.broadcasted_iota(jnp.result_type(index), shape, k) == index
    return [jnp.where(hit, g, jnp.zeros((), jnp.result_type(g)))]


def agree_across(cts: list[Any], scale: Any, axes: tuple[Any, ...], u_max: float) -> tuple[list[Any], Any]:
    """Before a collective's transpose (``pvary`` -> ``psum`` under ``shard_map``, ``ppermute``,
    ``all_gather``...) moves cotangents between devices, which may have chosen different
    scales: bring them to one scale on every device of ``axes``, the smallest, lowered to a
    power of two at which even their sum over the devices stays below ``u_max``. One
    all-reduce (a ``pmin`` of two scalars)."""
    s = jnp.asarray(scale, _F32)
    floats = [c for c in cts if is_float(jnp.result_type(c))]
    m = jnp.max(jnp.stack([jnp.max(jnp.abs(c)).astype(_F32) for c in floats])) / s
    common, neg_m = jax.lax.pmin(jnp.stack([s, -m]), axes)
    total = -neg_m * jax.lax.psum(1, axes)  # |a sum over the devices| <= target · total
    # u_max may be traced (times the back-off factor); the quotient saturates at fp32's max
    quotient = jnp.asarray(u_max, _F32) / jnp.maximum(total, jnp.float32(2.0**-126))
    cap = solver.pow2_floor(jnp.minimum(quotient, jnp.float32(solver.F32_MAX)), jnp)
    target = _settled(jnp.where(total > 0, jnp.minimum(common, cap), common))
    return [_rescale(c, target / s) if is_float(jnp.result_type(c)) else c for c in cts], target



def scaled_backward(jaxpr: jcore.ClosedJaxpr, flat_args: Sequence[Any], diff: Sequence[bool],
                    origins: Sequence[str | None], config: AdaLossConfig, capture: bool = False,
                    reference: Reference | None = None, backoff: Any = None,
                    lift: dict[str, Any] | None = None, report: bool = True
                    ) -> tuple[list[Any], list[tuple[Any, Any] | None], BackwardReport, dict[str, Any],
                               list[Any], dict[str, Any]]:
    """Run ``jaxpr`` forward and the scale-propagating backward from its first output.

    ``diff[i]``: flat argument ``i`` is differentiated; ``origins[i]``: its weight name
    (``None``: data, differentiated or not). The jaxpr's constants (arrays the function
    closed over: an outer ``jit``'s batch) are data. ``capture`` keeps each layer's
    incoming cotangent in the report; a ``reference`` (:data:`REFERENCES`) applies no per-layer
    scale (one global scale: ``init_scale``); ``"fp32"`` computes every cotangent in fp32 too
    (the 16-bit forward's exact gradient, a reference for measurements). ``backoff``
    (``2^-h``, fp32, or None) lowers every decision's target range; ``lift`` (weight name ->
    ``2^k``) raises the statistical scale of that weight's layer decisions. ``report=False``
    leaves the per-layer reports out (the caller discards them: less to trace and compile;
    the report's ``layers`` are then empty). Returns the
    outputs, ``(cotangent, scale)`` (or ``None``: not differentiated, or unused) per flat
    argument, the report, and per weight the underflow ratio its decisions left
    (:meth:`_Sweep.underflow_signals`; empty without ``config.underflow_feedback``), and per
    flat argument ``1 / scale`` of its gradient where the backward computed it with the scale
    (else ``None``), and per weight the trace a skipped step keeps (:meth:`_Sweep.traces`).
    """
    adaptive = reference is None
    tape = Tape(config, regions=adaptive)
    in_slots = [tape.slot(a, o, d) for a, d, o in zip(flat_args, diff, origins)]
    consts = [tape.slot(c, None, False) for c in jaxpr.consts]
    out_slots = tape.run(jaxpr.jaxpr, consts, in_slots)
    if adaptive:
        names = sorted({o.split("/")[0] for o in origins if o is not None})
        tape.warn_coverage(f"weight leaves under {', '.join(names)}" if names else "no weight leaves")
    outs = [tape.values[s] for s in out_slots]
    sweep = _Sweep(tape, config, capture, reference, backoff=backoff, lift=lift, reporting=report)
    loss = outs[0]
    seed_scale = jnp.asarray(config.init_scale, _F32)
    seed = (jnp.ones_like(loss) * seed_scale).astype(jnp.result_type(loss))
    sweep.run([(out_slots[0], seed, seed_scale)])
    if sweep.unlifted and config.underflow_feedback:
        warnings.warn(f"adaptive loss scaling: the adaloss state holds no lift for "
                      f"{sorted(set(sweep.unlifted))}: it was initialised with another tree than the "
                      "differentiated weights (pass those to tx.init); their underflow feedback is off.",
                      AdaLossCoverageWarning, stacklevel=3)
    grads = [sweep.take(s) if d else None for s, d in zip(in_slots, diff)]
    inverses = [None if g is None else sweep.book.inverse_of(g[1]) for g in grads]
    return outs, grads, sweep.report(), sweep.underflow_signals(), inverses, sweep.traces(loss)
