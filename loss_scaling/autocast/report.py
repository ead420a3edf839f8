""":func:`autocast_report`: which equation ran in which dtype, and which rule decided."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from loss_scaling.autocast.function import Autocast, Call, autocast
from loss_scaling.autocast.rewrite import Row
from loss_scaling.autocast.rules import Rule

__all__ = ["AutocastReport", "autocast_report"]


@dataclasses.dataclass(frozen=True)
class AutocastReport:
    """What :func:`autocast_report` found: one :class:`~loss_scaling.autocast.rewrite.Row`
    per equation of the autocast program (loop bodies once, with ``repeats``).

    Attributes:
      rows: the equations in program order.
      dtype: the half dtype.
    """

    rows: tuple[Row, ...]
    dtype: np.dtype

    def flops_by_dtype(self) -> dict[str, int]:
        """Matmul and convolution FLOPs of one call, by the dtype of their operands
        (``"mixed"`` when they differ)."""
        totals: dict[str, int] = collections.Counter()
        for row in self.rows:
            if row.flops:
                names = {str(d) for d in row.in_dtypes if d is not None}
                totals[names.pop() if len(names) == 1 else "mixed"] += row.flops * row.repeats
        return dict(totals)

    def rules(self) -> dict[Rule, int]:
        """How many equations each rule decided."""
        return dict(collections.Counter(row.rule for row in self.rows))

    @property
    def unknown(self) -> tuple[Row, ...]:
        """The equations whose primitive the rules do not know (run as written)."""
        return tuple(r for r in self.rows if r.rule is Rule.UNKNOWN)

    def half_flops_fraction(self) -> float:
        """The share of matmul/convolution FLOPs with half operands (1.0 with none)."""
        totals = self.flops_by_dtype()
        total = sum(totals.values())
        return 1.0 if not total else totals.get(str(self.dtype), 0) / total

    def __str__(self) -> str:
        def dtypes(ds: tuple[Any, ...]) -> str:
            return ",".join("lit" if d is None else _short(d) for d in ds) or "-"

        header = ("primitive", "rule", "in", "out", "module path", "source")
        body = [(r.primitive + (f" x{r.repeats}" if r.repeats > 1 else ""), r.rule.value,
                 dtypes(r.in_dtypes), dtypes(r.out_dtypes), r.path or "-",
                 _short_source(r.source) + (f"  ({r.note})" if r.note else ""))
                for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
                 for line in (header, *body)]
        flops = self.flops_by_dtype()
        total = sum(flops.values()) or 1
        summary = [f"ls.autocast to {self.dtype}: {len(self.rows)} equations"]
        if flops:
            summary.append("matmul/conv FLOPs: " + ", ".join(
                f"{k} {v:.3g} ({100 * v / total:.0f}%)" for k, v in sorted(flops.items())))
        summary.append("equations per rule: " + ", ".join(
            f"{rule.value} {n}" for rule, n in sorted(self.rules().items(),
                                                      key=lambda kv: -kv[1])))
        if self.unknown:
            summary.append(f"unknown primitives (run as written): "
                           f"{', '.join(sorted({r.primitive for r in self.unknown}))}")
        return "\n".join([*summary, "", *lines])


def autocast_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> AutocastReport:
    """What :func:`loss_scaling.autocast` makes of ``fn`` for these arguments.

    Args:
      fn: a function (autocast to float16 with the default policy) or the result of
        :func:`loss_scaling.autocast` (its dtype and policy are used).
      *args: its arguments (arrays or their ``jax.ShapeDtypeStruct``: nothing runs).
      **kwargs: its keyword arguments.

    Returns:
      An :class:`AutocastReport`; ``print`` it for the table.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> report = ls.autocast_report(lambda w, x: jnp.sum(x @ w), jnp.ones((4, 3)),
      ...                             jnp.ones((2, 4)))
      >>> [(r.primitive, r.rule.value, str(r.out_dtypes[0])) for r in report.rows]
      [('dot_general', 'half', 'float16'), ('reduce_sum', 'float32', 'float32')]
    """
    cast = fn if isinstance(fn, Autocast) else autocast(fn)
    rows: list[Row] = []

    def record(pure_fn: Any, pure_args: Any, pure_kwargs: Any = None) -> Any:
        cast.trace(Call(pure_fn, pure_args, pure_kwargs or {}), rows=rows)
        raise _Recorded  # before anything runs, or writes into a module

    spy = Autocast(cast.fn, cast.dtype, cast.policy)
    spy.call_pure = record  # type: ignore[method-assign]
    try:
        spy(*args, **kwargs)
    except _Recorded:
        pass
    return AutocastReport(tuple(rows), cast.dtype)


class _Recorded(Exception):
    """Ends the report's call once the program is traced."""


def _short(dtype: Any) -> str:
    return {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
            "int32": "i32", "bool": "bool"}.get(str(dtype), str(dtype))


def _short_source(source: str | None) -> str:
    if source is None:
        return "-"
    file, _, line = source.rpartition(":")
    return f"{file.rsplit('/', 1)[-1]}:{line}"
