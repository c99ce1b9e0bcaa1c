"""The reverse sweep of the scale-propagating backward over unmodified JAX functions.

The forward pass (:mod:`jax_adaloss.trace`) re-binds each equation of the traced function
with its ``jax.vjp`` and classifies it; the sweep here runs the vjps in reverse, carrying with
each cotangent the scale it holds, and at each decision node applies the rule of
:data:`SWEEP` (the decisions themselves: :mod:`adaloss.decisions`):

- a layer ``y = x·W`` with incoming cotangent ``g`` (scale ``P``) sends ``vjp_x(s·g)``
  (scale ``P·s``) to ``x`` and ``vjp_W(g)`` (scale ``P``) to ``W``;
- a narrowing cast of the cotangent gets its scale from the log-normal model before
  narrowing, unless every entry is already a value of the narrow format;
- every other equation is linear in its cotangent and passes the scale through; a
  multiplication by a scalar that can amplify a 16-bit cotangent lowers it first
  (:func:`adaloss.solver.amplified_scale`);
- a ``scan`` with layers inside is swept per iteration by a reverse ``scan`` that re-runs the
  body (:class:`~jax_adaloss.trace.ScanRegion`); a ``jax.checkpoint`` region is re-run in the
  backward (rematerialised) and swept like inline code;
- every decided scale and every merged 16-bit cotangent is materialised (:func:`_settled`,
  :func:`_stored`), so that XLA does not recompute the chain of decisions above each point:
  the compiled backward grows linearly with depth;
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
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from adaloss import decisions, solver
from adaloss.config import AdaLossConfig
from adaloss.feedback import Feedback
from adaloss.report import AdaLossCoverageWarning, decision_report, weight_of
from jax_adaloss import reductions
from jax_adaloss.fp8_gemm import gemm_out
from jax_adaloss.report import BackwardReport, LayerReport, ScaleCache
from jax_adaloss.scaled_grad import NO_LAYER, encode_trace
from jax_adaloss.scaled_grad import rescale as _rescale
from jax_adaloss.trace import CONST, EXACT_MOVES, NONLINEAR, Node, Tape, body_slots
from jax_adaloss.weight_grads import (
    dot_operand_grad,
    dtype_of,
    is_float,
    wide_vjp,
)

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

    def __init__(self, tape: Tape, config: AdaLossConfig, cache: ScaleCache | None,
                 capture: bool = False, reference: Reference | None = None,
                 backoff: Any = None, lift: Any = None, reporting: bool = True) -> None:
        self.tape, self.config = tape, config
        # a reference backward (measurements) makes no decision: no rule for decision nodes
        adaptive = reference is None
        self.rules = SWEEP if adaptive else {}
        self.fp32 = reference == "fp32"
        # per-layer reports (predicted underflow, held flags...): traced only when asked for
        self.reporting = reporting
        self.backoff = backoff  # 2^-h (fp32) from the back-off state, or None
        self.lift = lift or {}  # weight name -> 2^k (fp32) from the lift state
        # id(scale) -> (scale, the layer decisions that set it): a decision's scale passes
        # through ops unchanged (the same object) and is merged into new ones
        self.deciders: dict[int, tuple[Any, frozenset[str]]] = {}
        self.feedback = Feedback()  # what each layer decision heard, and scans' ratios per weight
        self.unlifted: list[str] = []  # layer decisions whose weight the lift state lacks
        # layer decisions in the order the sweep reaches them: (weight, position, whether the
        # incoming cotangent was finite), for the trace of a skipped step (traces)
        self.health: list[tuple[str, int, Any]] = []
        self.capture, self.adaptive = capture, adaptive
        self.captured: dict[str, Any] = {}
        self.captured_scales: dict[str, Any] = {}
        self.cts: dict[int, list[tuple[Any, Any]]] = defaultdict(list)
        # fp8: id(scale) -> scale, for scales a decision fitted to the format's range (layers,
        # casts, merges); a cotangent carrying another (the loss seed's) is fitted at its cast
        self.fitted: dict[int, Any] = {}
        self.layers: dict[str, LayerReport] = {}
        self.model_scales: dict[str, Any] = {}
        self.spreads: dict[str, Any] = {}
        self.cache = cache
        self.inverses: dict[int, tuple[Any, Any]] = {}  # id(scale) -> (scale, 1 / scale)
        # id(cotangent) -> (cotangent, a 16-bit dtype): a wider cotangent all of whose entries are
        # values of that dtype (:meth:`_exact_dtype`)
        self.exact: dict[int, tuple[Any, Any]] = {}
        step = cache.step if cache is not None else jnp.zeros((), jnp.int32)
        self.recompute = (step % config.update_every) == 0
        self.step = step
        # chains of elementwise 16-bit math with a nonlinear op (_chains): their equations, and
        # the slots inside them (computed by one of them and used by one: a fan-out merges its
        # parts in 16 bits); none in a reference backward (measurements)
        self.dual: set[int] = set()  # id(node)
        self.chained: set[int] = set()
        if adaptive:
            self.dual, self.chained = _chains(tape)

    def _settle(self, x: Any) -> Any:
        """:func:`_settled`, the inverses of the scales recorded (:meth:`inverse_of`)."""
        return _settled(x, self.inverses)

    def inverse_of(self, scale: Any) -> Any:
        """``1 / scale`` as the reduction that settled ``scale`` computed it, or ``None``."""
        got = self.inverses.get(id(scale))
        return got[1] if got is not None and got[0] is scale else None

    def _exact_dtype(self, ct: Any) -> Any:
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
        dtype = self._exact_dtype(out_cts[0])
        ct = cts[0]
        into = jnp.dtype(jnp.result_type(ct)) if is_float(jnp.result_type(ct)) else None
        if dtype is None or into is None or (into != dtype and into.itemsize < 4):
            return
        if prim.name == "broadcast_in_dim" and np.size(vals[0]) != np.size(self.tape.values[node.outs[0]]):
            return  # its transpose sums several entries
        if into.itemsize > 2:
            self.exact[id(ct)] = (ct, dtype)

    # -- merging ----------------------------------------------------------------
    def _u_max(self, dtype: Any) -> Any:
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
            target = self._settle(decisions.wide_merge([jnp.asarray(s, _F32) for s in scales], jnp))
        else:
            absmax = _absmaxes([p[0] for p in parts])  # one kernel for all on a GPU
            target, _ = decisions.merge(self.config, self._u_max(dtype), False, jnp, scales, absmax,
                                        self.backoff)
            target = self._settle(target)
        self._decided(target, frozenset().union(*(self._decided_by(s) for _, s in parts)))
        self._fit(target)
        return _stored(_sum([_rescale(ct, target / s) for ct, s in parts])), target

    def _lift_of(self, decision: str) -> Any:
        """``2^k`` of the decision's weight (``argN/…`` names match unprefixed state leaves)."""
        w = weight_of(decision)
        got = self.lift.get(w)
        if got is None and w.startswith("arg") and "/" in w:
            got = self.lift.get(w.split("/", 1)[1])
        if got is None and self.lift:
            self.unlifted.append(w)
        return got

    def _decided(self, scale: Any, names: frozenset[str]) -> None:
        self.deciders[id(scale)] = (scale, names)

    def _decided_by(self, scale: Any) -> frozenset[str]:
        got = self.deciders.get(id(scale))
        return got[1] if got is not None and got[0] is scale else frozenset()

    def _fit(self, scale: Any, fitted: bool = True) -> None:
        """Mark ``scale`` fitted to the fp8 format's range (``fitted=False``: leave it)."""
        if fitted:
            self.fitted[id(scale)] = scale

    def _is_fitted(self, scale: Any) -> bool:
        got = self.fitted.get(id(scale))
        return got is not None and got is scale

    def _unfitted(self, scale: Any) -> Any:
        """``scale`` (the same value, another object) no longer fitted to the fp8 format: what a
        normalization's backward sends may exceed what the decisions behind it modelled, so the
        next cast reads its tensor's max (current scaling); those decisions still hear it."""
        out = scale * jnp.ones((), _F32)
        self._decided(out, self._decided_by(scale))
        return out

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
            self._fit(seed_scale, i < len(fitted) and fitted[i])
        self._sweep(self.tape.nodes)

    def _sweep(self, nodes: list[Node]) -> None:
        for node in reversed(nodes):
            got = [self.take(s) for s in node.outs]
            present = [g for g in got if g is not None]
            if not present:
                continue
            if node.kind in ("scan", "remat"):  # each output keeps its scale
                (self._scan if node.kind == "scan" else self._remat)(node, got)
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
                    scale = self._unfitted(scale)
                chain = id(node) in self.dual
                cts = self._elementwise(node, out_cts) if chain else self._transpose(node, out_cts)
                if not chain and node.factor is None and not node.axes:
                    self._mark_exact(node, out_cts, cts)
                for pos, ct in zip(node.diff, cts):
                    self.cts[node.ins[pos]].append((ct, scale))

    def _agree(self, cts: list[Any], scale: Any, axes: tuple[Any, ...]) -> tuple[list[Any], Any]:
        """:func:`agree_across`, the common scale decided by whoever decided ``scale``."""
        floats = [c for c in cts if is_float(jnp.result_type(c))]
        cts, target = agree_across(cts, scale, axes, self._u_max(jnp.result_type(*floats)))
        self._decided(target, self._decided_by(scale))
        self._fit(target, self._is_fitted(scale))
        return cts, target

    def _amplified(self, cts: list[Any], scale: Any, factor: Any) -> tuple[list[Any], Any]:
        """:func:`adaloss.solver.amplified_scale` before a scalar factor's transpose: the
        cotangent (and its scale) lowered by the power of two that keeps ``factor·s·g`` finite."""
        g = cts[0]
        r = solver.amplified_scale(self.config, _absmax(_narrow_part(g)), factor, jnp, self.backoff)
        target = self._settle(scale * r)
        self._decided(target, self._decided_by(scale))
        self._fit(target, self._is_fitted(scale))
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

    def _scan(self, node: Node, got: list[tuple[Any, Any] | None]) -> None:
        """The backward of a scan region: a reverse scan whose body re-runs one iteration's
        forward and sweeps it; the carry's cotangents ride in the loop with their scales, each
        iteration's layers decide their own scales (stacked in the report), a stacked input's
        per-iteration cotangents are brought to one scale at the end (a merge)."""
        r = node.region
        assert r is not None
        if self.capture:
            raise ValueError("capture_cotangents=True is not supported with layers inside a scan; "
                             "unroll the scan (e.g. nn.scan -> a Python loop) to measure them")
        if self.cache is not None and self.config.update_every > 1:
            raise NotImplementedError("AdaLossConfig.update_every > 1 is not supported with layers "
                                      "inside a scan; use update_every=1")
        nc, nk = r.num_consts, r.num_carry
        one = jnp.ones((), _F32)
        out_vals = [self.tape.values[s] for s in node.outs]
        wanted = [j for j, s in enumerate(node.outs) if self.tape.needs[s]]
        seeds = {j: got[j] if got[j] is not None else (jnp.zeros_like(out_vals[j]), one) for j in wanted}
        fitted = {j: got[j] is not None and self._is_fitted(got[j][1]) for j in wanted}
        carry_js = [j for j in wanted if j < nk]
        ys_js = [j for j in wanted if j >= nk]
        consts = [i for i in range(nc) if r.needs[i]]
        xs = [i for i in range(nc + nk, len(r.inputs)) if r.needs[i]]
        acc0 = [jnp.zeros(np.shape(r.inputs[i]), _ct_dtype(r.inputs[i], r.origins[i])) for i in consts]

        def back(carry: Any, inp: Any) -> Any:
            cts, scales, acc, acc_scales = carry
            x_i, c_i, y_cts = inp
            sub = Tape(self.config, regions=True, remat=False)  # the body is re-run already
            slots = body_slots(sub, r, c_i, x_i)
            ins, outs = slots[:len(r.inputs)], slots[len(r.inputs):]
            sweep = _Sweep(sub, self.config, None, backoff=self.backoff, lift=self.lift,
                           reporting=self.reporting)
            sweep.run([(outs[j], ct, s) for j, ct, s in zip(carry_js, cts, scales)]
                      + [(outs[j], ct, seeds[j][1]) for j, ct in zip(ys_js, y_cts)],
                      [fitted[j] for j in carry_js + ys_js])
            new = [_or_zero(sweep.take(ins[nc + j]), c_i[j], jnp.result_type(c_i[j])) for j in carry_js]
            merged = []
            for i, a, a_s in zip(consts, acc, acc_scales):
                part = sweep.take(ins[i])
                merged.append((a, a_s) if part is None else sweep.merge([(a, a_s), part]))
            x_cts = [_or_zero(sweep.take(ins[i]), x_i[i - nc - nk], _ct_dtype(r.inputs[i], r.origins[i]))
                     for i in xs]
            self.unlifted.extend(sweep.unlifted)
            return (([ct for ct, _ in new], [s for _, s in new],
                     [m.astype(a.dtype) for (m, _), a in zip(merged, acc)], [s for _, s in merged]),
                    (x_cts, sweep.layers, sweep.underflow_signals()))

        init = ([seeds[j][0] for j in carry_js], [seeds[j][1] for j in carry_js], acc0, [one] * len(acc0))
        per_iter = ([r.inputs[i] for i in range(nc + nk, len(r.inputs))], r.carries,
                    [seeds[j][0] for j in ys_js])
        (cts, scales, acc, acc_scales), (x_cts, layers, signals) = jax.lax.scan(
            back, init, per_iter, length=r.length, reverse=not r.reverse, unroll=r.unroll)
        for j, ct, s in zip(carry_js, cts, scales):  # to the initial carry
            self.cts[node.ins[nc + j]].append((ct, s))
        for i, a, a_s in zip(consts, acc, acc_scales):
            self.cts[node.ins[i]].append((a, a_s))
        for i, (ct, s) in zip(xs, x_cts):
            self.cts[node.ins[i]].append(self._one_scale(ct, s))
        for name, rep in layers.items():  # a weight's name, a cast's or constant's within the scan
            key = f"{node.name}/{name}" if name.startswith(("cast:", "const:")) else name
            self.layers[key if key not in self.layers else f"{key}@{node.name}"] = rep
        for w, ratio in signals.items():  # over the iterations
            if self.config.fp8:
                ratio = jnp.where(jnp.min(ratio) < 0, jnp.min(ratio), jnp.max(ratio))
            else:
                ratio = jnp.max(ratio)
            self.feedback.ratios.append((w, ratio))

    def _remat(self, node: Node, got: list[tuple[Any, Any] | None]) -> None:
        """The backward of a ``jax.checkpoint`` region: its forward re-run from the saved inputs
        (behind an optimisation barrier, as ``jax.checkpoint`` does, so that XLA does not reuse
        the first forward) on a tape that shares this sweep's names, decisions and report."""
        r = node.region
        assert r is not None
        sub = Tape(self.config, regions=True, parent=self.tape)
        inputs = list(r.inputs)
        arrays = [k for k, v in enumerate(inputs) if isinstance(v, jax.Array)]  # not literals
        for k, v in zip(arrays, jax.lax.optimization_barrier([inputs[k] for k in arrays])):
            inputs[k] = v
        slots = [sub.slot(v, o, n) for v, o, n in zip(inputs, r.origins, r.needs)]
        outs = sub.run(r.body.jaxpr, [sub.slot(c, CONST, False) for c in r.body.consts], slots)
        outer = self.tape, self.cts, self.dual, self.chained
        self.tape, self.cts = sub, defaultdict(list)
        if self.adaptive:  # (as __init__ finds them for its tape)
            self.dual, self.chained = _chains(sub)
            self.chained -= set(outs)  # (each seeded)
        for s, g in zip(outs, got):
            if g is not None:
                self.cts[s].append(g)
        self._sweep(sub.nodes)
        results = [self.take(s) if n else None for s, n in zip(slots, r.needs)]
        self.tape, self.cts, self.dual, self.chained = outer
        for i, res in zip(node.ins, results):
            if res is not None:
                self.cts[i].append(res)

    def _one_scale(self, ct: Any, scales: Any) -> tuple[Any, Any]:
        """Per-iteration cotangents of a stacked input (``ct[l]`` carries ``scales[l]``) at one
        scale: the merge of the slices."""
        n = scales.shape[0]
        absmax = jnp.max(jnp.abs(ct.astype(_F32)).reshape(n, -1), axis=1)
        if self.config.fp8:
            target = self._settle(solver.fp8_merge_scale(self.config, [scales[k] for k in range(n)],
                                                         [absmax[k] for k in range(n)], jnp, self.backoff,
                                                         summed=False))
        else:
            target = self._settle(solver.merge_scale([scales[k] for k in range(n)],
                                                     [absmax[k] for k in range(n)],
                                                     self._u_max(jnp.result_type(ct)), jnp))
        factor = (target / scales).reshape((n,) + (1,) * (np.ndim(ct) - 1))
        return _rescale(ct, factor), target

    def _statistical(self, name: str, fresh: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
        """(statistical scale, its spread) of a decision: ``fresh()`` on recompute calls
        (``update_every``), else the cached pair.

        A select, not a ``lax.cond``: the statistics run on every call, but the step
        has no conditional, whose predicate XLA:GPU may read on the host.
        """
        out = fresh()
        if self.cache is not None and self.config.update_every > 1:
            cached = (self.cache.model_scales[name], self.cache.spreads[name])
            out = jax.tree.map(lambda f, c: jnp.where(self.recompute, f, c), out, cached)
        self.model_scales[name], self.spreads[name] = out
        return out

    def _layer(self, node: Node, g: Any, incoming: Any) -> None:
        """The layer's scale decided from its cotangent's and weight's statistics
        (:func:`adaloss.decisions.layer_of_stats`); its input gets ``vjp_x(s·g)``, carrying
        ``incoming·s``, its weight ``vjp_W(g)``, carrying ``incoming``."""
        cfg = self.config
        weight = None if cfg.model == "gradient" else node.weight

        # every reduction of g (and of W) the decision reads: one pass each on a GPU
        gs = reductions.statistics(g, sq_mean=True, mean=cfg.model == "gradient",
                                   below=cfg.underflow_limit if cfg.underflow_feedback else None)
        ws = None if weight is None else reductions.statistics(weight, sq_mean=True)
        g_ext, w_ext = gs.magnitude(), None if ws is None else ws.magnitude()

        def fresh() -> tuple[Any, Any]:
            sigma = solver.model_sigma(cfg, g_ext, w_ext, node.fan_in, jnp)
            return solver.model_scale(cfg, sigma, jnp, self.backoff, self._lift_of(node.name)), sigma

        s_model, sigma = self._statistical(node.name, fresh)
        # the caps use current statistics on every call
        behind = sorted(self._decided_by(incoming))
        counts = (gs.nonzero, gs.below) if cfg.underflow_feedback else None
        dec = decisions.layer_of_stats(cfg, node.fan_in, jnp, gs.size, g_ext, w_ext, None, incoming,
                                       self.backoff, None, s_model, sigma, counts,
                                       self.feedback.flags(behind))
        if dec.fraction is not None:
            self.feedback.hear(behind, dec.fraction)
        self._checked(node.name, dec.absmax)
        scale, outgoing = self._settle((dec.d.scale, dec.outgoing))
        d = dec.d._replace(scale=scale)
        self._decided(outgoing, frozenset({node.name}))
        self.feedback.decided(node.name, dec.limited)
        act_ct = self._input_grad(node, g, d.scale)
        self.cts[node.ins[node.diff[node.act]]].append((act_ct, outgoing))
        if node.wgt >= 0:
            w_ct = self._weight_grad(node, g)
            self.cts[node.ins[node.diff[node.wgt]]].append((w_ct, incoming))
        if self.reporting:
            self._report(node, d, None, incoming, outgoing, dec.absmax, dec.held)

    def _input_grad(self, node: Node, g: Any, scale: Any, q: Any = None) -> Any:
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
            (qw, sw), (qx, _) = node.fp8_operands[1 - x], node.fp8_operands[x]
            out = dot_operand_grad(q, qw, qx, params["dimension_numbers"], x, params.get("precision"),
                                   gemm_out(dtype_of(vals[x]), self.config.power_of_two))
            return (out * (scale / sw).astype(out.dtype)).astype(dtype_of(vals[x]))
        if prim.name != "dot_general" or not self.config.power_of_two:
            return node.vjp([_rescale(g, scale)])[node.act]
        out = dot_operand_grad(_like(g, self.tape.values[node.outs[0]]), vals[1 - x], vals[x],
                               params["dimension_numbers"], x, params.get("precision"))
        return (out * scale).astype(dtype_of(vals[x]))

    def _fit_current(self, g: Any, incoming: Any) -> tuple[Any, Any]:
        """Per-tensor current scaling where no decision fitted ``incoming`` to the fp8 format
        (:func:`adaloss.solver.fp8_fit_scale`): ``g`` rescaled and the scale it then carries."""
        fit = solver.fp8_fit_scale(self.config, _absmax(g), incoming, jnp,
                                   self.backoff)
        r = self._settle(fit.scale)
        g, incoming = _rescale(g, r), self._settle(incoming * r)
        self._fit(incoming)
        return g, incoming

    def _quantize(self, g: Any, behind: frozenset[str]) -> tuple[Any, Any, Any, Any]:
        """``g`` cast to the fp8 format once (:func:`adaloss.solver.to_fp8`): the fp8 values, the
        same in ``g``'s dtype (exactly), their ``max|q|`` statistics and the cast's fractions
        (``None`` unless reported); the decisions ``behind`` the scale hear the fractions'
        signal (:func:`adaloss.solver.fp8_signal`). The fp8 tensor passes an optimization
        barrier: XLA:GPU, allowed excess precision, folds a cast to fp8 and back to 16 bits
        away (the GEMMs and statistics would read the unquantized values); XLA:CPU removes the
        barrier, and keeps the cast anyway."""
        cfg = self.config
        q = jax.lax.optimization_barrier(solver.to_fp8(g, self.tape.grad_dtype, cfg.overflow_limit, jnp))
        gq = q.astype(jnp.result_type(g))  # exact: every fp8 value is a 16-bit one
        fractions = None
        counted = self.reporting or (cfg.underflow_feedback and behind)
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
            self.feedback.hear(behind, signal)
        return q, gq, q_ext, fractions

    def _layer_fp8(self, node: Node, g: Any, incoming: Any) -> None:
        """The cotangent quantized to fp8 once, and the scale of the output decided before the
        GEMM computes it. A layer (or first layer) with an fp8 ``grad_format``: ``g`` (carrying
        ``incoming``) quantized once, saturating (:meth:`_quantize`); both GEMMs read it; the
        decision (:func:`adaloss.solver.fp8_layer_scale`) sets the scale of the output it sends on."""
        cfg = self.config
        current = cfg.fp8_rule == "current" or not self._is_fitted(incoming)
        if current:  # no decision fitted this scale to the format
            g, incoming = self._fit_current(g, incoming)
        behind = self._decided_by(incoming)
        q, gq, q_ext, fractions = self._quantize(g, behind)
        if node.wgt >= 0:
            self.cts[node.ins[node.diff[node.wgt]]].append((self._weight_grad(node, gq, q), incoming))
        if node.kind == "first":
            if self.reporting:
                one = jnp.ones((), _F32)
                d = solver.LayerScale(one, one, jnp.zeros((), _F32), one)
                self._report(node, d, None, incoming, incoming, solver.absmax(q_ext, jnp), None, fractions,
                             current)
            return
        weight = node.weight
        self._checked(node.name, solver.absmax(q_ext, jnp))

        modelled = cfg.fp8_rule != "current" and cfg.layer_rule
        ws = reductions.statistics(weight, sq_mean=modelled).magnitude()

        def fresh() -> tuple[Any, Any]:
            gs = q_ext if q_ext.sq_mean is not None else solver.magnitude_stats(gq, jnp)
            sigma = solver.output_sigma(gs, ws, node.fan_in, jnp,
                                        solver.worst_row_sq_mean(gq, node.feature_axes, jnp))
            return solver.fp8_model_scale(cfg, sigma, jnp, self.backoff, self._lift_of(node.name)), sigma

        # "current": the next cast fits its own tensor; no layer_rule: one global scale, the loss
        # cotangent's (the cast-only ablation); the caps still hold (decisions.fp8_layer)
        s_model, sigma = self._statistical(node.name, fresh) if modelled else (None, None)
        carrier_max = float(jnp.finfo(jnp.result_type(g)).max)
        dec = decisions.fp8_layer(cfg, node.fan_in, carrier_max, jnp, q_ext, ws, None, incoming, self.backoff,
                                  None, s_model, sigma, None, self.feedback.flags(behind))
        scale, outgoing = self._settle((dec.d.scale, dec.outgoing))
        d = dec.d._replace(scale=scale)
        self._decided(outgoing, frozenset({node.name}))
        self._fit(outgoing)
        self.feedback.decided(node.name, dec.limited)
        act_ct = self._input_grad(node, gq, d.scale, q)
        self.cts[node.ins[node.diff[node.act]]].append((act_ct, outgoing))
        if self.reporting:
            self._report(node, d, None, incoming, outgoing, dec.absmax, dec.held, fractions, current)

    def _weight_grad(self, node: Node, g: Any, q: Any = None) -> Any:
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

    def _cast(self, node: Node, g: Any, incoming: Any) -> None:
        """The cotangent narrowed at a scale decided from its log-statistics
        (:func:`adaloss.decisions.cast_of_logs`); none where it holds widened 16-bit values
        only, the fp8 format's fit where the gradient format is fp8."""
        cfg = self.config
        if self._exact_dtype(g) == jnp.dtype(jnp.result_type(node.eqn[2][0])):
            # every entry is a value of the cast's 16-bit dtype (:meth:`_exact_dtype`): narrowing
            # it loses nothing, and the cotangent keeps the scale it carries
            (ct,) = node.vjp([g])
            self.cts[node.ins[0]].append((ct, incoming))
            return
        if cfg.fp8:  # it reads its tensor anyway: per-tensor current scaling, no entry saturates
            m = jnp.max(jnp.abs(g)).astype(_F32)
            d = solver.fp8_fit_scale(cfg, m, incoming, jnp, self.backoff)
            scale, outgoing = self._settle((d.scale, incoming * d.scale))
            d = d._replace(scale=scale)
            (ct,) = node.vjp([_rescale(g, d.scale)])
            self.cts[node.ins[0]].append((ct, outgoing))
            self._fit(outgoing)
            if self.reporting:
                self._report(node, d, None, incoming, outgoing, m)
            return

        st = reductions.statistics(g, logs=True)

        def fresh() -> tuple[Any, Any]:
            return solver.cast_model_scale(cfg, st.logs, jnp, self.backoff), st.logs

        s_model, ls = self._statistical(node.name, fresh)
        ls = ls._replace(absmax=st.absmax)  # the cap: current max|g|
        dec = decisions.cast_of_logs(cfg, jnp, ls, incoming, self.backoff, s_model)
        scale, outgoing = self._settle((dec.d.scale, dec.outgoing))
        d = dec.d._replace(scale=scale)
        (ct,) = node.vjp([_rescale(g, d.scale)])
        self.cts[node.ins[0]].append((ct, outgoing))
        if self.reporting:
            self._report(node, d, ls, incoming, outgoing, ls.absmax)

    def _report(self, node: Node, d: solver.LayerScale, spread: Any, incoming: Any, outgoing: Any,
                absmax: Any, held: Any = None, fractions: Any = None, current: Any = None) -> None:
        """The node's :func:`adaloss.report.decision_report` (``held`` None: no decision behind)."""
        self.layers[node.name] = decision_report(
            self.config, node.kind, d, spread, incoming, outgoing, absmax, node.fan_in,
            False if held is None else held, fractions, current, jax.scipy.special.erf, jnp)

    def _checked(self, decision: str, g_absmax: Any) -> None:
        """Record that the sweep reached ``decision`` with a cotangent whose ``max|g|`` is this."""
        self.health.append((weight_of(decision), len(self.health), jnp.isfinite(g_absmax)))

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
        values = decisions.signals(self.config, weights, jnp, fractions, limited, ratios)
        return _materialized(dict(zip(self.feedback.weights(weight_of), values)))

    def report(self) -> BackwardReport:
        cache = ScaleCache(self.step + 1, self.model_scales, self.spreads)
        return BackwardReport(self.layers, cache, self.captured, self.captured_scales,
                              self.tape.coverage())


#: per decision node's kind, the sweep's rule with a 16-bit and with an fp8 ``grad_format``
SWEEP: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    "layer": (_Sweep._layer, _Sweep._layer_fp8),
    "first": (_Sweep._layer_fp8, _Sweep._layer_fp8),  # fp8 only: its weight gradient's cast
    "cast": (_Sweep._cast, _Sweep._cast),
}


def _chains(tape: Tape) -> tuple[set[int], set[int]]:
    """The elementwise 16-bit equations differentiated in fp32 too (:meth:`_Sweep._elementwise`),
    by ``id``, and the slots inside their chains. A chain: elementwise equations joined by values
    that one computes and one other uses (nothing else does); those of several equations with a
    nonlinear one (:data:`NONLINEAR`: an activation function; one nonlinear equation alone, a
    softmax's ``exp``, has no 16-bit intermediate that its result does not have) are kept."""
    uses = Counter(node.ins[p] for node in tape.nodes for p in node.diff)
    producer = {s: node for node in tape.nodes if node.elementwise for s in node.outs}
    inside = {s for s in producer if uses[s] == 1}
    root = {id(node): id(node) for node in producer.values()}

    def find(k: int) -> int:
        while root[k] != k:
            root[k] = root[root[k]]
            k = root[k]
        return k

    for node in tape.nodes:
        if node.elementwise:
            for p in node.diff:
                if node.ins[p] in inside:
                    root[find(id(node))] = find(id(producer[node.ins[p]]))
    size = Counter(find(k) for k in root)
    nonlinear = {find(id(n)) for n in producer.values() if n.eqn[0].name in NONLINEAR}
    dual = {k for k in root if find(k) in nonlinear and size[find(k)] > 1}
    return dual, {s for s in inside if id(producer[s]) in dual}


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


def _settled(x: Any, inverses: dict[int, tuple[Any, Any]] | None = None) -> Any:
    """``x`` (non-negative fp32 scalars: scales), unchanged, as the result of a reduction
    (``max(v, v/2)``), which XLA never fuses into its consumers. Without this, every decision's
    chain of scalar ops (and every earlier decision's, through the incoming scale) is duplicated
    into each elementwise fusion that reads a scale: compile and step time grow with the square
    of the depth. (``lax.optimization_barrier`` does not do it: XLA:CPU removes it before
    fusion; a reduction of identical values is simplified away.) Several scales (a decision's
    own and its outgoing one) go through one variadic reduction: one kernel whose results are
    scalars (slices of a stacked result would each be a kernel on a GPU). With ``inverses``,
    the same reduction computes ``1 / v`` too, recorded there under the result's ``id`` (a
    gradient's :class:`~jax_adaloss.scaled_grad.ScaledGrad` check, else a kernel per scale)."""
    leaves, tree = jax.tree.flatten(x)
    halves = jnp.array([1.0, 0.5], _F32)
    leaves = [jnp.asarray(v, _F32) for v in leaves]
    operands = [v * halves for v in leaves]
    if inverses is not None:
        operands += [(1.0 / v) * halves for v in leaves]
    out = jax.lax.reduce(tuple(operands), (_F32(-jnp.inf),) * len(operands),
                         lambda a, b: tuple(jnp.maximum(u, v) for u, v in zip(a, b)), (0,))
    n = len(leaves)
    if inverses is not None:
        for v, inv in zip(out[:n], out[n:]):
            inverses[id(v)] = (v, inv)
    return jax.tree.unflatten(tree, list(out[:n]))


#: the most values :func:`_materialized` computes in one kernel: XLA fuses the formulas of a
#: few into the reduction; of many more (64: the LM's 32 blocks) it keeps each its own kernel
MAX_MATERIALIZED = 16


def _materialized(x: Any) -> Any:
    """``x`` (fp32 scalars of any sign, NaN kept), unchanged, as the results of variadic
    reductions (``max(v, -inf)``) of at most :data:`MAX_MATERIALIZED` each: one kernel computes
    them. Values each read only by the program's outputs (the per-weight underflow signals)
    would otherwise be computed by a scalar kernel each on a GPU."""
    leaves, tree = jax.tree.flatten(x)
    if len(leaves) < 2:
        return x
    low = jnp.array([0.0, -jnp.inf], _F32)
    out: list[Any] = []
    for k in range(0, len(leaves), MAX_MATERIALIZED):
        operands = [jnp.where(low < 0, low, jnp.asarray(v, _F32)) for v in leaves[k:k + MAX_MATERIALIZED]]
        out += jax.lax.reduce(tuple(operands), (_F32(-jnp.inf),) * len(operands),
                              lambda a, b: tuple(jnp.maximum(u, v) for u, v in zip(a, b)), (0,))
    return jax.tree.unflatten(tree, out)


def _stored(x: Any) -> Any:
    """``x`` (a ≤16-bit float tensor; others unchanged) as the result of a reduction, so that
    XLA writes it to memory instead of fusing the elementwise sums that computed it into every
    consumer: the maximum of ``x`` and ``−inf`` over a trailing axis of two, in ``x``'s own
    dtype: bitwise ``x`` (−0 included), but for a negative NaN, which XLA:CPU's maximum may
    turn into ``−inf`` (non-finite either way: the step is skipped).

    A merged cotangent (the residual stream) feeds only fusible consumers (the next merge's
    rescale and max-abs, a cast decision's statistics), so without this XLA recomputes the
    whole chain of merges above each point of the stream: compile and step time grow with
    the square of the depth. A reduction is never fused into its consumers. The two terms
    lie on a trailing axis: XLA:CPU reduces a leading axis of two ~3× slower; in the 16-bit
    dtype with no product, the pass costs about half of a sum in fp32 on XLA:CPU
    (``lax.optimization_barrier`` does not do it: XLA:CPU removes it before fusion)."""
    dtype = jnp.result_type(x)
    if not (is_float(dtype) and dtype.itemsize <= 2):
        return x
    return jnp.max(jnp.stack([x, jnp.full_like(x, -jnp.inf)], axis=-1), axis=-1)


def _absmax(x: Any) -> Any:
    """``max|x|`` in fp32 (:func:`jax_adaloss.reductions.statistics`: one kernel on a GPU)."""
    return _absmaxes([x])[0]


def _absmaxes(xs: list[Any]) -> list[Any]:
    """``max|x|`` of each of ``xs`` in fp32 (:func:`jax_adaloss.reductions.statistics_of`: one
    kernel for those of one shape on a GPU)."""
    if not reductions.fused():
        return [jnp.max(jnp.abs(x)).astype(_F32) for x in xs]  # in x's dtype, widened: exact
    return [s.absmax for s in reductions.statistics_of(xs)]


def _sum(xs: list[Any]) -> Any:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _like(ct: Any, value: Any) -> Any:
    """A float cotangent in its primal's dtype (a widened weight-path cotangent narrowed back
    for a transpose that expects the primal's dtype)."""
    dtype = jnp.result_type(value)
    if is_float(dtype) and jnp.result_type(ct) != dtype:
        return ct.astype(dtype)
    return ct


def _or_zero(got: tuple[Any, Any] | None, value: Any, dtype: Any) -> tuple[Any, Any]:
    """A (cotangent, scale) pair in ``dtype``, or a zero cotangent like ``value`` at scale 1
    (a loop's carry and outputs need a fixed type)."""
    if got is not None:
        return jnp.asarray(got[0]).astype(dtype), got[1]
    return jnp.zeros(np.shape(value), dtype), jnp.ones((), _F32)


def _ct_dtype(value: Any, origin: str | None) -> Any:
    """The dtype a sweep gives the cotangent of ``value``: a 16-bit weight's in fp32."""
    dtype = jnp.result_type(value)
    if origin not in (None, CONST) and jnp.dtype(dtype).itemsize < 4:
        return jnp.promote_types(dtype, _F32)
    return dtype


def _zero_ct(value: Any) -> Any:
    dtype = jnp.result_type(value)
    if is_float(dtype):
        return jnp.zeros(np.shape(value), dtype)
    return np.zeros(np.shape(value), jax.dtypes.float0)


def scaled_backward(jaxpr: jcore.ClosedJaxpr, flat_args: Sequence[Any], diff: Sequence[bool],
                    origins: Sequence[str | None], config: AdaLossConfig,
                    cache: ScaleCache | None, capture: bool = False, reference: Reference | None = None,
                    backoff: Any = None, lift: dict[str, Any] | None = None,
                    report: bool = True
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
    sweep = _Sweep(tape, config, cache, capture, reference, backoff=backoff, lift=lift, reporting=report)
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
    inverses = [None if g is None else sweep.inverse_of(g[1]) for g in grads]
    return outs, grads, sweep.report(), sweep.underflow_signals(), inverses, sweep.traces(loss)
