"""``find_overflow``: the first equation of one training step whose value is not finite."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

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
        outermost first (a layer stack scanned by ``nnx.scan`` / ``lax.scan``). A scan's
        iteration is the index into its scanned axis, whichever way it runs; a while
        loop's is its count from 0.
      loop_runs: per loop in ``loops``, ``(position, length)``: the how-manieth iteration
        it was in execution order (from 1) and the scan's length (``None`` for a while
        loop). A backward pass runs the scan of a forward one from its last index down:
        index 95 of 200 is the 105th iteration to run.
      equation: the equation as JAX prints it, shortened.
      reaches: what its non-finite output reaches: ``"loss"``, ``"gradients"`` or
        ``"loss and gradients"``.
      sums_a_loop_carry: the equation is an ``add_any`` that adds one iteration's term
        to a sum the loop carries: in a backward scan, the gradient of something the
        scan closes over, summed over the iterations in its dtype.
      later: the other equations whose inf/NaN also reaches the loss or a gradient, in
        execution order (their values may go there through entries an earlier one
        already made non-finite): fixing the first may leave these.
      notes: the non-finite values masked or selected away before they could reach the
        loss or a gradient (a ``finfo.min`` mask fill that becomes ``-inf``, then
        ``exp(-inf) = 0``): harmless, listed so that nobody chases them.
      compiled_finite: whether the compiled step (``jax.jit`` of ``jax.value_and_grad``
        of the loss times ``scale``, what training runs) gives a finite loss and
        gradients; ``None`` when not run (``compiled=False``). XLA folds and fuses
        float16 arithmetic, so it can overflow where the op-by-op run does not, and the
        other way round: when they disagree, the report says so.
      compiled_nonfinite: what the compiled step computed non-finite: ``"loss"`` and the
        paths of the differentiated leaves whose gradients are.
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
    loop_runs: tuple[tuple[int, int | None], ...] = ()
    equation: str = ""
    reaches: str = ""
    sums_a_loop_carry: bool = False
    later: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    compiled_finite: bool | None = None
    compiled_nonfinite: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        """Whether the step overflows: an equation was found, or the compiled step is not
        finite although the op-by-op run is."""
        return self.found or self.compiled_finite is False

    def __str__(self) -> str:
        notes = [f"  note: {n}" for n in self.notes]
        if self.notes:
            notes.insert(0, "  harmless non-finite values (they reach neither the loss "
                            "nor a gradient):")
        later = [f"  later: {n}" for n in self.later]
        if self.later:
            later.insert(0, "  later overflows that also reach the loss or a gradient "
                            "(fixing the first may leave them):")
        if not self.found:
            if self.compiled_finite is False:
                return "\n".join([COMPILED_ONLY.format(
                    scale=self.scale, what=_listed(self.compiled_nonfinite)), *notes])
            return "\n".join([f"find_overflow: the loss and every gradient at scale "
                              f"{self.scale:g} are finite.", *notes])
        if self.primitive is None:
            return "\n".join([f"find_overflow: {self.equation}; it reaches the "
                              f"{self.reaches}.", *later, *notes])
        lines = [f"find_overflow: the first overflow that reaches the {self.reaches} is in "
                 f"the {self.phase} pass"
                 + (f" (loss scale {self.scale:g})" if self.phase == "backward" else ""),
                 f"  layer:      {self.layer or '(top level)'}",
                 f"  primitive:  {self.primitive} -> {self.dtype}{list(self.shape or ())}",
                 f"  source:     {source_text(self.file, self.line, self.function)}",
                 f"  name stack: {self.name_stack}"]
        if self.loops:
            lines.append("  loops:      " + loops_text(self.loops, self.loop_runs))
        if self.max_finite_input is not None:
            lines.append(f"  largest finite input magnitude: {self.max_finite_input:.4g} "
                         f"({self.dtype} max {float(jnp.finfo(self.dtype).max):.4g})")
        if self.sums_a_loop_carry:
            lines.append("  why:        " + CARRY_SUM.format(dtype=self.dtype))
        if self.phase == "forward" and self.inputs_finite:
            lines.append("  fix:        " + FORWARD_FIX)
        if self.compiled_finite is True:
            lines.append("  compiled:   " + COMPILED_FINITE.format(scale=self.scale))
        elif self.compiled_finite is False:
            lines.append("  compiled:   the compiled step is not finite either ("
                         f"{_listed(self.compiled_nonfinite)})")
        return "\n".join([*lines, *later, *notes])


COMPILED_ONLY = (
    "find_overflow: the op-by-op run finds the loss and every gradient at scale {scale:g} "
    "finite, but the compiled step does not: {what} not finite in jax.jit("
    "jax.value_and_grad) of the loss times {scale:g}, the step training runs. XLA compiles "
    "float16 arithmetic differently from the op-by-op run: it folds and reorders constants "
    "(x * 100 * 1024 becomes x * inf once 100 * 1024 is folded in float16) and fuses "
    "operations, so this overflow is in no single equation the interpreter runs. Look in "
    "those layers, their custom_jvp / custom_vjp rules included, for float16 constants "
    "multiplied together or values near 65504 and compute them in float32, or train at a "
    "scale the compiled step takes (ls.float16_report's max_scale).")
COMPILED_FINITE = (
    "the compiled step (jax.jit(jax.value_and_grad) of the loss times {scale:g}) is finite "
    "on this batch: XLA rounds this float16 arithmetic differently from the op-by-op run "
    "(fusions, reordering), so training at this scale does not skip on it; the value that "
    "overflowed here is within float16's last bits of its largest value.")
FORWARD_FIX = (
    "no loss scale fixes a forward overflow. Write the model in float32 and let autocast "
    "keep exactly what overflows in float32: ls.autocast(loss_fn, policy=ls.autocast_report("
    "loss_fn, *args).policy) (docs/autocast.md, 'When float16 overflows in the forward "
    "pass'); in a hand-cast model, compute this layer in float32.")
CARRY_SUM = (
    "this add_any adds one iteration's term to a sum the loop carries: in a backward "
    "scan, the gradient of something the scan closes over (a weight cast to {dtype} "
    "before the scan), summed over the iterations in {dtype}. Each term can be finite "
    "while the sum passes {dtype}'s largest value. Cast it inside the scanned function "
    "(its gradient then sums in float32), or lower the loss scale.")


def source_text(file: str | None, line: int | None, function: str | None) -> str:
    """``file:line (function)``, or why there is none (never ``None:None``)."""
    if file is None:
        return "(no source line: JAX made this equation outside any line of yours)"
    return f"{file}:{line} ({function})"


def loops_text(loops: Sequence[tuple[str, int]],
               runs: Sequence[tuple[int, int | None]]) -> str:
    """``scan iteration 95 of 0..199 (by index; this scan runs from 199 down: 105th to
    run)``."""
    parts = []
    for (kind, index), run in zip(loops, [*runs, *[None] * len(loops)], strict=False):
        position, length = run or (index + 1, None)
        if length is None:
            parts.append(f"{kind} iteration {index}")
        elif position == index + 1:
            parts.append(f"{kind} iteration {index} of 0..{length - 1}")
        else:
            parts.append(f"{kind} iteration {index} of 0..{length - 1} (by index; this "
                         f"scan runs from {length - 1} down: {_ordinal(position)} to run)")
    return ", ".join(parts)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _listed(names: Sequence[str], most: int = 5) -> str:
    grads = [n for n in names if n != "loss"]
    shown = ", ".join(grads[:most]) + (f" and {len(grads) - most} more"
                                       if len(grads) > most else "")
    parts = (["the loss"] if "loss" in names else []) + (
        [f"the gradients of {shown}"] if grads else [])
    return " and ".join(parts) or "nothing"


_ARGUMENT_TEXT = "an argument of loss_fn (the batch or the params) already holds an inf or NaN"
_MAX_NOTES = 5


def find_overflow(loss_fn: Callable[..., Any], *args: Any, scale: Any = None,
                  has_aux: bool = False, compiled: bool = True) -> OverflowReport:
    """Runs one step's forward and backward pass an op at a time; reports the first overflow.

    Eager, on one batch: ``jax.vjp`` of the loss times ``scale`` is interpreted equation by
    equation, following every inf/NaN. The report names the first whose non-finite output
    *reaches* the loss or a gradient; one masked away (``exp(-inf) = 0``) is only listed
    in ``notes``. The same step is also run compiled, as training runs it, and the
    report says when the two disagree. The model is not modified. How it works:
    debug/README.md.

    Args:
      loss_fn: ``loss_fn(params_or_model, *batch) -> loss`` (or ``(loss, aux)``).
      *args: ``loss_fn``'s arguments, optionally preceded by what holds the loss scale,
        as ``ls.value_and_grad`` takes them: ``(optimizer, model, *batch)`` for nnx,
        ``(state, state.params, *batch)``, ``(opt_state, params, *batch)``, or just
        ``(params_or_model, *batch)``.
      scale: the loss scale of the backward pass; by default the scale held by the first
        argument, else 1.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      compiled: also run the compiled step (``jax.jit`` of ``jax.value_and_grad``, kept
        for later calls with the same shapes) and compare; ``False`` skips it and its
        compile.

    Returns:
      An :class:`OverflowReport`; it is falsy when the loss and every gradient are
      finite, op by op and compiled.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> loss_fn = lambda w, x: jnp.sum(jnp.exp(w * x))
      >>> w = jnp.array([1.0, 2.0], jnp.float16)
      >>> report = ls.find_overflow(loss_fn, w, jnp.array([1.0, 12.0], jnp.float16))
      >>> report.phase, report.primitive, report.dtype, report.compiled_finite
      ('forward', 'exp', 'float16', False)
      >>> bool(ls.find_overflow(loss_fn, w, jnp.ones(2, jnp.float16)))
      False
    """
    p = _trace.problem(loss_fn, args, scale, has_aux)
    records: dict[int, OverflowReport] = {}

    def fresh(key: int, eqn: Any, invals: Sequence[Any], out: Any, where: Where) -> None:
        records[key] = _describe(eqn, invals, out, where, p.scale)

    step = _trace.interpret_step(p, lambda *_: None, fresh)
    reaching = _trace.reaching(step)
    compared: dict[str, Any] = {}
    if compiled:
        check = _trace.compiled_step(p)
        loss_finite, leaves_finite = check.finite(p.scale)
        compared = {"compiled_finite": bool(loss_finite and leaves_finite.all()),
                    "compiled_nonfinite": tuple(
                        (["loss"] if not loss_finite else [])
                        + [n for n, ok in zip(check.names, leaves_finite, strict=True)
                           if not ok])}
    notes = _grouped([(key, r) for key, r in sorted(records.items()) if key not in reaching],
                     "masked or selected away")
    if not reaching:
        return OverflowReport(found=False, scale=p.scale, notes=notes, **compared)
    first = min(reaching)
    later = _grouped([(key, r) for key, r in sorted(records.items())
                      if key in reaching and key != first], "reaches them too")
    origins = step.loss, step.grads
    in_loss = first in _interpret.origin_ids(origins[0])
    # (the first is held as a label: one joined to another is joined to an earlier one)
    in_grads = any(first in _interpret.origin_ids(o) for o in origins[1])
    reaches = " and ".join(n for n, b in (("loss", in_loss), ("gradients", in_grads)) if b)
    if first == _interpret.ARGUMENT:
        return OverflowReport(found=True, scale=p.scale, phase="forward", inputs_finite=False,
                              reaches=reaches, later=later, notes=notes,
                              equation=_ARGUMENT_TEXT, **compared)
    return dataclasses.replace(records[first], reaches=reaches, later=later, notes=notes,
                               **compared)


def _grouped(records: list[tuple[int, OverflowReport]], verdict: str) -> tuple[str, ...]:
    """One line per equation (its iterations together), in execution order, at most
    :data:`_MAX_NOTES` of them."""
    lines: dict[str, list[str]] = {}
    for _, r in records:
        where = (f"{r.phase} {r.primitive} -> {r.dtype}{list(r.shape or ())} in "
                 f"{r.layer or '(top level)'} at {source_text(r.file, r.line, r.function)}")
        lines.setdefault(where, [])
        if r.loops:
            lines[where].append(loops_text(r.loops, r.loop_runs))
    texts = [f"{where}" + (f", {runs[0]}" if len(runs) == 1 else
                           f", {len(runs)} loop iterations from {runs[0]}" if runs else "")
             + f": {verdict}" for where, runs in lines.items()]
    return tuple(texts[:_MAX_NOTES]) + (
        (f"... and {len(texts) - _MAX_NOTES} more",) if len(texts) > _MAX_NOTES else ())


def _describe(eqn: Any, invals: Sequence[Any], out: Any, where: Where,
              scale: float) -> OverflowReport:
    """The report on an equation that made a new inf/NaN (its inputs read on the host)."""
    magnitudes = [np.abs(np.asarray(x)).astype(np.float64)
                  for x in invals if _interpret.is_float(x)]
    frame = where.frame
    return OverflowReport(
        found=True, scale=scale, phase=where.phase, primitive=eqn.primitive.name,
        file=frame and frame.file_name, line=frame and frame.start_line,
        function=frame and frame.function_name, layer=where.layer,
        name_stack=str(where.name_stack), dtype=str(out.dtype), shape=tuple(out.shape),
        max_finite_input=max((float(np.where(np.isfinite(m), m, 0).max())
                              for m in magnitudes if m.size), default=None),
        inputs_finite=all(np.isfinite(m).all() for m in magnitudes),
        loops=where.loops, loop_runs=where.runs, equation=str(eqn)[:_EQUATION_CHARS],
        sums_a_loop_carry=eqn.primitive.name == "add_any" and any(
            v in where.carries for v in eqn.invars if not isinstance(v, jex.Literal)))
