"""The one guarded step of the wrapper, used by ``update`` and ``apply_gradients``.

Order (docs/architecture.md): :func:`decide` reads the gradients once (the finite flags
per leaf, the norm, the loss, the state's health and the scale's validity, checked once);
:func:`guarded_step` runs the inner update (and, fused, ``apply_updates``) under one
``lax.cond`` or select, the unscale inside the taken branch; :func:`_next_state` steps
the loss scale, the counters and the failure register, always, last.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from loss_scaling import _errors
from loss_scaling._errors import Failure
from loss_scaling.core import numerics
from loss_scaling.core.numerics import finite_leaves, skip_cond
from loss_scaling.core.scalers import DynamicLossScale, LossScale, NoOpLossScale
from loss_scaling.core.update import is_positive_normal, records_max, step_recorded
from loss_scaling.wrapper import replay
from loss_scaling.wrapper.state import (
    _BELOW_F16_TINY,
    CONSUMED_EXTRA_ARGS,
    GRADIENT_EXTRA_ARGS,
    REPLAY_EXTRA_ARG,
    LossScalingState,
    SkipMode,
    UnderflowStats,
    WrapperOptions,
    _count,
    key_path_names,
    wrapper_failure_message,
)


def _stepped_scaler(scaler: LossScale, finite: jax.Array, grads_max: jax.Array | None,
                    valid: jax.Array) -> LossScale:
    """The scaler's next state, a failure recorded but never raised (eager included).

    The wrapper decides afterwards whether that step counts (``nonfinite_loss="skip"``
    discards it on a non-finite loss) and raises an eager failure itself (:func:`_report`).
    ``grads_max``: the scaled gradients' max |entry|, for ``growth="headroom"``;
    ``valid``: the scale's validity, checked once in :func:`decide`.
    """
    if isinstance(scaler, DynamicLossScale):
        return step_recorded(scaler, finite, grads_max=grads_max, valid=valid)
    return scaler



def _underflow_stats(grads: Any, inverse: numerics.Reciprocal | None) -> UnderflowStats:
    """Per leaf: the fractions of exact zeros (in the scaled gradients, as the backward pass
    left them), and of nonzero entries below float16's smallest normal once unscaled (in
    float32): one more read of the gradients, opt-in."""
    zero, small, size = [], [], []
    for g in jax.tree.leaves(grads):
        size.append(jnp.size(g) if numerics.is_floating(g) else 0)  # weighs the overall fractions
        if not numerics.is_floating(g) or not jnp.size(g):
            zero.append(jnp.zeros((), jnp.float32))
            small.append(jnp.zeros((), jnp.float32))
            continue
        # In the compute dtype, not cast back: a float16 leaf's small values must show.
        magnitude = jnp.abs(g.astype(numerics.compute_dtype(g.dtype)) if inverse is None
                            else numerics.unscale_leaf(g, inverse, cast_back=False))
        # Indicators by arithmetic (sign, max), not comparisons: XLA on CPU fuses these into
        # the reduction, where a boolean mask would be materialized per leaf.
        # A complex entry is zero iff both parts are (not only its real part); it is small
        # when nonzero with an unscaled modulus below float16's smallest normal.
        parts = ([jnp.real(g), jnp.imag(g)] if jnp.issubdtype(g.dtype, jnp.complexfloating)
                 else [g])
        nonzero = jnp.sign(sum(jnp.abs(p.astype(magnitude.dtype)) for p in parts))
        normal16 = jnp.sign(jnp.maximum(magnitude - _BELOW_F16_TINY, 0))  # |y| >= f16 tiny
        zero.append(jnp.mean(1 - nonzero, dtype=jnp.float32))
        small.append(jnp.mean(jnp.sign(magnitude) - normal16, dtype=jnp.float32))
    if not size:
        empty = jnp.zeros((0,), jnp.float32)
        return UnderflowStats(empty, empty, jnp.zeros((0,), jnp.int32))
    return UnderflowStats(jnp.stack(zero), jnp.stack(small),
                          jnp.asarray(np.asarray(size, np.int32)))


def _reciprocal(scaler: LossScale) -> numerics.Reciprocal | None:
    """The scaler's reciprocal; ``None`` for ``NoOpLossScale``, which compiles to nothing."""
    return None if isinstance(scaler, NoOpLossScale) else numerics.reciprocal(scaler.loss_scale)


def _inner_extra_args(options: WrapperOptions, extra_args: dict[str, Any],
                      inverse: numerics.Reciprocal | None) -> dict[str, Any]:
    """The extra arguments for the inner update: ``grad=`` unscaled, ``loss=`` consumed;
    with replay on, ``value_fn=`` (the wrapper's) only for an inner update that takes it."""
    consumed: tuple[str, ...] = CONSUMED_EXTRA_ARGS
    if options.max_replays and not replay.inner_takes_value_fn(options.inner):
        consumed += (REPLAY_EXTRA_ARG,)
    return {name: numerics.unscale_tree(value, inverse) if name in GRADIENT_EXTRA_ARGS else value
            for name, value in extra_args.items() if name not in consumed}


class StepDecision(NamedTuple):
    """What :func:`decide` read from one step's gradients and state, before the step."""

    apply: jax.Array  # run the inner step
    healthy: jax.Array  # no recorded failure and a usable scale
    valid_scale: jax.Array  # the scale is a positive normal float32 (checked once a step)
    grads_finite: jax.Array
    loss_finite: jax.Array
    leaf_finite: jax.Array  # one flag per gradient leaf
    grads: Any  # the scaled gradients (their leaves' names, the underflow statistics)
    inverse: numerics.Reciprocal | None  # the scale's reciprocal, computed once per step
    grad_norm: jax.Array  # float32 global norm of the unscaled gradients
    replays: jax.Array  # int32: how often this step's batch was recomputed (wrapper/replay.py)
    # max |entry| of the SCALED gradients (float32, agreed over replicas), read by the
    # same pass as the finite screen; only for growth="headroom", else None
    grads_max: jax.Array | None = None


def decide(options: WrapperOptions, grads: Any, state: LossScalingState,
           extra_args: dict) -> StepDecision:
    n_leaves = len(jax.tree.leaves(grads))
    if state.nonfinite_grads.shape[-1:] != (n_leaves,):
        raise ValueError(
            f"the gradients have {n_leaves} leaves but this optimizer state was initialised "
            f"for {state.nonfinite_grads.shape[-1]} (with_loss_scaling sizes its per-leaf "
            "diagnostics from the params given to `init`): pass gradients with the structure "
            "of the params the state was initialised with.")
    inverse = _reciprocal(state.scaler)
    scaler = state.scaler
    measure = (records_max(scaler) if isinstance(scaler, DynamicLossScale)
               and scaler.growth == "headroom" else None)
    leaf_finite, grads_finite, squares, grads_max = finite_leaves(
        grads, inverse, options.axis_name, measure)
    grad_norm = jnp.sqrt(squares)
    if inverse is not None:  # unscaled: by the reciprocal's two exact factors
        grad_norm = (grad_norm * inverse.lifted) * inverse.unlift
    for name in GRADIENT_EXTRA_ARGS:
        if extra_args.get(name) is not None:
            grads_finite &= numerics.unscaled_finite_leaves(extra_args[name], inverse,
                                                        options.axis_name)[1]
    loss = extra_args.get("loss")
    loss_finite = jnp.asarray(True)
    if loss is not None:
        loss_finite = jnp.isfinite(jnp.asarray(loss)).all()
        if options.axis_name is not None:
            loss_finite = lax.pmin(loss_finite.astype(jnp.int32), options.axis_name) == 1
    healthy = state.failure == Failure.NONE
    if isinstance(state.scaler, DynamicLossScale):  # a failed scaler restored into a fresh
        healthy &= state.scaler.failure == Failure.NONE  # state: its own register counts
    valid_scale = jnp.asarray(True)
    if inverse is not None:
        valid_scale = is_positive_normal(state.scaler.loss_scale)
    healthy &= valid_scale
    return StepDecision(healthy & grads_finite & loss_finite, healthy, valid_scale,
                        grads_finite, loss_finite, leaf_finite, grads, inverse, grad_norm,
                        jnp.zeros((), jnp.int32), grads_max)


def _next_state(options: WrapperOptions, state: LossScalingState, inner_state: Any,
                decision: StepDecision, loss_given: bool) -> LossScalingState:
    applied = decision.apply
    if options.nonfinite_loss == "skip":
        # The forward pass, not the scale, made the loss non-finite: leave the scale be.
        # Eagerly too: a backoff discarded here must not raise (as under jit).
        stepped_scaler = _stepped_scaler(state.scaler, decision.grads_finite,
                                         decision.grads_max, decision.valid_scale)
        stepped_scaler = optax.tree.where(decision.loss_finite, stepped_scaler, state.scaler)
    else:
        stepped_scaler = _stepped_scaler(state.scaler,
                                         decision.grads_finite & decision.loss_finite,
                                         decision.grads_max, decision.valid_scale)
    if replay.enabled(options, state):
        stepped_scaler = replay.no_growth_after(decision.replays, state.scaler, stepped_scaler)
    consecutive_skips = _count(state.consecutive_skips, applied, reset=True)

    failure, fails, new_scaler = _next_failure(options, state, stepped_scaler,
                                               consecutive_skips, decision, loss_given)

    # Growths since the last overflow (the mis-use detector), and the underflow statistics.
    grew = jnp.asarray(new_scaler.loss_scale) > jnp.asarray(state.scaler.loss_scale)
    clean_growths = jnp.where(decision.grads_finite & (decision.replays == 0),
                              state.clean_growths + grew.astype(jnp.int32), 0)
    underflow = None
    if state.underflow is not None:  # non-finite gradients have no fractions: keep the last
        underflow = optax.tree.where(decision.grads_finite,
                                     _underflow_stats(decision.grads, decision.inverse),
                                     state.underflow)
    # Flags of the last step skipped for its gradients; frozen once the run has failed.
    keep_flags = applied | ~decision.healthy | decision.grads_finite
    new_state = LossScalingState(
        scaler=new_scaler,
        inner_state=inner_state,
        skipped_steps=_count(state.skipped_steps, applied, reset=False),
        consecutive_skips=consecutive_skips,
        last_step_applied=applied,
        nonfinite_loss_steps=_count(state.nonfinite_loss_steps, decision.loss_finite,
                                    reset=False),
        nonfinite_grads=jnp.where(keep_flags, state.nonfinite_grads, ~decision.leaf_finite),
        failure=failure,
        failure_skips=jnp.where(fails, consecutive_skips, state.failure_skips),
        clean_growths=clean_growths,
        underflow=underflow,
        grad_norm=decision.grad_norm,
        replays=(replay.saturating_add(state.replays, decision.replays)
                 if replay.enabled(options, state) else state.replays),
        last_step_replays=decision.replays,
    )
    _report(options, new_state, fails, key_path_names(decision.grads))
    return new_state


def _next_failure(options: WrapperOptions, state: LossScalingState, stepped_scaler: LossScale,
                  consecutive_skips: jax.Array, decision: StepDecision,
                  loss_given: bool) -> tuple[jax.Array, jax.Array, LossScale]:
    """The failure code after this step, whether it is new, and the scaler to keep.

    The first failure wins and is kept; the scaler is frozen from then on. One register:
    the wrapper's code is also written into a dynamic scaler's own ``failure``, so that
    ``ls.check(scaler)`` and the scaler's state dict carry a ``TOO_MANY_SKIPS`` too (a
    restore of that JSON does not heal the run). ``NONFINITE_LOSS`` (a loss still
    non-finite on the ``max_nonfinite_losses``-th skip in a row) is compiled only into
    steps given a ``loss=``.
    """
    failed_before = state.failure != Failure.NONE
    failure = getattr(stepped_scaler, "failure", jnp.int32(Failure.NONE))
    failure = jnp.where(decision.valid_scale, failure, Failure.INVALID_SCALE)
    if options.max_consecutive_skips is not None:
        failure = jnp.where(
            (failure == Failure.NONE) & (consecutive_skips >= options.max_consecutive_skips),
            Failure.TOO_MANY_SKIPS, failure)
    if loss_given and options.max_nonfinite_losses is not None:  # only with a loss=
        loss_fails = ~decision.loss_finite & (consecutive_skips
                                              >= options.max_nonfinite_losses)
        failure = jnp.where((failure == Failure.NONE) & loss_fails, Failure.NONFINITE_LOSS,
                            failure)
    failure = jnp.where(failed_before, state.failure, failure).astype(jnp.int32)
    fails = ~failed_before & (failure != Failure.NONE)
    new_scaler = optax.tree.where(failed_before, state.scaler, stepped_scaler)
    if isinstance(new_scaler, DynamicLossScale):
        new_scaler = new_scaler._replace(failure=jnp.where(
            new_scaler.failure == Failure.NONE, failure, new_scaler.failure))
    return failure, fails, new_scaler


def _report(options: WrapperOptions, state: LossScalingState, fails: jax.Array,
            names: list[str]) -> None:
    """Eagerly, raises a failure at once; under ``jit``, only with ``on_failure="raise"``."""
    values = jax.tree.leaves(state)
    if not any(isinstance(x, jax.core.Tracer) for x in values):
        if np.any(np.asarray(state.failure)):
            raise _errors.LossScaleError(wrapper_failure_message(state, names))
        return
    if options.on_failure == "raise":
        treedef = jax.tree.structure(state)
        _errors.raise_in_graph(
            fails,
            lambda *leaves: wrapper_failure_message(jax.tree.unflatten(treedef, leaves), names),
            *values)


def _in_dtypes_of(new_state: Any, old_state: Any) -> Any:
    """The inner state in the dtypes it came in, so that a skip can return the old one.

    Only integer params change anything: optax's moments for an int32 param start as int32
    and come back float32 (optax lets the dtype drift, which retraces a jitted step).
    """
    # A Python scalar in the state (optax accepts any pytree, e.g. {"foo": 1}) has no
    # dtype: it is held as the array the conditional makes of it.
    return optax.tree.cast_like(jax.tree.map(jnp.asarray, new_state),
                                jax.tree.map(jnp.asarray, old_state))


def _resolve_skip(skip: SkipMode, fused: bool) -> Literal["cond", "select"]:
    if skip != "auto":
        return skip
    # Measured in benchmarks/overhead.py (see docs/performance.md): the fused step is
    # cheapest as a conditional everywhere. The plain step must hand its updates out of
    # the decision; on GPU a select of them fused better than a conditional.
    if fused or jax.default_backend() == "cpu":
        return "cond"
    return "select"


def _inner_step(options: WrapperOptions, inverse: numerics.Reciprocal | None,
                extra_args: dict[str, Any], fused: bool, operands: Any) -> Any:
    """The taken branch: unscale, the inner update and, fused, ``apply_updates``."""
    grads, inner_state, params = operands
    unscaled = numerics.unscale_tree(grads, inverse)
    extra = _inner_extra_args(options, extra_args, inverse)
    try:
        updates, new_inner = options.inner.update(unscaled, inner_state, params, **extra)
    except TypeError as error:  # replay's value_fn, refused inside a chain (sam)
        if not replay.refuses_value_fn(options, extra, error):
            raise
        del extra[REPLAY_EXTRA_ARG]
        updates, new_inner = options.inner.update(unscaled, inner_state, params, **extra)
    out = optax.apply_updates(params, updates) if fused else updates
    return out, _in_dtypes_of(new_inner, inner_state)


def guarded_step(options: WrapperOptions, grads: Any, state: LossScalingState, params: Any,
                 extra_args: dict[str, Any], *, fused: bool) -> tuple[Any, LossScalingState]:
    """The one step of both paths: decide, then step or skip, then the next state.

    ``fused=False`` (``update``) returns ``(updates, state)``, a skip's updates ``-0.0``;
    ``fused=True`` (:func:`~loss_scaling.apply_gradients`) puts ``apply_updates`` under the
    decision too and returns ``(params, state)``, a skip's params the given ones.
    """
    decision = decide(options, grads, state, extra_args)
    mode = _resolve_skip(options.skip, fused)
    if replay.enabled(options, state):  # the batch recomputed while it overflows
        decision, scaler, extra_args = replay.replay(options, state, params, extra_args,
                                                     decision, decide)
        state, grads = state._replace(scaler=scaler), decision.grads
    step = functools.partial(_inner_step, options, decision.inverse, extra_args, fused)

    operands = (grads, state.inner_state, params)
    if mode == "select":
        stepped, stepped_inner = step(operands)
        skipped = params if fused else optax.tree.full_like(stepped, -0.0)
        out = optax.tree.where(decision.apply, stepped, skipped)
        new_inner = optax.tree.where(decision.apply, stepped_inner, state.inner_state)
    elif fused:  # operands passed: XLA reuses the donated buffers
        out, new_inner = skip_cond(decision.apply, step, lambda ops: (ops[2], ops[1]),
                                    operands)
    else:
        # The branches close over their inputs (operand None), as optax.apply_if_finite
        # does (measured cheaper). The skip's -0.0 take the updates' types from the step
        # branch, which lax.cond traces first (jax.eval_shape, a second trace, if not).
        types: list[Any] = []
        def stepped(_: Any) -> Any:
            types.append(jax.eval_shape(lambda x: x, (result := step(operands))[0]))
            return result

        def skip(_: Any) -> Any:
            shapes = types[-1] if types else jax.eval_shape(step, operands)[0]
            return optax.tree.full_like(shapes, -0.0), state.inner_state
        out, new_inner = skip_cond(decision.apply, stepped, skip, None)
    return out, _next_state(options, state, new_inner, decision,
                            extra_args.get("loss") is not None)
