"""``float16_report``: does a model train in float16, up to which scale, and what limits it."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from loss_scaling.debug import _interpret, _trace
from loss_scaling.debug._interpret import Where

__all__ = ["Float16Report", "LayerHeadroom", "float16_report"]

F16_MAX = float(np.finfo(np.float16).max)  # 65504
F16_TINY = float(np.finfo(np.float16).tiny)  # 2**-14, the smallest normal
NARROW = ("float16", "bfloat16")
# The powers of two the verdict tries: from float16's smallest normal to float32's largest.
EXPONENTS = range(-14, 128)


@dataclasses.dataclass(frozen=True)
class LayerHeadroom:
    """One row of :class:`Float16Report`: a layer (or, outside any, a source line).

    Attributes:
      layer: the module path / ``named_scope`` (as in ``OverflowReport.layer``), or
        ``file:line (function)`` for equations outside any scope.
      forward_max: the largest magnitude of its limiting forward value (activations;
        ``inf`` where the run itself overflowed and it reached the loss or a gradient).
      backward_max: the same for the backward values (cotangents of the loss times the
        scale).
      forward_headroom, backward_headroom: ``log2(dtype max / max)`` of the limiting
        value: how many doublings are left before it overflows (negative: it overflows;
        ``inf``: all zero).
      headroom: the smaller of the two: the rows are sorted by it.
      underflow: the fraction of its float16 / bfloat16 backward entries (all of them in
        a hypothetical report) that are nonzero but below float16's smallest normal
        (2**-14), which float16 flushes to zero where subnormals flush (XLA on CPU) and
        keeps with fewer bits elsewhere.
      zero: the fraction of those entries that are exactly zero (in a float16 run this
        includes what already flushed).
      op: the primitive that holds the limiting value and its dtype; ``source`` its line.
      overflow: ``"first"`` for the layer of the first equation whose inf/NaN reaches the
        loss or a gradient (it overflowed with finite inputs: its row is on top),
        ``"also"`` for a layer with a later one, ``"carried"`` for a layer whose
        values only pass another layer's inf/NaN on (its headroom reads ``-inf`` for
        that reason), ``""`` otherwise.
    """

    layer: str
    forward_max: float
    backward_max: float
    forward_headroom: float
    backward_headroom: float
    headroom: float
    underflow: float
    zero: float
    op: str
    source: str
    overflow: str = ""


_MARKS = {"first": "<- first overflow", "also": "<- overflows too", "carried": "(carries it)"}


@dataclasses.dataclass(frozen=True)
class Float16Report:
    """Per-layer float16 headroom of one step, the tightest layer first, and the verdict.

    Attributes:
      rows: the :class:`LayerHeadroom` rows, sorted by ``headroom`` (ascending), the
        layer of the first overflow on top.
      scale: the loss scale of the backward pass the rows were measured at.
      fits: whether the real step (``jax.value_and_grad`` of the loss times a power of
        two from 2**-14 to 2**127, compiled) gives a finite loss and gradients at some
        scale on this batch; ``None`` in a hypothetical report.
      max_scale: the largest such power of two, or ``None`` (none, or hypothetical).
      table_scale: the scale the rows predict: ``scale`` times 2 to the floor of the
        smallest backward headroom (``None`` without backward values or when one
        already overflowed). It can be below ``max_scale`` where the value that
        overflows first does not reach a gradient.
      hypothetical: the model computes nothing in float16 or bfloat16: the rows hold
        every value to float16's range as if it were float16 (see ``HYPOTHETICAL``).
      notes: what was left out of the rows (masked non-finite values, mask fills).
      first_overflow: where the first inf/NaN that reaches the loss or a gradient
        appeared: ``"<phase> <primitive> in <layer> at <file:line>"``; ``None`` if the
        run at ``scale`` is finite.
    """

    rows: tuple[LayerHeadroom, ...]
    scale: float
    fits: bool | None
    max_scale: float | None
    table_scale: float | None = None
    hypothetical: bool = False
    notes: tuple[str, ...] = ()
    first_overflow: str | None = None

    def __iter__(self) -> Any:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        width = max([len(r.layer) for r in self.rows] + [5])
        head = (f"{'layer':<{width}}  {'fwd max':>9}  {'bwd max':>9}  {'headroom':>8}  "
                f"{'underflow':>9}  op")
        against = ("every value against float16's 65504, as if float16" if self.hypothetical
                   else "each value against its own dtype's largest value")
        lines = [f"float16 readiness at loss scale {self.scale:g} "
                 f"(headroom: doublings left, {against})", head, "-" * len(head)]
        for r in self.rows:
            mark = f"  {_MARKS[r.overflow]}" if r.overflow else ""
            lines.append(f"{r.layer:<{width}}  {r.forward_max:>9.3g}  {r.backward_max:>9.3g}  "
                         f"{r.headroom:>8.1f}  {r.underflow:>9.2%}  {r.op}{mark}")
        if self.first_overflow is not None:
            lines.append(FIRST_OVERFLOW.format(where=self.first_overflow))
        if self.hypothetical:
            lines.append(HYPOTHETICAL)
        else:
            verdict = ("fits float16: the real step is finite" if self.fits else
                       "does NOT fit float16: the real step is not finite at any scale")
            safe = ("" if self.max_scale is None
                    else f" up to loss scale 2**{math.log2(self.max_scale):g}")
            lines.append(verdict + safe)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


FIRST_OVERFLOW = (
    "first overflow: {where}, from finite inputs; its row is on top. Rows marked "
    "'(carries it)' read -inf only because its inf/NaN passes through them: fix the first "
    "(ls.find_overflow says more). In the forward pass no loss scale fixes it: "
    "ls.autocast(loss_fn, policy=ls.autocast_report(loss_fn, *args).policy) on the float32 "
    "model keeps exactly what overflows in float32 (docs/autocast.md).")
DISAGREE = (
    "at scale {scale:g} the compiled step is {compiled} while the op-by-op run the rows "
    "come from {op_by_op}: XLA folds, reorders and fuses float16 arithmetic; the verdict "
    "follows the compiled step (ls.find_overflow says which gradients)")
HYPOTHETICAL = (
    "no verdict: this model computes nothing in float16 or bfloat16. The rows hold every "
    "value to float16's range as if it were float16, but a float16 model keeps some "
    "(normalization statistics, the loss, what a layer asks for in float32) in float32. "
    "Pass the float16 version of the model (float16 compute, float32 params) for the "
    "verdict and the largest safe scale.")


def float16_report(loss_fn: Callable[..., Any], *args: Any, scale: Any = None,
                   has_aux: bool = False) -> Float16Report:
    """Per layer, how close one step's values come to their dtype's limits; and the verdict.

    Runs the batch as :func:`find_overflow` does and groups every floating value of the
    forward and backward pass (of the loss times ``scale``) by layer, each against its
    own dtype's range; masked inf/NaN, mask fills and the multiplication by the scale
    are left out. The verdict (``fits``) and ``max_scale`` come from the real step
    compiled once and bisected over 2**-14 .. 2**127, not from the table. Pass the
    float16 model; on a float32 one the table is hypothetical and there is no verdict.

    Args:
      loss_fn, ``*args``, scale, has_aux: as for :func:`find_overflow`.

    Returns:
      A :class:`Float16Report`: printable, its rows programmatic.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> loss_fn = lambda w: jnp.sum(w.astype(jnp.float16) * 1000.0)
      >>> table = ls.float16_report(loss_fn, jnp.ones(2), scale=1.0)
      >>> table.fits, table.max_scale, table.table_scale
      (True, 64.0, 64.0)
    """
    p = _trace.problem(loss_fn, args, scale, has_aux)
    values: list[_Value] = []
    made: dict[int, tuple[str, str]] = {}  # origin -> (its layer, how to name it)

    def visit(eqn: Any, invals: Sequence[Any], outvals: Sequence[Any], where: Where,
              origins: Sequence[Any]) -> None:
        if _trace.SCALE_SCOPE in where.scopes:
            return
        layer, source = _layer(where)
        for out, origin in zip(outvals, origins, strict=True):
            if _interpret.is_float(out) and out.size:
                values.append(_Value(layer, where.phase, eqn.primitive.name, source,
                                     str(out.dtype), *_magnitudes(out),
                                     _interpret.origin_ids(origin)))

    def fresh(key: int, eqn: Any, invals: Sequence[Any], out: Any, where: Where) -> None:
        layer, source = _layer(where)
        made[key] = layer, f"{where.phase} {eqn.primitive.name} in {layer} at {source}"

    reaching = _trace.reaching(_trace.interpret_step(p, visit, fresh))
    hypothetical = not any(v.phase == "forward" and v.dtype in NARROW for v in values)
    masked = sum(1 for v in values if v.origins and not v.origins & reaching)
    fills = sum(v.fills for v in values)
    notes = tuple(text for count, text in (
        (masked, f"{masked} values held inf/NaN that reach neither the loss nor a gradient "
                 "(masked away): left out"),
        (fills, f"{fills} saturated entries (at their dtype's largest magnitude, as a "
                "finfo.min mask fill is): left out")) if count)
    first = min((k for k in reaching if k in made), default=None)
    rows, table_scale = _rows(values, p.scale, reaching, hypothetical, made, first)
    if hypothetical:
        return Float16Report(rows, p.scale, None, None, table_scale, True, notes,
                             None if first is None else made[first][1])
    step = _trace.compiled_step(p)
    loss_finite, leaves_finite = step.finite(p.scale)
    if (loss_finite and leaves_finite.all()) == bool(reaching):  # the two runs disagree
        notes += (DISAGREE.format(scale=p.scale, compiled="finite" if reaching else
                                  "not finite", op_by_op="is not" if reaching else "is"),)
    max_scale = largest_finite_scale(step)
    return Float16Report(rows, p.scale, max_scale is not None, max_scale, table_scale,
                         False, notes, None if first is None else made[first][1])


def _layer(where: Where) -> tuple[str, str]:
    """A value's row (its layer, else its source line) and its source line."""
    frame = where.frame
    source = (f"{os.path.basename(frame.file_name)}:{frame.start_line} "
              f"({frame.function_name})") if frame else "(no source line)"
    return where.layer or source, source


class _Value(NamedTuple):
    """One floating output of one equation, reduced on the host as it was computed."""

    layer: str
    phase: str
    op: str
    source: str
    dtype: str
    top: float  # the largest finite magnitude that is not a mask fill
    small: int  # nonzero entries below float16's smallest normal
    zero: int
    fills: int  # entries at a dtype's largest magnitude (a finfo.min mask fill)
    size: int
    origins: set[int]  # the equations whose inf/NaN it carries


# Saturated values (a ``jnp.finfo(dtype).min`` mask fill) are masks, not activations.
_FILLS = np.array([F16_MAX, jnp.finfo(jnp.bfloat16).max, np.finfo(np.float32).max], np.float32)


def _magnitudes(x: Any) -> tuple[float, int, int, int, int]:
    """``_Value``'s top, small, zero, fills and size.

    Read on the host (an eager or jitted reduction would compile once per shape and
    dtype, the bulk of a first run's time). Non-finite entries count as none of these
    (whether they matter is known at the end of the run).
    """
    magnitude = np.abs(np.asarray(x)).astype(np.float32)
    fill = np.isin(magnitude, _FILLS)
    kept = magnitude[np.isfinite(magnitude) & ~fill]
    top = float(kept.max()) if kept.size else 0.0
    small = int(np.count_nonzero((kept > 0) & (kept < F16_TINY)))
    return top, small, int(np.count_nonzero(kept == 0)), int(np.count_nonzero(fill)), x.size


def _rows(values: list[_Value], scale: float, reaching: set[int], hypothetical: bool,
          made: dict[int, tuple[str, str]], first: int | None
          ) -> tuple[tuple[LayerHeadroom, ...], float | None]:
    """The rows, the first overflow's on top, then tightest first, and the scale they
    predict (``table_scale``)."""
    created: dict[str, set[int]] = {}  # layer -> the origins that reach, made there
    for key in reaching & made.keys():
        created.setdefault(made[key][0], set()).add(key)

    def rated(v: _Value) -> tuple[float, float, _Value]:  # (headroom, max, value)
        if v.origins & reaching:  # an inf/NaN that reaches the loss or a gradient
            return -math.inf, math.inf, v
        limit = F16_MAX if hypothetical else float(jnp.finfo(v.dtype).max)
        return (math.log2(limit / v.top) if v.top else math.inf), v.top, v

    by_layer: dict[str, list[_Value]] = {}
    for v in values:
        by_layer.setdefault(v.layer, []).append(v)
    rows = []
    for layer, mine in by_layer.items():
        (fwd_room, fwd, fwd_v), (bwd_room, bwd, bwd_v) = (
            min((rated(v) for v in mine if v.phase == phase), key=lambda r: r[0],
                default=(math.inf, 0.0, None)) for phase in ("forward", "backward"))
        limiting = fwd_v if fwd_room <= bwd_room else bwd_v
        flushed = [v for v in mine if v.phase == "backward" and (hypothetical or v.dtype in NARROW)]
        size = max(sum(v.size for v in flushed), 1)
        own = created.get(layer, set())
        overflow = ("first" if first in own else "also" if own
                    else "carried" if any(v.origins & reaching for v in mine) else "")
        rows.append(LayerHeadroom(
            layer, fwd, bwd, fwd_room, bwd_room, min(fwd_room, bwd_room),
            sum(v.small for v in flushed) / size, sum(v.zero for v in flushed) / size,
            f"{limiting.op} {limiting.dtype.replace('float', 'f')}" if limiting else "",
            limiting.source if limiting else "", overflow))
    # the first overflow's layer on top; among the -inf rows, overflows before carriers
    rows.sort(key=lambda r: (r.overflow != "first", r.headroom, r.overflow == "carried"))
    tightest = min((r.backward_headroom for r in rows if r.backward_max > 0), default=None)
    if tightest is None or not math.isfinite(tightest):  # none, or one already overflowed
        return tuple(rows), None
    return tuple(rows), scale * 2.0 ** math.floor(tightest)


def largest_finite_scale(step: _trace.CompiledStep) -> float | None:
    """The largest power of two in :data:`EXPONENTS` at which the real step (compiled
    once, and kept for later calls with the same shapes: ``_trace.compiled_step``) is
    finite, bisected: finite at a power of two is taken as finite at every power below it
    (cotangents grow with the scale). ``None`` when it is finite at none."""
    def finite(exponent: int) -> bool:
        loss, leaves = step.finite(2.0**exponent)
        return loss and bool(leaves.all())

    lo, hi = EXPONENTS[0], EXPONENTS[-1]
    if finite(hi):
        return 2.0**hi
    if not finite(lo):
        return None
    while hi - lo > 1:  # finite at lo, not at hi
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if finite(mid) else (lo, mid)
    return 2.0**lo
