"""The update rule of :class:`DynamicLossScale` and :func:`update`."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scaling import _errors
from loss_scaling._errors import Failure
from loss_scaling.core import headroom
from loss_scaling.core.fields import DynamicConfig
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    StaticLossScale,
    dynamic_from_leaves,
    holds_failure,
    replace_leaves,
    require_scaler,
    with_failure,
)
from loss_scaling.core.validation import F32, is_traced


def _as_finite_flag(grads_finite: Any) -> jax.Array:
    dtype = getattr(grads_finite, "dtype", None)
    if not isinstance(grads_finite, bool) and (getattr(grads_finite, "shape", None) != ()
                                               or dtype is None
                                               or not jnp.issubdtype(dtype, jnp.bool_)):
        raise ValueError(
            "grads_finite must be a scalar bool (a Python bool or a bool array of shape ()), "
            f"got {grads_finite!r}."
        )
    return jnp.asarray(grads_finite)


def _as_grads_max(state: LossScale, grads_max: Any) -> jax.Array | None:
    """``grads_max`` checked: a real scalar (float32), required by the headroom rule."""
    uses_max = headroom.is_headroom(state)
    if grads_max is None:
        if uses_max:
            raise ValueError(
                "a DynamicLossScale with growth='headroom' needs grads_max=, the largest "
                "|entry| of this step's SCALED gradients as a float32 scalar, got None: "
                "pass `grads_max=loss_scaling.grads_max(grads)` to update (the optax "
                "wrapper passes it itself).")
        return None
    shape, dtype = getattr(grads_max, "shape", ()), getattr(grads_max, "dtype", None)
    if isinstance(grads_max, (bool, np.bool_)) or shape != () or (
            dtype is not None and not (jnp.issubdtype(dtype, jnp.floating)
                                       or jnp.issubdtype(dtype, jnp.integer))) or (
            dtype is None and not isinstance(grads_max, (int, float))):
        raise ValueError(
            "grads_max must be a real scalar (the largest |entry| of the scaled gradients, "
            f"e.g. loss_scaling.grads_max(grads)), got {grads_max!r}.")
    return jnp.asarray(grads_max, jnp.float32) if uses_max else None


def grown(config: DynamicConfig, scale: jax.Array) -> jax.Array:
    """The scale times ``growth_factor``, capped at ``max_scale``; a product beyond float32
    is no growth."""
    grown = scale * jnp.float32(config.growth_factor)
    if config.max_scale is not None:
        grown = jnp.minimum(grown, jnp.float32(config.max_scale))
    return jnp.where(jnp.isfinite(grown), grown, scale)


def _clean_step(state: DynamicLossScale,
                grads_max: jax.Array | None) -> dict[str, jax.Array]:
    """The leaves a clean step changes (``nonfinite_tracker`` is then 0)."""
    config = state.config
    scale, tracker = state.loss_scale, state.growth_tracker
    # Count, and grow on the growth_interval-th one unless that overflows. The counters
    # saturate at int32's max: hysteresis and growth_interval may be anything in
    # [1, 2**31 - 1], and no counter ever wraps.
    counted = optax.safe_increment(tracker)
    grows = counted >= config.growth_interval
    if config.growth == headroom.RULE:
        assert grads_max is not None
        return headroom.clean_step(state, grads_max, grows, counted, grown)
    return {"loss_scale": jnp.where(grows, grown(config, scale), scale),
            "growth_tracker": jnp.where(grows, jnp.zeros_like(tracker), counted)}


def _dynamic_step(
    state: DynamicLossScale, finite: jax.Array, grads_max: jax.Array | None = None,
    backoff: bool = False, valid: jax.Array | None = None, healthy: jax.Array | None = None,
) -> tuple[DynamicLossScale, jax.Array, jax.Array]:
    """One application of the rule: (new state, its failure code after this step (held by
    a wrapper: this step's code, which the wrapper keeps only while healthy), whether it
    failed on this step).

    ``backoff=True`` is :func:`backoff_now`; ``valid``, the scale's validity when the caller
    checked it already. Fail closed and sticky: a failing step records a :class:`Failure`
    code and keeps every value, and a failed state never changes again. A scaler on its
    own records the code in its ``failure`` leaf and is healthy while that is 0; one held
    by a wrapper has no such leaf: the wrapper says whether it is ``healthy`` and keeps
    the code returned in its own register.
    """
    config = state.config
    scale, tracker, streak = state.loss_scale, state.growth_tracker, state.nonfinite_tracker
    own = state.failure if holds_failure(state) else None  # its register, if on its own
    if healthy is None:
        assert own is not None, "a wrapper's scaler: the wrapper says if it is healthy"
        healthy = own == 0
    assert healthy is not None
    valid = is_positive_normal(scale) if valid is None else valid
    clean = _clean_step(state, grads_max)

    # Non-finite step: back off once the hysteresis is used up (at once for a replay).
    bad_streak = jnp.minimum(optax.safe_increment(streak), config.hysteresis)
    backs_off = jnp.asarray(True) if backoff else bad_streak >= config.hysteresis
    shrunk = scale * jnp.float32(config.backoff_factor)
    if config.min_scale is not None:
        shrunk = jnp.maximum(shrunk, jnp.float32(config.min_scale))
    # `>= tiny` rather than `> 0`: XLA on CPU flushes subnormals to zero, GPUs may not.
    underflow = ~finite & backs_off & ~(shrunk >= jnp.float32(F32.tiny))

    code = jnp.where(~valid, Failure.INVALID_SCALE,
                     jnp.where(underflow, Failure.BACKOFF_UNDERFLOW, Failure.NONE))
    fails = healthy & (code != Failure.NONE)
    frozen = ~healthy | fails
    stepped = {
        "loss_scale": jnp.where(finite, clean["loss_scale"], jnp.where(backs_off, shrunk, scale)),
        "growth_tracker": jnp.where(finite, clean["growth_tracker"], jnp.zeros_like(tracker)),
        "nonfinite_tracker": jnp.where(finite, jnp.zeros_like(streak), bad_streak),
    }
    if config.growth == headroom.RULE:
        stepped.update(headroom.nonfinite_step(state, finite, backs_off, shrunk, clean))
    new_leaves = {name: jnp.where(frozen, getattr(state, name), value)
                  for name, value in stepped.items()}
    if own is None:  # the wrapper keeps the code (and its own, once failed)
        return replace_leaves(state, **new_leaves), code.astype(jnp.int32), fails
    new_leaves["failure"] = jnp.where(healthy, code.astype(jnp.int32), own)
    return replace_leaves(state, **new_leaves), new_leaves["failure"], fails


_dynamic_step_jit = jax.jit(_dynamic_step, static_argnames="backoff")


def _run(state: DynamicLossScale, finite: jax.Array, grads_max: jax.Array | None,
         backoff: bool = False, valid: jax.Array | None = None,
         healthy: jax.Array | None = None) -> tuple[DynamicLossScale, jax.Array, jax.Array]:
    """The rule traced in place inside a trace, else one cached compiled call."""
    if any(is_traced(x) for x in jax.tree.leaves((state, finite, grads_max, valid, healthy))):
        return _dynamic_step(state, finite, grads_max, backoff, valid, healthy)
    return _dynamic_step_jit(state, finite, grads_max, backoff=backoff, valid=valid,
                             healthy=healthy)


def step_recorded(state: DynamicLossScale, finite: jax.Array, *, grads_max: Any = None,
                  valid: jax.Array | None = None,
                  healthy: jax.Array | None = None) -> tuple[DynamicLossScale, jax.Array]:
    """:func:`update`'s new state and its failure code, a failure only recorded, never
    raised (eager too): the wrapper's step, which keeps the code in its own register."""
    new_state, code, _ = _run(state, jnp.asarray(finite), _as_grads_max(state, grads_max),
                              valid=valid, healthy=healthy)
    return new_state, code


def backoff_step(state: LossScale) -> tuple[LossScale, jax.Array]:
    """:func:`backoff_now` and the failure code it leaves (0: it backed off cleanly); a
    wrapper's scaler is taken to be healthy (the wrapper checks its own register)."""
    if not isinstance(state, DynamicLossScale):
        return state, jnp.zeros((), jnp.int32)
    peak = jnp.zeros((), jnp.float32) if headroom.is_headroom(state) else None
    healthy = None if holds_failure(state) else jnp.asarray(True)
    new_state, code, _ = _run(state, jnp.asarray(False), peak, backoff=True, healthy=healthy)
    return new_state, code


def backoff_now(state: LossScale) -> LossScale:
    """The rule's non-finite branch applied at once, hysteresis ignored: a replay's backoff.

    A failing backoff is recorded in the state, never raised (eagerly neither).
    ``NoOpLossScale`` and ``StaticLossScale`` are returned as they are.

    Examples:
      >>> import loss_scaling as ls
      >>> from loss_scaling.core.update import backoff_now
      >>> s = backoff_now(ls.DynamicLossScale(init_scale=1024.0, hysteresis=3))
      >>> float(s.loss_scale), int(s.nonfinite_tracker)
      (512.0, 1)
    """
    return backoff_step(state)[0]


def is_positive_normal(scale: Any) -> jax.Array:
    """In-graph: whether ``scale`` is a finite, positive, normal float32 (NaN is not)."""
    scale = jnp.asarray(scale, jnp.float32)
    return (scale >= jnp.float32(F32.tiny)) & (scale <= jnp.float32(F32.max))


OnFailure = Literal["record", "raise"]


def resolve_on_failure(on_failure: Any) -> OnFailure:
    """Checks ``on_failure``."""
    if on_failure not in ("record", "raise"):
        raise ValueError(
            f"on_failure must be 'record' (the default: the failure is kept in the state and "
            f"`loss_scaling.check` raises it on the host) or 'raise' (an immediate raise from "
            f"a host callback, for debugging), got {on_failure!r}.")
    return on_failure


def scaler_failure_message(scaler: DynamicLossScale | StaticLossScale) -> str:
    """The host-side message for a scaler on its own that failed (concrete, unreplicated
    values): its code, else ``INVALID_SCALE`` (:func:`loss_scaling._errors.failure_message`)."""
    code = getattr(scaler, "failure", None)
    return _errors.failure_message(
        Failure.INVALID_SCALE if code is None else code, scale=scaler.loss_scale,
        backoff_factor=getattr(getattr(scaler, "config", None), "backoff_factor", None))


def update(
    state: LossScale,
    grads_finite: Any,
    *,
    grads_max: Any = None,
    on_failure: OnFailure = "record",
) -> LossScale:
    """Returns the state for the next step, given whether this step's gradients were finite.

    Call it on every step, skipped or not, after the optimizer step. ``NoOpLossScale`` and
    ``StaticLossScale`` are returned unchanged; ``DynamicLossScale`` follows the rule in
    its docstring, failing closed as it says (a scale invalid on arrival fails too): under
    ``jit`` the state keeps its last valid scale and never changes again.

    Args:
      state: the current loss-scale state.
      grads_finite: a scalar bool (Python or array), e.g. from :func:`all_finite`.
      grads_max: the largest ``|entry|`` of this step's *scaled* gradients, a real scalar
        (:func:`loss_scaling.grads_max`); required by ``growth="headroom"``, which divides
        it by the scale and records it; ignored by every other rule.
      on_failure: ``"record"`` (the default) or ``"raise"``: under ``jit``, also raise at
        once from a host callback when the state fails. Debugging only: any executable
        holding a callback leaves JAX's fast dispatch path (about 1 ms of host time per
        step, see the README), and a raise inside a donated step deletes its inputs.

    Returns:
      The new state, of the same kind and configuration.

    Raises:
      LossScaleError: called eagerly, when the new state has failed.
      ValueError: if ``grads_finite`` is not a scalar bool, ``grads_max`` is not a real
        scalar (or missing for ``growth="headroom"``), or ``on_failure`` is unknown.
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
    require_scaler("state", state)
    finite = _as_finite_flag(grads_finite)
    peak = _as_grads_max(state, grads_max)
    if not isinstance(state, DynamicLossScale):
        return state
    if not holds_failure(state):  # a wrapper's scaler, without the register: its own again
        alone = with_failure(state, jnp.zeros_like(state.growth_tracker))
        assert isinstance(alone, DynamicLossScale)
        state = alone
    new_state, _, fails = _run(state, finite, peak)
    if any(is_traced(x) for x in jax.tree.leaves((state, finite, peak))):
        if on_failure == "raise":
            def message(*leaves: Any) -> str:
                return scaler_failure_message(dynamic_from_leaves(state.config, leaves))

            _errors.raise_in_graph(fails, message, *jax.tree.leaves(new_state))
        return new_state
    if np.any(np.asarray(new_state.failure)):
        raise _errors.LossScaleError(scaler_failure_message(new_state))
    return new_state

