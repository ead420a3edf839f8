"""Scaling, unscaling and finiteness over pytrees, on the step's own definitions.

Floating leaves (real or complex) take part; integer and bool leaves pass through. Why each
shortcut is exact: :mod:`loss_scaling.core.numerics`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from loss_scaling.core.numerics import (
    AxisName,
    agree,
    compute_dtype,
    floating_leaves,
    is_floating,
    normalized_axis_name,
    peak_of,
    per_part,
    reciprocal,
    unscale_tree,
    unscaled_finite_leaves,
)
from loss_scaling.core.scalers import (
    LossScale,
    NoOpLossScale,
    require_scaler,
)

__all__ = ["SCALED_BY", "all_finite", "any_leaf", "grads_max", "scale", "unscale"]


def any_leaf(pred: Callable[[Any], bool], tree: Any) -> bool:
    """Whether ``pred`` holds for any node of ``tree``, a node it holds for being a leaf."""
    return any(map(pred, jax.tree.leaves(tree, is_leaf=pred)))


def scale_loss(state: LossScale, loss: Any) -> Any:
    """:func:`scale` without the argument check (``ls.value_and_grad``'s own scaling)."""
    if isinstance(state, NoOpLossScale):
        return loss
    return _times_factor(state.loss_scale, loss)


@jax.jit
def _times_factor(factor: jax.Array, tree: Any) -> Any:
    def leaf(x: Any) -> Any:
        if not is_floating(x):
            return x
        x = jnp.asarray(x)
        compute = compute_dtype(x.dtype)
        return per_part(x, lambda part: part.astype(compute) * factor.astype(compute))

    return jax.tree.map(leaf, tree)


SCALED_BY: str = _times_factor.__name__  # type: ignore[attr-defined]
"""The name under which :func:`scale` (and ``ls.value_and_grad``'s own scaling) appears in
a program, a ``jit`` of that name: what :mod:`loss_scaling.wrapper.provenance` looks for."""


@jax.jit
def _times_reciprocal(factor: jax.Array, tree: Any) -> Any:
    return unscale_tree(tree, reciprocal(factor))


def scale(state: LossScale, tree: Any) -> Any:
    """Multiplies every floating leaf of ``tree`` (a loss or any pytree) by the loss scale.

    Leaves are computed in at least float32 (complex64), so the multiplication itself
    never overflows a float16 loss. With :class:`NoOpLossScale` the tree comes back as is.

    Args:
      state: a loss-scale state (``ls.get_loss_scale(opt_state)`` reads it from an
        optimizer state).
      tree: a scalar loss or any pytree.

    Returns:
      ``tree`` times the factor; float16 / bfloat16 / float8 leaves come back as float32.

    Raises:
      TypeError: if ``state`` is not a loss-scale state.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> s = ls.DynamicLossScale()            # 2**15
      >>> ls.scale(s, jnp.float16(4.0))        # would be inf in float16
      Array(131072., dtype=float32)
    """
    require_scaler("state", state)
    return scale_loss(state, tree)


def unscale(state: LossScale, tree: Any) -> Any:
    """Divides every floating leaf of ``tree`` by the loss scale; each leaf keeps its dtype.

    A multiplication by the float32 reciprocal, as PyTorch's ``GradScaler`` does: exact for
    power-of-two factors, PyTorch's CPU bits for any factor wherever the result is normal; a
    subnormal result may flush to zero (XLA on CPU does).

    Args:
      state: the loss-scale state that scaled the loss.
      tree: scaled gradients (any pytree).

    Returns:
      The unscaled tree, with the same structure and dtypes.

    Raises:
      TypeError: if ``state`` is not a loss-scale state.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> s = ls.StaticLossScale(1024.0)
      >>> ls.unscale(s, {"w": jnp.array([2048.0, 512.0], jnp.float16)})
      {'w': Array([2. , 0.5], dtype=float16)}
      >>> ls.unscale(ls.StaticLossScale(2.0**127), jnp.float32(2.0**127))  # 1/scale is subnormal
      Array(1., dtype=float32)
    """
    require_scaler("state", state)
    if isinstance(state, NoOpLossScale):
        return tree
    return _times_reciprocal(state.loss_scale, tree)


@functools.partial(jax.jit, static_argnames="axis_name")
def _all_finite(tree: Any, axis_name: AxisName) -> jax.Array:
    return unscaled_finite_leaves(tree, None, axis_name)[1]


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
    """Whether every floating (real or complex) leaf of ``tree`` is free of inf and NaN.

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
    return _all_finite(tree, axis_name=normalized_axis_name(axis_name))


@functools.partial(jax.jit, static_argnames="axis_name")
def _grads_max(tree: Any, axis_name: AxisName) -> jax.Array:
    # A max may drop a NaN (XLA CPU's vectorized max does): the finite test says inf.
    finite = unscaled_finite_leaves(tree, None)[1]
    return agree(axis_name, None, jnp.where(finite, peak_of(floating_leaves(tree)), jnp.inf))[0]


def grads_max(tree: Any, axis_name: AxisName = None) -> jax.Array:
    """The largest ``|entry|`` over the floating (real or complex) leaves of ``tree``.

    What ``update(state, finite, grads_max=...)`` of a ``growth="headroom"`` scaler takes,
    from the *scaled* gradients (the optax wrapper computes it itself). 0 for no leaves.

    Args:
      tree: any pytree.
      axis_name: inside ``pmap`` or ``shard_map``, the mapped axis name (or names): the
        max is taken over the replicas too, so that every replica grows alike.

    Returns:
      A float32 scalar array: inf if a leaf holds an inf or a NaN (on any replica, with
      ``axis_name``), as the step reads a NaN.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> ls.grads_max({"w": jnp.array([1.0, -3.0]), "step": jnp.int32(7)})
      Array(3., dtype=float32)
      >>> ls.grads_max({"w": jnp.array([1.0, jnp.nan, -3.0])})
      Array(inf, dtype=float32)
    """
    return _grads_max(tree, axis_name=normalized_axis_name(axis_name))
