"""A jaxpr walker written for the tests, independent of loss_scaling.autocast: it visits
every equation of a program (inside jit, scan, while, cond, checkpoint, shard_map and custom
rules) with how often it runs, and counts matmul/convolution FLOPs by operand dtype."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex


def sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, int]]:
    """The sub-programs of an equation and how often each runs per execution of it."""
    repeats = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jex.ClosedJaxpr):
                yield item.jaxpr, repeats
            elif isinstance(item, jex.Jaxpr):
                yield item, repeats


def equations(jaxpr: Any, repeats: int = 1) -> Iterator[tuple[Any, int]]:
    """Every equation (sub-programs' included) with how often it runs."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn, repeats
        for sub, times in sub_jaxprs(eqn):
            yield from equations(sub, repeats * times)


def matmul_flops(eqn: Any) -> int:
    name = eqn.primitive.name
    out = eqn.outvars[0].aval.shape
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * int(np.prod([lhs[d] for d in contract])) * int(np.prod(out))
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
        return 2 * int(np.prod(out)) * int(np.prod(rhs)) // rhs[out_feature]
    return 0


def flops_by_dtype(jaxpr: Any) -> dict[str, int]:
    """Matmul/convolution FLOPs by the dtypes of their two operands ("a,b")."""
    totals: dict[str, int] = collections.Counter()
    for eqn, repeats in equations(jaxpr):
        flops = matmul_flops(eqn)
        if flops:
            key = ",".join(str(v.aval.dtype) for v in eqn.invars[:2])
            totals[key] += flops * repeats
    return dict(totals)


def half_fraction(jaxpr: Any, half: str = "float16") -> float:
    totals = flops_by_dtype(jaxpr)
    return totals.get(f"{half},{half}", 0) / max(1, sum(totals.values()))


def reading_half(jaxpr: Any, names: set[str], half: str = "float16") -> list[str]:
    """The equations among ``names`` that read a half input."""
    return [f"{eqn.primitive.name} {eqn.source_info.name_stack}"
            for eqn, _ in equations(jaxpr) if eqn.primitive.name in names
            and any(str(getattr(v.aval, "dtype", "")) == half for v in eqn.invars)]


def casts(jaxpr: Any, src: str, dst: str) -> list[tuple[Any, int]]:
    """The convert_element_type equations from ``src`` to ``dst``, with their repeats."""
    return [(e, r) for e, r in equations(jaxpr) if e.primitive.name == "convert_element_type"
            and str(e.invars[0].aval.dtype) == src and str(e.outvars[0].aval.dtype) == dst]


def forward_and_grad(f: Any, *args: Any) -> tuple[Any, Any]:
    """The jaxprs of ``f`` and of ``jax.value_and_grad(f)``."""
    return jax.make_jaxpr(f)(*args), jax.make_jaxpr(jax.value_and_grad(f))(*args)
