"""``float16_report``: per layer, how close one step's values come to float16's limits."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling.debug import _interpret, _trace
from loss_scaling.debug._interpret import Where

__all__ = ["Float16Report", "LayerHeadroom", "float16_report"]

F16_MAX = float(np.finfo(np.float16).max)  # 65504
F16_TINY = float(np.finfo(np.float16).tiny)  # 2**-14, the smallest normal


def headroom(magnitude: float) -> float:
    """Powers of two between ``magnitude`` and float16's largest value (negative: over)."""
    if magnitude == 0:
        return math.inf
    return math.log2(F16_MAX / magnitude) if math.isfinite(magnitude) else -math.inf


@dataclasses.dataclass(frozen=True)
class LayerHeadroom:
    """One row of :class:`Float16Report`: a layer (or, outside any, a source line).

    Attributes:
      layer: the module path / ``named_scope`` (as in ``OverflowReport.layer``), or
        ``file:line (function)`` for equations outside any scope.
      forward_max: the largest magnitude among its forward values (activations; ``inf``
        where the run itself overflowed).
      backward_max: the largest magnitude among its backward values (cotangents of the
        loss times the scale).
      forward_headroom, backward_headroom: ``log2(65504 / max)``: how many doublings
        are left before float16 overflows (negative: it overflows; ``inf``: all zero).
      headroom: the smaller of the two.
      underflow: the fraction of its backward entries that are nonzero but below
        float16's smallest normal (2**-14), which float16 flushes to zero where
        subnormals flush (XLA on CPU) and keeps with fewer bits elsewhere.
      zero: the fraction of its backward entries that are exactly zero (in a float16
        run this includes what already flushed).
      op: the primitive that holds the limiting maximum; ``source`` its user line.
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


@dataclasses.dataclass(frozen=True)
class Float16Report:
    """Per-layer float16 headroom of one step, the tightest layer first.

    Attributes:
      rows: the :class:`LayerHeadroom` rows, sorted by ``headroom`` (ascending).
      scale: the loss scale of the backward pass.
      fits: whether every forward and backward value is within float16's range.
      max_scale: the largest power-of-two multiple of ``scale`` at which no backward
        value exceeds float16's range (cotangents are linear in the scale), or ``None``
        without backward values or when some already overflowed at ``scale`` (run it
        again at a smaller one).
    """

    rows: tuple[LayerHeadroom, ...]
    scale: float
    fits: bool
    max_scale: float | None

    def __iter__(self) -> Any:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        width = max([len(r.layer) for r in self.rows] + [5])
        head = (f"{'layer':<{width}}  {'fwd max':>9}  {'bwd max':>9}  {'headroom':>8}  "
                f"{'underflow':>9}  op")
        lines = [f"float16 readiness at loss scale {self.scale:g} "
                 f"(headroom: doublings left below 65504)", head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r.layer:<{width}}  {r.forward_max:>9.3g}  {r.backward_max:>9.3g}  "
                         f"{r.headroom:>8.1f}  {r.underflow:>9.2%}  {r.op}")
        verdict = "fits float16" if self.fits else "does NOT fit float16"
        safe = ("" if self.max_scale is None
                else f"; largest safe scale 2**{math.log2(self.max_scale):g}")
        lines.append(f"{verdict}{safe}")
        return "\n".join(lines)


def float16_report(loss_fn: Callable[..., Any], *args: Any, scale: Any = None,
                   has_aux: bool = False) -> Float16Report:
    """Per layer, the largest forward and backward magnitudes of one step against float16.

    Runs the batch as :func:`find_overflow` does (same arguments, same differentiation,
    eagerly, op by op) in the computation's own dtype, and records every floating value
    of the forward pass and of the backward pass of the loss times ``scale``, grouped by
    layer. Run it on the float32 version of a model to see how far past float16's range
    a layer goes and what would flush to zero; on the float16 version, an overflowing
    layer shows ``inf`` (use :func:`find_overflow` there). The multiplication by the
    scale itself (float32, in ``loss_scaling.scale``) is left out.

    Returns:
      A :class:`Float16Report`: printable, its rows programmatic.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> table = ls.float16_report(lambda w: jnp.sum(w * 1000.0), jnp.ones(2), scale=1.0)
      >>> table.fits, table.max_scale
      (True, 64.0)
    """
    p = _trace.problem(loss_fn, args, scale, has_aux)
    skip = _trace.library_dirs()
    records: list[tuple[str, str, str, str, Any]] = []

    def visit(eqn: Any, invals: Sequence[Any], outvals: Sequence[Any], where: Where) -> None:
        names = _interpret.scopes(where.name_stack)
        if _trace.SCALE_SCOPE in names:
            return
        frame = _interpret.user_frame(eqn, skip)
        source = (f"{os.path.basename(frame.file_name)}:{frame.start_line} "
                  f"({frame.function_name})") if frame else "?"
        for out in outvals:
            if _interpret.is_float(out) and out.size:
                records.append(("/".join(names) or source, where.phase, eqn.primitive.name,
                                source, _stats(out)))

    _trace.run(p, visit)
    stats = jax.device_get([r[4] for r in records])
    return _table([(*r[:4], s) for r, s in zip(records, stats, strict=True)],
                  _trace.scale_value(p))


def _stats(x: Any) -> Any:
    return (*_reduce(x), x.size)


@jax.jit
def _reduce(x: Any) -> Any:
    """One compiled kernel per shape and dtype (eagerly: six, each compiled on its own)."""
    magnitude = jnp.abs(x).astype(jnp.float32)
    magnitude = jnp.where(jnp.isnan(magnitude), jnp.inf, magnitude)
    return (jnp.max(magnitude), jnp.sum((magnitude > 0) & (magnitude < F16_TINY)),
            jnp.sum(magnitude == 0))


def _table(records: list[tuple[str, str, str, str, Any]], scale: float) -> Float16Report:
    layers: dict[str, dict[str, Any]] = {}
    for layer, phase, op, source, (top, small, zero, size) in records:
        row = layers.setdefault(layer, {"forward": (0.0, "", ""), "backward": (0.0, "", ""),
                                        "small": 0, "zero": 0, "size": 0})
        if float(top) >= row[phase][0]:
            row[phase] = (float(top), op, source)
        if phase == "backward":
            row["small"] += int(small)
            row["zero"] += int(zero)
            row["size"] += int(size)
    rows = [_row(layer, row) for layer, row in layers.items()]
    rows.sort(key=lambda r: r.headroom)
    room = min((r.backward_headroom for r in rows if r.backward_max > 0), default=None)
    max_scale = None  # no backward values, or some already overflowed at this scale
    if room is not None and math.isfinite(room):
        max_scale = scale * 2.0 ** math.floor(room)
    return Float16Report(tuple(rows), scale, all(r.headroom >= 0 for r in rows), max_scale)


def _row(layer: str, row: dict[str, Any]) -> LayerHeadroom:
    (fwd, fwd_op, fwd_src), (bwd, bwd_op, bwd_src) = row["forward"], row["backward"]
    fwd_room, bwd_room = headroom(fwd), headroom(bwd)
    op, source = (fwd_op, fwd_src) if fwd_room <= bwd_room else (bwd_op, bwd_src)
    size = max(row["size"], 1)
    return LayerHeadroom(layer, fwd, bwd, fwd_room, bwd_room, min(fwd_room, bwd_room),
                         row["small"] / size, row["zero"] / size, op, source)
