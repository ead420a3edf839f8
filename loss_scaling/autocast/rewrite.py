"""The staged rewrite: a float32 jaxpr re-traced, equation by equation, into its autocast
program. README.md ("Why a staged rewrite") argues the design; :mod:`.rules` is the table
this module reads.

:func:`rewrite_closed` traces a new jaxpr whose equations are those of the old one, each
bound again by :func:`interpret` with the operands its :class:`~.rules.Rule` asks for.
Binding (rather than editing equations) lets every primitive's own shape and dtype rules
type the new program, and sub-programs are rewritten by the same loop: ``jit``,
``checkpoint``, ``shard_map`` and ``cond`` in the dtypes their operands arrive in; ``scan``
and ``while`` with their carries pinned to the dtypes they had; custom rules with their
boundary pinned to the dtypes their author wrote them for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import api_util, core, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import ad
from jax._src.interpreters import partial_eval as pe

from loss_scaling import _registry
from loss_scaling.autocast.rules import Rule, rule_of

FLOAT32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Row:
    """One equation of the autocast program, as :func:`loss_scaling.autocast_report` shows it.

    Attributes:
      primitive: the primitive's name.
      rule: the :class:`~.rules.Rule` that decided its dtypes.
      in_dtypes: the dtypes of its operands as it runs (``None`` for a literal's place).
      out_dtypes: the dtypes of its results.
      path: where it is in the model: the name stack (flax module path, ``named_scope``).
      source: ``file:line`` of the user's code that wrote it (``None`` when unknown).
      flops: the FLOPs of one execution of a matmul or convolution, else 0.
      repeats: how often it runs per call (the product of the enclosing ``scan`` lengths).
      note: why a rule was not applied as tabled (a fallback), or ``""``.
      max_abs: the largest magnitude among its floating results over every execution
        (``None`` when the report did not run the program).
      overflows: ``""``, or why the half dtype does not hold it: ``"result"`` (a half
        result is inf or NaN while its operands are finite), ``"near max"`` (a half result
        within :data:`HEADROOM_FACTOR` of the dtype's largest value) or ``"input"`` (a
        float32 operand it casts to half overflows).
    """

    primitive: str
    rule: Rule
    in_dtypes: tuple[Any, ...]
    out_dtypes: tuple[Any, ...]
    path: str
    source: str | None
    flops: int = 0
    repeats: int = 1
    note: str = ""
    max_abs: float | None = None
    overflows: str = ""


HEADROOM_FACTOR = 4.0
"""A half result larger than the dtype's largest value over this factor is flagged: other
batches than the measured one must fit too (two bits of headroom: 16,376 in float16)."""


@dataclasses.dataclass(frozen=True)
class Place:
    """Where an equation is in the user's code, and how often it runs per call.

    Attributes:
      path: its module path or named scopes (``"LM/block_0/wo"``; transformations such as
        ``vmap(...)`` are not part of it).
      repeats: how often it runs per call (the product of the enclosing ``scan`` lengths).
      eqn: the equation (``None`` for the program itself).
      outer: the place of the equation whose sub-program holds this one.
      library: whether its code is a library's (inside a ``jit`` of ``jax.nn``, flax): then
        its :attr:`source` is where the user called the library.
      holds_library: whether the sub-program it holds is a library's.
    """

    path: str = ""
    repeats: int = 1
    eqn: Any = None
    outer: Place | None = None
    library: bool = False
    holds_library: bool = False

    @functools.cached_property
    def source(self) -> str | None:
        """``file:line`` of the user's code that wrote it: its own line when that is the
        user's, else the enclosing equation's."""
        own = None if self.eqn is None or self.library else source_of(self.eqn)
        return own or (self.outer.source if self.outer is not None else None)

    def of(self, eqn: Any) -> Place:
        """The place of ``eqn``, an equation of the sub-program this place holds."""
        inside = self.library or self.holds_library
        return Place(_join(self.path, scope_names(eqn.source_info.name_stack)), self.repeats,
                     eqn, self, library=inside, holds_library=inside)


Decide = Callable[[Any, Place, Rule], Rule]
"""``(eqn, place, tabled_rule) -> rule``: a policy's choice for one equation."""


@dataclasses.dataclass
class Context:
    """What one rewrite needs: the half dtype, the policy's choice per equation, and the
    report's rows (``None`` when nobody asked for them), one per equation and place.

    ``eager`` holds the rules that run sub-programs on concrete values when the report
    measures (``measure.py``); without it every sub-program is rewritten and staged.
    """

    half: np.dtype
    decide: Decide
    rows: dict[Any, Row] | None = None
    eager: dict[Rule, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Literal:
    """A jaxpr literal as the interpreter holds it: a Python or NumPy scalar."""

    val: Any
    aval: Any


@dataclasses.dataclass
class Scope:
    """One jaxpr being interpreted: its variables' values and casts already made."""

    ctx: Context
    place: Place  # of the equation whose sub-program this is
    env: dict[Any, Any] = dataclasses.field(default_factory=dict)
    twins: dict[Any, Any] = dataclasses.field(default_factory=dict)  # var -> its half copy
    casts: dict[tuple[Any, Any], Any] = dataclasses.field(default_factory=dict)
    producers: dict[Any, Any] = dataclasses.field(default_factory=dict)  # var -> its eqn
    matmul_results: set[Any] = dataclasses.field(default_factory=set)  # of half matmuls
    bound: Sequence[Any] = ()  # the operands the last equation was bound with (for its row)
    cast_overflow: bool = False  # a cast to half of a finite value gave inf (when measuring)

    def read(self, atom: Any) -> Any:
        if isinstance(atom, core.Literal):
            return Literal(atom.val, atom.aval)
        return self.env[atom]

    def cast(self, atom: Any, dtype: Any) -> Any:
        """``atom``'s value in ``dtype``, cast once per variable and dtype in this scope."""
        value = self.read(atom)
        if isinstance(value, Literal):
            return np.asarray(value.val, dtype)[()] if is_float(value.aval.dtype) else value.val
        dtype = np.dtype(dtype)
        if dtype_of(value) == dtype:
            return value
        key = (atom, dtype)
        if key not in self.casts:
            twin = self.twins.get(atom)
            if twin is not None and dtype == self.ctx.half and dtype_of(value) == FLOAT32:
                self.casts[key] = invariant_cast(value, twin)
            else:
                self.casts[key] = lax.convert_element_type(value, dtype)
            if self.ctx.eager is not None and dtype == self.ctx.half:
                self.cast_overflow |= _overflowed(value, self.casts[key])
        return self.casts[key]


# -- the rewrite --------------------------------------------------------------------------

def rewrite_closed(ctx: Context, closed: core.ClosedJaxpr, in_avals: Sequence[Any], *,
                   place: Place | None = None, twins: Sequence[bool] = (),
                   pin_out: Sequence[Any] | None = None, name: str = "autocast"
                   ) -> tuple[core.ClosedJaxpr, list[bool]]:
    """``closed`` rewritten for operands of ``in_avals``.

    ``twins[i]`` offers invar ``i`` a half copy made outside (an extra invar after all the
    others); ``pin_out[i]`` casts output ``i`` to a dtype (``None``: as it comes). Returns
    the new jaxpr (its constants as constvars) and which offered twins it uses (unused ones
    are not invars).
    """
    n = len(in_avals)
    twins = list(twins) or [False] * n
    twin_of = [i for i, t in enumerate(twins) if t]
    twin_avals = [in_avals[i].update(dtype=ctx.half, weak_type=False) for i in twin_of]

    def run(*flat: Any) -> list[Any]:
        args, copies = flat[:n], flat[n:]
        scope = Scope(ctx, place or Place())
        scope.twins = {closed.jaxpr.invars[i]: c for i, c in zip(twin_of, copies, strict=True)}
        outs = interpret(scope, closed.jaxpr, closed.consts, args)
        if pin_out is not None:
            outs = [o if d is None else convert(o, d) for o, d in zip(outs, pin_out, strict=True)]
        return outs

    debug = api_util.debug_info(name, run, (*in_avals, *twin_avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(run, debug_info=debug),
                                                 [*in_avals, *twin_avals])
    jaxpr, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars),
                               instantiate=[True] * n + [False] * len(twin_of))
    used_twins = [False] * n
    for i, u in zip(twin_of, used[n:], strict=True):
        used_twins[i] = u
    return core.ClosedJaxpr(_named_like(jaxpr, closed.jaxpr), consts), used_twins


def _named_like(jaxpr: core.Jaxpr, old: core.Jaxpr) -> core.Jaxpr:
    """``jaxpr`` with ``old``'s debug info (its name shows in custom rules and profiles)."""
    info = old.debug_info
    if info is None:
        return jaxpr
    names = info.arg_names
    if names is not None:
        names = (*names, *[""] * (len(jaxpr.invars) - len(names)))[:len(jaxpr.invars)]
    paths = info.result_paths if isinstance(info.result_paths, tuple) else None
    if paths is not None and len(paths) != len(jaxpr.outvars):
        paths = None
    return jaxpr.replace(debug_info=info._replace(arg_names=names, result_paths=paths))


def interpret(scope: Scope, jaxpr: core.Jaxpr, consts: Sequence[Any],
              args: Sequence[Any]) -> list[Any]:
    """Binds ``jaxpr``'s equations again, each as its rule asks, in the current trace."""
    scope.env.update(zip(jaxpr.constvars, consts, strict=True))
    scope.env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        place = scope.place.of(eqn)
        rule = rule_of(eqn.primitive.name)
        if rule not in _STRUCTURAL and not _floating(eqn):
            rule = Rule.AS_WRITTEN  # integers, bools, keys: nothing to decide
        elif rule in _STRUCTURAL or rule is Rule.CONVERT or _eligible(eqn):
            rule = scope.ctx.decide(eqn, place, rule)
        else:
            rule = Rule.AS_WRITTEN  # float64, complex, the user's own 16-bit code
        scope.bound, scope.cast_overflow = (), False
        apply = _APPLY[rule] if scope.ctx.eager is None else scope.ctx.eager.get(
            rule, _APPLY[rule])
        with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
              eqn.ctx.manager):
            outs, note = apply(scope, eqn, place)
        for var, out in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, core.DropVar):
                scope.env[var] = out
                scope.producers[var] = eqn
        if scope.ctx.rows is not None and (rule not in _STRUCTURAL or note):
            _record(scope, eqn, rule, place, outs, note)
    return [literal_value(scope.read(v)) for v in jaxpr.outvars]


def _record(scope: Scope, eqn: Any, rule: Rule, place: Place, outs: Sequence[Any],
            note: str) -> None:
    """The equation's row (one per equation and place: a loop body's executions meet in
    one row, with the largest magnitude over them when measuring)."""
    rows = scope.ctx.rows
    assert rows is not None
    key = (id(eqn), place.path)
    row = rows.get(key)
    if row is None:
        row = rows[key] = Row(eqn.primitive.name, rule, tuple(map(dtype_of, scope.bound)),
                              tuple(dtype_of(o) for o in outs), place.path, place.source,
                              _flops(eqn), place.repeats, note)
    if scope.ctx.eager is None:
        return
    floats = [o for o in outs if is_float(dtype_of(o)) and not isinstance(o, core.Tracer)]
    if len(floats) < len([o for o in outs if is_float(dtype_of(o))]):
        return  # staged (inside a shard_map): nothing to measure
    arrays = [np.asarray(o, np.float32) for o in floats]
    largest = max((float(np.max(np.abs(a), initial=0.0)) if np.isfinite(a).all() else np.inf
                   for a in arrays), default=0.0)  # a NaN counts as past every bound
    overflows = row.overflows or _overflow_reason(scope, outs, largest)
    rows[key] = dataclasses.replace(row, max_abs=max(largest, row.max_abs or 0.0),
                                    overflows=overflows)


def _overflow_reason(scope: Scope, outs: Sequence[Any], largest: float) -> str:
    half = scope.ctx.half
    if scope.cast_overflow:
        return "input"
    halves = [np.asarray(o, np.float32) for o in outs if dtype_of(o) == half]
    if not halves or not all(np.isfinite(np.asarray(b, np.float32)).all()
                             for b in scope.bound if is_float(dtype_of(b))):
        return ""
    if not all(np.isfinite(h).all() for h in halves):
        return "result"
    return "near max" if largest > float(jnp.finfo(half).max) / HEADROOM_FACTOR else ""


def _overflowed(value: Any, cast: Any) -> bool:
    """Whether casting finite entries of ``value`` gave inf (concrete values only)."""
    if isinstance(value, core.Tracer) or isinstance(cast, core.Tracer):
        return False
    before, after = np.asarray(value, np.float32), np.asarray(cast, np.float32)
    return bool(np.any(np.isfinite(before) & ~np.isfinite(after)))


# -- one function per rule: (scope, eqn, path) -> (outputs, note) ---------------------------

def _bind(scope: Scope, eqn: Any, operands: Sequence[Any], **changes: Any) -> list[Any]:
    scope.bound = [o for o, a in zip(operands, eqn.invars, strict=False) if _is_float_atom(a)]
    return _bind_params(eqn, operands, {**eqn.params, **changes})


def _bind_params(eqn: Any, operands: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    out = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]


def as_written(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    return _bind(scope, eqn, [as_original(scope, a) for a in eqn.invars]), ""


def _operands(scope: Scope, eqn: Any, dtype: Any) -> list[Any]:
    """The operands with every floating one in ``dtype``."""
    return [scope.cast(a, dtype) if is_float(a.aval.dtype) else literal_value(scope.read(a))
            for a in eqn.invars]


def _half(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    changes = {}
    if eqn.params.get("preferred_element_type") is not None:
        changes["preferred_element_type"] = scope.ctx.half
    scope.matmul_results.update(eqn.outvars)
    return _bind(scope, eqn, _operands(scope, eqn, scope.ctx.half), **changes), ""


def _half_float32_out(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    if "preferred_element_type" not in eqn.params:  # no float32 accumulation to ask for
        return _float32(scope, eqn, place)
    return _bind(scope, eqn, _operands(scope, eqn, scope.ctx.half),
                 preferred_element_type=FLOAT32), ""


def _float32(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    return _bind(scope, eqn, _operands(scope, eqn, FLOAT32)), ""


def _widest(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    target = None  # literals follow the variables, unless the half dtype cannot hold them
    literal_fits = True
    for atom in eqn.invars:
        if not is_float(atom.aval.dtype):
            continue
        value = scope.read(atom)
        if isinstance(value, Literal):
            literal_fits = literal_fits and fits(value.val, scope.ctx.half)
        elif target is None or dtype_of(value) == FLOAT32:
            target = dtype_of(value)
    if target is None:  # no variable: a constant of the program, as written
        return as_written(scope, eqn, place)
    if not literal_fits:
        target = FLOAT32
    elif target == FLOAT32 and (bias := _bias_of(scope, eqn)) is not None:
        return _bind(scope, eqn, _with_half_bias(scope, eqn, bias)), ""
    return _bind(scope, eqn, _operands(scope, eqn, target)), ""


def _bias_of(scope: Scope, eqn: Any) -> int | None:
    """Which operand of ``eqn`` is a float32 bias added to a half matmul result, if one
    is: torch's ``linear`` (``addmm``) adds its bias in half, and so does autocast. A bias
    is a vector along the last axis (broadcast, or of size 1 elsewhere)."""
    if eqn.primitive.name not in ("add", "sub") or len(eqn.invars) != 2 or any(
            isinstance(a, core.Literal) for a in eqn.invars):
        return None
    out = eqn.outvars[0].aval.shape
    for i, (matmul, bias) in enumerate((eqn.invars[::-1], eqn.invars)):
        if matmul not in scope.matmul_results or dtype_of(scope.read(matmul)) != scope.ctx.half:
            continue
        producer = scope.producers.get(bias)
        if producer is not None and producer.primitive.name == "broadcast_in_dim":
            source = producer.invars[0].aval.shape
            dims = producer.params["broadcast_dimensions"]
            wide = [d for d, n in zip(dims, source, strict=True) if n != 1]
        else:
            shape = bias.aval.shape
            wide = [d for d, n in enumerate(shape) if n != 1] if len(shape) == len(out) else []
        if out and wide == [len(out) - 1]:
            return i
    return None


def _with_half_bias(scope: Scope, eqn: Any, index: int) -> list[Any]:
    """The operands of a matmul's bias add, both half; the bias broadcast first, so that
    the transpose sums its gradient over the batch in float32, then cast."""
    operands = [literal_value(scope.read(a)) for a in eqn.invars]
    bias, shape = eqn.invars[index], eqn.outvars[0].aval.shape
    if bias.aval.shape == shape:
        operands[index] = scope.cast(bias, scope.ctx.half)
    else:
        full = lax.broadcast_in_dim(operands[index], shape, tuple(range(len(shape))))
        operands[index] = lax.convert_element_type(full, scope.ctx.half)
    return operands


def _each(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    return _bind(scope, eqn, [literal_value(scope.read(a)) for a in eqn.invars]), ""


def convert(value: Any, dtype: Any) -> Any:
    """``value`` in ``dtype`` (a floating value; others are returned as they are)."""
    if dtype is None or not is_float(dtype) or dtype_of(value) == np.dtype(dtype):
        return value
    return lax.convert_element_type(value, dtype)


def _user_convert(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    return _bind(scope, eqn, [literal_value(scope.read(eqn.invars[0]))]), ""


def rewrite_call(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    """``jit``, ``checkpoint``, ``closed_call``, ``shard_map``, ``cond``."""
    name = eqn.primitive.name
    if name == "cond":
        return _cond(scope, eqn, place), ""
    if name == "shard_map":
        return _shard_map(scope, eqn, place), ""
    key = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
    inner = eqn.params[key]
    closed = inner if isinstance(inner, core.ClosedJaxpr) else core.ClosedJaxpr(inner, ())
    operands = [literal_value(scope.read(a)) for a in eqn.invars]
    offer = [] if name in ("jit", "pjit") else _passes_twins(scope, eqn.invars)
    if name in ("jit", "pjit") and is_library(closed.jaxpr.debug_info):
        place = dataclasses.replace(place, holds_library=True)
    new, used = rewrite_closed(scope.ctx, closed, [_aval(o) for o in operands], place=place,
                               twins=offer)
    copies = _copies(scope, eqn.invars, used)
    if isinstance(inner, core.ClosedJaxpr) and not copies:
        return _bind(scope, eqn, operands, **{key: new}), ""
    open_jaxpr = pe.convert_constvars_jaxpr(new.jaxpr)
    changes: dict[str, Any] = {key: open_jaxpr}
    if isinstance(inner, core.ClosedJaxpr):  # closed_call with copies: its consts as operands
        changes[key] = core.ClosedJaxpr(open_jaxpr, ())
    return _bind(scope, eqn, [*new.consts, *operands, *copies], **changes), ""


def _cond(scope: Scope, eqn: Any, place: Place) -> list[Any]:
    index, *operands = [literal_value(scope.read(a)) for a in eqn.invars]
    atoms = eqn.invars[1:]
    offer = _passes_twins(scope, atoms)
    avals = [_aval(o) for o in operands]
    rewrite = functools.partial(rewrite_closed, scope.ctx, in_avals=avals, place=place,
                                twins=offer)
    branches = [rewrite(b) for b in eqn.params["branches"]]
    outs = [[dtype_of_aval(v.aval) for v in b.jaxpr.outvars] for b, _ in branches]
    target = [FLOAT32 if FLOAT32 in column else column[0] for column in zip(*outs, strict=True)]
    branches = [(b, u) if o == target else rewrite(old, pin_out=target)
                for (b, u), o, old in zip(branches, outs, eqn.params["branches"], strict=True)]
    used = [any(u[i] for _, u in branches) for i in range(len(atoms))]
    copies = _copies(scope, atoms, used)
    # every branch takes every branch's constants and every copy any branch uses
    consts = [c for b, _ in branches for c in b.consts]
    n_const = [len(b.consts) for b, _ in branches]
    jaxprs = []
    for k, (b, u) in enumerate(branches):
        jaxpr = pe.convert_constvars_jaxpr(b.jaxpr)
        own = jaxpr.invars[:n_const[k]]
        args = jaxpr.invars[n_const[k]:n_const[k] + len(atoms)]
        mine = iter(jaxpr.invars[n_const[k] + len(atoms):])
        twin_vars = [next(mine) if u[i] else core.Var(_twin_aval(avals[i], scope.ctx.half))
                     for i in range(len(atoms)) if used[i]]
        const_vars = [v for j, c in enumerate(n_const)
                      for v in (own if j == k else [core.Var(x.aval) for x in
                                                    pe.convert_constvars_jaxpr(
                                                        branches[j][0].jaxpr).invars[:c]])]
        jaxprs.append(core.ClosedJaxpr(
            jaxpr.replace(invars=[*const_vars, *args, *twin_vars]), ()))
    return _bind(scope, eqn, [index, *consts, *operands, *copies], branches=tuple(jaxprs))


def _shard_map(scope: Scope, eqn: Any, place: Place) -> list[Any]:
    """Rewritten while ``shard_map`` traces its body (its axes and mesh in context)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    del params["subfuns"]
    jaxpr = eqn.params["jaxpr"]
    ctx = scope.ctx

    def rewritten(*args: Any) -> Any:
        return _flat_tree(interpret(Scope(ctx, place), jaxpr, (), args), eqn)

    out = eqn.primitive.bind(*[literal_value(scope.read(a)) for a in eqn.invars],
                             subfuns=(rewritten,), **params)
    return list(out)


def _flat_tree(outs: list[Any], eqn: Any) -> Any:
    from jax._src.tree_util import FlatTree  # noqa: PLC0415  (shard_map's own return type)

    return FlatTree.flatten(outs).with_aux(eqn.params["out_specs"])


def _loop(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    return (rewrite_scan if eqn.primitive.name == "scan" else _while)(scope, eqn, place), ""


def rewrite_scan(scope: Scope, eqn: Any, place: Place) -> list[Any]:
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    atoms = eqn.invars
    operands = [literal_value(scope.read(a)) for a in atoms]
    body = p["jaxpr"]
    for i in range(n_consts, n_consts + n_carry):  # the carry keeps its dtype
        operands[i] = as_original(scope, atoms[i])
    avals = [v.aval.update(dtype=dtype_of(o)) for v, o in zip(body.jaxpr.invars, operands,
                                                              strict=True)]
    offer = [*_offers(scope, atoms[:n_consts]), *[False] * (len(atoms) - n_consts)]
    pin = [v.aval.dtype for v in body.jaxpr.outvars[:n_carry]]
    new, used = rewrite_closed(scope.ctx, body, avals, twins=offer,
                               place=dataclasses.replace(place, repeats=place.repeats * int(
                                   p["length"])),
                               pin_out=[*pin, *[None] * (len(body.jaxpr.outvars) - n_carry)])
    copies = _copies(scope, atoms, used)
    jaxpr = _twins_after(pe.convert_constvars_jaxpr(new.jaxpr), len(new.consts) + n_consts,
                         len(copies))
    args = [*new.consts, *operands[:n_consts], *copies, *operands[n_consts:]]
    changes = {"linear": (False,) * len(args)} if "linear" in p else {}
    return _bind(scope, eqn, args, jaxpr=core.ClosedJaxpr(jaxpr, ()),
                 num_consts=len(new.consts) + n_consts + len(copies), **changes)


def _while(scope: Scope, eqn: Any, place: Place) -> list[Any]:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    atoms = eqn.invars
    operands = [literal_value(scope.read(a)) for a in atoms]
    for i in range(nc + nb, len(atoms)):
        operands[i] = as_original(scope, atoms[i])
    carry_avals = [_aval(o) for o in operands[nc + nb:]]

    def part(closed: Any, consts: slice, pin: Any) -> tuple[Any, list[Any]]:
        const_atoms = atoms[consts]
        avals = [_aval(o) for o in operands[consts]] + carry_avals
        offer = [*_offers(scope, const_atoms), *[False] * len(carry_avals)]
        new, used = rewrite_closed(scope.ctx, closed, avals, place=place, twins=offer,
                                   pin_out=pin)
        copies = _copies(scope, const_atoms, used[:len(const_atoms)])
        k = len(new.consts) + len(const_atoms)
        jaxpr = _twins_after(pe.convert_constvars_jaxpr(new.jaxpr), k, len(copies))
        return core.ClosedJaxpr(jaxpr, ()), [*new.consts, *operands[consts], *copies]

    cond, cond_args = part(p["cond_jaxpr"], slice(0, nc), None)
    body, body_args = part(p["body_jaxpr"], slice(nc, nc + nb),
                           [a.aval.dtype for a in atoms[nc + nb:]])
    return _bind(scope, eqn, [*cond_args, *body_args, *operands[nc + nb:]], cond_jaxpr=cond,
                 body_jaxpr=body, cond_nconsts=len(cond_args), body_nconsts=len(body_args))


def _twins_after(jaxpr: core.Jaxpr, at: int, n: int) -> core.Jaxpr:
    """Moves the last ``n`` invars (the twins) to position ``at`` (after the constants)."""
    if not n:
        return jaxpr
    invars = list(jaxpr.invars)
    twins, rest = invars[-n:], invars[:-n]
    return jaxpr.replace(invars=[*rest[:at], *twins, *rest[at:]])


def _custom(scope: Scope, eqn: Any, place: Place) -> tuple[list[Any], str]:
    """A custom rule: the author's rule kept, its boundary in the dtypes it was written for,
    the code inside (primal function and rule) rewritten like the rest."""
    rows_before = None if scope.ctx.rows is None else dict(scope.ctx.rows)
    try:
        params = custom_params(scope.ctx, eqn, place)
    except (KeyError, TypeError, AttributeError) as error:
        # another JAX's parameters: the rule runs as written (its row says so, and the
        # rows of its inside, which does not run as rewritten, are gone)
        if rows_before is not None and scope.ctx.rows is not None:
            scope.ctx.rows.clear()
            scope.ctx.rows.update(rows_before)
        return as_written(scope, eqn, place)[0], kept_as_written(error)
    outs = _bind_params(eqn, [as_original(scope, a) for a in eqn.invars], params)
    return [convert(o, v.aval.dtype) for o, v in zip(outs, eqn.outvars, strict=True)], ""


def kept_as_written(error: BaseException) -> str:
    return f"custom rule kept as written: {error!r}"


def custom_params(ctx: Context, eqn: Any, place: Place, *,
                  record: bool = True) -> dict[str, Any]:
    """A custom rule's parameters with its primal function and its rule rewritten, each
    with its boundary pinned to the dtypes the author wrote it for (rows recorded for the
    primal function only, when ``record``)."""
    params = dict(eqn.params)

    def pinned(closed: Any, record: bool) -> core.ClosedJaxpr:
        sub = ctx if record else dataclasses.replace(ctx, rows=None)
        new, _ = rewrite_closed(sub, closed, closed.in_avals, place=place,
                                pin_out=[a.dtype for a in closed.out_avals])
        return new

    if eqn.primitive.name == "custom_jvp_call":
        params["jvp_jaxpr_fun"] = _pinned_thunk(params["jvp_jaxpr_fun"], pinned)
    else:
        params["fwd_jaxpr_thunk"] = _pinned_thunk(params["fwd_jaxpr_thunk"], pinned)
        params["bwd"] = _pinned_bwd(params["bwd"], ctx)
    params["call_jaxpr"] = pinned(params["call_jaxpr"], record=record)
    return params


def _pinned_thunk(thunk: Any, pinned: Callable[..., Any]) -> Any:
    """A custom rule's jaxpr thunk whose jaxpr comes back rewritten, boundary pinned."""

    @functools.cache
    def rewritten(*zeros: Any) -> Any:
        jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
        new = pinned(core.ClosedJaxpr(pe.convert_constvars_jaxpr(jaxpr), ()), False)
        # its constants and the thunk's back as constvars, as the thunk's callers bind them
        jaxpr = pe.convert_invars_to_constvars(pe.convert_constvars_jaxpr(new.jaxpr),
                                               len(new.consts) + len(consts))
        return (jaxpr, [*new.consts, *consts], *rest)

    return lu.wrap_init(rewritten, debug_info=thunk.debug_info)


def _pinned_bwd(bwd: Any, ctx: Context) -> Any:
    """A ``custom_vjp``'s backward rule, rewritten each time it is traced."""
    sub = dataclasses.replace(ctx, rows=None)

    def rewritten(*args: Any) -> Any:
        zeros: list[Any] = []

        def flat(*xs: Any) -> list[Any]:
            outs = bwd.call_wrapped(*xs)
            zeros[:] = [o if isinstance(o, ad.Zero) else None for o in outs]
            return [o for o in outs if not isinstance(o, ad.Zero)]

        avals = [core.typeof(a) for a in args]
        debug = api_util.debug_info("autocast bwd", flat, avals, {})
        jaxpr, out_avals, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(flat, debug_info=debug),
                                                             avals)
        closed = core.ClosedJaxpr(pe.convert_constvars_jaxpr(jaxpr), ())
        new, _ = rewrite_closed(sub, closed, [*map(core.typeof, consts), *avals],
                                pin_out=[a.dtype for a in out_avals])
        outs = iter(core.eval_jaxpr(new.jaxpr, new.consts, *consts, *args))
        return [z if z is not None else next(outs) for z in zeros]

    return lu.wrap_init(rewritten, debug_info=bwd.debug_info)


Apply = Callable[[Scope, Any, Place], tuple[list[Any], str]]

_APPLY: dict[Rule, Apply] = {
    Rule.HALF: _half,
    Rule.HALF_FLOAT32_OUT: _half_float32_out,
    Rule.FLOAT32: _float32,
    Rule.WIDEST: _widest,
    Rule.EACH: _each,
    Rule.AS_WRITTEN: as_written,
    Rule.UNKNOWN: as_written,
    Rule.CONVERT: _user_convert,
    Rule.CALL: rewrite_call,
    Rule.LOOP: _loop,
    Rule.CUSTOM: _custom,
}
_STRUCTURAL = frozenset({Rule.CALL, Rule.LOOP, Rule.CUSTOM})  # rewritten inside, never as a whole
_NEVER_INELIGIBLE = _STRUCTURAL | {Rule.CONVERT}  # a user's astype keeps its dtype, any dtype


# -- helpers --------------------------------------------------------------------------------

@jax.custom_jvp
def invariant_cast(value: Any, half_copy: Any) -> Any:
    """``half_copy`` (``value`` cast outside a loop), with ``value``'s gradient: the
    gradient of a loop-invariant weight still accumulates in float32 over the loop."""
    del value
    return half_copy


@invariant_cast.defjvp
def _invariant_cast_jvp(primals: Any, tangents: Any) -> Any:
    _, half_copy = primals
    tangent, _ = tangents
    return half_copy, lax.convert_element_type(tangent, half_copy.dtype)


def _offers(scope: Scope, atoms: Sequence[Any]) -> list[bool]:
    """Which operands could come with a half copy made here (float32 variables)."""
    return [not isinstance(a, core.Literal) and a.aval.dtype == FLOAT32
            and dtype_of(scope.read(a)) == FLOAT32 for a in atoms]


def _passes_twins(scope: Scope, atoms: Sequence[Any]) -> list[bool]:
    """Which operands of a call bring in a half copy made outside a loop (a call makes
    no new copies: a copy made outside ``checkpoint`` would be saved, not recomputed)."""
    return [not isinstance(a, core.Literal) and a in scope.twins for a in atoms]


def _copies(scope: Scope, atoms: Sequence[Any], used: Sequence[bool]) -> list[Any]:
    """The half copies a sub-program uses: this scope's own (from outside a loop), or a
    cast made here."""
    return [scope.twins[a] if a in scope.twins else scope.cast(a, scope.ctx.half)
            for a, u in zip(atoms, used, strict=True) if u]


def _twin_aval(aval: Any, half: Any) -> Any:
    return aval.update(dtype=half, weak_type=False)


def as_original(scope: Scope, atom: Any) -> Any:
    if isinstance(atom, core.Literal):
        return atom.val
    return scope.cast(atom, atom.aval.dtype) if is_float(atom.aval.dtype) else scope.read(atom)


def _is_float_atom(atom: Any) -> bool:
    return hasattr(atom.aval, "dtype") and is_float(atom.aval.dtype)


def literal_value(value: Any) -> Any:
    return value.val if isinstance(value, Literal) else value


def _aval(value: Any) -> Any:
    return core.typeof(value)


def _floating(eqn: Any) -> bool:
    """Whether the equation reads or writes a floating (real or complex) value."""
    return any(jnp.issubdtype(d, jnp.inexact) for d in _dtypes(eqn))


def _dtypes(eqn: Any) -> list[Any]:
    return [v.aval.dtype for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "dtype")
            and not jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)]


def scope_names(name_stack: Any) -> str:
    """A name stack's scopes (module paths, ``named_scope``), its transformations dropped:
    ``vmap(head)`` is ``head``."""
    return "/".join(e.name for e in name_stack.stack if type(e).__name__ == "Scope")


def is_library(debug_info: Any) -> bool:
    """Whether a sub-program's function is a library's (JAX, flax, Equinox, optax)."""
    info = getattr(debug_info, "func_src_info", None) or ""
    _, _, where = info.partition(" at ")
    return bool(where) and where.startswith(_registry.library_dirs(with_jax=True))


def _eligible(eqn: Any) -> bool:
    """Whether every floating value the equation reads or writes was float32: autocast
    changes float32 computations only; float64, complex and what the user wrote in a
    16-bit dtype run as written."""
    return all(d == FLOAT32 for d in _dtypes(eqn) if jnp.issubdtype(d, jnp.inexact))


def _flops(eqn: Any) -> int:
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * int(np.prod([lhs[d] for d in lc], dtype=np.int64)) * int(
            np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out = eqn.outvars[0].aval.shape
        spec = eqn.params["dimension_numbers"]
        rhs_spec = spec.rhs_spec if spec is not None else tuple(range(len(rhs)))
        per_output = int(np.prod([rhs[d] for d in rhs_spec[1:]], dtype=np.int64))
        return 2 * per_output * int(np.prod(out, dtype=np.int64))
    return 0


def is_float(dtype: Any) -> bool:
    """Whether ``dtype`` is a real floating dtype."""
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def dtype_of(value: Any) -> Any:
    """The dtype of a value (a NumPy dtype, or JAX's extended dtype of a PRNG key)."""
    return dtype_of_aval(value.aval if isinstance(value, Literal) else core.typeof(value))


def dtype_of_aval(aval: Any) -> Any:
    dtype = getattr(aval, "dtype", None)
    return dtype if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else (
        np.dtype(dtype))


def fits(value: Any, half: Any) -> bool:
    """Whether a scalar is held by ``half`` without becoming 0, a subnormal or inf."""
    x = float(np.asarray(value, np.float64))
    if x == 0.0 or not np.isfinite(x):
        return True
    with np.errstate(over="ignore"):
        y = float(np.asarray(x, half).astype(np.float64))
    return bool(np.isfinite(y) and abs(y) >= float(jnp.finfo(half).tiny))


def _join(outer: str, inner: str) -> str:
    return "/".join(p for p in (outer, inner) if p)


def source_of(eqn: Any) -> str | None:
    """``file:line`` of the innermost frame of ``eqn`` outside JAX, the frameworks and
    this library."""
    frame = user_frame(eqn.source_info.traceback)
    return None if frame is None else f"{frame.file_name}:{frame.start_line}"


def user_frame(traceback: Any) -> Any:
    """The innermost frame of ``traceback`` outside JAX, flax, Equinox, optax and this
    library (``None`` when there is none)."""
    if traceback is None:
        return None
    skip = _registry.library_dirs()
    for frame in source_info_util.user_frames(traceback):
        if not frame.file_name.startswith(skip) or frame.file_name.endswith("demo.py"):
            return frame
    return None
