"""The forward pass the scaled backward records: each equation of a traced function re-bound
with its vjp kept, each value's origin (a weight's name, or data), and each equation
classified by the rule table :data:`CLASSIFY` (a layer, a first layer, a cast, or an ``op``
that passes its cotangent's scale through).

- a *weight* is a value computed only from the differentiated arguments and constants (fp16
  casts, reshapes, transposes, masks included); an *activation* depends on a
  non-differentiated argument (the batch);
- a ``dot_general``/``conv_general_dilated``/``ragged_dot_general`` of a weight and an
  activation is a layer; a forward widening cast of an activation is a narrowing cast of the
  cotangent;
- a multiplication by a scalar that can amplify a 16-bit cotangent is marked with its static
  bound; a normalizer's output, elementwise 16-bit chains and scanned or rematerialised
  regions are recorded for the sweep (:mod:`jax_adaloss.backward`);
- with ``config.operand_format`` every layer's input and weight are quantized to that format
  before its forward GEMM (:mod:`jax_adaloss.fp8_gemm`), which the vjp then differentiates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from adaloss.config import GRAD_FORMATS, AdaLossConfig
from adaloss.fan_in import conv_fan_in
from adaloss.report import Coverage, warn_coverage
from jax_adaloss.fp8_gemm import dequantized, fp8_dot, fp8_operand, quantized_operand
from jax_adaloss.weight_grads import dtype_of, is_float, is_narrow_float, widenable

_F32 = jnp.float32

CONST = "<const>"  # origin of values computed from constants only
_INLINE_PARAM = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                 "core_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}
_WEIGHTED = ("dot_general", "conv_general_dilated", "ragged_dot_general")  # ragged: grouped matmuls (MoE)
_REMAT = ("checkpoint", "remat2")
_SCALAR_FACTOR = ("mul", "div")
_KEEPS_VALUE = ("pvary", "convert_element_type", "broadcast_in_dim", "reshape", "squeeze",
                "expand_dims", "copy", "copy_p")
#: elementwise math whose result on known scalars is known too (:meth:`Tape._evaluate`)
_SCALAR_MATH = ("sqrt", "rsqrt", "exp", "log", "neg", "abs", "mul", "div", "add", "sub", "integer_pow",
                "pow", "max", "min", "square")
#: elementwise math whose backward, on 16-bit values, is also computed in fp32 where the 16-bit one
#: is not finite (the sweep's ``_elementwise``, :mod:`jax_adaloss.backward`)
_ELEMENTWISE = frozenset((
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log", "log1p",
    "expm1", "tanh", "logistic", "erf", "erfc", "erf_inv", "sin", "cos", "tan", "sinh", "cosh",
    "asinh", "acosh", "atanh", "atan2", "sqrt", "rsqrt", "cbrt", "integer_pow", "pow", "square",
    "select_n", "clamp"))
#: of those, the ones an activation function is made of (the rest, arithmetic and selects alone,
#: stays 16-bit: a score mask or a ``q / √d`` has no intermediate to overflow)
NONLINEAR = frozenset((
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc", "erf_inv", "sin", "cos",
    "tan", "sinh", "cosh", "asinh", "acosh", "atanh", "atan2", "sqrt", "rsqrt", "cbrt", "integer_pow",
    "pow"))
#: equations whose transpose moves, copies or sums entries of one value into another's place, and
#: casts: a cotangent whose entries are all values of a 16-bit format stays so through them
#: (a ``broadcast_in_dim`` only where it adds unit axes: its transpose sums one entry each)
EXACT_MOVES = frozenset(("reshape", "squeeze", "expand_dims", "transpose", "reduce_sum", "copy", "copy_p",
                          "rev", "broadcast_in_dim", "convert_element_type"))

def _combine(origins: Sequence[str | None], sizes: Sequence[int], prim: str) -> str | None:
    """Origin of an output: a weight name if the inputs are weights and constants (a
    ``mul``/``div`` by a data scalar too: a scalar factor); ``CONST`` if all are
    constants; else ``None`` (data: any data operand, e.g. a matmul with the batch)."""
    names = [o for o in origins if o is not None and o != CONST]
    if any(o is None for o in origins):
        scalar_factor = prim in _SCALAR_FACTOR and names and all(
            n == 1 for o, n in zip(origins, sizes) if o is None)
        return names[0] if scalar_factor else None
    return names[0] if names else CONST


@dataclasses.dataclass
class Node:
    kind: str  # "op" | "layer" | "cast"
    ins: list[int]
    outs: list[int]
    vjp: Callable[[list[Any]], tuple[Any, ...]] | None
    diff: tuple[int, ...]  # input positions the vjp differentiates, in its output order
    name: str = ""
    act: int = -1  # index into ``diff`` of the activation operand
    wgt: int = -1  # index into ``diff`` of the weight operand (-1: weight not differentiated)
    weight: Any = None
    fan_in: int = 1
    feature_axes: tuple[int, ...] = ()  # a layer's output axes that come from the weight
    eqn: Any = None  # (primitive, bind params, input values): to transpose it widened
    wide: tuple[int, ...] = ()  # positions in ``diff`` whose cotangent goes to a weight
    widenable: bool = False  # the equation can be re-bound on fp32 inputs
    # elementwise math on 16-bit values (_ELEMENTWISE): its backward in fp32 too, where needed
    elementwise: bool = False
    region: ScanRegion | CondRegion | None = None  # kinds "scan", "remat", "cond": what its backward re-runs
    axes: tuple[Any, ...] = ()  # a collective's named axes (its transpose moves cotangents across devices)
    # a mul/div by a scalar that may amplify a 16-bit cotangent: the bound |c| or 1/|c|
    factor: Any = None
    # a normalization's 16-bit backward (x·rsqrt(v), x/sqrt(v), rsqrt(v) with v from the data):
    # it may amplify the cotangent where no decision sees it (fp8: the next cast fits its own max)
    norm: bool = False
    # an operand_format ``dot_general`` layer: each operand in fp8 and its scale, ``((q, s),
    # (q, s))``: the forward GEMM and both backward GEMMs multiply fp8 values (FP8 GEMMs)
    fp8_operands: tuple[tuple[Any, Any], ...] | None = None
    what: str = ""  # a cast's: what it casts (dtypes, shape, the user's line), for people


@dataclasses.dataclass
class ScanRegion:
    """A ``scan`` whose body holds layers: its backward is a reverse scan that re-runs the
    body's forward for each iteration from the saved carry (rematerialised, as under
    ``jax.checkpoint``) and sweeps it with per-iteration scale decisions."""

    body: jcore.ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any
    inputs: list[Any]  # the scan's operands: consts, initial carry, xs (stacked)
    carries: list[Any]  # the carry entering each iteration, stacked
    origins: list[str | None]  # of the operands
    needs: list[bool]  # of the operands


@dataclasses.dataclass
class CondRegion:
    """A ``cond`` (``lax.cond``/``lax.switch``) whose branches hold layers: its backward is a
    ``cond`` on the same index whose branches re-run their forward and sweep it, each with its
    own decisions, from the scales the region's outputs carry."""

    branches: tuple[jcore.ClosedJaxpr, ...]
    inputs: list[Any]  # the operands after the index
    origins: list[str | None]  # of the operands
    needs: list[bool]  # of the operands
    # per branch, its layers' fan-ins by name (a report for a branch not taken)
    fan_ins: list[dict[str, int]] = dataclasses.field(default_factory=list)


def _site(eqn: jcore.JaxprEqn) -> str:
    """`` at file.py:42 (fn)``: the user's line that made ``eqn`` (JAX's own summary of its
    traceback, past JAX's and this library's frames); empty where JAX keeps none."""
    try:
        from jax._src import source_info_util
        where = source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 (a private helper: a JAX without it gives no site)
        return ""
    return f" at {where}" if where and where != "unknown" else ""


class Tape:
    """Forward pass that records a vjp per equation and each value's origin."""

    def __init__(self, config: AdaLossConfig, regions: bool = False, remat: bool = True,
                 parent: Tape | None = None) -> None:
        self.config = config
        self.regions = regions  # scans with layers inside get per-iteration scales
        self.remat = regions and remat  # jax.checkpoint regions are re-run in the backward
        self.region_layers = 0  # layers found inside them
        self._scans = 0
        self._conds = 0
        self.values: list[Any] = []
        self.origin: list[str | None] = []
        self.needs: list[bool] = []
        self.nodes: list[Node] = []
        # name counters ("<cast>", "<const>": their numbers), shared with a remat region's
        # tape (``parent``) so that its layers' names stay unique in one report
        self._names: dict[str, int] = parent._names if parent is not None else defaultdict(int)
        self._converts: dict[tuple[Any, ...], int] = {}  # (input slot, dtype, sharding) -> slot
        self._fp8_operands: dict[int, tuple[Any, Any]] = {}  # slot -> its fp8 values and scale
        self.grad_dtype = jnp.dtype(GRAD_FORMATS[config.grad_format])
        self.fp8 = config.fp8  # layers quantize their incoming cotangent to grad_format
        # layers quantize their input and weight to operand_format, forward and backward (only
        # where the backward is adaptive: a reference's tape leaves the forward as it is)
        self.operands = None if config.operand_format is None or not regions else \
            jnp.dtype(GRAD_FORMATS[config.operand_format])
        self.weighted_ops = 0  # matmuls/convolutions on the differentiated path
        self.data_path_ops = 0  # of those, with a data operand that needs a gradient
        self.opaque: list[tuple[str, int]] = []  # (primitive, matmuls inside) of opaque regions
        self.missed: list[str] = []  # why a weighted op with a weight operand got no scale
        # slot -> its value where a scalar is a constant known at trace time behind ops that
        # keep it (``pvary`` under ``shard_map``, casts, reshapes): a factor's static bound
        self.known: dict[int, float] = {}
        # slots holding a normalizer: rsqrt (or sqrt, a divisor) of data, as computed or moved,
        # cast, broadcast, or times weights (a norm's scale folded in)
        self.normalizers: set[int] = set()
        self.elementwise: set[int] = set()  # slots computed by elementwise 16-bit math

    def slot(self, value: Any, origin: str | None, needs: bool) -> int:
        self.values.append(value)
        self.origin.append(origin)
        self.needs.append(needs)
        return len(self.values) - 1

    def _count(self, key: str) -> int:
        k = self._names[key]
        self._names[key] += 1
        return k

    def _unique(self, name: str) -> str:
        k = self._names[name]
        self._names[name] += 1
        return name if k == 0 else f"{name}@{k}"

    def run(self, jaxpr: jcore.Jaxpr, const_slots: Sequence[int],
            in_slots: Sequence[int]) -> list[int]:
        env: dict[Any, int] = {}
        env.update(zip(jaxpr.constvars, const_slots))
        env.update(zip(jaxpr.invars, in_slots))

        def read(atom: Any) -> int:
            if isinstance(atom, jcore.Literal):
                return self.slot(atom.val, CONST, False)
            return env[atom]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            prim = eqn.primitive.name
            if prim in _REMAT and self.remat:
                outs = self._remat(eqn, ins)
            elif prim in _INLINE_PARAM:
                sub = eqn.params[_INLINE_PARAM[prim]]
                if isinstance(sub, jcore.ClosedJaxpr):
                    consts = [self.slot(c, CONST, False) for c in sub.consts]
                    sub = sub.jaxpr
                else:
                    consts = []
                outs = self.run(sub, consts, ins)
            elif prim in REGION_FORWARD and self.regions and _weighted_inside(eqn.params):
                outs = REGION_FORWARD[prim](self, eqn, ins)
            elif prim == "convert_element_type" and not eqn.params.get("weak_type"):
                # one value cast twice to the same dtype (flax's LayerNorm does) is
                # one cast: its consumers' cotangents then share one scale decision
                key = (ins[0], jnp.dtype(eqn.params["new_dtype"]), eqn.params.get("sharding"))
                if key not in self._converts:
                    self._converts[key] = self._bind(eqn, ins)[0]
                outs = [self._converts[key]]
            else:
                outs = self._bind(eqn, ins)
            for var, s in zip(eqn.outvars, outs):
                env[var] = s
        return [read(a) for a in jaxpr.outvars]

    def _layer_operands(self, prim: str, ins: list[int]) -> tuple[int, int] | None:
        """``(weight position, activation position)`` of a matmul/convolution with exactly one
        operand computed from the weights alone; ``None`` for other equations."""
        if prim not in _WEIGHTED or len(ins) != (3 if prim == "ragged_dot_general" else 2):
            return None
        weights = [i for i in (0, 1) if self.origin[ins[i]] is not None]
        return (weights[0], 1 - weights[0]) if len(weights) == 1 else None

    def _bind(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
        prim = eqn.primitive
        params = prim.get_bind_params(eqn.params)
        if prim.name == "dot_general" and params.get("precision") is not None:
            params = runnable_precision(params, [self.values[s] for s in ins[:2]])
        vals = [self.values[s] for s in ins]
        fp8_operands = None
        if self.operands is not None and self._layer_operands(prim.name, ins) is not None:
            # both operands as the fp8 GEMM reads them; the vjp below takes the quantized values
            # as its inputs, so their cotangents pass the quantization unchanged
            if prim.name == "dot_general":  # each tensor quantized once (q, k, v share an input)
                for slot, v in zip(ins[:2], vals[:2]):
                    if slot not in self._fp8_operands:
                        self._fp8_operands[slot] = fp8_operand(v, self.config, self.operands)
                fp8_operands = tuple(self._fp8_operands[slot] for slot in ins[:2])
                vals[:2] = [dequantized(q, sc, dtype_of(v)) for (q, sc), v in zip(fp8_operands, vals[:2])]
            else:
                vals[:2] = [quantized_operand(v, self.config, self.operands) for v in vals[:2]]

        def bind(*xs: Any) -> list[Any]:
            out = prim.bind(*xs, **params)
            return list(out) if prim.multiple_results else [out]

        # stop_gradient: its output needs no gradient (a zero cotangent would still reach merges
        # and casts, with a scale of its own)
        diff = () if prim.name == "stop_gradient" else tuple(i for i, s in enumerate(ins) if self.needs[s])
        if diff:
            def f(*dx: Any) -> list[Any]:
                xs = list(vals)
                for i, x in zip(diff, dx):
                    xs[i] = x
                return bind(*xs)
            out_vals, vjp = jax.vjp(f, *[vals[i] for i in diff])
        else:
            out_vals, vjp = bind(*vals), None
        if fp8_operands is not None:  # the forward GEMM on the fp8 values themselves
            out_vals = [fp8_dot(fp8_operands, params, dtype_of(out_vals[0]), self.config.power_of_two)]
        origin = _combine([self.origin[s] for s in ins], [int(np.size(v)) for v in vals], prim.name)
        outs = [self.slot(v, origin, bool(diff) and is_float(jnp.result_type(v)))
                for v in out_vals]
        node = Node("op", ins, outs, vjp, diff, eqn=(prim, params, vals), axes=named_axes(eqn.params),
                     fp8_operands=fp8_operands)
        # normalizers are tracked through values that need no gradient too (running statistics)
        node.norm = self._normalizes(prim.name, ins, outs, out_vals) and vjp is not None
        if vjp is not None:
            node.widenable = widenable(eqn.params)  # not the bind params: custom rules' are functions
            if node.widenable:
                # every cotangent bound for a weight: its incoming cotangent may already be
                # fp32 (an fp32 master weight's cast receives one), which a transpose typed
                # for the 16-bit output would narrow
                node.wide = tuple(k for k, i in enumerate(diff)
                                  if self.origin[ins[i]] not in (None, CONST))
            self._classify(node, eqn, vals)
            node.factor = _amplification(prim.name, vals, [self.known.get(s) for s in ins], diff,
                                         node.wide, out_vals)
            if (node.kind == "op" and node.widenable and not node.wide and not node.axes
                    and _narrow_elementwise(prim.name, vals, out_vals)):
                node.elementwise = True
                self.elementwise.update(outs)
            self.nodes.append(node)
        if prim.name in _KEEPS_VALUE and len(ins) == 1 and len(outs) == 1 and np.size(out_vals[0]) == 1:
            c = vals[0] if not isinstance(vals[0], jax.core.Tracer) else self.known.get(ins[0])
            if c is not None:
                self.known[outs[0]] = float(np.asarray(c, np.float64).reshape(()))
        elif prim.name in _SCALAR_MATH and len(outs) == 1 and np.size(out_vals[0]) == 1:
            self._evaluate(eqn, ins, outs, vals)
        return outs

    def _evaluate(self, eqn: jcore.JaxprEqn, ins: list[int], outs: list[int], vals: list[Any]) -> None:
        """Record the value of scalar math on known scalars (attention's ``1/sqrt(d)``,
        computed in the trace): in the value's dtype, as the program computes it."""
        cs = []
        for v, s in zip(vals, ins):
            c = v if not isinstance(v, jax.core.Tracer) else self.known.get(s)
            if c is None or np.size(c) != 1:
                return
            cs.append(np.asarray(c, dtype_of(v)).reshape(np.shape(v)))
        with jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*cs, **eqn.params)
        self.known[outs[0]] = float(np.asarray(out, np.float64).reshape(()))

    def _normalizes(self, prim: str, ins: list[int], outs: list[int], out_vals: list[Any]) -> bool:
        """Track normalizers (:attr:`normalizers`); whether this equation's backward is a
        normalization's, in 16 bits (a narrower dtype: in fp32 a cast narrows the result, and a
        cast reads its tensor anyway)."""
        flagged = [s in self.normalizers for s in ins]
        data = [self.origin[s] is None for s in ins]
        narrow = len(outs) == 1 and is_float(jnp.result_type(out_vals[0])) \
            and jnp.dtype(jnp.result_type(out_vals[0])).itemsize <= 2
        if prim in ("rsqrt", "sqrt") and data[0]:
            self.normalizers.add(outs[0])
            return narrow  # its own backward amplifies too (by r³/2, 1/(2·sqrt))
        if not any(flagged) or len(outs) != 1:
            return False
        if prim in _KEEPS_VALUE or (prim == "mul" and not any(d and not f for d, f in zip(data, flagged))):
            self.normalizers.add(outs[0])  # moved, or times weights and constants only
            return False
        divisor = prim == "div" and flagged[1] and not flagged[0]
        return narrow and (prim == "mul" or divisor)

    def _scan(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
        """Run a ``scan`` forward, keeping the carry that enters each iteration."""
        p = eqn.params
        body, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
        vals = [self.values[s] for s in ins]
        consts, init, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
        needs = [self.needs[s] for s in ins]
        region = ScanRegion(body, nc, nk, p["length"], p["reverse"], p["unroll"], vals, [],
                             [self.origin[s] for s in ins], needs)
        run_body = jcore.jaxpr_as_fun(body)

        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
            if self.operands is not None:  # the body's layers quantize as its backward's re-run does
                sub = Tape(self.config, regions=True, remat=False)
                out = [sub.values[k] for k in body_slots(sub, region, carry, x)[len(vals):]]
            else:
                out = run_body(*consts, *carry, *x)
            return list(out[:nk]), (list(out[nk:]), list(carry))

        final, (ys, carries) = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                                            reverse=p["reverse"], unroll=p["unroll"])
        region.carries = carries
        origin = _combine([self.origin[s] for s in ins], [int(np.size(v)) for v in vals], "scan")
        outs = [self.slot(v, origin, any(needs) and is_float(jnp.result_type(v)))
                for v in [*final, *ys]]
        diff = tuple(i for i, n in enumerate(needs) if n)
        if diff:
            self._survey(region)
            self.nodes.append(Node("scan", ins, outs, None, diff, name=f"scan:{self._scans}",
                                    region=region))
            self._scans += 1
        return outs

    def _remat(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
        """A ``jax.checkpoint`` region: its outputs now; its forward again in the backward."""
        body = eqn.params["jaxpr"]
        body = body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, [])
        vals = [self.values[s] for s in ins]
        needs = [self.needs[s] for s in ins]
        if self.operands is not None:  # the body's layers quantize as its backward's re-run does
            sub = Tape(self.config, regions=True)
            slots = [sub.slot(v, self.origin[s], n) for v, s, n in zip(vals, ins, needs)]
            outs = sub.run(body.jaxpr, [sub.slot(c, CONST, False) for c in body.consts], slots)
            out_vals = [sub.values[k] for k in outs]
        else:
            out_vals = jcore.jaxpr_as_fun(body)(*vals)
        origin = _combine([self.origin[s] for s in ins], [int(np.size(v)) for v in vals], "remat")
        outs = [self.slot(v, origin, any(needs) and is_float(jnp.result_type(v))) for v in out_vals]
        region = ScanRegion(body, len(vals), 0, 1, False, 1, vals, [],
                             [self.origin[s] for s in ins], needs)
        diff = tuple(i for i, n in enumerate(needs) if n)
        if diff:
            self._survey(region)
            self.nodes.append(Node("remat", ins, outs, None, diff, region=region))
        return outs

    def _cond(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
        """A ``cond`` whose branches hold layers: its outputs now (the branch the index picks); the
        branches' forward again in the backward, in a ``cond`` on the same index."""
        vals = [self.values[s] for s in ins]
        index, ops = vals[0], vals[1:]
        region = CondRegion(tuple(eqn.params["branches"]), ops, [self.origin[s] for s in ins[1:]],
                            [self.needs[s] for s in ins[1:]])
        if self.operands is not None:  # the branches' layers quantize as their backward's re-run does
            def branch(k: int) -> Callable[..., list[Any]]:
                def run(*xs: Any) -> list[Any]:
                    sub = Tape(self.config, regions=True, remat=False)
                    return [sub.values[s] for s in branch_slots(sub, region, k, xs)[len(xs):]]
                return run
            out_vals = jax.lax.switch(index, [branch(k) for k in range(len(region.branches))], *ops)
        else:
            out_vals = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
        origin = _combine([self.origin[s] for s in ins], [int(np.size(v)) for v in vals], "cond")
        outs = [self.slot(v, origin, any(region.needs) and is_float(jnp.result_type(v))) for v in out_vals]
        diff = tuple(1 + i for i, n in enumerate(region.needs) if n)
        if diff:
            for k in range(len(region.branches)):
                sub = Tape(self.config, regions=True, remat=False)
                branch_slots(sub, region, k, ops)
                self._absorb(sub)
                region.fan_ins.append({n.name: n.fan_in for n in sub.nodes if n.kind in ("layer", "first")})
            self.nodes.append(Node("cond", ins, outs, None, diff, name=f"cond:{self._conds}", region=region))
            self._conds += 1
        return outs

    def _survey(self, r: ScanRegion) -> None:
        """Trace one iteration of the body (XLA drops it: nothing uses it) to count its layers
        and check its formats now, before the backward."""
        sub = Tape(self.config, regions=True, remat=False)
        body_slots(sub, r, r.inputs[r.num_consts:r.num_consts + r.num_carry],
                    [x[0] for x in r.inputs[r.num_consts + r.num_carry:]])
        self._absorb(sub)

    def _absorb(self, sub: Tape) -> None:
        """Count a region's tape (traced to survey it) in this one's coverage."""
        self.weighted_ops += sub.weighted_ops
        self.data_path_ops += sub.data_path_ops
        self.opaque += sub.opaque
        self.missed += sub.missed
        self.region_layers += sub.layers_found

    def _classify(self, node: Node, eqn: jcore.JaxprEqn, vals: list[Any]) -> None:
        """What the sweep does at ``eqn``: the rule of :data:`CLASSIFY` for its primitive may make
        it a decision node (a layer, a first layer, a cast); any other stays an ``op``."""
        prim = eqn.primitive.name
        inner = _weighted_inside(eqn.params)
        if inner:  # scan/while/cond or a custom rule: no per-layer scale inside
            self.opaque.append((prim, inner))
        rule = CLASSIFY.get(prim)
        if rule is not None:
            rule(self, node, eqn, vals)

    def _classify_layer(self, node: Node, eqn: jcore.JaxprEqn, vals: list[Any]) -> None:
        """A matmul or convolution of a weight and data: a layer (``first`` where the data needs no
        gradient), named for its weight."""
        prim = eqn.primitive.name
        if len(node.ins) != (3 if prim == "ragged_dot_general" else 2):
            return
        origins = [self.origin[s] for s in node.ins]
        self.weighted_ops += 1
        if any(o is None and i in node.diff for i, o in enumerate(origins)):
            self.data_path_ops += 1
        operands = self._layer_operands(prim, node.ins)
        if operands is None:
            return  # data·data (attention) or weight·weight (a factored weight)
        w, x = operands
        first = x not in node.diff  # the first layer: its input needs no gradient
        if first and not (self.fp8 and w in node.diff):
            return
        if prim == "conv_general_dilated" and w != 1:
            self.missed.append("a convolution whose weight is its lhs operand")
            return
        name = origins[w]
        if name == CONST:
            name = f"const:{self._count('<const>')}"
        # an fp8 first layer quantizes its cotangent for its weight gradient; no decision
        node.kind, node.name = ("first" if first else "layer"), self._unique(name)
        node.act = -1 if first else node.diff.index(x)
        node.wgt = node.diff.index(w) if w in node.diff else -1
        node.weight = vals[w]
        node.fan_in = _fan_in(eqn, w, np.shape(vals[w]))
        node.feature_axes = _feature_axes(eqn, w, np.ndim(vals[0]), np.ndim(vals[1]))
        self._check_format(jnp.result_type(self.values[node.outs[0]]), f"layer {node.name}")

    def _classify_cast(self, node: Node, eqn: jcore.JaxprEqn, vals: list[Any]) -> None:
        """A 16-bit float widened on the data path: its cotangent is narrowed back, a cast."""
        if self.config.cast_rule and node.diff == (0,) and self.origin[node.ins[0]] is None:
            src = jnp.dtype(jnp.result_type(vals[0]))
            dst = jnp.dtype(eqn.params["new_dtype"])
            if is_float(src) and is_float(dst) and src.itemsize < dst.itemsize <= 8 \
                    and src.itemsize <= 2:
                node.kind, node.name = "cast", f"cast:{self._count('<cast>')}"
                node.what = f"{src.name} → {dst.name} {tuple(np.shape(vals[0]))}{_site(eqn)}"
                self._check_format(src, f"{node.name} (a {dst.name} → {src.name} cotangent cast)")

    def _check_format(self, dtype: Any, where: str) -> None:
        """A cotangent in a 16-bit (or narrower) float format must be ``config.grad_format``."""
        dtype = jnp.dtype(dtype)
        if self.fp8:  # the layers quantize whatever dtype the model's backward runs in
            return
        if dtype.itemsize <= 2 and dtype != self.grad_dtype:
            raise ValueError(
                f"AdaLossConfig.grad_format={self.config.grad_format!r}, but the cotangent of {where} "
                f"is {dtype.name}: its limits (u_min, u_max) would be wrong. Set "
                f"AdaLossConfig(grad_format={dtype.name!r}).")

    def coverage(self) -> Coverage:
        # one entry per layer report: an fp8 first layer quantizes the cotangent of its weight
        # gradient and reports it
        first = sum(1 for n in self.nodes if n.kind == "first")
        return Coverage(weighted_ops=self.weighted_ops, layers=self.layers_found + first,
                        opaque_regions=len(self.opaque))

    @property
    def layers_found(self) -> int:
        return sum(1 for n in self.nodes if n.kind == "layer") + self.region_layers

    def warn_coverage(self, weight_args: str) -> None:
        """Say once (per trace) when matmuls/convolutions that should scale do not."""
        opaque = no_layer = None
        if self.opaque:
            kinds = "/".join(sorted({p for p, _ in self.opaque}))
            opaque = (f"{sum(n for _, n in self.opaque)} matmul/convolution ops inside "
                      f"{len(self.opaque)} {kinds} region(s) get no per-layer scale (the scale entering "
                      "the region passes through it); unroll the loop or call the layers outside the "
                      "region to scale them")
        if self.layers_found == 0 and self.data_path_ops:
            no_layer = (f"no layer found among {self.data_path_ops} matmul/convolution ops on the data "
                        f"path: none has an operand computed from the weights alone ({weight_args}). If "
                        "the weights are in another differentiated argument, pass weights=<its "
                        "position>; weights passed as non-differentiated arguments, or transformed with "
                        "the data, are data")
        warn_coverage(opaque, self.missed, no_layer, stacklevel=4)


def body_slots(tape: Tape, r: ScanRegion, carry: Sequence[Any], x: Sequence[Any]) -> list[int]:
    """Run a scan body on ``tape`` for one iteration (``carry``, ``x``: its values); returns
    the input slots (consts, carry, xs) followed by the output slots (carry, ys). A slice of
    a stacked weight is that weight; the carry needs a cotangent where any operand does."""
    nc, nk = r.num_consts, r.num_carry
    any_needs = any(r.needs)
    slots = [tape.slot(v, r.origins[i], r.needs[i]) for i, v in enumerate(r.inputs[:nc])]
    slots += [tape.slot(v, None, any_needs and is_float(jnp.result_type(v))) for v in carry]
    slots += [tape.slot(v, r.origins[nc + nk + i], r.needs[nc + nk + i]) for i, v in enumerate(x)]
    consts = [tape.slot(c, CONST, False) for c in r.body.consts]
    return slots + tape.run(r.body.jaxpr, consts, slots)


def branch_slots(tape: Tape, r: CondRegion, k: int, ops: Sequence[Any]) -> list[int]:
    """Run branch ``k`` of a cond region on ``tape`` (``ops``: its operands' values); returns the
    input slots followed by the output slots."""
    slots = [tape.slot(v, o, n) for v, o, n in zip(ops, r.origins, r.needs)]
    b = r.branches[k]
    return slots + tape.run(b.jaxpr, [tape.slot(c, CONST, False) for c in b.consts], slots)


def chains(tape: Tape) -> tuple[set[int], set[int]]:
    """The elementwise 16-bit equations the sweep (:mod:`jax_adaloss.backward`) differentiates
    in fp32 too, by ``id``, and the slots inside their chains. A chain: elementwise equations joined by values
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


def _narrow_elementwise(prim: str, vals: list[Any], out_vals: list[Any]) -> bool:
    """An elementwise equation (:data:`_ELEMENTWISE`) whose float operands and result are 16-bit
    arrays of one shape (scalar operands aside)."""
    if prim not in _ELEMENTWISE or len(out_vals) != 1:
        return False
    out = out_vals[0]
    floats = [v for v in (*vals, out) if is_float(jnp.result_type(v)) and np.ndim(v)]
    return (is_narrow_float(dtype_of(out)) and all(is_narrow_float(dtype_of(v)) for v in floats)
            and all(np.shape(v) == np.shape(out) for v in floats))


def runnable_precision(params: dict[str, Any], operands: Sequence[Any]) -> dict[str, Any]:
    """``dot_general``'s bind params with a dot algorithm the default backend cannot lower
    (XLA:CPU has no ``F16_F16_F32`` / ``BF16_BF16_F32``, which ``jax.nn.dot_product_attention``
    asks for) replaced by the default precision: the fallback ``jax.nn.dot_product_attention``
    itself takes where the algorithm fails eagerly (its ``jax.grad`` runs on CPU), and the same
    numbers on CPU (a 16-bit dot accumulates in fp32 there). Under a trace the algorithm would
    fail only when the program is lowered, so it is checked here, once per algorithm and dtypes."""
    algorithm = params["precision"]
    if not isinstance(algorithm, (jax.lax.DotAlgorithmPreset, jax.lax.DotAlgorithm)):
        return params
    dtypes = tuple(jnp.dtype(jnp.result_type(v)) for v in operands)
    out = params.get("preferred_element_type")
    if _lowers(algorithm, dtypes, None if out is None else jnp.dtype(out), jax.default_backend()):
        return params
    return {**params, "precision": None}


@functools.cache
def _lowers(algorithm: Any, dtypes: tuple[Any, ...], out: Any, backend: str) -> bool:
    """Whether a ``dot_general`` of two vectors of ``dtypes`` with ``algorithm`` lowers on ``backend``."""
    def dot(a: Any, b: Any) -> Any:
        return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=algorithm,
                                   preferred_element_type=out)

    try:
        jax.jit(dot).trace(*(jax.ShapeDtypeStruct((2,), d) for d in dtypes)).lower(
            lowering_platforms=(backend,))
    except Exception:  # noqa: BLE001 (XLA's refusal: ValueError or NotImplementedError by platform)
        return False
    return True


def _amplification(prim: str, vals: list[Any], known: list[float | None], diff: tuple[int, ...],
                   wide: tuple[int, ...], out_vals: list[Any]) -> Any:
    """For ``x·c``, ``c·x`` or ``x/c`` with ``c`` a scalar and a 16-bit (or narrower) result: the
    factor ``|c|`` (``1/|c|``) the backward multiplies ``x``'s cotangent by, where it may exceed
    1 (always for a traced ``c`` not ``known`` at trace time: a learned logit scale); ``None``
    elsewhere (``c/x`` is data-dependent: the back-off is its net)."""
    if prim not in _SCALAR_FACTOR or len(vals) != 2 or len(out_vals) != 1:
        return None
    dtype = jnp.dtype(jnp.result_type(out_vals[0]))
    if not is_float(dtype) or dtype.itemsize > 2:
        return None
    sizes = [int(np.size(v)) for v in vals]
    if sorted(sizes)[0] != 1 or sizes[0] == sizes[1]:
        return None
    j = sizes.index(1)  # the scalar
    x = 1 - j
    if x not in diff or diff.index(x) in wide or (prim == "div" and j == 0):
        return None
    c = vals[j] if not isinstance(vals[j], jax.core.Tracer) else known[j]
    if c is not None:
        bound = abs(float(np.asarray(c, np.float64).reshape(())))
        bound = 1.0 / bound if prim == "div" and bound > 0 else (math.inf if prim == "div" else bound)
        return bound if bound > 1.0 else None
    c = jnp.abs(jnp.asarray(vals[j], _F32).reshape(()))
    return 1.0 / c if prim == "div" else c


def _weighted_inside(params: dict[str, Any]) -> int:
    """Matmuls/convolutions in the sub-jaxprs of an equation's params (scan, while, cond,
    custom_jvp/custom_vjp bodies), recursively."""
    total = 0
    for v in params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(sub, jcore.ClosedJaxpr):
                sub = sub.jaxpr
            if isinstance(sub, jcore.Jaxpr):
                for e in sub.eqns:
                    total += (e.primitive.name in _WEIGHTED) + _weighted_inside(e.params)
    return total


def _feature_axes(eqn: jcore.JaxprEqn, w: int, lhs_ndim: int, rhs_ndim: int) -> tuple[int, ...]:
    """The axes of a layer's output that come from its weight operand ``w`` (its output features):
    ``dot_general``'s output is (batch, lhs free, rhs free), a convolution's feature axis is its
    ``out_spec[1]``, a ragged dot's output is ``[m, n]``."""
    prim = eqn.primitive.name
    if prim == "conv_general_dilated":
        return (eqn.params["dimension_numbers"].out_spec[1],)
    if prim == "ragged_dot_general":
        return (-1,)
    (contract, batch) = eqn.params["dimension_numbers"]
    free = [nd - len(contract[i]) - len(batch[i]) for i, nd in enumerate((lhs_ndim, rhs_ndim))]
    start = len(batch[0]) + (free[0] if w == 1 else 0)
    return tuple(range(start, start + free[w]))


def _fan_in(eqn: jcore.JaxprEqn, w: int, shape: tuple[int, ...]) -> int:
    """Terms summed into each entry of the activation's gradient."""
    if eqn.primitive.name == "dot_general":
        (contract, batch) = eqn.params["dimension_numbers"]
        skip = set(contract[w]) | set(batch[w])
        return math.prod(d for i, d in enumerate(shape) if i not in skip)
    if eqn.primitive.name == "ragged_dot_general":  # lhs [m, k] · rhs [groups, k, n]
        nums = eqn.params["ragged_dot_dimension_numbers"]
        (contract, batch) = nums.dot_dimension_numbers
        skip = set(contract[w]) | set(batch[w]) | (set(nums.rhs_group_dimensions) if w == 1 else set())
        return math.prod(d for i, d in enumerate(shape) if i not in skip)
    params = eqn.params  # conv_general_dilated
    rhs_spec = params["dimension_numbers"].rhs_spec
    return conv_fan_in(shape[rhs_spec[0]], params["feature_group_count"],
                       [shape[d] for d in rhs_spec[2:]], params["window_strides"],
                       params["rhs_dilation"], params["lhs_dilation"],
                       [lo for lo, _ in params["padding"]])

#: per primitive, the tape's rule that may make its equation a decision node; every other
#: equation is an ``op``, transposed (its cotangent keeps the scale it carries)
CLASSIFY: dict[str, Callable[[Tape, Node, jcore.JaxprEqn, list[Any]], None]] = {
    **dict.fromkeys(_WEIGHTED, Tape._classify_layer),
    "convert_element_type": Tape._classify_cast,
}


#: per primitive with sub-jaxprs, the tape's forward for it where layers are inside: a region
#: node whose backward is :data:`jax_adaloss.regions.REGIONS`'s rule (``jax.checkpoint``: remat)
REGION_FORWARD: dict[str, Callable[[Tape, jcore.JaxprEqn, list[int]], list[int]]] = {
    "scan": Tape._scan,
    "cond": Tape._cond,
}


def named_axes(params: dict[str, Any]) -> tuple[Any, ...]:
    """The named mesh axes a collective (``psum``, ``pvary``, ``ppermute``, ``all_gather``...)
    communicates over; ``()`` for other equations (whose ``axes`` are positional ints)."""
    for key in ("axes", "axis_name"):
        v = params.get(key)
        if v is None:
            continue
        names = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        if names and not any(isinstance(a, (int, np.integer)) for a in names):
            return names
    return ()
