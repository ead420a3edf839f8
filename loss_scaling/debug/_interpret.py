"""An eager jaxpr interpreter that keeps, per inf/NaN entry, the equation it came from: an
int32 *origin* array beside each value with inf/NaN entries (:data:`FINITE` where finite).
:func:`_propagate` is the rule per primitive; README.md ("The interpreter") says why, which
primitives are interpreted, and what it cannot see.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import source_info_util
from jax.extend import core as jex

CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                   "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_JAXPR_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")

FINITE = np.iinfo(np.int32).max  # the origin of a finite entry
ARGUMENT = 1  # the origin of a non-finite entry of an argument (the batch, the params)

# Output entry i depends on input entry i (after broadcasting a scalar) and on no other.
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "complex", "conj", "convert_element_type", "copysign", "cos",
    "cosh", "digamma", "div", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "imag", "integer_pow", "is_finite", "lgamma", "log", "log1p", "logistic", "max", "min",
    "mul", "neg", "nextafter", "pow", "real", "reduce_precision", "rem", "round", "rsqrt",
    "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh",
    "polygamma", "igamma", "igammac", "bessel_i0e", "bessel_i1e", "optimization_barrier",
})
# Data movement: the same primitive applied to the origins moves them as it moves the data.
STRUCTURAL = frozenset({
    "broadcast_in_dim", "concatenate", "copy", "copy_p", "dynamic_slice",
    "dynamic_update_slice", "expand_dims", "gather", "pad", "reshape", "rev", "scatter",
    "select_n", "slice", "squeeze", "transpose",
})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                        "reduce_and", "reduce_or", "argmax", "argmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


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

    @property
    def scopes(self) -> list[str]:
        """The scope names (module paths, ``named_scope``), transforms dropped."""
        return [e.name for e in self.name_stack.stack if type(e).__name__ == "Scope"]


# visit(eqn, invals, outvals, where, out_origins) after each leaf equation (None: finite).
Visitor = Callable[[Any, Sequence[Any], Sequence[Any], Where, Sequence[Any]], None]
# fresh(id, eqn, invals, out, where) is called once per equation output that holds a
# non-finite entry none of its inputs gave it: ``id`` is its origin (in execution order).
Fresh = Callable[[int, Any, Sequence[Any], Any, Where], None]


@dataclasses.dataclass
class Interpreter:
    """Runs jaxprs eagerly; ``fresh`` registers each new non-finite, ``visit`` sees all."""

    visit: Visitor
    fresh: Fresh
    ids: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(ARGUMENT + 1))

    def eval_jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], where: Where,
                   origins: Sequence[Any], const_origins: Sequence[Any] = ()
                   ) -> tuple[list[Any], list[Any]]:
        """Evaluates ``jaxpr``; returns its outputs and their origins.

        ``origins`` and ``const_origins`` are those of ``args`` and ``consts`` (``None``
        for a finite one; ``consts`` carry none by default, nor does a literal).
        """
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        src = dict(zip(jaxpr.invars, origins, strict=True))
        src.update(zip(jaxpr.constvars, const_origins, strict=False))

        def read(v: Any) -> tuple[Any, Any]:
            if isinstance(v, jex.Literal):
                return v.val, None
            return env[v], src.get(v)

        for eqn in jaxpr.eqns:
            invals, inorigins = zip(*map(read, eqn.invars), strict=True) if eqn.invars else ((), ())
            with eqn.ctx.manager:
                outvals, outorigins = self._eval(eqn, list(invals), list(inorigins),
                                                 where.inside(eqn))
            for v, x, o in zip(eqn.outvars, outvals, outorigins, strict=True):
                if not isinstance(v, jex.DropVar):
                    env[v] = x
                    if o is not None:
                        src[v] = o
        outs = [read(v) for v in jaxpr.outvars]
        return [x for x, _ in outs], [o for _, o in outs]

    def _eval(self, eqn: Any, invals: list[Any], origins: list[Any],
              where: Where) -> tuple[list[Any], list[Any]]:
        name = eqn.primitive.name
        if name in CALLS:
            closed = eqn.params[next(k for k in _JAXPR_KEYS if k in eqn.params)]
            if isinstance(closed, jex.ClosedJaxpr):
                return self.eval_jaxpr(closed.jaxpr, closed.consts, invals, where, origins)
            return self.eval_jaxpr(closed, (), invals, where, origins)
        if name == "cond":
            branch = eqn.params["branches"][int(invals[0])]
            return self.eval_jaxpr(branch.jaxpr, branch.consts, invals[1:], where, origins[1:])
        if name == "scan":
            return self._scan(eqn, invals, origins, where)
        if name == "while":
            return self._while(eqn, invals, origins, where)
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        outvals = list(out) if eqn.primitive.multiple_results else [out]
        outorigins = [self._origin(eqn, invals, origins, i, x, where)
                      for i, x in enumerate(outvals)]
        self.visit(eqn, invals, outvals, where, outorigins)
        return outvals, outorigins

    def _origin(self, eqn: Any, invals: list[Any], origins: list[Any], index: int, out: Any,
                where: Where) -> Any:
        if not is_float(out) or finite_on_host(out):
            return None
        bad = ~jnp.isfinite(out)
        came = (_propagate(eqn, invals, origins, index, out) if any(o is not None for o in origins)
                else jnp.full(out.shape, FINITE, jnp.int32))
        new = bad & (came == FINITE)
        if bool(jnp.any(new)):
            key = next(self.ids)
            self.fresh(key, eqn, invals, out, where)
            came = jnp.where(new, jnp.int32(key), came)
        return jnp.where(bad, came, FINITE).astype(jnp.int32)

    def _scan(self, eqn: Any, invals: list[Any], origins: list[Any],
              where: Where) -> tuple[list[Any], list[Any]]:
        p = eqn.params
        body, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
        n_in = n_consts + n_carry
        consts, carry, xs = invals[:n_consts], invals[n_consts:n_in], invals[n_in:]
        c_o, carry_o, xs_o = origins[:n_consts], origins[n_consts:n_in], origins[n_in:]
        ys: list[list[tuple[Any, Any]]] = [[] for _ in eqn.outvars[n_carry:]]  # (value, origin)
        for i in range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"]):
            out, out_o = self.eval_jaxpr(
                body.jaxpr, body.consts, [*consts, *carry, *(x[i] for x in xs)],
                where.iteration("scan", i),
                [*c_o, *carry_o, *(None if o is None else o[i] for o in xs_o)])
            carry, carry_o = out[:n_carry], out_o[:n_carry]
            for stack, y, o in zip(ys, out[n_carry:], out_o[n_carry:], strict=True):
                stack.append((y, o))
        stacked: list[Any] = []
        stacked_o: list[Any] = []
        for var, stack in zip(eqn.outvars[n_carry:], ys, strict=True):
            if p["reverse"]:
                stack.reverse()
            if not stack:  # length 0
                stacked.append(jnp.zeros(var.aval.shape, var.aval.dtype))
                stacked_o.append(None)
                continue
            stacked.append(jnp.stack([y for y, _ in stack]))
            stacked_o.append(None if all(o is None for _, o in stack)
                             else jnp.stack([_full(o, y) for y, o in stack]))
        return [*carry, *stacked], [*carry_o, *stacked_o]

    def _while(self, eqn: Any, invals: list[Any], origins: list[Any],
               where: Where) -> tuple[list[Any], list[Any]]:
        p = eqn.params
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:n_cond], invals[n_cond:n_cond + n_body]
        cond_o, body_o = origins[:n_cond], origins[n_cond:n_cond + n_body]
        carry, carry_o = invals[n_cond + n_body:], origins[n_cond + n_body:]
        i = 0
        while True:
            inner = where.iteration("while", i)
            (go,), _ = self.eval_jaxpr(cond.jaxpr, cond.consts, [*cond_consts, *carry],
                                       inner, [*cond_o, *carry_o])
            if not bool(go):
                return carry, carry_o
            carry, carry_o = self.eval_jaxpr(body.jaxpr, body.consts, [*body_consts, *carry],
                                             inner, [*body_o, *carry_o])
            i += 1


def _full(origin: Any, like: Any) -> Any:
    """``origin``, or all :data:`FINITE` where there is none, in ``like``'s shape."""
    return jnp.full(jnp.shape(like), FINITE, jnp.int32) if origin is None else origin


def _propagate(eqn: Any, invals: list[Any], origins: list[Any], index: int, out: Any) -> Any:
    """Per entry of output ``index``: the earliest origin among the entries it depends on."""
    name, shape = eqn.primitive.name, out.shape
    if name in ELEMENTWISE:
        came = jnp.full(shape, FINITE, jnp.int32)
        for o in origins:
            if o is not None:
                came = jnp.minimum(came, jnp.broadcast_to(o, shape))
        return came
    if name in STRUCTURAL:
        args = [_full(o, x) if is_float(x) else x
                for x, o in zip(invals, origins, strict=True)]
        params = dict(eqn.primitive.get_bind_params(eqn.params))
        if name == "gather":
            params["fill_value"] = FINITE
        try:
            moved = eqn.primitive.bind(*args, **params)
        except Exception:  # noqa: BLE001  (a parameter tied to the float dtype)
            return _earliest(origins, shape)
        moved = moved[index] if eqn.primitive.multiple_results else moved
        return jnp.broadcast_to(moved, shape).astype(jnp.int32)
    if name in REDUCTIONS and len(invals) == 1:
        return jnp.broadcast_to(jnp.min(origins[0], axis=tuple(eqn.params["axes"])), shape)
    if name in CUMULATIVE and origins[0] is not None:
        return lax.cummin(origins[0], axis=eqn.params["axis"], reverse=eqn.params["reverse"])
    if name == "dot_general":
        return _dot_general(eqn, origins, shape)
    return _earliest(origins, shape)


def _earliest(origins: list[Any], shape: tuple[int, ...]) -> Any:
    earliest = min(int(jnp.min(o)) for o in origins if o is not None)
    return jnp.full(shape, earliest, jnp.int32)


def _dot_general(eqn: Any, origins: list[Any], shape: tuple[int, ...]) -> Any:
    """Output (batch, lhs free, rhs free) depends on the rows and columns it contracts."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    n_batch = len(lb)
    came = jnp.full(shape, FINITE, jnp.int32)
    for o, contract, batch, first in ((origins[0], lc, lb, True), (origins[1], rc, rb, False)):
        if o is None:
            continue
        free = [d for d in range(o.ndim) if d not in contract and d not in batch]
        reduced = jnp.min(jnp.transpose(o, (*batch, *free, *contract)),
                          axis=tuple(range(len(batch) + len(free), o.ndim)))
        # insert the other operand's free dimensions: after ours (lhs) or before (rhs)
        n_other = len(shape) - n_batch - len(free)
        at = n_batch + len(free) if first else n_batch
        expanded = jnp.expand_dims(reduced, tuple(range(at, at + n_other)))
        came = jnp.minimum(came, jnp.broadcast_to(expanded, shape))
    return came


def finite_on_host(x: Any) -> bool:
    """Whether every entry of a floating array is finite (read on the host: an eager
    ``jnp`` test would compile once per shape, the bulk of a first run's time)."""
    return bool(np.isfinite(np.asarray(x)).all())


def arguments(xs: Sequence[Any]) -> list[Any]:
    """The origins of a jaxpr's arguments: :data:`ARGUMENT` at their non-finite entries."""
    return [jnp.where(jnp.isfinite(x), FINITE, ARGUMENT).astype(jnp.int32)
            if is_float(x) and not finite_on_host(x) else None for x in xs]


def origin_ids(origin: Any) -> set[int]:
    """The equations whose non-finite values an origin array carries (none for ``None``)."""
    if origin is None:
        return set()
    return set(np.unique(np.asarray(origin)).tolist()) - {FINITE}


def is_float(x: Any) -> bool:
    """Whether ``x`` is an array of a floating (real or complex) dtype."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)

