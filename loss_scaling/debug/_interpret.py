"""An eager jaxpr interpreter that keeps, per inf/NaN entry, the equation it came from: an
int32 *origin* array beside each value with inf/NaN entries (:data:`FINITE` where finite),
a NumPy array: computed on the host, the origins compile nothing (an eager ``jnp`` op
compiles once per shape, the bulk of a first run's time).
:func:`_propagate` is the rule per primitive; README.md ("The interpreter") says why, which
primitives are interpreted, how origins that meet are joined, where an equation is placed
(its user frame and layer) and what it cannot see.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
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


# Scopes JAX itself opens (jax.checkpoint's recomputation): not a layer of the user's.
JAX_SCOPES = frozenset({"rematted_computation"})


@dataclasses.dataclass(frozen=True)
class Where:
    """Where an equation runs: the pass, the name stack above it, the loop iterations, and
    the user's source frame (``frame``: its own, else borrowed; see :meth:`Interpreter._place`).

    ``loops`` holds ``(kind, index)`` per enclosing loop, outermost first: for a scan the
    index into the scanned axis (a reverse scan, as every backward pass of a forward scan
    is, runs its indices from the last down), for a while loop the iteration count.
    ``runs`` holds, per loop, ``(position, length)``: the how-manieth iteration it was in
    execution order (from 1) and the scan's length (``None`` for a while loop).
    """

    phase: str  # "forward" or "backward"
    name_stack: Any = dataclasses.field(default_factory=source_info_util.NameStack)
    loops: tuple[tuple[str, int], ...] = ()
    runs: tuple[tuple[int, int | None], ...] = ()
    frame: Any = None  # the user's frame: of the equation, else borrowed (see _place)
    enclosing: Any = None  # the innermost enclosing call's user frame (jit, scan, ...)
    carries: frozenset[Any] = frozenset()  # the innermost loop body's sums of its carry

    def inside(self, eqn: Any, frame: Any = None) -> Where:
        """Inside ``eqn``; ``frame`` is its user frame, if it has one."""
        return dataclasses.replace(self, name_stack=self.name_stack + eqn.source_info.name_stack,
                                   enclosing=frame or self.enclosing)

    def iteration(self, kind: str, index: int, position: int, length: int | None,
                  carries: frozenset[Any] = frozenset()) -> Where:
        return dataclasses.replace(self, loops=(*self.loops, (kind, index)),
                                   runs=(*self.runs, (position, length)), carries=carries)

    @property
    def scopes(self) -> list[str]:
        """The scope names (module paths, ``named_scope``), transforms and JAX's own
        scopes dropped."""
        return [e.name for e in self.name_stack.stack
                if type(e).__name__ == "Scope" and e.name not in JAX_SCOPES]

    @property
    def layer(self) -> str:
        return "/".join(self.scopes)


# visit(eqn, invals, outvals, where, out_origins) after each leaf equation (None: finite).
Visitor = Callable[[Any, Sequence[Any], Sequence[Any], Where, Sequence[Any]], None]
# fresh(id, eqn, invals, out, where) is called once per equation output that holds a
# non-finite entry none of its inputs gave it: ``id`` is its origin (in execution order).
Fresh = Callable[[int, Any, Sequence[Any], Any, Where], None]


class Run(NamedTuple):
    """What evaluating a jaxpr gives, one entry per output: the values, their origins
    (``None`` where finite) and their places (the ``Where`` of the equation that made
    them, once placed at a user frame; ``None`` if unknown)."""

    values: list[Any]
    origins: list[Any]
    places: list[Any]


@dataclasses.dataclass
class Interpreter:
    """Runs jaxprs eagerly; ``fresh`` registers each new non-finite, ``visit`` sees all.

    ``frame_of(eqn)`` is the user's frame of an equation's traceback (or ``None``);
    ``joined`` maps an origin to the origins it was joined to (see :meth:`_join`).
    """

    visit: Visitor
    fresh: Fresh
    frame_of: Callable[[Any], Any] = lambda eqn: None
    ids: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(ARGUMENT + 1))
    joined: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    _frames: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)

    def eval_jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], where: Where,
                   origins: Sequence[Any], const_origins: Sequence[Any] = (),
                   places: Sequence[Any] = ()) -> Run:
        """Evaluates ``jaxpr``; returns its outputs, their origins and places.

        ``origins`` and ``const_origins`` are those of ``args`` and ``consts`` (``None``
        for a finite one; ``consts`` carry none by default, nor does a literal); ``places``
        those of ``args`` (none by default).
        """
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        src = dict(zip(jaxpr.invars, origins, strict=True))
        src.update(zip(jaxpr.constvars, const_origins, strict=False))
        made = dict(zip(jaxpr.invars, places, strict=False))

        def read(v: Any) -> tuple[Any, Any, Any]:
            if isinstance(v, jex.Literal):
                return v.val, None, None
            return env[v], src.get(v), made.get(v)

        for eqn in jaxpr.eqns:
            invals, inorigins, inplaces = (zip(*map(read, eqn.invars), strict=True)
                                           if eqn.invars else ((), (), ()))
            with eqn.ctx.manager:
                run = self._eval(eqn, list(invals), list(inorigins), list(inplaces), where)
            for v, x, o, m in zip(eqn.outvars, *run, strict=True):
                if not isinstance(v, jex.DropVar):
                    env[v], made[v] = x, m
                    if o is not None:
                        src[v] = o
        return Run(*map(list, zip(*map(read, jaxpr.outvars), strict=True))
                   ) if jaxpr.outvars else Run([], [], [])

    def _frame(self, eqn: Any) -> tuple[Any, Any]:
        """``eqn``'s user frame (cached: an equation of a loop body runs many times) and
        the equation itself, kept so that its ``id`` stays its own."""
        key = id(eqn)
        if key not in self._frames:
            self._frames[key] = (self.frame_of(eqn), eqn)
        return self._frames[key]

    def _place(self, eqn: Any, where: Where, inplaces: list[Any]) -> Where:
        """Where to report a leaf equation: at its own user frame if its traceback has
        one. One JAX made with no name of its own (the sum of a gradient's terms, zeros)
        borrows the place of the first input made at a user frame inside its own scopes, a
        sum that a loop carries that of the term it adds (under ``jax.checkpoint`` the sum
        of a weight's gradient over a scan's iterations is such a one). Any other takes
        the innermost enclosing call's frame (the cell of flax's ``nn.RNN``, whose
        traceback ends in flax)."""
        inner = where.inside(eqn)
        frame = self._frame(eqn)[0]
        if frame is not None:
            return dataclasses.replace(inner, frame=frame)
        if not eqn.source_info.name_stack.stack:
            # a sum a loop carries takes the place of the term it adds, not of the sum
            ranked = sorted(zip(eqn.invars, inplaces, strict=True),
                            key=lambda vp: not isinstance(vp[0], jex.Literal)
                            and vp[0] in where.carries)
            scopes = inner.scopes  # borrowed only from inside them: a value made
            borrowed = next((p for _, p in ranked  # elsewhere says nothing of this place
                             if p is not None and p.frame is not None
                             and p.scopes[:len(scopes)] == scopes), None)
            if borrowed is not None:
                return dataclasses.replace(inner, name_stack=borrowed.name_stack,
                                           frame=borrowed.frame)
        return dataclasses.replace(inner, frame=where.enclosing)

    def _eval(self, eqn: Any, invals: list[Any], origins: list[Any], inplaces: list[Any],
              where: Where) -> Run:
        name = eqn.primitive.name
        if name in {*CALLS, "cond", "scan", "while"}:
            inner = where.inside(eqn, self._frame(eqn)[0])
            if name == "scan":
                return self._scan(eqn, invals, origins, inplaces, inner)
            if name == "while":
                return self._while(eqn, invals, origins, inplaces, inner)
            if name == "cond":
                branch = eqn.params["branches"][int(invals[0])]
                return self.eval_jaxpr(branch.jaxpr, branch.consts, invals[1:], inner,
                                       origins[1:], places=inplaces[1:])
            closed = eqn.params[next(k for k in _JAXPR_KEYS if k in eqn.params)]
            if isinstance(closed, jex.ClosedJaxpr):
                return self.eval_jaxpr(closed.jaxpr, closed.consts, invals, inner, origins,
                                       places=inplaces)
            return self.eval_jaxpr(closed, (), invals, inner, origins, places=inplaces)
        placed = self._place(eqn, where, inplaces)
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        outvals = list(out) if eqn.primitive.multiple_results else [out]
        outorigins = [self._origin(eqn, invals, origins, i, x, placed)
                      for i, x in enumerate(outvals)]
        self.visit(eqn, invals, outvals, placed, outorigins)
        made = placed if placed.frame is not None else None
        return Run(outvals, outorigins, [made] * len(outvals))

    def _origin(self, eqn: Any, invals: list[Any], origins: list[Any], index: int, out: Any,
                where: Where) -> Any:
        if not is_float(out) or finite_on_host(out):
            return None
        bad = ~np.isfinite(np.asarray(out))
        came = (_propagate(eqn, invals, origins, index, out) if any(o is not None for o in origins)
                else np.full(out.shape, FINITE, np.int32))
        new = bad & (came == FINITE)
        if new.any():
            key = next(self.ids)
            self.fresh(key, eqn, invals, out, where)
            came = np.where(new, np.int32(key), came)
        result = np.where(bad, came, FINITE).astype(np.int32)
        self._join(eqn, invals, origins, index, out, bad, result)
        return result

    def _join(self, eqn: Any, invals: list[Any], origins: list[Any], index: int, out: Any,
              bad: Any, result: Any) -> None:
        """Records the origins of the inputs that this output's labels lost without their
        values being masked: an entry keeps the earliest origin among those it depends on,
        so where the inf/NaN of a later one meets an earlier one's, the later is *joined*
        to it: its values go on, labelled by the earlier (``joined[later]`` gets the
        labels of the entries it went into). An origin that neither goes on under its own
        label nor joins one was masked here (its entries turned finite).

        Exact per origin: each lost one is propagated alone, with the same rule.
        """
        kept = origin_ids(result)
        lost = set().union(*map(origin_ids, origins)) - kept
        for key in sorted(lost):
            alone = [None if o is None else np.where(o == key, key, FINITE).astype(np.int32)
                     for o in origins]
            if all(o is None or not origin_ids(o) for o in alone):
                continue
            went = bad & (_propagate(eqn, invals, alone, index, out) == key)
            if went.any():
                self.joined.setdefault(key, set()).update(origin_ids(np.where(went, result,
                                                                              FINITE)))

    def _scan(self, eqn: Any, invals: list[Any], origins: list[Any], inplaces: list[Any],
              where: Where) -> Run:
        p = eqn.params
        body, n_consts, n_carry, length = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
        n_in = n_consts + n_carry
        consts, carry, xs = invals[:n_consts], invals[n_consts:n_in], invals[n_in:]
        c_o, carry_o, xs_o = origins[:n_consts], origins[n_consts:n_in], origins[n_in:]
        c_p, carry_p, xs_p = inplaces[:n_consts], inplaces[n_consts:n_in], inplaces[n_in:]
        carries = _sums_of(body.jaxpr, body.jaxpr.invars[n_consts:n_in])
        ys: list[list[tuple[Any, Any]]] = [[] for _ in eqn.outvars[n_carry:]]  # (value, origin)
        ys_p: list[Any] = [None] * (len(eqn.outvars) - n_carry)
        order = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for position, i in enumerate(order, 1):
            out = self.eval_jaxpr(
                body.jaxpr, body.consts, [*consts, *carry, *(x[i] for x in xs)],
                where.iteration("scan", i, position, length, carries),
                [*c_o, *carry_o, *(None if o is None else o[i] for o in xs_o)],
                places=[*c_p, *carry_p, *xs_p])
            carry, carry_o, carry_p = (r[:n_carry] for r in out)
            ys_p = out.places[n_carry:]
            for stack, y, o in zip(ys, out.values[n_carry:], out.origins[n_carry:], strict=True):
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
                             else np.stack([_full(o, y) for y, o in stack]))
        return Run([*carry, *stacked], [*carry_o, *stacked_o], [*carry_p, *ys_p])

    def _while(self, eqn: Any, invals: list[Any], origins: list[Any], inplaces: list[Any],
               where: Where) -> Run:
        p = eqn.params
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:n_cond], invals[n_cond:n_cond + n_body]
        cond_o, body_o = origins[:n_cond], origins[n_cond:n_cond + n_body]
        body_p = inplaces[n_cond:n_cond + n_body]
        carry, carry_o = invals[n_cond + n_body:], origins[n_cond + n_body:]
        carry_p = inplaces[n_cond + n_body:]
        carries = _sums_of(body.jaxpr, body.jaxpr.invars[n_body:])
        i = 0
        while True:
            inner = where.iteration("while", i, i + 1, None, carries)
            go = self.eval_jaxpr(cond.jaxpr, cond.consts, [*cond_consts, *carry], inner,
                                 [*cond_o, *carry_o]).values[0]
            if not bool(go):
                return Run(list(carry), list(carry_o), list(carry_p))
            carry, carry_o, carry_p = self.eval_jaxpr(
                body.jaxpr, body.consts, [*body_consts, *carry], inner, [*body_o, *carry_o],
                places=[*body_p, *carry_p])
            i += 1


def _sums_of(jaxpr: Any, carry: Sequence[Any]) -> frozenset[Any]:
    """A loop body's carry variables and the ``add_any`` results that add to one: the sums
    a backward scan carries (the gradient of what the scan closes over, over iterations)."""
    sums = set(carry)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "add_any" and any(v in sums for v in eqn.invars
                                                   if not isinstance(v, jex.Literal)):
            sums.update(eqn.outvars)
    return frozenset(sums)


def _full(origin: Any, like: Any) -> Any:
    """``origin``, or all :data:`FINITE` where there is none, in ``like``'s shape."""
    return np.full(np.shape(like), FINITE, np.int32) if origin is None else origin


def _propagate(eqn: Any, invals: list[Any], origins: list[Any], index: int, out: Any) -> Any:
    """Per entry of output ``index``: the earliest origin among the entries it depends on."""
    name, shape = eqn.primitive.name, out.shape
    if name in ELEMENTWISE:
        came = np.full(shape, FINITE, np.int32)
        for o in origins:
            if o is not None:
                came = np.minimum(came, np.broadcast_to(o, shape))
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
        return np.broadcast_to(np.asarray(moved), shape).astype(np.int32)
    if name in REDUCTIONS and len(invals) == 1:
        return np.broadcast_to(np.min(origins[0], axis=tuple(eqn.params["axes"])), shape)
    if name in CUMULATIVE and origins[0] is not None:
        axis, flip = eqn.params["axis"], eqn.params["reverse"]
        o = np.flip(origins[0], axis) if flip else origins[0]
        o = np.minimum.accumulate(o, axis=axis)
        return np.flip(o, axis) if flip else o
    if name == "dot_general":
        return _dot_general(eqn, origins, shape)
    return _earliest(origins, shape)


def _earliest(origins: list[Any], shape: tuple[int, ...]) -> Any:
    earliest = min(int(np.min(o)) for o in origins if o is not None)
    return np.full(shape, earliest, np.int32)


def _dot_general(eqn: Any, origins: list[Any], shape: tuple[int, ...]) -> Any:
    """Output (batch, lhs free, rhs free) depends on the rows and columns it contracts."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    n_batch = len(lb)
    came = np.full(shape, FINITE, np.int32)
    for o, contract, batch, first in ((origins[0], lc, lb, True), (origins[1], rc, rb, False)):
        if o is None:
            continue
        free = [d for d in range(o.ndim) if d not in contract and d not in batch]
        reduced = np.min(np.transpose(o, (*batch, *free, *contract)),
                          axis=tuple(range(len(batch) + len(free), o.ndim)))
        # insert the other operand's free dimensions: after ours (lhs) or before (rhs)
        n_other = len(shape) - n_batch - len(free)
        at = n_batch + len(free) if first else n_batch
        expanded = np.expand_dims(reduced, tuple(range(at, at + n_other)))
        came = np.minimum(came, np.broadcast_to(expanded, shape))
    return came


def finite_on_host(x: Any) -> bool:
    """Whether every entry of a floating array is finite (read on the host: an eager
    ``jnp`` test would compile once per shape, the bulk of a first run's time)."""
    return bool(np.isfinite(np.asarray(x)).all())


def arguments(xs: Sequence[Any]) -> list[Any]:
    """The origins of a jaxpr's arguments: :data:`ARGUMENT` at their non-finite entries."""
    return [np.where(np.isfinite(np.asarray(x)), FINITE, ARGUMENT).astype(np.int32)
            if is_float(x) and not finite_on_host(x) else None for x in xs]


def origin_ids(origin: Any) -> set[int]:
    """The equations whose non-finite values an origin array carries (none for ``None``)."""
    if origin is None:
        return set()
    return set(np.unique(np.asarray(origin)).tolist()) - {FINITE}


def is_float(x: Any) -> bool:
    """Whether ``x`` is an array of a floating (real or complex) dtype."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)

