"""One walk over a jaxpr's equations, nested calls inlined, for the tools that read or
re-evaluate a traced function (:mod:`adaloss_tools.audit`, :mod:`adaloss_zoo.fp8_delayed`).

Each caller says what it keeps per value (an id, a value and a flag...) through three
callbacks; the walk does the environment, the literals and the inlining of call-like
equations (nested ``jit``, ``closed_call``...). Loops and conditionals stay one equation.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from jax.extend import core as jcore

V = TypeVar("V")

#: call primitives whose body a walk inlines, and the parameter that holds it
CALLS: Mapping[str, str] = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
                            "core_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
                            "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}
#: the calls whose body is plain code (re-binding it drops no custom derivative rule)
PLAIN_CALLS: tuple[str, ...] = ("pjit", "jit", "closed_call", "core_call")


def inlined_body(eqn: jcore.JaxprEqn, inline: Collection[str] = tuple(CALLS)) -> jcore.ClosedJaxpr | None:
    """The body of a call equation whose primitive is in ``inline``, closed; else ``None``."""
    name = eqn.primitive.name
    sub = eqn.params.get(CALLS[name]) if name in inline and name in CALLS else None
    if sub is None:
        return None
    return sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, [])


def walk(jaxpr: jcore.Jaxpr, consts: Sequence[V], args: Sequence[V],
         visit: Callable[[jcore.JaxprEqn, list[V]], Sequence[V]],
         literal: Callable[[Any], V], const: Callable[[Any], V],
         inline: Collection[str] = tuple(CALLS)) -> list[V]:
    """``jaxpr``'s outputs as ``visit`` computes them, equation by equation: ``visit(eqn, ins)``
    returns the outputs of one equation (not inlined) from what its inputs hold; ``literal(value)``
    and ``const(value)`` what a literal and an inlined body's constant hold. ``consts`` and
    ``args`` go with ``jaxpr``'s constvars and invars."""
    env: dict[Any, V] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom: Any) -> V:
        return literal(atom.val) if isinstance(atom, jcore.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        body = inlined_body(eqn, inline)
        if body is not None:
            outs = walk(body.jaxpr, [const(c) for c in body.consts], ins, visit, literal, const, inline)
        else:
            outs = list(visit(eqn, ins))
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]
