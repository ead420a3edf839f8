"""An eager jaxpr interpreter that shows every leaf equation's values to a visitor.

``jax.core.eval_jaxpr`` semantics (``eqn.primitive.bind(*invals, **bind_params)`` under
the equation's context), except that the higher-order primitives are interpreted rather than
bound: ``jit`` / ``closed_call``, ``checkpoint`` (``remat``), ``custom_jvp_call`` /
``custom_vjp_call`` (their primal function), ``cond`` (the taken branch), and ``scan`` /
``while`` one iteration at a time, so that a visitor sees the equations of the iteration
where something first goes wrong. Any other primitive (``shard_map``, callbacks) is bound
as a whole and shown as one equation.

The primitive names and parameter keys are JAX internals; tests/test_overflow.py pins
each one, so that a JAX release that renames one fails there and not silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import source_info_util
from jax.extend import core as jex

CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                   "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_JAXPR_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass(frozen=True)
class Where:
    """Where an equation runs: the pass, the name stack above it, the loop iterations."""

    phase: str  # "forward" or "backward"
    name_stack: Any = dataclasses.field(default_factory=source_info_util.NameStack)
    loops: tuple[tuple[str, int], ...] = ()

    def inside(self, eqn: Any) -> Where:
        return dataclasses.replace(self, name_stack=self.name_stack + eqn.source_info.name_stack)

    def iteration(self, kind: str, index: int) -> Where:
        return dataclasses.replace(self, loops=(*self.loops, (kind, index)))


# visit(eqn, invals, outvals, where) is called after each leaf equation ran.
Visitor = Callable[[Any, Sequence[Any], Sequence[Any], Where], None]


def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], where: Where,
        visit: Visitor) -> list[Any]:
    """Evaluates ``jaxpr`` eagerly, one equation at a time; returns its outputs."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with eqn.ctx.manager:
            outvals = _eval(eqn, invals, where.inside(eqn), visit)
        for v, x in zip(eqn.outvars, outvals, strict=True):
            if not isinstance(v, jex.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _open(closed: Any) -> tuple[Any, Sequence[Any]]:
    if isinstance(closed, jex.ClosedJaxpr):
        return closed.jaxpr, closed.consts
    return closed, ()


def _eval(eqn: Any, invals: list[Any], where: Where, visit: Visitor) -> list[Any]:
    name = eqn.primitive.name
    if name in CALLS:
        key = next(k for k in _JAXPR_KEYS if k in eqn.params)
        jaxpr, consts = _open(eqn.params[key])
        return run(jaxpr, consts, invals, where, visit)
    if name == "cond":
        branch = eqn.params["branches"][int(invals[0])]
        return run(branch.jaxpr, branch.consts, invals[1:], where, visit)
    if name == "scan":
        return _scan(eqn, invals, where, visit)
    if name == "while":
        return _while(eqn, invals, where, visit)
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    outvals = list(out) if eqn.primitive.multiple_results else [out]
    visit(eqn, invals, outvals, where)
    return outvals


def _scan(eqn: Any, invals: list[Any], where: Where, visit: Visitor) -> list[Any]:
    p = eqn.params
    body, length = p["jaxpr"], p["length"]
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, carry, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                         invals[n_consts + n_carry:])
    ys: list[list[Any]] = [[] for _ in eqn.outvars[n_carry:]]
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in order:
        out = run(body.jaxpr, body.consts, [*consts, *carry, *(x[i] for x in xs)],
                  where.iteration("scan", i), visit)
        carry = out[:n_carry]
        for stack, y in zip(ys, out[n_carry:], strict=True):
            stack.append(y)
    stacked = []
    for var, stack in zip(eqn.outvars[n_carry:], ys, strict=True):
        if not stack:
            stacked.append(jnp.zeros(var.aval.shape, var.aval.dtype))
        else:
            stacked.append(jnp.stack(stack[::-1] if p["reverse"] else stack))
    return [*carry, *stacked]


def _while(eqn: Any, invals: list[Any], where: Where, visit: Visitor) -> list[Any]:
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond:n_cond + n_body]
    carry = invals[n_cond + n_body:]
    i = 0
    while True:
        inner = where.iteration("while", i)
        (go,) = run(cond.jaxpr, cond.consts, [*cond_consts, *carry], inner, visit)
        if not bool(go):
            return carry
        carry = run(body.jaxpr, body.consts, [*body_consts, *carry], inner, visit)
        i += 1


def is_float(x: Any) -> bool:
    """Whether ``x`` is an array of a floating (real or complex) dtype."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def scopes(name_stack: Any) -> list[str]:
    """The scope names of a name stack (module paths, ``named_scope``), transforms dropped."""
    return [entry.name for entry in name_stack.stack
            if type(entry).__name__ == "Scope"]


def user_frame(eqn: Any, skip: Sequence[str]) -> Any:
    """The innermost frame of ``eqn``'s traceback outside JAX and the ``skip`` directories."""
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        if not frame.file_name.startswith(tuple(skip)):
            return frame
    return None


def as_jax_values(xs: Sequence[Any]) -> list[Any]:
    """Literals come as Python or numpy scalars: make every value an array."""
    return [jnp.asarray(x) if not isinstance(x, jax.Array) else x for x in xs]
