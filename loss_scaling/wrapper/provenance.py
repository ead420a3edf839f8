"""Were these gradients scaled, and by this state's scale? Trace-time checks on the program.

A loss differentiated with ``jax.value_and_grad`` instead of ``ls.value_and_grad`` (or
without ``ls.scale``) gives the wrapper true-sized gradients, which it divides by the
scale all the same: every step is 1/scale the size it should be, and nothing overflows
to say so. At run time the two cannot be told apart (a gradient of ``32768 * L`` and one
of an ``L`` 32768 times larger are the same numbers); while the step is traced they can:
a gradient of the scaled loss *depends on* the scale the optimizer state holds (the
backward pass starts from it), a forgotten one does not.

So while ``jit`` traces the update, these checks walk back through the equations JAX has
recorded (nothing is added to the compiled step; each walk is bounded and gives up
silently beyond :data:`MAX_NODES`):

* :func:`loss_not_scaled`: gradients computed in this trace (from the params, or by a
  backward pass: ``tx.update(grads, opt_state)`` is given no params) that depend neither
  on the state's scale nor, for a ``StaticLossScale``, on its value written as a constant.
  They come from a loss not scaled at all (:data:`LOSS_NOT_SCALED`), or scaled by
  ``ls.scale`` with another state's scale (:data:`ANOTHER_SCALE`: a state from an earlier
  step, a GAN's other optimizer).
* :func:`made_finite`: gradients that went through ``jnp.nan_to_num`` (or a ``jnp.where``
  on their own finiteness) after the backward pass (:data:`MADE_FINITE`): an overflow's
  inf becomes a finite number, and the wrapper applies the step it should skip.
* :func:`scaled_in_forward`: a loss returned to ``ls.value_and_grad`` that is already
  scaled (:data:`SCALED_TWICE`), read from the loss's tangent, which JAX records eagerly
  too, and into the ``jit`` calls it holds: a jitted loss that JAX's cache supplies
  without running its Python again is seen. A scaling inside an inner backward pass (a
  gradient penalty, scaled and unscaled there) is not one.

``ls.scale`` is a ``jit`` named :data:`loss_scaling.core.tree.SCALED_BY` in a program; a
backward pass is what JAX's name stacks mark ``transpose``. These are JAX's tracing
internals (``DynamicJaxprTracer.parent``, ``TracingEqn``, name stacks); where they are
missing the checks say nothing (a test holds them to the current JAX). They cannot see an
eager step (the gradients are concrete numbers), or gradients computed outside the traced
function (passed in as arguments).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from loss_scaling._errors import LossScaleWarning
from loss_scaling.core.scalers import NoOpLossScale, StaticLossScale
from loss_scaling.core.tree import SCALED_BY

__all__ = [
    "ANOTHER_SCALE",
    "LOSS_NOT_SCALED",
    "MADE_FINITE",
    "MAX_NODES",
    "SCALED_TWICE",
    "Caller",
    "called_as",
    "check_gradients",
    "loss_not_scaled",
    "made_finite",
    "scaled_in_forward",
]

MAX_NODES = 1_000_000
"""Tracers and equations visited at most by one walk; beyond that a check says nothing."""


class _TooLarge(Exception):
    """A walk went past :data:`MAX_NODES`."""


class _Budget:
    def __init__(self, nodes: int = MAX_NODES) -> None:
        self.left = nodes

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _TooLarge


def _traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer) and hasattr(x, "parent")


def _transforms(eqn: Any) -> frozenset[str]:
    """The transformations whose names the equation's name stack holds (``jvp``,
    ``transpose``, ...), not the user's ``named_scope`` names."""
    stack = getattr(getattr(getattr(eqn, "source_info", None), "name_stack", None),
                    "stack", ())
    return frozenset(getattr(s, "name", "") for s in stack if type(s).__name__ == "Transform")


def _sub_jaxprs(eqn: Any) -> list[Any]:
    """The programs an equation holds (a ``jit``'s, a ``cond``'s branches, a loop's body)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)  # a ClosedJaxpr's Jaxpr, or a Jaxpr
            if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "outvars"):
                found.append(jaxpr)
    return found


def _behind(jaxpr: Any, outputs: set[int] | None,
            budget: _Budget) -> Iterator[tuple[Any, set[int]]]:
    """The equations of ``jaxpr`` its outputs ``outputs`` (all if None) depend on, each
    with the outputs of its own that are used."""
    needed = {id(v) for i, v in enumerate(jaxpr.outvars)
              if (outputs is None or i in outputs) and not hasattr(v, "val")}
    for eqn in reversed(jaxpr.eqns):
        used = {i for i, v in enumerate(eqn.outvars) if id(v) in needed}
        if not used:
            continue
        budget.spend()
        yield eqn, used
        needed.update(id(v) for v in eqn.invars if not hasattr(v, "val"))  # not literals


Predicate = Callable[[Any, frozenset[str]], bool]


_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat"})
"""Primitives whose one program maps its inputs to its outputs once (not a loop's body)."""


def _inside(eqn: Any, outputs: set[int] | None, transforms: frozenset[str],
            pred: Predicate, budget: _Budget) -> bool:
    """Whether an equation inside ``eqn``'s programs, behind its ``outputs``, satisfies
    ``pred`` (given the transformations around it). Exact through a call (a ``jit``);
    inside other programs (branches, loop bodies), behind any of their outputs."""
    jaxprs = _sub_jaxprs(eqn)
    exact = (eqn.primitive.name in _CALLS and len(jaxprs) == 1
             and len(jaxprs[0].outvars) == len(eqn.outvars))
    for jaxpr in jaxprs:
        for inner, used in _behind(jaxpr, outputs if exact else None, budget):
            around = transforms | _transforms(inner)
            if pred(inner, around) or _inside(inner, used, around, pred, budget):
                return True
    return False


class _Walk(NamedTuple):
    tracers: dict[int, Any]  # every tracer reached, by id
    eqns: dict[int, tuple[Any, set[int]]]  # their equations, the outputs reached (-1: ?)
    stopped: bool  # reached a tracer of ``stop``


def _walk(start: list[Any], stop: set[int] | frozenset[int] = frozenset()) -> _Walk | None:
    """Every tracer ``start`` was computed from in this trace, itself included; the walk
    ends early at a tracer in ``stop``. ``None`` beyond :data:`MAX_NODES`."""
    budget = _Budget()
    tracers = {id(x): x for x in start if _traced(x)}
    eqns: dict[int, tuple[Any, set[int]]] = {}
    stack = list(tracers.values())
    try:
        while stack:
            x = stack.pop()
            eqn = getattr(x, "parent", None)
            if eqn is None:
                continue
            output = next((i for i, v in enumerate(eqn.outvars) if v is x.val), -1)
            if id(eqn) in eqns:
                eqns[id(eqn)][1].add(output)
                continue
            eqns[id(eqn)] = (eqn, {output})
            for parent in getattr(eqn, "in_tracers", ()):
                if id(parent) in tracers or not _traced(parent):
                    continue
                budget.spend()
                tracers[id(parent)] = parent
                if id(parent) in stop:
                    return _Walk(tracers, eqns, True)
                stack.append(parent)
    except _TooLarge:
        return None
    return _Walk(tracers, eqns, False)


def _any_equation(walk: _Walk, pred: Predicate) -> bool:
    """Whether an equation of the walk, or one inside it behind the outputs the walk
    reached, satisfies ``pred``; ``False`` beyond :data:`MAX_NODES`."""
    budget = _Budget()
    try:
        for eqn, outputs in walk.eqns.values():
            around = _transforms(eqn)
            exact = None if -1 in outputs else outputs
            if pred(eqn, around) or _inside(eqn, exact, around, pred, budget):
                return True
    except _TooLarge:
        pass
    return False


def _is_scaling(eqn: Any, transforms: frozenset[str]) -> bool:
    """``ls.scale`` (or ``ls.value_and_grad``'s own scaling), forward or transposed."""
    return eqn.params.get("name") == SCALED_BY


def _is_backward(eqn: Any, transforms: frozenset[str]) -> bool:
    return "transpose" in transforms


def _scalar_constants(eqn: Any) -> list[float]:
    """The floating scalar constants an equation reads (literals, concrete arrays)."""
    values = []
    for x in getattr(eqn, "in_tracers", None) or eqn.invars:
        value = x.full_lower() if _traced(x) else getattr(x, "val", None)  # a Literal's
        if value is None or isinstance(value, jax.core.Tracer):
            continue
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            continue
        if array.shape == () and np.issubdtype(array.dtype, np.floating):
            values.append(float(array))
    return values


def _multiplies_by(eqn: Any, transforms: frozenset[str], factor: float) -> bool:
    """A multiplication by the constant ``factor`` in a backward pass (``factor * loss``
    transposed, or ``ls.scale`` by a scaler closed over); a division by it (a mean) is
    not one."""
    return (_is_backward(eqn, transforms)
            and (eqn.primitive.name == "mul" or _is_scaling(eqn, transforms))
            and factor in _scalar_constants(eqn))


def _marks(tracers: list[Any]) -> set[int] | None:
    """The tracers and the roots they were computed from (inputs of the trace)."""
    walk = _walk(tracers)
    if walk is None:
        return None
    return {id(x) for x in tracers} | {i for i, x in walk.tracers.items()
                                       if getattr(x, "parent", None) is None}


FORGOTTEN = "forgotten"
ANOTHER = "another"


def loss_not_scaled(grads: Any, scale: Any, params: Any,
                    static_scale: float | None = None) -> str | None:
    """:data:`FORGOTTEN` or :data:`ANOTHER` when ``grads`` were computed in the trace now
    running (from ``params``, or by a backward pass) without ``scale``; ``None`` when
    they depend on it (or on ``static_scale`` as a constant), or when it cannot tell
    (eager, gradients passed in)."""
    if not _traced(scale):
        return None
    grad_leaves = [x for x in jax.tree.leaves(grads) if _traced(x)]
    if not any(getattr(x, "parent", None) is not None for x in grad_leaves):
        return None  # concrete, or inputs of the trace: computed elsewhere
    scale_marks = _marks([scale])
    if scale_marks is None:
        return None
    walk = _walk(grad_leaves, stop=scale_marks)  # ends at the scale: the common case
    if walk is None or walk.stopped or scale_marks & walk.tracers.keys():
        return None
    param_leaves = [x for x in jax.tree.leaves(params) if _traced(x)]
    param_marks = _marks(param_leaves) if param_leaves else None
    from_params = bool(param_marks and param_marks & walk.tracers.keys())
    if not (from_params or _any_equation(walk, _is_backward)):
        return None  # not differentiated here
    if static_scale is not None and _any_equation(
            walk, lambda eqn, tf: _multiplies_by(eqn, tf, static_scale)):
        return None  # a static scale written as its own constant
    return ANOTHER if _any_equation(walk, _is_scaling) else FORGOTTEN


def scaled_in_forward(loss: Any) -> bool:
    """Whether the loss that a function gave back to ``ls.value_and_grad`` was scaled on
    its way (the scaling's tangent is in the loss's): ``False`` when it cannot tell."""
    tangent = getattr(loss, "tangent", None)  # the loss as value_and_grad traces it
    if not _traced(tangent):
        return False
    walk = _walk([tangent])
    return walk is not None and _any_equation(
        walk, lambda eqn, tf: _is_scaling(eqn, tf) and "transpose" not in tf)


# ------------------------------------------------- gradients made finite before the wrapper

_FINITENESS_TESTS = frozenset({"isinf", "isnan", "isfinite", "isposinf", "isneginf"})
_SEARCH = 10_000  # nodes: how far back a gradient's backward pass is looked for


_PRUNE = object()  # _search_back: do not walk past this equation


def _search_back(start: list[Any], visit: Callable[[Any, _Budget], Any]) -> Any:
    """Walks back from ``start`` through the equations that computed it (at most
    :data:`_SEARCH` nodes): the first result ``visit(eqn, budget)`` gives other than
    ``None`` and :data:`_PRUNE` (which stops the walk along that equation), else ``None``."""
    stack = [x for x in start if _traced(x)]
    seen = {id(x) for x in stack}
    budget = _Budget(_SEARCH)
    try:
        while stack:
            eqn = getattr(stack.pop(), "parent", None)
            if eqn is None:
                continue
            found = visit(eqn, budget)
            if found is _PRUNE:
                continue
            if found is not None:
                return found
            for parent in eqn.in_tracers:
                if _traced(parent) and id(parent) not in seen:
                    budget.spend()
                    seen.add(id(parent))
                    stack.append(parent)
    except _TooLarge:
        pass
    return None


def _holds_backward(eqn: Any, budget: _Budget) -> bool:
    """A ``transpose`` equation, or a program holding one (a jitted gradient function)."""
    around = _transforms(eqn)
    return _is_backward(eqn, around) or _inside(eqn, None, around, _is_backward, budget)


def _from_backward(x: Any) -> bool:
    """Whether ``x`` was computed by a backward pass in this trace."""
    return _search_back([x], lambda eqn, budget: _holds_backward(eqn, budget) or None) is True


def _tests_finiteness_of(pred: Any, value: Any, depth: int = 4) -> bool:
    """Whether the predicate ``pred`` is a finiteness test of ``value`` itself
    (``isfinite``, ``isnan``, ``isinf``, ``== inf``, negated or combined)."""
    eqn = getattr(pred, "parent", None)
    if eqn is None or depth == 0:
        return False
    name = eqn.params.get("name") if eqn.primitive.name in ("jit", "pjit") else None
    inputs = list(eqn.in_tracers)
    if any(x is value for x in inputs):
        if name in _FINITENESS_TESTS or eqn.primitive.name == "is_finite":
            return True
        if eqn.primitive.name == "ne" and all(x is value for x in inputs):  # isnan
            return True
        if eqn.primitive.name == "eq" and any(map(np.isinf, _scalar_constants(eqn))):
            return True
    return any(_tests_finiteness_of(x, value, depth - 1) for x in inputs)


def _sanitized(eqn: Any) -> tuple[str, Any] | None:
    """``(what, operand)`` when ``eqn`` replaces non-finite values of ``operand``."""
    primitive = eqn.primitive.name
    name = eqn.params.get("name") if primitive in ("jit", "pjit") else None
    inputs = list(eqn.in_tracers)
    if name == "nan_to_num" and inputs:
        return "`jnp.nan_to_num`", inputs[0]
    if (name == "_where" or primitive == "select_n") and len(inputs) > 2:
        for value in inputs[1:]:
            if _traced(value) and _tests_finiteness_of(inputs[0], value):
                return "`jnp.where` on their own finiteness", value
    return None


def made_finite(grads: Any) -> str | None:
    """What made ``grads`` finite after their backward pass in this trace (e.g.
    ``"`jnp.nan_to_num`"``), else ``None``. Only what runs between the backward pass and
    the wrapper is read: a ``jnp.where`` inside the loss (masking, differentiated), or a
    batch cleaned before the loss, is not this mistake."""
    def visit(eqn: Any, budget: _Budget) -> Any:
        if {"jvp", "transpose"} & _transforms(eqn):
            return _PRUNE  # the backward pass (or a differentiated loss) itself
        found = _sanitized(eqn)
        if found is not None and _from_backward(found[1]):
            return found[0]
        return _PRUNE if _holds_backward(eqn, budget) else None  # a jitted gradient

    result = _search_back(jax.tree.leaves(grads), visit)
    return result if isinstance(result, str) else None


# ------------------------------------------------------------------------ the messages

class Caller(NamedTuple):
    """Who called the step, for the messages: the call, the user's framework's plain
    gradient, and the recipe with the user's own arguments."""

    call: str
    grad: str = "`jax.grad`"
    recipe: str = "ls.value_and_grad(loss_fn)(opt_state, params, batch)"


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "loss_scaling_caller", default=None)


@contextlib.contextmanager
def called_as(caller: Caller) -> Iterator[None]:
    """The integrations' entry points (``optimizer.update``, ``state.apply_gradients``,
    ``ls.equinox.apply_gradients``) name themselves in the messages of the step they run."""
    token = _CALLER.set(caller)
    try:
        yield
    finally:
        _CALLER.reset(token)


_DOCS = "(docs/common_mistakes.md, \"Scaling forgotten or doubled\")."

LOSS_NOT_SCALED = (
    "{call}: these gradients were computed from the params without the loss scale that "
    "the optimizer state holds: the loss was not scaled ({grad} instead of "
    "`ls.value_and_grad`, or `ls.scale` left out), so every step is 1/scale the size it "
    "should be. Differentiate the scaled loss: `loss, grads = {recipe}` " + _DOCS
)

ANOTHER_SCALE = (
    "{call}: these gradients were computed from a loss scaled by another loss scale than "
    "the one this optimizer state holds: `ls.value_and_grad` (or `ls.scale`) was given "
    "another state, an optimizer state from before the last update (read the scale from "
    "the state this update is given, at every step) or another optimizer's (a GAN: scale "
    "each loss with the state of the optimizer that steps on its gradients). The wrapper "
    "unscales by its own scale, so every step is off by the ratio of the two. "
    "Differentiate with this state: `loss, grads = {recipe}` " + _DOCS
)

MADE_FINITE = (
    "{call}: these gradients were made finite before they reached the wrapper ({how} on "
    "the gradients after the backward pass): an overflow's inf or NaN becomes a finite "
    "number (`jnp.nan_to_num` makes inf 3.4e38), so the wrapper applies the step instead "
    "of skipping it, the params jump, and the scale never backs off. Give the wrapper the "
    "gradients as the backward pass returns them: it checks them itself and skips a step "
    "that is not finite (docs/common_mistakes.md, \"Gradients made finite before the "
    "wrapper\")."
)

SCALED_TWICE = (
    "The loss that the function given to ls.value_and_grad returned was already scaled "
    "(`ls.scale` inside it, or inside a jitted function it calls), and ls.value_and_grad "
    "scales the loss itself: the loss would be scaled twice (by the scale squared). Return "
    "the plain loss from the loss function, or differentiate `ls.scale(s, loss_fn(...))` "
    "with `jax.grad`. (A gradient penalty that scales an inner backward pass and unscales "
    "its gradients with `ls.unscale` is fine.) " + _DOCS
)


def _static_scale(configured: Any) -> float | None:
    """The value of the ``StaticLossScale`` the wrapper was built with, else ``None``."""
    if not isinstance(configured, StaticLossScale):
        return None
    try:
        return float(configured.loss_scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def check_gradients(grads: Any, scaler: Any, params: Any, call: str,
                    configured: Any = None) -> None:
    """A :class:`loss_scaling.LossScaleWarning` while tracing, for gradients made finite
    before the wrapper (:func:`made_finite`) or computed without ``scaler``'s scale
    (:func:`loss_not_scaled`); ``configured`` is the scaler the wrapper was built with."""
    caller = _CALLER.get() or Caller(call)
    how = made_finite(grads)
    if how is not None:
        warnings.warn(MADE_FINITE.format(call=caller.call, how=how), LossScaleWarning,
                      stacklevel=4)
    if isinstance(scaler, NoOpLossScale):
        return
    finding = loss_not_scaled(grads, scaler.loss_scale, params, _static_scale(configured))
    if finding is not None:
        message = LOSS_NOT_SCALED if finding == FORGOTTEN else ANOTHER_SCALE
        warnings.warn(message.format(**caller._asdict()), LossScaleWarning, stacklevel=4)
