"""The Optax wrapper and its one guarded step, in the order it runs.

:func:`with_loss_scaling` sets its :class:`WrapperOptions` on ``tx.update``
(:func:`~loss_scaling.wrapper.state.attach_options`), where :func:`apply_gradients` finds
them to run the step fused. Both paths call
:func:`guarded_step`: :func:`decide` (the one read of the gradients), replay (only with
``max_replays``), :func:`_inner_step` under one ``lax.cond`` or select, and
:func:`_next_state`, always, last (docs/architecture.md, "One step, in order").
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scaling import _errors
from loss_scaling._errors import Failure
from loss_scaling.core import headroom, numerics, validation
from loss_scaling.core.numerics import AxisName, finite_leaves, skip_cond
from loss_scaling.core.scalers import (
    SCALER_TYPES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    require_scaler,
)
from loss_scaling.core.update import (
    OnFailure,
    is_positive_normal,
    resolve_on_failure,
    step_recorded,
)
from loss_scaling.wrapper import provenance, replay
from loss_scaling.wrapper.placement import (
    refuse_inside_a_chain,
    refuse_not_outermost,
    wrapper_states_in,
)
from loss_scaling.wrapper.state import (
    CONSUMED_EXTRA_ARGS,
    GRADIENT_EXTRA_ARGS,
    MAX_NONFINITE_LOSSES,
    MAX_REPLAYS,
    REPLAY_EXTRA_ARG,
    LossScalingState,
    NonFiniteLoss,
    SkipMode,
    UnderflowStats,
    WrapperOptions,
    attach_options,
    differentiated,
    initial_scaler_of,
    initial_state,
    key_path_names,
    options_of,
    refuse_dtypes_without_zero,
    warn_low_precision_state,
    wrapper_failure_message,
)

__all__ = ["apply_gradients", "with_loss_scaling"]

_BELOW_F16_TINY = float(np.nextafter(np.float32(np.finfo(np.float16).tiny), np.float32(0)))


def _fresh(scaler: LossScale) -> LossScale:
    # New buffers: donating an opt_state must never delete arrays the caller's scaler holds.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), scaler)


def _count(counter: jax.Array, reset_when: jax.Array, reset: bool) -> jax.Array:
    stepped = optax.safe_increment(counter)
    return jnp.where(reset_when, jnp.zeros_like(counter) if reset else counter, stepped)


def with_loss_scaling(
    inner: optax.GradientTransformation,
    scaler: LossScale | None = None,
    *,
    axis_name: AxisName = None,
    skip: SkipMode = "auto",
    on_failure: OnFailure = "record",
    max_consecutive_skips: int | None = None,
    nonfinite_loss: NonFiniteLoss = "backoff",
    underflow_diagnostics: bool = False,
    max_replays: int = 0,
    max_nonfinite_losses: int | None = MAX_NONFINITE_LOSSES,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that it takes gradients of the scaled loss and skips bad steps.

    Each update unscales the gradients by the factor that scaled this step's loss, checks
    them, runs ``inner`` only if every unscaled element is finite, and then updates the
    loss scale. A skipped step leaves the inner state bit-identical and returns ``-0.0``
    updates (``p + -0.0 == p`` bit for bit). It never gives up and applies a non-finite
    update, however many steps in a row are skipped.

    A failure (a backoff below the normal float32 range without ``min_scale``,
    ``max_consecutive_skips`` or ``max_nonfinite_losses`` reached, a scale that is not a
    positive normal float32) is recorded in the state: every later step is skipped, and
    :func:`loss_scaling.check` raises :class:`loss_scaling.LossScaleError` on the host
    (call it where you log). An eager (un-jitted) update raises at once.

    Args:
      inner: the optimizer to wrap (any optax transformation). Extra arguments of
        ``update`` are forwarded to it, except ``loss=`` (checked, not forwarded: optax's
        line searches and ``optax.contrib.sam`` refuse unknown arguments; give the inner
        optimizer the loss as ``value=``). ``grad=`` (``optax.lbfgs``) holds gradients of
        the scaled loss: unscaled and checked like them. Others pass through untouched.
      scaler: the initial loss-scale state; ``DynamicLossScale()`` by default.
      axis_name: inside ``pmap`` / ``shard_map``, the axis name (or names) over which the
        finite flags are AND-reduced so that every replica skips together.
      skip: ``"cond"`` (a ``lax.cond`` around the inner update), ``"select"`` (compute,
        then select) or ``"auto"`` (the one measured faster for the path and backend).
      on_failure: ``"record"`` (the default) or ``"raise"``: also raise at once from a
        host callback compiled into the step. Debugging only: the callback leaves JAX's
        fast dispatch path (~1 ms a step) and a raise in a donated step deletes its inputs.
      max_consecutive_skips: after this many consecutive skipped steps the run fails,
        naming the non-finite gradient leaves. ``None`` (the default) compiles nothing.
      nonfinite_loss: a non-finite ``loss=``: ``"backoff"`` (the default) treats it as a
        gradient overflow; ``"skip"`` skips the step and leaves the scale as it is. Either
        way it is counted in ``nonfinite_loss_steps``.
      underflow_diagnostics: per-step fractions of zero and of tiny (below float16's
        smallest normal once unscaled) gradient entries, per leaf and overall
        (:class:`UnderflowStats`, in :func:`loss_scaling.metrics`). One more read.
      max_replays: with a ``DynamicLossScale``, an overflowed batch is recomputed at the
        backed-off scale inside the same step, up to this many times (docs/replay.md);
        the update then needs ``value_fn=lambda params: loss_fn(params, batch)``
        (unscaled). An integer in [0, 64]; 0 (the default) compiles nothing.
      max_nonfinite_losses: the run fails (``Failure.NONFINITE_LOSS``) when the ``loss=``
        is not finite on this many steps in a row (``consecutive_nonfinite_losses``;
        gradient overflows with a finite loss do not count): the forward pass keeps
        failing, which no scale fixes. 16 by default; ``None`` turns it off. Compiled only
        into steps given a ``loss=``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; :func:`apply_gradients` and the
      integrations run its update fused.

    Raises:
      ValueError: for an invalid option; from ``update``, with replay on and no
        ``value_fn=``, or when ``optax.chain`` runs it with another transformation
        before or after it (put the wrapper outermost).
      TypeError: if ``inner`` is not an optax transformation or ``scaler`` not a
        loss-scale state; from ``init``, for a params dtype without a zero
        (``float8_e8m0fnu``), which no skipped step can keep.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=8.0))
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> s = ls.get_loss_scale(opt_state)
      >>> grads = jax.grad(lambda p: ls.scale(s, loss_fn(p)))(params)   # scaled by 8
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> optax.apply_updates(params, updates)["w"]
      Array([0.8, 1.6], dtype=float32)
      >>> bad = {"w": jnp.array([jnp.inf, 0.0])}
      >>> updates, opt_state = tx.update(bad, opt_state, params)    # skipped
      >>> optax.apply_updates(params, updates)["w"], float(ls.get_loss_scale(opt_state).loss_scale)
      (Array([1., 2.], dtype=float32), 4.0)
      >>> ls.check(opt_state)    # healthy: returns None
    """
    _refuse_other_inner(inner)
    on_failure = resolve_on_failure(on_failure)
    if skip not in ("auto", "cond", "select"):
        raise ValueError(f"skip must be 'auto', 'cond' or 'select', got {skip!r}.")
    if nonfinite_loss not in ("backoff", "skip"):
        raise ValueError(f"nonfinite_loss must be 'backoff' or 'skip', got {nonfinite_loss!r}.")
    max_consecutive_skips = _optional_count("max_consecutive_skips", max_consecutive_skips)
    max_nonfinite_losses = _optional_count("max_nonfinite_losses", max_nonfinite_losses)
    max_replays = validation.int_in_range(
        "max_replays", max_replays, 0, MAX_REPLAYS,
        " Pass 0 (the default) for no replay, or a small count such as 2: each replay is "
        "one more forward and backward pass of an overflowed batch.")
    underflow_diagnostics = validation.flag(
        "underflow_diagnostics", underflow_diagnostics,
        " Pass True to record the fractions of zero and tiny gradients, False for none.")
    if scaler is None:
        scaler = DynamicLossScale()
    require_scaler("scaler", scaler)
    axis_name = numerics.normalized_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)
    initial_scaler = scaler
    options = WrapperOptions(
        inner=inner, axis_name=axis_name, skip=skip, on_failure=on_failure,
        max_consecutive_skips=max_consecutive_skips, nonfinite_loss=nonfinite_loss,
        underflow_diagnostics=bool(underflow_diagnostics), max_replays=max_replays,
        max_nonfinite_losses=max_nonfinite_losses)

    def init_fn(params: optax.Params) -> LossScalingState:
        refuse_dtypes_without_zero(params)
        inner_state = inner.init(params)
        warn_low_precision_state(params, inner_state)
        return initial_state(_fresh(initial_scaler), inner_state,
                             len(jax.tree.leaves(differentiated(params))),
                             bool(underflow_diagnostics))

    def update_fn(
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        refuse_other_state(state, "tx.update(grads, opt_state, params)")
        refuse_inside_a_chain()  # reads its caller's frame: called here, directly
        _check_scaled(updates, state, params, "tx.update(grads, opt_state, params)",
                      initial_scaler)
        return guarded_step(options, updates, state, params, extra_args, fused=False)

    attach_options(update_fn, options, initial_scaler)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer step on scaled gradients: ``(params, opt_state) -> (params, opt_state)``.

    When ``tx`` comes from :func:`with_loss_scaling`, the inner update *and*
    ``optax.apply_updates`` run under one skip decision with the unscale inside it, so
    neither the unscaled gradients nor the updates are ever materialized: the cheapest
    step (one extra read of the gradients over a bare optimizer step). A skipped step
    returns ``params`` itself. Any other ``tx`` falls back to ``tx.update`` followed by
    ``optax.apply_updates``; a ``tx`` that holds the wrapper anywhere but outermost (after
    a clip in ``optax.chain``, ...) is refused (``docs/common_mistakes.md``).

    Args:
      tx: the transformation (ideally the result of :func:`with_loss_scaling`).
      grads: gradients of the scaled loss.
      opt_state: ``tx``'s state.
      params: the parameters.
      **extra_args: forwarded to the inner update, except ``loss=``, which is checked
        (see ``nonfinite_loss`` in :func:`with_loss_scaling`) and not forwarded; ``grad=``
        is unscaled and checked; ``value_fn=`` (the params' unscaled loss) is what a
        replay differentiates (``max_replays`` in :func:`with_loss_scaling`).

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      ValueError: if ``opt_state`` holds the wrapper's state inside another
        transformation's (``optax.chain(clip, wrapper)``, ``optax.MultiSteps(wrapper)``):
        the message says what that transformation does wrong and how to put it inside.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = ls.with_loss_scaling(optax.sgd(0.5), ls.StaticLossScale(4.0))
      >>> params = jnp.array([1.0, -2.0])
      >>> opt_state = tx.init(params)
      >>> params, opt_state = ls.apply_gradients(tx, jnp.array([4.0, 4.0]), opt_state, params)
      >>> params
      Array([ 0.5, -2.5], dtype=float32)
    """
    options = options_of(getattr(tx, "update", None))
    if options is not None:
        call = "ls.apply_gradients(tx, grads, opt_state, params)"
        refuse_other_state(opt_state, call)
        _check_scaled(grads, opt_state, params, call, initial_scaler_of(tx.update))
        return guarded_step(options, grads, opt_state, params, extra_args, fused=True)
    if isinstance(opt_state, LossScalingState):
        raise TypeError(NOT_THE_WRAPPER.format(what=_errors.show(tx, type_only=True)))
    refuse_not_outermost(opt_state)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state


# ---------------------------------------------------------------- the guarded step


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
    """The step's one read, before anything is applied: the scale's reciprocal, what the
    growth rule measures (``headroom.measures``), the raw gradients read once
    (``finite_leaves``: flags per leaf, the norm, the max when measured, agreed over
    ``axis_name``), a ``grad=`` extra argument's flags, the loss's, and the health of the
    state and of its scale (checked once here; the update rule is handed the result).
    ``apply`` is their AND. Replay calls it again on each recomputed batch."""
    n_leaves = len(jax.tree.leaves(grads))
    if state.nonfinite_grads.shape[-1:] != (n_leaves,):
        raise ValueError(
            f"the gradients have {n_leaves} leaves but this optimizer state was initialised "
            f"for {state.nonfinite_grads.shape[-1]} (with_loss_scaling sizes its per-leaf "
            "diagnostics from the params given to `init`): pass gradients with the structure "
            "of the params the state was initialised with.")
    inverse = _reciprocal(state.scaler)
    measure = headroom.measures(state.scaler)
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
        loss_finite = numerics.agree(options.axis_name, jnp.isfinite(jnp.asarray(loss)).all())[0]
    healthy = state.failure == Failure.NONE
    valid_scale = jnp.asarray(True)
    if inverse is not None:
        valid_scale = is_positive_normal(state.scaler.loss_scale)
    healthy &= valid_scale
    return StepDecision(healthy & grads_finite & loss_finite, healthy, valid_scale,
                        grads_finite, loss_finite, leaf_finite, grads, inverse, grad_norm,
                        jnp.zeros((), jnp.int32), grads_max)


def _reciprocal(scaler: LossScale) -> numerics.Reciprocal | None:
    """The scaler's reciprocal; ``None`` for ``NoOpLossScale``, which compiles to nothing."""
    return None if isinstance(scaler, NoOpLossScale) else numerics.reciprocal(scaler.loss_scale)


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


def _inner_extra_args(options: WrapperOptions, extra_args: dict[str, Any],
                      inverse: numerics.Reciprocal | None) -> dict[str, Any]:
    """The extra arguments for the inner update: ``grad=`` unscaled, ``loss=`` consumed;
    with replay on, ``value_fn=`` (the wrapper's) only for an inner update that takes it."""
    consumed: tuple[str, ...] = CONSUMED_EXTRA_ARGS
    if options.max_replays and not replay.inner_takes_value_fn(options.inner):
        consumed += (REPLAY_EXTRA_ARG,)
    return {name: numerics.unscale_tree(value, inverse) if name in GRADIENT_EXTRA_ARGS else value
            for name, value in extra_args.items() if name not in consumed}


def _resolve_skip(skip: SkipMode, fused: bool) -> Literal["cond", "select"]:
    """``skip="auto"`` made a conditional or a select for this path and backend: a Python
    choice at trace time, nothing compiled."""
    if skip != "auto":
        return skip
    # Measured in benchmarks/overhead.py (see docs/performance.md): the fused step is
    # cheapest as a conditional everywhere. The plain step must hand its updates out of
    # the decision; on GPU a select of them fused better than a conditional.
    if fused or jax.default_backend() == "cpu":
        return "cond"
    return "select"


def _in_dtypes_of(new_state: Any, old_state: Any) -> Any:
    """The inner state in the dtypes it came in, so that a skip can return the old one.

    Only integer params change anything: optax's moments for an int32 param start as int32
    and come back float32 (optax lets the dtype drift, which retraces a jitted step).
    """
    # A Python scalar in the state (optax accepts any pytree, e.g. {"foo": 1}) has no
    # dtype: it is held as the array the conditional makes of it.
    return optax.tree.cast_like(jax.tree.map(jnp.asarray, new_state),
                                jax.tree.map(jnp.asarray, old_state))


def _next_state(options: WrapperOptions, state: LossScalingState, inner_state: Any,
                decision: StepDecision, loss_given: bool) -> LossScalingState:
    """The state after the step, built on every step (applied or skipped), last: the
    scaler's next state by its rule (a non-finite loss leaves it be with
    ``nonfinite_loss="skip"``; after a replay no growth back to the scale that
    overflowed), the counters, the one failure register (:func:`_next_failure`), the
    underflow statistics, and an eager or opt-in raise (:func:`_report`)."""
    applied = decision.apply
    healthy = state.failure == Failure.NONE  # what the rule's own register said
    if options.nonfinite_loss == "skip":
        # The forward pass, not the scale, made the loss non-finite: leave the scale be.
        # Eagerly too: a backoff discarded here must not raise (as under jit).
        stepped_scaler, code = _stepped_scaler(state.scaler, decision.grads_finite,
                                               decision.grads_max, decision.valid_scale,
                                               healthy)
        stepped_scaler = optax.tree.where(decision.loss_finite, stepped_scaler, state.scaler)
        code = jnp.where(decision.loss_finite, code, state.failure)
    else:
        stepped_scaler, code = _stepped_scaler(state.scaler,
                                               decision.grads_finite & decision.loss_finite,
                                               decision.grads_max, decision.valid_scale,
                                               healthy)
    if replay.enabled(options, state):
        stepped_scaler = replay.no_growth_after(decision.replays, state.scaler, stepped_scaler)
    consecutive_skips = _count(state.consecutive_skips, applied, reset=True)
    nonfinite_losses = _count(state.consecutive_nonfinite_losses, decision.loss_finite,
                              reset=True)

    failure, fails, new_scaler = _next_failure(options, state, stepped_scaler, code,
                                               consecutive_skips, nonfinite_losses, decision,
                                               loss_given)

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
        nonfinite_loss_steps=_count(state.nonfinite_loss_steps, decision.loss_finite,
                                    reset=False),
        consecutive_nonfinite_losses=nonfinite_losses,
        nonfinite_grads=jnp.where(keep_flags, state.nonfinite_grads, ~decision.leaf_finite),
        failure=failure,
        failure_skips=jnp.where(fails, jnp.where(failure == Failure.NONFINITE_LOSS,
                                                 nonfinite_losses, consecutive_skips),
                                state.failure_skips),
        clean_growths=clean_growths,
        underflow=underflow,
        grad_norm=decision.grad_norm,
        replays=(replay.saturating_add(state.replays, decision.replays)
                 if replay.enabled(options, state) else state.replays),
        last_step_replays=decision.replays,
    )
    _report(options, new_state, fails, key_path_names(decision.grads))
    return new_state


def _stepped_scaler(scaler: LossScale, finite: jax.Array, grads_max: jax.Array | None,
                    valid: jax.Array, healthy: jax.Array) -> tuple[LossScale, jax.Array]:
    """The scaler's next state and the failure code its rule leaves, a failure recorded
    but never raised (eager included): the wrapper decides whether the step counts
    (``nonfinite_loss="skip"``), keeps the code in its register and raises itself
    (:func:`_report`)."""
    if isinstance(scaler, DynamicLossScale):
        return step_recorded(scaler, finite, grads_max=grads_max, valid=valid,
                             healthy=healthy)
    return scaler, jnp.zeros((), jnp.int32)


def _next_failure(options: WrapperOptions, state: LossScalingState, stepped_scaler: LossScale,
                  code: jax.Array, consecutive_skips: jax.Array, nonfinite_losses: jax.Array,
                  decision: StepDecision,
                  loss_given: bool) -> tuple[jax.Array, jax.Array, LossScale]:
    """The failure code after this step (the one register: the rule's ``code``, an
    invalid scale, too many skips, too many non-finite losses), whether it is new, and
    the scaler to keep: the first failure wins and freezes the scaler."""
    failed_before = state.failure != Failure.NONE
    failure = jnp.where(decision.valid_scale, code, Failure.INVALID_SCALE)
    if options.max_consecutive_skips is not None:
        failure = jnp.where(
            (failure == Failure.NONE) & (consecutive_skips >= options.max_consecutive_skips),
            Failure.TOO_MANY_SKIPS, failure)
    if loss_given and options.max_nonfinite_losses is not None:  # only with a loss=
        # The losses in a row, not the skips: overflows before them are the scale's.
        loss_fails = nonfinite_losses >= options.max_nonfinite_losses
        failure = jnp.where((failure == Failure.NONE) & loss_fails, Failure.NONFINITE_LOSS,
                            failure)
    failure = jnp.where(failed_before, state.failure, failure).astype(jnp.int32)
    fails = ~failed_before & (failure != Failure.NONE)
    new_scaler = optax.tree.where(failed_before, state.scaler, stepped_scaler)
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


def _optional_count(name: str, value: int | None) -> int | None:
    return None if value is None else validation.positive_int32(name, value)


def _check_scaled(grads: Any, state: LossScalingState, params: Any, call: str,
                  initial_scaler: LossScale | None) -> None:
    """Trace time only, nothing compiled: gradients of a loss not scaled by this state,
    or made finite before the wrapper (:mod:`loss_scaling.wrapper.provenance`)."""
    provenance.check_gradients(grads, state.scaler, params, call, initial_scaler)


NOT_THE_WRAPPER = (
    "ls.apply_gradients(tx, grads, opt_state, params): opt_state is a with_loss_scaling "
    "state, but tx ({what}) is not the transformation that made it. Pass the `tx` that "
    "`ls.with_loss_scaling(...)` returned (the inner optimizer would read the wrapper's "
    "state as its own)."
)


NOT_AN_OPTIMIZER = (
    "with_loss_scaling(inner, scaler): inner must be an optax transformation (with `init` "
    "and `update`), e.g. `ls.with_loss_scaling(optax.adam(1e-3))`, got {what}.{hint}"
)


WRAPPED_TWICE = (
    "with_loss_scaling(inner, scaler): inner is already a `ls.with_loss_scaling(...)` "
    "transformation; wrapped twice, the gradients are unscaled twice (divided by the scale "
    "squared). Wrap the optimizer once: "
    "`ls.with_loss_scaling(optax.adam(1e-3), ls.DynamicLossScale(...))`."
)


def _refuse_other_inner(inner: Any) -> None:
    """A ``TypeError`` naming ``inner`` and the fix: the loss scale first, the optimizer's
    factory uncalled, or a wrapper wrapped again; otherwise fail later as a missing
    ``init``."""
    if options_of(getattr(inner, "update", None)) is not None:
        raise TypeError(WRAPPED_TWICE)
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return
    if isinstance(inner, SCALER_TYPES):
        hint = (" That is a loss scale, which comes second: "
                "`ls.with_loss_scaling(optax.adam(1e-3), ls.DynamicLossScale(...))`.")
    elif callable(inner):
        name = ".".join(filter(None, (getattr(inner, "__module__", "").split(".")[0],
                                      getattr(inner, "__name__", "factory"))))
        hint = f" That is a function: call it to build the optimizer, e.g. `{name}(1e-3)`."
    else:
        hint = ""
    raise TypeError(NOT_AN_OPTIMIZER.format(what=_errors.show(inner, type_only=True), hint=hint))


NOT_A_WRAPPER_STATE = (
    "{call}: opt_state must be the state that `tx.init(params)` returned for this "
    "`ls.with_loss_scaling(...)` transformation (a LossScalingState), got {what}. {hint}"
)


def refuse_other_state(opt_state: Any, call: str) -> None:
    """A ``TypeError`` naming ``opt_state`` and the fix when it is not the wrapper's state
    (the loss scale itself, a TrainState, params in its place): read as given, a field
    missing deep inside the step would be all the user saw."""
    if isinstance(opt_state, LossScalingState):
        return
    if isinstance(opt_state, SCALER_TYPES):
        hint = ("That is the loss scale: pass the optimizer state that holds it "
                "(`ls.get_loss_scale(opt_state)` reads the scale out of it).")
    elif held := wrapper_states_in(opt_state):
        hint = (f"It holds one at {held[0][0]!r}: pass the transformation whose state it "
                "is as `tx` (e.g. the optax.chain around the wrapper), or that part as "
                "opt_state. For a TrainState call `state.apply_gradients(grads=grads)`; "
                "for an nnx Optimizer `optimizer.update(model, grads)`.")
    else:
        hint = ("Are the arguments in order? `tx.update(grads, opt_state, params)`, "
                "`ls.apply_gradients(tx, grads, opt_state, params)`.")
    raise TypeError(NOT_A_WRAPPER_STATE.format(
        call=call, what=_errors.show(opt_state, type_only=True), hint=hint))
