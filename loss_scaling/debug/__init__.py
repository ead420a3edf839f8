"""Debugging tools for float16: where a step overflows, and whether a model fits float16.

Run eagerly on one batch, outside the training step: nothing here is compiled into a step,
and nothing in the training path imports this package. ``loss_scaling.find_overflow`` and
``loss_scaling.float16_report`` are the entry points (see docs/diagnostics.md).

* ``_interpret``: an eager jaxpr interpreter that shows every leaf equation to a visitor
  and follows each inf/NaN entry to where it ends up (the earliest equation it came from).
* ``_trace``: the scaled loss, forward and backward, as each recipe differentiates it.
* ``overflow``: :func:`find_overflow` and its :class:`OverflowReport`: the first equation
  whose inf/NaN reaches the loss or a gradient; the masked ones are notes.
* ``readiness``: :func:`float16_report` and its :class:`Float16Report` table: each value
  against its own dtype's range; the verdict and safe scale from the real compiled step.
"""

from loss_scaling.debug.overflow import OverflowReport, find_overflow
from loss_scaling.debug.readiness import Float16Report, LayerHeadroom, float16_report

__all__ = ["Float16Report", "LayerHeadroom", "OverflowReport", "find_overflow",
           "float16_report"]
