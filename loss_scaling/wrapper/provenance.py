"""Were these gradients scaled? A trace-time check for a loss differentiated unscaled.

A loss differentiated with ``jax.value_and_grad`` instead of ``ls.value_and_grad`` (or
without ``ls.scale``) gives the wrapper true-sized gradients, which it divides by the
scale all the same: every step is 1/scale the size it should be, and nothing overflows
to say so. At run time the two cannot be told apart (a gradient of ``32768 * L`` and one
of an ``L`` 32768 times larger are the same numbers); while the step is traced they can:
a gradient of the scaled loss *depends on* the scale the optimizer state holds (the
backward pass starts from it), a forgotten one does not.

So while ``jit`` traces the update, :func:`loss_not_scaled` walks back from the gradient
tracers through the equations that computed them: gradients computed in this trace from
the params, none of which depends on the scale (or on what the scale was computed from),
were differentiated from an unscaled loss. Nothing is added to the compiled step; the
walk costs a few milliseconds of tracing on a large model (it is bounded, and gives up
silently beyond :data:`MAX_NODES`).

It reads JAX's tracing internals (``DynamicJaxprTracer.parent``,
``TracingEqn.in_tracers``); where they are missing it says nothing (a test holds it to
the current JAX). It cannot see: an eager step (the gradients are concrete numbers), and
gradients computed outside the traced function (passed in as arguments).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import jax

from loss_scaling._errors import LossScaleWarning

__all__ = ["LOSS_NOT_SCALED", "MAX_NODES", "loss_not_scaled", "warn_if_loss_not_scaled"]

MAX_NODES = 1_000_000
"""Tracers visited at most; beyond that the check says nothing."""


def _traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer) and hasattr(x, "parent")


def _inputs(x: Any) -> Iterable[Any]:
    eqn = getattr(x, "parent", None)
    return () if eqn is None else getattr(eqn, "in_tracers", ())


def _ancestors(start: list[Any], stop: set[int] | None = None) -> dict[int, Any] | None:
    """Every tracer ``start`` was computed from, itself included (by ``id``); the walk
    ends early at a tracer in ``stop``. ``None`` beyond :data:`MAX_NODES`."""
    stop = stop or set()
    seen = {id(x): x for x in start}
    stack = list(start)
    while stack:
        for parent in _inputs(stack.pop()):
            if id(parent) not in seen and _traced(parent):
                seen[id(parent)] = parent
                if id(parent) in stop or len(seen) > MAX_NODES:
                    return seen if id(parent) in stop else None
                stack.append(parent)
    return seen


def _marks(tracers: list[Any]) -> set[int] | None:
    """The tracers and the roots they were computed from (inputs of the trace)."""
    found = _ancestors(tracers)
    if found is None:
        return None
    return {id(x) for x in tracers} | {i for i, x in found.items()
                                       if getattr(x, "parent", None) is None}


def loss_not_scaled(grads: Any, scale: Any, params: Any) -> bool:
    """Whether ``grads`` were computed, in the trace now running, from ``params`` without
    ``scale``. ``False`` whenever it cannot tell (eager, gradients passed in, no params)."""
    if not _traced(scale):
        return False
    grad_leaves = [x for x in jax.tree.leaves(grads) if _traced(x)]
    if not any(getattr(x, "parent", None) is not None for x in grad_leaves):
        return False  # concrete, or inputs of the trace: computed elsewhere
    param_leaves = [x for x in jax.tree.leaves(params) if _traced(x)]
    if not param_leaves:
        return False
    scale_marks = _marks([scale])
    if scale_marks is None:
        return False
    found = _ancestors(grad_leaves, stop=scale_marks)  # ends at the scale: the common case
    if found is None or scale_marks & found.keys():
        return False
    param_marks = _marks(param_leaves)
    return param_marks is not None and bool(param_marks & found.keys())


LOSS_NOT_SCALED = (
    "{call}: these gradients were computed from the params without the loss scale that "
    "the optimizer state holds: the loss was not scaled (`jax.grad` instead of "
    "`ls.value_and_grad`, or `ls.scale` left out), so every step is 1/scale the size it "
    "should be. Differentiate the scaled loss: `loss, grads = ls.value_and_grad(loss_fn)"
    "(opt_state, params, batch)` (docs/common_mistakes.md, \"Scaling forgotten or doubled\")."
)


def warn_if_loss_not_scaled(grads: Any, scale: Any, params: Any, call: str) -> None:
    """A :class:`loss_scaling.LossScaleWarning` while tracing, if :func:`loss_not_scaled`."""
    if loss_not_scaled(grads, scale, params):
        warnings.warn(LOSS_NOT_SCALED.format(call=call), LossScaleWarning, stacklevel=4)
