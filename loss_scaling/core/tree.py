"""Scaling, unscaling and finiteness over pytrees, on the step's own definitions.

Floating leaves take part, real (float64 down to float8 / float4) and complex; integer and
bool leaves pass through untouched. The numerics, and why each shortcut is exact, are in
:mod:`loss_scaling.core.numerics`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from loss_scaling.core.numerics import (
    AxisName,
    _peak,
    _per_part,
    compute_dtype,
    floating_leaves,
    is_floating,
    reciprocal,
    unscale_tree,
    unscaled_finite_leaves,
)
from loss_scaling.core.scalers import (
    LossScale,
    NoOpLossScale,
    require_scaler,
)

__all__ = ["all_finite", "grads_max", "scale", "scaling_a_loss", "unscale"]

SCALED_TWICE = (
    "ls.scale was called inside the loss function given to ls.value_and_grad, which "
    "scales the loss itself: the loss would be scaled twice (by the scale squared). Return "
    "the plain loss from the loss function, or differentiate `ls.scale(s, loss_fn(...))` "
    "with `jax.grad` (docs/common_mistakes.md, \"Scaling forgotten or doubled\")."
)

_SCALING_A_LOSS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "loss_scaling_scaling_a_loss", default=False)


@contextlib.contextmanager
def scaling_a_loss() -> Iterator[None]:
    """While ``ls.value_and_grad`` calls the loss function (a trace-time fact): a
    :func:`scale` inside it would scale the loss a second time, and raises."""
    token = _SCALING_A_LOSS.set(True)
    try:
        yield
    finally:
        _SCALING_A_LOSS.reset(token)


def scale_loss(state: LossScale, loss: Any) -> Any:
    """:func:`scale` for ``ls.value_and_grad`` itself (no double-scaling check)."""
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
        return _per_part(x, lambda part: part.astype(compute) * factor.astype(compute))

    return jax.tree.map(leaf, tree)


@jax.jit
def _times_reciprocal(factor: jax.Array, tree: Any) -> Any:
    return unscale_tree(tree, reciprocal(factor))


def scale(state: LossScale, tree: Any) -> Any:
    """Multiplies every floating leaf of ``tree`` (a loss or any pytree) by the loss scale.

    Leaves are computed and returned in at least float32 (complex64 for complex leaves),
    so a float16 loss is never overflowed by the multiplication itself. With
    :class:`NoOpLossScale` the tree is returned as it is. Integer and bool leaves (an
    integer loss such as ``3`` included) are not floating and pass through unscaled, as
    they have no gradient.

    Args:
      state: a loss-scale state (``ls.get_loss_scale(opt_state)`` reads it from an
        optimizer state).
      tree: a scalar loss or any pytree.

    Returns:
      ``tree`` times the factor; float16 / bfloat16 / float8 leaves come back as float32.

    Raises:
      TypeError: if ``state`` is not a loss-scale state.
      ValueError: when called inside a loss function that ``ls.value_and_grad`` is
        differentiating (it scales the loss itself: the loss would be scaled twice).

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> s = ls.DynamicLossScale()            # 2**15
      >>> ls.scale(s, jnp.float16(4.0))        # would be inf in float16
      Array(131072., dtype=float32)
    """
    require_scaler("state", state)
    if _SCALING_A_LOSS.get():
        raise ValueError(SCALED_TWICE)
    return scale_loss(state, tree)


def unscale(state: LossScale, tree: Any) -> Any:
    """Divides every floating leaf of ``tree`` by the loss scale; each leaf keeps its dtype.

    Use the same state that scaled the loss of this step. The division is a multiplication
    by the float32 reciprocal of the factor, as PyTorch's ``GradScaler`` does: exact for
    the power-of-two factors a default :class:`DynamicLossScale` takes, and the same bits
    as PyTorch's CPU kernel for any factor wherever the result is a normal number. A result
    that is itself subnormal (or a subnormal gradient) may come back as zero on a backend
    that flushes subnormals, as XLA on CPU does.

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


def _all_finite(tree: Any, axis_name: AxisName) -> jax.Array:
    return unscaled_finite_leaves(tree, None, axis_name)[1]


_all_finite_jit = jax.jit(_all_finite, static_argnames="axis_name")


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
    """Whether every floating (real or complex) leaf of ``tree`` is free of inf and NaN.

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


def _grads_max(tree: Any, axis_name: AxisName) -> jax.Array:
    peak = _peak(floating_leaves(tree))
    return peak if axis_name is None else lax.pmax(peak, axis_name)


_grads_max_jit = jax.jit(_grads_max, static_argnames="axis_name")


def grads_max(tree: Any, axis_name: AxisName = None) -> jax.Array:
    """The largest ``|entry|`` over the floating (real or complex) leaves of ``tree``.

    What ``update(state, finite, grads_max=...)`` of a ``growth="headroom"`` scaler takes,
    computed from the *scaled* gradients; the optax wrapper computes it itself, from the
    same read as its finite test. Integer, bool and empty leaves are ignored (0 for none).

    Args:
      tree: any pytree.
      axis_name: inside ``pmap`` or ``shard_map``, the mapped axis name (or names): the
        max is taken over the replicas too, so that every replica grows alike.

    Returns:
      A float32 scalar array (inf or NaN if a leaf holds one).

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> ls.grads_max({"w": jnp.array([1.0, -3.0]), "step": jnp.int32(7)})
      Array(3., dtype=float32)
    """
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    return _grads_max_jit(tree, axis_name=axis_name)
