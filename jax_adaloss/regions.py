"""The sweep's rules at regions (:data:`REGIONS`): a ``scan`` with layers inside, swept per
iteration by a reverse ``scan`` that re-runs the body (:class:`~jax_adaloss.trace.ScanRegion`),
a ``jax.checkpoint`` region, re-run in the backward and swept like inline code, and a ``cond``
(``lax.cond``/``lax.switch``) with layers in its branches, swept by a ``cond`` on the same index
whose branches re-run theirs (:class:`~jax_adaloss.trace.CondRegion`), on the sweep's state
(:class:`jax_adaloss.backward._Sweep`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from adaloss import solver
from adaloss.report import LayerReport
from jax_adaloss.cotangents import _ct_dtype, _or_zero
from jax_adaloss.scaled_grad import rescale as _rescale
from jax_adaloss.trace import CONST, Node, Tape, body_slots, branch_slots, chains

if TYPE_CHECKING:
    from jax_adaloss.backward import _Sweep as Sweep

_F32 = jnp.float32


def scan(sw: Sweep, node: Node, got: list[tuple[Any, Any] | None]) -> None:
    """The backward of a scan region: a reverse scan whose body re-runs one iteration's
    forward and sweeps it; the carry's cotangents ride in the loop with their scales, each
    iteration's layers decide their own scales (stacked in the report), a stacked input's
    per-iteration cotangents are brought to one scale at the end (a merge)."""
    r = node.region
    assert r is not None
    if sw.capture:
        raise ValueError("capture_cotangents=True is not supported with layers inside a scan; "
                         "unroll the scan (e.g. nn.scan -> a Python loop) to measure them")
    nc, nk = r.num_consts, r.num_carry
    one = jnp.ones((), _F32)
    out_vals = [sw.tape.values[s] for s in node.outs]
    wanted = [j for j, s in enumerate(node.outs) if sw.tape.needs[s]]
    seeds = {j: got[j] if got[j] is not None else (jnp.zeros_like(out_vals[j]), one) for j in wanted}
    fitted = {j: got[j] is not None and sw.book.is_fitted(got[j][1]) for j in wanted}
    carry_js = [j for j in wanted if j < nk]
    ys_js = [j for j in wanted if j >= nk]
    consts = [i for i in range(nc) if r.needs[i]]
    xs = [i for i in range(nc + nk, len(r.inputs)) if r.needs[i]]
    acc0 = [jnp.zeros(np.shape(r.inputs[i]), _ct_dtype(r.inputs[i], r.origins[i])) for i in consts]

    def back(carry: Any, inp: Any) -> Any:
        cts, scales, acc, acc_scales = carry
        x_i, c_i, y_cts = inp
        sub = Tape(sw.config, regions=True, remat=False)  # the body is re-run already
        slots = body_slots(sub, r, c_i, x_i)
        ins, outs = slots[:len(r.inputs)], slots[len(r.inputs):]
        sweep = type(sw)(sub, sw.config, backoff=sw.backoff, lift=sw.lift,
                       reporting=sw.reporting)
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
        sw.unlifted.extend(sweep.unlifted)
        return (([ct for ct, _ in new], [s for _, s in new],
                 [m.astype(a.dtype) for (m, _), a in zip(merged, acc)], [s for _, s in merged]),
                (x_cts, sweep.layers, sweep.underflow_signals()))

    init = ([seeds[j][0] for j in carry_js], [seeds[j][1] for j in carry_js], acc0, [one] * len(acc0))
    per_iter = ([r.inputs[i] for i in range(nc + nk, len(r.inputs))], r.carries,
                [seeds[j][0] for j in ys_js])
    (cts, scales, acc, acc_scales), (x_cts, layers, signals) = jax.lax.scan(
        back, init, per_iter, length=r.length, reverse=not r.reverse, unroll=r.unroll)
    for j, ct, s in zip(carry_js, cts, scales):  # to the initial carry
        sw.cts[node.ins[nc + j]].append((ct, s))
    for i, a, a_s in zip(consts, acc, acc_scales):
        sw.cts[node.ins[i]].append((a, a_s))
    for i, (ct, s) in zip(xs, x_cts):
        sw.cts[node.ins[i]].append(one_scale(sw, ct, s))
    for name, rep in layers.items():  # a weight's name, a cast's or constant's within the scan
        key = f"{node.name}/{name}" if name.startswith(("cast:", "const:")) else name
        sw.layers[key if key not in sw.layers else f"{key}@{node.name}"] = rep
    for w, ratio in signals.items():  # over the iterations
        if sw.config.fp8:
            ratio = jnp.where(jnp.min(ratio) < 0, jnp.min(ratio), jnp.max(ratio))
        else:
            ratio = jnp.max(ratio)
        sw.feedback.ratios.append((w, ratio))

def remat(sw: Sweep, node: Node, got: list[tuple[Any, Any] | None]) -> None:
    """The backward of a ``jax.checkpoint`` region: its forward re-run from the saved inputs
    (behind an optimisation barrier, as ``jax.checkpoint`` does, so that XLA does not reuse
    the first forward) on a tape that shares this sweep's names, decisions and report."""
    r = node.region
    assert r is not None
    sub = Tape(sw.config, regions=True, parent=sw.tape)
    inputs = list(r.inputs)
    arrays = [k for k, v in enumerate(inputs) if isinstance(v, jax.Array)]  # not literals
    for k, v in zip(arrays, jax.lax.optimization_barrier([inputs[k] for k in arrays])):
        inputs[k] = v
    slots = [sub.slot(v, o, n) for v, o, n in zip(inputs, r.origins, r.needs)]
    outs = sub.run(r.body.jaxpr, [sub.slot(c, CONST, False) for c in r.body.consts], slots)
    outer = sw.tape, sw.cts, sw.dual, sw.chained
    sw.tape, sw.cts = sub, defaultdict(list)
    if sw.adaptive:  # (as __init__ finds them for its tape)
        sw.dual, sw.chained = chains(sub)
        sw.chained -= set(outs)  # (each seeded)
    for s, g in zip(outs, got):
        if g is not None:
            sw.cts[s].append(g)
    sw.sweep_nodes(sub.nodes)
    results = [sw.take(s) if n else None for s, n in zip(slots, r.needs)]
    sw.tape, sw.cts, sw.dual, sw.chained = outer
    for i, res in zip(node.ins, results):
        if res is not None:
            sw.cts[i].append(res)

def cond(sw: Sweep, node: Node, got: list[tuple[Any, Any] | None]) -> None:
    """The backward of a cond region: a ``cond`` on the region's index whose branch ``k`` re-runs
    branch ``k``'s forward (rematerialised, as a scan's body) and sweeps it from the cotangents
    the region's outputs carry, with their scales; the branch taken decides its layers' scales
    and the scales its cotangents leave with, on device. Every branch returns the same
    structure: per differentiated operand a cotangent and its scale (zeros, with the first
    incoming scale, where the branch does not use it), the union of the branches' layer
    reports (:func:`idle_report` for a layer of a branch not taken) and, per weight, its
    underflow signal and whether the branch taken has decisions of it."""
    r = node.region
    assert r is not None
    if sw.capture:
        raise ValueError("capture_cotangents=True is not supported with layers inside a lax.cond/"
                         "lax.switch branch; call the branches' layers outside the conditional to "
                         "measure them")
    index = sw.tape.values[node.ins[0]]
    present = [j for j, g in enumerate(got) if g is not None]
    seeds = [got[j][0] for j in present]
    scales = [got[j][1] for j in present]
    fitted = [sw.book.is_fitted(s) for s in scales]
    xs = [i for i, n in enumerate(r.needs) if n]

    def branch(k: int) -> Callable[[list[Any], list[Any]], Any]:
        def back(ops: list[Any], cts: list[Any]) -> Any:
            sub = Tape(sw.config, regions=True, remat=False)  # the branch is re-run already
            slots = branch_slots(sub, r, k, ops)
            ins, outs = slots[:len(ops)], slots[len(ops):]
            sweep = type(sw)(sub, sw.config, backoff=sw.backoff, lift=sw.lift, reporting=sw.reporting)
            sweep.run([(outs[j], ct, s) for j, ct, s in zip(present, cts, scales)], fitted)
            sw.unlifted.extend(sweep.unlifted)
            return [sweep.take(ins[i]) for i in xs], sweep.layers, sweep.underflow_signals()
        return back

    backs = [branch(k) for k in range(len(r.branches))]
    shapes = [jax.eval_shape(b, r.inputs, seeds) for b in backs]
    dtypes = [jnp.result_type(*[sh[0][n][0].dtype for sh in shapes if sh[0][n] is not None]
                              or [_ct_dtype(r.inputs[i], r.origins[i])]) for n, i in enumerate(xs)]
    layers: dict[str, tuple[int, Any]] = {}  # name -> (a branch that has it, its report's shapes)
    for k, sh in enumerate(shapes):
        for name, rep in sh[1].items():
            layers.setdefault(name, (k, rep))
    weights = list(dict.fromkeys(w for sh in shapes for w in sh[2]))

    def padded(k: int) -> Callable[[list[Any], list[Any]], Any]:
        def back(ops: list[Any], cts: list[Any]) -> Any:
            grads, reps, signals = backs[k](ops, cts)
            grads = [(jnp.zeros(np.shape(r.inputs[i]), d), jnp.asarray(scales[0], _F32)) if g is None
                     else (g[0].astype(d), jnp.asarray(g[1], _F32)) for g, i, d in zip(grads, xs, dtypes)]
            reps = {name: reps[name] if name in reps else
                    idle_report(rep, scales[0], r.fan_ins[b].get(name, 1))
                    for name, (b, rep) in layers.items()}
            ran = {w: (signals[w], jnp.bool_(True)) if w in signals else
                   (jnp.zeros((), _F32), jnp.bool_(False)) for w in weights}
            return grads, reps, ran
        return back

    grads, reps, ran = jax.lax.switch(index, [padded(k) for k in range(len(r.branches))],
                                      list(r.inputs), seeds)
    for i, g in zip(xs, grads):
        sw.cts[node.ins[1 + i]].append(g)
    for name, rep in reps.items():  # a weight's name, a cast's or constant's within the branch
        key = f"{node.name}/{name}" if name.startswith(("cast:", "const:")) else name
        sw.layers[key if key not in sw.layers else f"{key}@{node.name}"] = rep
    for w, (ratio, now) in ran.items():
        sw.feedback.branches.append((w, ratio, now))


def idle_report(shape: LayerReport, incoming: Any, fan_in: int) -> LayerReport:
    """The report of a layer whose decision did not run (its branch was not taken), shaped as
    ``shape`` (its report's shapes): scale 1 (incoming and outgoing scale the region's first
    incoming one), its fan-in, zero statistics and underflow, nothing held."""
    def full(s: Any, value: Any) -> Any:
        return jnp.broadcast_to(jnp.asarray(value, s.dtype), s.shape)

    rep = jax.tree.map(lambda s: full(s, 0), shape)
    one = {f: full(getattr(shape, f), 1) for f in ("scale", "model_scale", "unrounded_scale")}
    carried = {f: full(getattr(shape, f), incoming) for f in ("incoming_scale", "outgoing_scale")}
    return rep._replace(**one, **carried, fan_in=full(shape.fan_in, fan_in))


def one_scale(sw: Sweep, ct: Any, scales: Any) -> tuple[Any, Any]:
    """Per-iteration cotangents of a stacked input (``ct[l]`` carries ``scales[l]``) at one
    scale: the merge of the slices."""
    n = scales.shape[0]
    absmax = jnp.max(jnp.abs(ct.astype(_F32)).reshape(n, -1), axis=1)
    if sw.config.fp8:
        target = sw.book.settle(solver.fp8_merge_scale(sw.config, [scales[k] for k in range(n)],
                                                     [absmax[k] for k in range(n)], jnp, sw.backoff,
                                                     summed=False))
    else:
        target = sw.book.settle(solver.merge_scale([scales[k] for k in range(n)],
                                                 [absmax[k] for k in range(n)],
                                                 sw.u_max(jnp.result_type(ct)), jnp))
    factor = (target / scales).reshape((n,) + (1,) * (np.ndim(ct) - 1))
    return _rescale(ct, factor), target

#: per region node's kind, the sweep's rule (each output keeps its scale)
REGIONS: dict[str, Callable[[Any, Node, list[tuple[Any, Any] | None]], None]] = {
    "scan": scan, "remat": remat, "cond": cond}
