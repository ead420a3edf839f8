"""Scaling, unscaling and finiteness over pytrees, with the dtype rules.

* Floating leaves take part; integer and bool leaves pass through untouched (and are
  ignored by the finiteness test). ``None`` and ``optax.MaskedNode`` hold no leaves.
* :func:`scale` computes in (at least) float32: a float16 loss of 4.0 at scale 2**15 is
  131072.0, not inf.
* :func:`unscale` divides by the same factor in (at least) float32 (as a multiplication by
  its reciprocal, exact for power-of-two factors) and casts each leaf back to its dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from loss_scaling.scalers import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale

__all__ = ["all_finite", "scale", "unscale"]

AxisName = str | Sequence[str] | None


def _is_floating(x: Any) -> bool:
    return isinstance(x, float) or (
        hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))


def _compute_dtype(x: Any) -> Any:
    """The dtype a leaf is scaled in: its own, promoted to at least float32."""
    return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _check_state(state: Any) -> None:
    if not isinstance(state, (NoOpLossScale, StaticLossScale, DynamicLossScale)):
        raise TypeError(
            f"state must be a NoOpLossScale, StaticLossScale or DynamicLossScale, got {state!r}."
        )


@jax.jit
def _scale(factor: jax.Array, tree: Any) -> Any:
    def leaf(x: Any) -> Any:
        if not _is_floating(x):
            return x
        dtype = _compute_dtype(x)
        return jnp.asarray(x, dtype) * factor.astype(dtype)

    return jax.tree.map(leaf, tree)


def divide_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x`` divided by ``factor``, in at least float32, returned in ``x``'s dtype.

    Multiplies by the reciprocal: exact for power-of-two factors (every factor the
    default dynamic scale takes), within 1 ulp otherwise, and unlike a division XLA
    fuses it into the optimizer's update without a gradient-sized temp buffer
    (benchmarks/overhead.py).
    """
    dtype = _compute_dtype(x)
    return (jnp.asarray(x, dtype) * (1 / factor.astype(dtype))).astype(jnp.result_type(x))


@jax.jit
def _unscale(factor: jax.Array, tree: Any) -> Any:
    return jax.tree.map(lambda x: divide_leaf(x, factor) if _is_floating(x) else x, tree)


def scale(state: LossScale, tree: Any) -> Any:
    """Multiplies every floating leaf of ``tree`` (a loss or any pytree) by the loss scale.

    Leaves are computed and returned in at least float32, so a float16 loss is never
    overflowed by the multiplication itself. With :class:`NoOpLossScale` the tree is
    returned as it is.

    Args:
      state: a loss-scale state.
      tree: a scalar loss or any pytree.

    Returns:
      ``tree`` times the factor; float16 / bfloat16 leaves come back as float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> s = ls.DynamicLossScale()            # 2**15
      >>> ls.scale(s, jnp.float16(4.0))        # would be inf in float16
      Array(131072., dtype=float32)
    """
    _check_state(state)
    if isinstance(state, NoOpLossScale):
        return tree
    return _scale(state.loss_scale, tree)


def unscale(state: LossScale, tree: Any) -> Any:
    """Divides every floating leaf of ``tree`` by the loss scale; each leaf keeps its dtype.

    Use the same state that scaled the loss of this step.

    Args:
      state: the loss-scale state that scaled the loss.
      tree: scaled gradients (any pytree).

    Returns:
      The unscaled tree, with the same structure and dtypes.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> s = ls.StaticLossScale(1024.0)
      >>> ls.unscale(s, {"w": jnp.array([2048.0, 512.0], jnp.float16)})
      {'w': Array([2. , 0.5], dtype=float16)}
    """
    _check_state(state)
    if isinstance(state, NoOpLossScale):
        return tree
    return _unscale(state.loss_scale, tree)


def _reduce_over_axes(finite: jax.Array, axis_name: AxisName) -> jax.Array:
    if axis_name is None:
        return finite
    # AND over replicas as a min of 0/1: one scalar collective per step.
    return lax.pmin(finite.astype(jnp.int32), axis_name) == 1


def _finite_leaves(tree: Any) -> list[jax.Array]:
    return [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if _is_floating(x)]


def _all_finite(tree: Any, axis_name: AxisName) -> jax.Array:
    flags = _finite_leaves(tree)
    finite = jnp.stack(flags).all() if flags else jnp.asarray(True)
    return _reduce_over_axes(finite, axis_name)


_all_finite_jit = jax.jit(_all_finite, static_argnames="axis_name")


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
    """Whether every floating leaf of ``tree`` is free of inf and NaN.

    Integer and bool leaves are ignored; an empty tree is finite.

    Args:
      tree: any pytree (``None`` leaves and ``optax.MaskedNode`` are fine).
      axis_name: inside ``pmap`` or ``shard_map``, the mapped axis name (or a tuple of
        names): the flag is AND-reduced over it, so every replica agrees. Not needed
        under ``jit`` with shardings, where the test already covers the global array.

    Returns:
      A scalar bool array.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> ls.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
      Array(False, dtype=bool)
      >>> ls.all_finite({"a": jnp.ones(3), "step": jnp.int32(7), "skip": None})
      Array(True, dtype=bool)
    """
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    return _all_finite_jit(tree, axis_name=axis_name)


def _unscaled_leaf_finite(x: Any, factor: jax.Array) -> jax.Array:
    if not _is_floating(x):
        return jnp.asarray(True)
    dtype = jnp.result_type(x)
    compute = _compute_dtype(x)
    limit = jnp.asarray(jnp.finfo(dtype).max, compute)
    inverse = 1 / factor.astype(compute)
    total = jnp.sum(jnp.abs(x), dtype=compute)
    if jnp.finfo(dtype).max < jnp.finfo(jnp.float32).max / 2:  # float16 and narrower
        largest = jnp.max(jnp.abs(x)).astype(compute) if jnp.size(x) else total
        return jnp.isfinite(total) & (largest * inverse <= limit)
    return total * inverse <= limit


def unscaled_finite_leaves(
    tree: Any, factor: jax.Array, axis_name: AxisName = None
) -> tuple[Any, jax.Array]:
    """Per leaf, whether ``unscale`` of it by ``factor`` would be finite; and all of them.

    Read from the raw (scaled) values in one fused reduction per leaf, without
    materializing the unscaled tree. Per leaf, ``sum(|x|)`` in float32 (float64 for
    float64 leaves) times ``1 / factor`` must not exceed the leaf dtype's largest value:
    inf and NaN propagate through a sum, also through the cross-device sum that ``jit``
    with shardings ends in (a cross-device *max* drops NaN on XLA CPU), and since every
    entry is at most the sum, no entry can overflow when unscaled. Float16 leaves, whose
    range a sum of many entries would exceed, compare ``max(|x|)`` instead (plus the sum
    for NaN: a second reduction). A leaf whose magnitudes sum past float32's range while
    every entry is finite (entries near 1e31) reads as non-finite: the step is skipped
    and the scale backs off, the safe direction.

    With ``axis_name``, the per-leaf flags are AND-reduced over the named axes in one
    collective (a ``pmin`` of one int32 per leaf), so every replica agrees on both.

    Returns:
      ``(flags, finite)``: a tree of scalar bools shaped like ``tree`` (``True`` for
      non-floating leaves) and their AND.
    """
    flags = jax.tree.map(lambda x: _unscaled_leaf_finite(x, factor), tree)
    leaves, treedef = jax.tree.flatten(flags)
    if not leaves:
        return flags, jnp.asarray(True)
    stacked = jnp.stack(leaves)
    if axis_name is not None:
        stacked = lax.pmin(stacked.astype(jnp.int32), axis_name) == 1
    return jax.tree.unflatten(treedef, list(stacked)), stacked.all()

