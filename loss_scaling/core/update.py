"""The update rule of :class:`DynamicLossScale` and :func:`update`.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling import _errors
from loss_scaling._errors import Failure
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from loss_scaling.core.validation import _F32, _INT32_MAX, DynamicConfig, _is_traced


def _as_finite_flag(grads_finite: Any) -> jax.Array:
    if isinstance(grads_finite, (bool, np.bool_)):
        return jnp.asarray(grads_finite)
    shape = getattr(grads_finite, "shape", None)
    dtype = getattr(grads_finite, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.bool_):
        raise ValueError(
            "grads_finite must be a scalar bool (a Python bool or a bool array of shape ()), "
            f"got {grads_finite!r}."
        )
    return jnp.asarray(grads_finite)


def _saturating_increment(counter: jax.Array) -> jax.Array:
    """``counter + 1``, staying at int32's max instead of wrapping."""
    return jnp.where(counter < _INT32_MAX, counter + 1, counter)


def _dynamic_step(
    state: DynamicLossScale, finite: jax.Array
) -> tuple[DynamicLossScale, jax.Array]:
    """One application of the rule; returns (new state, whether it failed on this step).

    Fail closed and sticky: a backoff below the normal float32 range, or a scale that is
    not a positive normal float32 on arrival, records a :class:`Failure` code and keeps
    every value as it was (the scale at its last valid value, never 0, subnormal or NaN);
    a failed state never changes again.
    """
    config = state.config
    scale, tracker, streak = state.loss_scale, state.growth_tracker, state.nonfinite_tracker
    healthy = state.failure == 0
    valid = is_positive_normal(scale)

    # Clean step: count, and grow on the growth_interval-th one unless that overflows.
    # Both counters saturate at int32's max (optax.safe_increment style): hysteresis and
    # growth_interval may be anything in [1, 2**31 - 1], and no counter ever wraps.
    counted = _saturating_increment(tracker)
    grows = counted >= config.growth_interval
    grown = scale * jnp.float32(config.growth_factor)
    if config.max_scale is not None:
        grown = jnp.minimum(grown, jnp.float32(config.max_scale))
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    clean_scale = jnp.where(grows, grown, scale)
    clean_tracker = jnp.where(grows, jnp.zeros_like(tracker), counted)

    # Non-finite step: back off once the hysteresis is used up.
    bad_streak = jnp.minimum(_saturating_increment(streak), config.hysteresis)
    backs_off = bad_streak >= config.hysteresis
    shrunk = scale * jnp.float32(config.backoff_factor)
    if config.min_scale is not None:
        shrunk = jnp.maximum(shrunk, jnp.float32(config.min_scale))
    # `>= tiny` rather than `> 0`: XLA on CPU flushes subnormals to zero, GPUs may not.
    underflow = ~finite & backs_off & ~(shrunk >= jnp.float32(_F32.tiny))

    code = jnp.where(~valid, Failure.INVALID_SCALE,
                     jnp.where(underflow, Failure.BACKOFF_UNDERFLOW, Failure.NONE))
    fails = healthy & (code != Failure.NONE)
    frozen = ~healthy | fails
    stepped = (
        jnp.where(finite, clean_scale, jnp.where(backs_off, shrunk, scale)),
        jnp.where(finite, clean_tracker, jnp.zeros_like(tracker)),
        jnp.where(finite, jnp.zeros_like(streak), bad_streak),
    )
    old = (scale, tracker, streak)
    new_state = DynamicLossScale._from_parts(config, (
        *(jnp.where(frozen, before, after) for before, after in zip(old, stepped, strict=True)),
        jnp.where(healthy, code.astype(jnp.int32), state.failure),
    ))
    return new_state, fails


_dynamic_step_jit = jax.jit(_dynamic_step)


def step_recorded(state: DynamicLossScale, finite: jax.Array) -> DynamicLossScale:
    """:func:`update`'s new state with a failure only recorded, never raised (eager too)."""
    finite = jnp.asarray(finite)
    if any(_is_traced(x) for x in jax.tree.leaves((state, finite))):
        return _dynamic_step(state, finite)[0]
    return _dynamic_step_jit(state, finite)[0]


def is_positive_normal(scale: Any) -> jax.Array:
    """In-graph: whether ``scale`` is a finite, positive, normal float32 (NaN is not)."""
    scale = jnp.asarray(scale, jnp.float32)
    return (scale >= jnp.float32(_F32.tiny)) & (scale <= jnp.float32(_F32.max))


OnFailure = Literal["record", "raise"]


def resolve_on_failure(on_failure: Any) -> OnFailure:
    """Checks ``on_failure``."""
    if on_failure not in ("record", "raise"):
        raise ValueError(
            f"on_failure must be 'record' (the default: the failure is kept in the state and "
            f"`loss_scaling.check` raises it on the host) or 'raise' (an immediate raise from "
            f"a host callback, for debugging), got {on_failure!r}.")
    return on_failure


def failure_message(scaler: DynamicLossScale | StaticLossScale) -> str:
    """The host-side message for a failed scaler (concrete, unreplicated values)."""
    code = Failure(int(np.asarray(getattr(scaler, "failure", Failure.INVALID_SCALE))))
    if code == Failure.BACKOFF_UNDERFLOW:
        assert isinstance(scaler, DynamicLossScale)
        return _errors.backoff_underflow_message(scaler.loss_scale, scaler.config.backoff_factor)
    if code == Failure.TOO_MANY_SKIPS:  # written by the wrapper (one register)
        return _errors.scaler_too_many_skips_message(scaler.loss_scale)
    return _errors.invalid_scale_message(scaler.loss_scale)


def update(
    state: LossScale,
    grads_finite: Any,
    *,
    on_failure: OnFailure = "record",
) -> LossScale:
    """Returns the state for the next step, given whether this step's gradients were finite.

    Call it on every step, skipped or not, after the optimizer step. ``NoOpLossScale`` and
    ``StaticLossScale`` are returned unchanged; ``DynamicLossScale`` follows the rule in
    its docstring.

    A backoff that would leave the normal float32 range (without ``min_scale``), or a
    scale that is not a positive normal float32 on arrival, fails closed: called eagerly,
    ``update`` raises :class:`LossScaleError`; under ``jit`` the returned state records
    the failure (``state.failure != 0``), keeps its last valid scale and never changes
    again, and :func:`loss_scaling.check` raises the full message on the host. Nothing is
    compiled into the step for this but a few scalar operations.

    Args:
      state: the current loss-scale state.
      grads_finite: a scalar bool (Python or array), e.g. from :func:`all_finite`.
      on_failure: ``"record"`` (the default) or ``"raise"``: under ``jit``, also raise at
        once from a host callback when the state fails. Debugging only: any executable
        holding a callback leaves JAX's fast dispatch path (about 1 ms of host time per
        step, see the README), and a raise inside a donated step deletes its inputs.

    Returns:
      The new state, of the same kind and configuration.

    Raises:
      LossScaleError: called eagerly, when the new state has failed.
      ValueError: if ``grads_finite`` is not a scalar bool, or ``on_failure`` is unknown.
      TypeError: if ``state`` is not a loss-scale state.

    Examples:
      >>> import jax
      >>> import loss_scaling as ls
      >>> s = ls.DynamicLossScale(init_scale=2.0**-125)
      >>> s = ls.update(s, False)   # 2**-126 is still normal
      >>> ls.update(s, False)
      Traceback (most recent call last):
      ...
      loss_scaling.LossScaleError: loss scale backoff failed: ...
      >>> failed = jax.jit(ls.update)(s, False)     # under jit: recorded, not raised
      >>> float(failed.loss_scale), int(failed.failure)
      (1.1754943508222875e-38, 1)
    """
    on_failure = resolve_on_failure(on_failure)
    if isinstance(state, (NoOpLossScale, StaticLossScale)):
        _as_finite_flag(grads_finite)
        return state
    if not isinstance(state, DynamicLossScale):
        raise TypeError(
            f"state must be a NoOpLossScale, StaticLossScale or DynamicLossScale, got {state!r}."
        )
    finite = _as_finite_flag(grads_finite)
    if any(_is_traced(x) for x in jax.tree.leaves((state, finite))):
        new_state, fails = _dynamic_step(state, finite)
        if on_failure == "raise":
            _errors.raise_in_graph(fails, _message_from_leaves(new_state.config),
                                   *jax.tree.leaves(new_state))
        return new_state
    new_state, _ = _dynamic_step_jit(state, finite)
    if np.any(np.asarray(new_state.failure)):
        raise _errors.LossScaleError(failure_message(new_state))
    return new_state


def _message_from_leaves(config: DynamicConfig) -> Any:
    return lambda *leaves: failure_message(DynamicLossScale._from_parts(config, leaves))


def backoff_now(state: DynamicLossScale) -> DynamicLossScale:
    """The scale backed off at once, hysteresis ignored: what a replayed batch runs at.

    ``loss_scale * backoff_factor``, clamped at ``min_scale``; ``growth_tracker`` reset to
    0, ``nonfinite_tracker`` kept. Fail closed as :func:`update`: a backoff below the
    normal float32 range (or a scale that is not a positive normal float32) records its
    :class:`~loss_scaling.Failure` code and keeps every value; a failed state is returned
    unchanged. Pure and jit-able; it never raises.

    Examples:
      >>> import loss_scaling as ls
      >>> from loss_scaling.core.update import backoff_now
      >>> s = backoff_now(ls.DynamicLossScale(init_scale=1024.0, hysteresis=3))
      >>> float(s.loss_scale), int(s.growth_tracker), int(s.failure)
      (512.0, 0, 0)
    """
    config = state.config
    scale, tracker, streak = state.loss_scale, state.growth_tracker, state.nonfinite_tracker
    healthy = state.failure == 0
    shrunk = scale * jnp.float32(config.backoff_factor)
    if config.min_scale is not None:
        shrunk = jnp.maximum(shrunk, jnp.float32(config.min_scale))
    code = jnp.where(~is_positive_normal(scale), Failure.INVALID_SCALE,
                     jnp.where(shrunk >= jnp.float32(_F32.tiny), Failure.NONE,
                               Failure.BACKOFF_UNDERFLOW))
    keep = ~healthy | (code != Failure.NONE)
    return DynamicLossScale._from_parts(config, (
        jnp.where(keep, scale, shrunk), jnp.where(keep, tracker, jnp.zeros_like(tracker)),
        streak, jnp.where(healthy, code.astype(jnp.int32), state.failure)))
