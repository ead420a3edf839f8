"""Debugging tools for float16: where a step overflows (:func:`find_overflow`), and
whether a model fits float16 (:func:`float16_report`). Eager, on one batch, never part
of a training step; README.md says how they work and what they cannot see.
"""

from loss_scaling.debug.overflow import OverflowReport, find_overflow
from loss_scaling.debug.readiness import Float16Report, LayerHeadroom, float16_report

__all__ = ["Float16Report", "LayerHeadroom", "OverflowReport", "find_overflow",
           "float16_report"]
