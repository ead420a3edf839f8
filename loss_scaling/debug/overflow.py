"""``find_overflow``: the first equation of one training step whose value is not finite."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from loss_scaling.debug import _interpret, _trace
from loss_scaling.debug._interpret import Where

__all__ = ["OverflowReport", "find_overflow"]

_EQUATION_CHARS = 240


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Where the first inf or NaN of a step appeared (or that none did); falsy if none.

    Attributes:
      found: whether a non-finite value appeared; when ``False`` the other fields are
        ``None`` (or empty) and ``scale`` is the scale that was tried.
      scale: the loss scale of the backward pass.
      phase: ``"forward"`` (the loss itself) or ``"backward"`` (the gradient of the loss
        times ``scale``).
      primitive: the JAX primitive that produced it (``"dot_general"``, ``"exp"``, ...).
      file, line, function: the user's source line that emitted the equation (the
        innermost frame outside JAX, flax, Equinox, optax and this library).
      layer: the module path (flax nnx / linen, Equinox) and ``jax.named_scope`` names
        around the equation, joined by ``/``; ``""`` at the top level.
      name_stack: JAX's full name stack, transformations included (``transpose(jvp())``).
      dtype: the dtype of the non-finite output (``"float16"``).
      shape: its shape.
      max_finite_input: the largest finite magnitude among the equation's floating
        inputs (``None`` when it has none): compare it with the dtype's maximum.
      inputs_finite: whether all of the inputs were finite. ``False`` with
        ``primitive=None``: an argument of ``loss_fn`` already held an inf/NaN that
        matters; with a primitive: a masked inf/NaN, and the equation made a new one.
      loops: the ``("scan" | "while", iteration)`` pairs of the loops around it,
        outermost first (a layer stack scanned by ``nnx.scan`` / ``lax.scan``).
      equation: the equation as JAX prints it, shortened.
      reaches: what its non-finite output reaches: ``"loss"``, ``"gradients"`` or
        ``"loss and gradients"``.
      notes: the non-finite values masked or selected away before they could reach the
        loss or a gradient (a ``finfo.min`` mask fill that becomes ``-inf``, then
        ``exp(-inf) = 0``): harmless, listed so that nobody chases them.
    """

    found: bool
    scale: float
    phase: str | None = None
    primitive: str | None = None
    file: str | None = None
    line: int | None = None
    function: str | None = None
    layer: str = ""
    name_stack: str = ""
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    max_finite_input: float | None = None
    inputs_finite: bool = True
    loops: tuple[tuple[str, int], ...] = ()
    equation: str = ""
    reaches: str = ""
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.found

    def __str__(self) -> str:
        notes = [f"  note: {n}" for n in self.notes]
        if self.notes:
            notes.insert(0, "  harmless non-finite values (they reach neither the loss "
                            "nor a gradient):")
        if not self.found:
            return "\n".join([f"find_overflow: the loss and every gradient at scale "
                              f"{self.scale:g} are finite.", *notes])
        if self.primitive is None:
            return "\n".join([f"find_overflow: {self.equation}; it reaches the "
                              f"{self.reaches}.", *notes])
        lines = [f"find_overflow: the first overflow that reaches the {self.reaches} is in "
                 f"the {self.phase} pass"
                 + (f" (loss scale {self.scale:g})" if self.phase == "backward" else ""),
                 f"  layer:      {self.layer or '(top level)'}",
                 f"  primitive:  {self.primitive} -> {self.dtype}{list(self.shape or ())}",
                 f"  source:     {self.file}:{self.line} ({self.function})",
                 f"  name stack: {self.name_stack}"]
        if self.loops:
            lines.append("  loops:      " + ", ".join(f"{k} iteration {i}" for k, i in self.loops))
        if self.max_finite_input is not None:
            lines.append(f"  largest finite input magnitude: {self.max_finite_input:.4g} "
                         f"({self.dtype} max {float(jnp.finfo(self.dtype).max):.4g})")
        return "\n".join([*lines, *notes])


_ARGUMENT_TEXT = "an argument of loss_fn (the batch or the params) already holds an inf or NaN"
_MAX_NOTES = 5


def find_overflow(loss_fn: Callable[..., Any], *args: Any, scale: Any = None,
                  has_aux: bool = False) -> OverflowReport:
    """Runs one step's forward and backward pass an op at a time; reports the first overflow.

    Eager, on one batch: ``jax.vjp`` of the loss times ``scale`` is interpreted equation by
    equation, following every inf/NaN. The report names the first whose non-finite output
    *reaches* the loss or a gradient; one masked away (``exp(-inf) = 0``) is only listed
    in ``notes``. The model is not modified. How it works: debug/README.md.

    Args:
      loss_fn: ``loss_fn(params_or_model, *batch) -> loss`` (or ``(loss, aux)``).
      *args: ``loss_fn``'s arguments, optionally preceded by what holds the loss scale,
        as ``ls.value_and_grad`` takes them: ``(optimizer, model, *batch)`` for nnx,
        ``(state, state.params, *batch)``, ``(opt_state, params, *batch)``, or just
        ``(params_or_model, *batch)``.
      scale: the loss scale of the backward pass; by default the scale held by the first
        argument, else 1.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      An :class:`OverflowReport`; ``report.found`` is ``False`` (and the report is falsy)
      when the loss and every gradient are finite.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> loss_fn = lambda w, x: jnp.sum(jnp.exp(w * x))
      >>> w = jnp.array([1.0, 2.0], jnp.float16)
      >>> report = ls.find_overflow(loss_fn, w, jnp.array([1.0, 12.0], jnp.float16))
      >>> report.phase, report.primitive, report.dtype
      ('forward', 'exp', 'float16')
      >>> bool(ls.find_overflow(loss_fn, w, jnp.ones(2, jnp.float16)))
      False
    """
    p = _trace.problem(loss_fn, args, scale, has_aux)
    records: dict[int, OverflowReport] = {}

    def fresh(key: int, eqn: Any, invals: Sequence[Any], out: Any, where: Where) -> None:
        records[key] = _describe(eqn, invals, out, where, p.scale)

    loss_origin, grad_origins = _trace.interpret_step(p, lambda *_: None, fresh)
    reaching = _trace.reaching(loss_origin, grad_origins)
    masked = [f"{r.phase} {r.primitive} -> {r.dtype}{list(r.shape or ())} in "
              f"{r.layer or '(top level)'} at {r.file}:{r.line}: masked or selected away"
              for key, r in sorted(records.items()) if key not in reaching]
    notes = tuple(masked[:_MAX_NOTES]) + (
        (f"... and {len(masked) - _MAX_NOTES} more",) if len(masked) > _MAX_NOTES else ())
    if not reaching:
        return OverflowReport(found=False, scale=p.scale, notes=notes)
    first = min(reaching)
    in_loss = first in _interpret.origin_ids(loss_origin)
    in_grads = any(first in _interpret.origin_ids(o) for o in grad_origins)
    reaches = " and ".join(n for n, b in (("loss", in_loss), ("gradients", in_grads)) if b)
    if first == _interpret.ARGUMENT:
        return OverflowReport(found=True, scale=p.scale, phase="forward", inputs_finite=False,
                              reaches=reaches, notes=notes, equation=_ARGUMENT_TEXT)
    return dataclasses.replace(records[first], reaches=reaches, notes=notes)


def _describe(eqn: Any, invals: Sequence[Any], out: Any, where: Where,
              scale: float) -> OverflowReport:
    """The report on an equation that made a new inf/NaN (its inputs read on the host)."""
    magnitudes = [np.abs(np.asarray(x)).astype(np.float64)
                  for x in invals if _interpret.is_float(x)]
    frame = _trace.user_frame(eqn)
    return OverflowReport(
        found=True, scale=scale, phase=where.phase, primitive=eqn.primitive.name,
        file=frame and frame.file_name, line=frame and frame.start_line,
        function=frame and frame.function_name, layer="/".join(where.scopes),
        name_stack=str(where.name_stack), dtype=str(out.dtype), shape=tuple(out.shape),
        max_finite_input=max((float(np.where(np.isfinite(m), m, 0).max())
                              for m in magnitudes if m.size), default=None),
        inputs_finite=all(np.isfinite(m).all() for m in magnitudes),
        loops=where.loops, equation=str(eqn)[:_EQUATION_CHARS])
