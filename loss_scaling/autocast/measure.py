"""The autocast program run on concrete values, equation by equation, so that each row of
the report holds the largest magnitude it produced and whether the half dtype held it.

The same rules as the staged rewrite decide every equation (``rewrite.interpret`` runs
both); only the sub-programs differ: here ``jit``, ``checkpoint``, custom rules and loops
run their bodies eagerly, iteration by iteration, so a value inside a ``scan`` is measured
at every step. ``shard_map`` bodies are staged as in the rewrite (they need their devices)
and are not measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax._src import core

from loss_scaling.autocast import rewrite
from loss_scaling.autocast.rewrite import Context, Place, Row, Scope, interpret
from loss_scaling.autocast.rules import Rule


def measure(ctx: Context, closed: core.ClosedJaxpr, args: Sequence[Any]) -> dict[Any, Row]:
    """Runs ``closed`` (a float32 program) on ``args`` under ``ctx``'s rules, eagerly;
    returns its rows, measured."""
    ctx = dataclasses.replace(ctx, rows={}, eager=EAGER)
    interpret(Scope(ctx, Place()), closed.jaxpr, closed.consts, list(args))
    assert ctx.rows is not None
    return ctx.rows


def _operands(scope: Scope, eqn: Any) -> list[Any]:
    return [rewrite.literal_value(scope.read(a)) for a in eqn.invars]


def _inner(closed_or_open: Any) -> tuple[Any, Sequence[Any]]:
    if isinstance(closed_or_open, core.ClosedJaxpr):
        return closed_or_open.jaxpr, closed_or_open.consts
    return closed_or_open, ()


def _call(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    name = eqn.primitive.name
    if name == "shard_map":
        return rewrite.rewrite_call(scope, eqn, place)
    if name == "cond":
        return _cond(scope, eqn, place), ""
    jaxpr, consts = _inner(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))
    if name in ("jit", "pjit") and rewrite.is_library(jaxpr.debug_info):
        place = dataclasses.replace(place, holds_library=True)
    return interpret(Scope(scope.ctx, place), jaxpr, consts, _operands(scope, eqn)), ""


def _cond(scope: Scope, eqn: Any, place: Place) -> list[Any]:
    index, *operands = _operands(scope, eqn)
    branches = eqn.params["branches"]
    # the dtypes the staged program gives the results: the widest over the branches
    staged = dataclasses.replace(scope.ctx, rows=None, eager=None)
    avals = [core.typeof(o) for o in operands]
    outs = [[v.aval.dtype for v in rewrite.rewrite_closed(staged, b, avals)[0].jaxpr.outvars]
            for b in branches]
    target = [rewrite.FLOAT32 if rewrite.FLOAT32 in column else column[0]
              for column in zip(*outs, strict=True)]
    taken = branches[int(jnp.clip(index, 0, len(branches) - 1))]
    values = interpret(Scope(scope.ctx, place), taken.jaxpr, taken.consts, operands)
    return [rewrite.convert(v, d) for v, d in zip(values, target, strict=True)]


def _loop(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    return (_scan if eqn.primitive.name == "scan" else _while)(scope, eqn, place), ""


def _scan(scope: Scope, eqn: Any, place: Place) -> list[Any]:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], int(p["length"])
    if length == 0:
        return rewrite.rewrite_scan(scope, eqn, place)
    operands = _operands(scope, eqn)
    consts, xs = operands[:n_consts], operands[n_consts + n_carry:]
    pinned = [a.aval.dtype for a in eqn.invars[n_consts:n_consts + n_carry]]
    carry = [rewrite.convert(v, d)
             for v, d in zip(operands[n_consts:n_consts + n_carry], pinned, strict=True)]
    body = p["jaxpr"]
    ys: list[list[Any]] = []
    inner = dataclasses.replace(place, repeats=place.repeats * length)
    for i in range(length - 1, -1, -1) if p["reverse"] else range(length):
        outs = interpret(Scope(scope.ctx, inner), body.jaxpr,
                         body.consts, [*consts, *carry, *(x[i] for x in xs)])
        carry = [rewrite.convert(v, d) for v, d in zip(outs[:n_carry], pinned, strict=True)]
        ys.append(outs[n_carry:])
    if p["reverse"]:
        ys.reverse()
    return [*carry, *(jnp.stack(column) for column in zip(*ys, strict=True))]


def _while(scope: Scope, eqn: Any, place: Place) -> list[Any]:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    operands = _operands(scope, eqn)
    pinned = [a.aval.dtype for a in eqn.invars[nc + nb:]]
    carry = [rewrite.convert(v, d) for v, d in zip(operands[nc + nb:], pinned, strict=True)]
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    while True:
        (go,) = interpret(Scope(scope.ctx, place), cond.jaxpr, cond.consts,
                          [*operands[:nc], *carry])
        if not bool(go):
            return carry
        outs = interpret(Scope(scope.ctx, place), body.jaxpr, body.consts,
                         [*operands[nc:nc + nb], *carry])
        carry = [rewrite.convert(v, d) for v, d in zip(outs, pinned, strict=True)]


def _custom(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    """The primal function of a custom rule, its boundary in the author's dtypes (as
    written, when the staged program keeps it as written)."""
    try:
        rewrite.custom_params(dataclasses.replace(scope.ctx, rows=None, eager=None), eqn,
                              place, record=False)
    except (KeyError, TypeError, AttributeError) as error:
        return rewrite.as_written(scope, eqn, place)[0], rewrite.kept_as_written(error)
    operands = [rewrite.as_original(scope, a) for a in eqn.invars]
    closed = eqn.params["call_jaxpr"]
    outs = interpret(Scope(scope.ctx, place), closed.jaxpr, closed.consts,
                     operands)
    return [rewrite.convert(o, v.aval.dtype) for o, v in zip(outs, eqn.outvars,
                                                               strict=True)], ""


EAGER = {Rule.CALL: _call, Rule.LOOP: _loop, Rule.CUSTOM: _custom}
"""The rules of sub-programs when measuring; every other rule is the staged rewrite's."""
