""":func:`autocast_report`: which equation runs in which dtype, which rule decided, and,
run on the given values, which half results overflow (with the policy that fixes them)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core

from loss_scaling.autocast.function import Autocast, Call, autocast, context
from loss_scaling.autocast.measure import measure
from loss_scaling.autocast.policy import AutocastPolicy, Site, site_of
from loss_scaling.autocast.rewrite import HEADROOM_FACTOR, Row, rewrite_closed
from loss_scaling.autocast.rules import Rule

__all__ = ["AutocastReport", "autocast_report"]

MAX_PASSES = 8  # measure, extend the policy, measure again: a fixed point in a few passes


@dataclasses.dataclass(frozen=True)
class AutocastReport:
    """What :func:`autocast_report` found.

    Attributes:
      rows: one :class:`~loss_scaling.autocast.rewrite.Row` per equation of the autocast
        program and place in the model, in program order (a loop body's equations once,
        with ``repeats``).
      dtype: the half dtype.
      measured: whether the program ran on the given values (``max_abs`` and
        ``overflows`` of each row); not when given shapes or traced values.
      policy: the policy that keeps in float32 exactly what overflows (the given one when
        nothing does): pass it to :func:`loss_scaling.autocast` as ``policy=``.
      unfixed: rows that still overflow under ``policy`` (a user's own ``astype`` to half
        is never changed).
      unmatched: the sites of the function's own policy that name no equation here (a
        module path is matched from its start: copy it from the table).
    """

    rows: tuple[Row, ...]
    dtype: np.dtype
    measured: bool = False
    policy: AutocastPolicy = dataclasses.field(default_factory=AutocastPolicy)
    unfixed: tuple[Row, ...] = ()
    unmatched: tuple[Site, ...] = ()

    @property
    def overflows(self) -> tuple[Row, ...]:
        """The rows whose half result (or half input) the dtype does not hold."""
        return tuple(r for r in self.rows if r.overflows)

    @property
    def unknown(self) -> tuple[Row, ...]:
        """The equations whose primitive the rules do not know (run as written)."""
        return tuple(r for r in self.rows if r.rule is Rule.UNKNOWN)

    def flops_by_dtype(self) -> dict[str, int]:
        """Matmul and convolution FLOPs of one call, by the dtype of their operands
        (``"mixed"`` when they differ)."""
        totals: dict[str, int] = collections.Counter()
        for row in self.rows:
            if row.flops:
                names = {str(d) for d in row.in_dtypes if d is not None}
                totals[names.pop() if len(names) == 1 else "mixed"] += row.flops * row.repeats
        return dict(totals)

    def half_flops_fraction(self) -> float:
        """The share of matmul/convolution FLOPs with half operands (1.0 with none)."""
        totals = self.flops_by_dtype()
        total = sum(totals.values())
        return 1.0 if not total else totals.get(str(self.dtype), 0) / total

    def rules(self) -> dict[Rule, int]:
        """How many equations each rule decided."""
        return dict(collections.Counter(row.rule for row in self.rows))

    def __str__(self) -> str:
        flops = self.flops_by_dtype()
        total = sum(flops.values()) or 1
        lines = [f"ls.autocast to {self.dtype}: {len(self.rows)} equations"]
        if flops:
            lines.append("matmul/conv FLOPs: " + ", ".join(
                f"{k} {v:.3g} ({100 * v / total:.0f}%)" for k, v in sorted(flops.items())))
        lines.append("equations per rule: " + ", ".join(
            f"{rule.value} {n}" for rule, n in sorted(self.rules().items(),
                                                      key=lambda kv: -kv[1])))
        if self.unknown:
            lines.append(f"unknown primitives (run as written): "
                         f"{', '.join(sorted({r.primitive for r in self.unknown}))}")
        if self.unmatched:
            lines.append("policy sites that name no equation (paths are matched from their "
                         "start, e.g. 'Model/head'): " + ", ".join(map(str, self.unmatched)))
        if self.measured:
            limit = float(np.finfo(self.dtype).max) if self.dtype != np.dtype("bfloat16") else (
                3.39e38)
            if self.overflows:
                lines += ["", f"{len(self.overflows)} equation(s) overflow {self.dtype} "
                          f"(or come within {HEADROOM_FACTOR:g}x of its largest value, "
                          f"{limit:.6g}) in the forward pass: no loss scale fixes them. Keep "
                          "them in float32:", "    ls.autocast(fn, policy=report.policy)",
                          "", _table(self.overflows, measured=True)]
                if self.unfixed:
                    lines += ["", "still overflowing under report.policy (the user's own "
                              "casts, or more than the passes allowed):",
                              _table(self.unfixed, measured=True)]
            else:
                lines.append(f"measured: every half result fits {self.dtype} with "
                             f"{HEADROOM_FACTOR:g}x headroom")
        return "\n".join([*lines, "", _table(self.rows, measured=self.measured)])


def _table(rows: tuple[Row, ...], measured: bool) -> str:
    def dtypes(ds: tuple[Any, ...]) -> str:
        return ",".join(_short(d) for d in ds) or "-"

    header = ("primitive", "rule", "in", "out", *(("max |x|", "flag") if measured else ()),
              "module path", "source")
    body = [(r.primitive + (f" x{r.repeats}" if r.repeats > 1 else ""), r.rule.value,
             dtypes(r.in_dtypes), dtypes(r.out_dtypes),
             *((("-" if r.max_abs is None else f"{r.max_abs:.4g}"), r.overflows or "")
               if measured else ()),
             r.path or "-", _short_source(r.source) + (f"  ({r.note})" if r.note else ""))
            for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True))
                     .rstrip() for line in (header, *body))


def autocast_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> AutocastReport:
    """What :func:`loss_scaling.autocast` makes of ``fn`` for these arguments, measured.

    Given values, the autocast program runs on them equation by equation (loops step by
    step; nothing is written into an ``nnx`` model) and each row records the largest
    magnitude it produced. A half result that is inf or NaN while its operands are finite,
    or that comes within :data:`~loss_scaling.autocast.rewrite.HEADROOM_FACTOR` of the half
    dtype's largest value, is flagged: a forward overflow no loss scale can fix.
    ``report.policy`` keeps exactly those equations in float32 (a matmul keeps half operands
    and accumulates in float32) and lets float32 spread only as far as the value stays out
    of half range; measured again until nothing more overflows. Given shapes
    (``jax.ShapeDtypeStruct``) or traced values, nothing runs and only the dtypes are shown.

    Args:
      fn: a function (autocast to float16 with the default policy) or the result of
        :func:`loss_scaling.autocast` (its dtype and policy are used).
      *args: its arguments.
      **kwargs: its keyword arguments.

    Returns:
      An :class:`AutocastReport`; ``print`` it for the table, overflows first.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> def fn(w, x):
      ...     return jnp.sum(x @ w)
      >>> w, x = jnp.full((4, 3), 300.0, jnp.float32), jnp.full((2, 4), 100.0, jnp.float32)
      >>> report = ls.autocast_report(fn, w, x)
      >>> [(r.primitive, r.rule.value, str(r.out_dtypes[0]), r.overflows) for r in report.rows]
      [('dot_general', 'half', 'float16', 'result'), ('reduce_sum', 'float32', 'float32', '')]
      >>> report.policy.float32_out[0].primitive
      'dot_general'
      >>> float(ls.autocast(fn, policy=report.policy)(w, x))
      720000.0
    """
    cast = fn if isinstance(fn, Autocast) else autocast(fn)
    calls: list[Call] = []

    def record(pure_fn: Any, pure_args: Any, pure_kwargs: Any = None) -> Any:
        calls.append(Call(pure_fn, pure_args, pure_kwargs or {}))
        calls[-1].jaxpr()  # traced inside the framework's context (nnx's split and merge)
        raise _Recorded  # before anything runs, or writes into a module

    spy = Autocast(cast.fn, cast.dtype, cast.policy)  # its own cache, its call_pure
    spy.call_pure = record  # type: ignore[method-assign,assignment]
    try:
        spy(*args, **kwargs)
    except _Recorded:
        pass
    (call,) = calls
    closed, _ = call.jaxpr()
    matched: set[Site] = set()
    given = context(cast.dtype, cast.policy, matched=matched)
    unmatched = lambda: tuple(s for s in cast.policy.sites() if s not in matched)  # noqa: E731
    if any(isinstance(x, core.Tracer | jax.ShapeDtypeStruct) for x in call.arrays):
        rows: dict[Any, Row] = {}
        rewrite_closed(dataclasses.replace(given, rows=rows), closed, closed.in_avals)
        return AutocastReport(tuple(rows.values()), cast.dtype, policy=cast.policy,
                              unmatched=unmatched())
    policy = cast.policy
    first = rows = measure(given, closed, call.arrays)
    for _ in range(MAX_PASSES):
        float32, float32_out = _fixes(rows.values())
        new = policy.extended(float32, float32_out)
        if new == policy:
            break
        policy = new
        rows = measure(context(cast.dtype, policy), closed, call.arrays)
    unfixed = tuple(r for r in rows.values() if r.overflows)
    return AutocastReport(tuple(first.values()), cast.dtype, measured=True, policy=policy,
                          unfixed=unfixed, unmatched=unmatched())


def _fixes(rows: Any) -> tuple[list[Site], list[Site]]:
    """The sites that keep each overflowing row in float32: an overflowing input cast runs
    the equation as written; an overflowing result runs it in float32 (a matmul with half
    operands, float32 accumulation and result). A user's own cast is never changed."""
    float32: list[Site] = []
    float32_out: list[Site] = []
    for row in rows:
        if not row.overflows or row.rule is Rule.CONVERT:
            continue
        site = site_of(row.path, row.source, row.primitive)
        (float32 if row.overflows == "input" else float32_out).append(site)
    return float32, float32_out


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
