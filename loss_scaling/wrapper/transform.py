"""The Optax wrapper: unscale, test, skip or step, then update the loss scale.

``with_loss_scaling(inner, scaler)`` takes the gradients of the *scaled* loss. One update:

1. ``apply``: the state is healthy (no recorded failure, a positive normal scale) and,
   per gradient leaf, every unscaled element is finite, read from the raw gradients in
   one fused reduction per leaf (the unscaled tree is never materialized for the test);
   AND-reduced over ``axis_name`` when given. With ``loss=...``, the loss must be finite
   too; a ``grad=`` extra argument is checked (and unscaled) like the gradients.
2. If ``apply``, unscale and run the inner update (so clipping in the inner chain sees
   true gradients). If not, skip it: the inner state is returned untouched and the
   updates are ``-0.0`` (``p + -0.0 == p`` bit for bit, ``-0.0`` params included).
3. Update the loss scale, the counters and the per-leaf diagnostics, always. A failure
   (a backoff out of the float32 range, ``max_consecutive_skips``, an invalid scale) is
   recorded in the state, sticky: every later step is skipped, and
   :func:`loss_scaling.check` raises it on the host. No host callback on the step.

The fused :func:`apply_gradients` puts the inner update *and* ``apply_updates`` under
one skip decision, so the updates tree never leaves it: the cheapest path (see the
README's benchmark table).
"""

from __future__ import annotations

from typing import Any

import optax

from loss_scaling import _errors
from loss_scaling.core import validation
from loss_scaling.core.numerics import AxisName
from loss_scaling.core.scalers import (
    SCALER_TYPES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    require_scaler,
)
from loss_scaling.core.update import OnFailure, resolve_on_failure
from loss_scaling.wrapper import provenance
from loss_scaling.wrapper.placement import refuse_not_outermost, wrapper_states_in
from loss_scaling.wrapper.state import (
    MAX_NONFINITE_LOSSES,
    MAX_REPLAYS,
    LossScalingState,
    NonFiniteLoss,
    SkipMode,
    WrapperOptions,
    _fresh,
    _refuse_dtypes_without_zero,
    _warn_low_precision_state,
    gradient_leaf_count,
    initial_state,
)
from loss_scaling.wrapper.step import guarded_step

__all__ = ["LossScalingTransformation", "apply_gradients", "with_loss_scaling"]


class LossScalingTransformation(optax.GradientTransformationExtraArgs):
    """The ``GradientTransformationExtraArgs`` returned by :func:`with_loss_scaling`.

    An ordinary optax transformation (``init``, ``update``) that also carries what
    :func:`apply_gradients` needs for the fused path.
    """

    # Set per instance: a NamedTuple subclass without __slots__ has a __dict__.
    options: WrapperOptions


_DIAGNOSTICS_HINT = (" Pass True to record the fractions of zero and tiny gradients, "
                     "False (the default) for none.")


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
) -> LossScalingTransformation:
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
        is not finite on this many skipped steps in a row: the forward pass keeps
        failing, which no scale fixes. 16 by default; ``None`` turns it off. Compiled only
        into steps given a ``loss=``.

    Returns:
      A :class:`LossScalingTransformation` (an ``optax.GradientTransformationExtraArgs``).

    Raises:
      ValueError: for an invalid option; from ``update``, with replay on and no
        ``value_fn=``.
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
    underflow_diagnostics = validation.flag("underflow_diagnostics", underflow_diagnostics,
                                            _DIAGNOSTICS_HINT)
    if scaler is None:
        scaler = DynamicLossScale()
    require_scaler("scaler", scaler)
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    inner = optax.with_extra_args_support(inner)
    initial_scaler = scaler
    options = WrapperOptions(
        inner=inner, axis_name=axis_name, skip=skip, on_failure=on_failure,
        max_consecutive_skips=max_consecutive_skips, nonfinite_loss=nonfinite_loss,
        underflow_diagnostics=bool(underflow_diagnostics), max_replays=max_replays,
        max_nonfinite_losses=max_nonfinite_losses)

    def init_fn(params: optax.Params) -> LossScalingState:
        _refuse_dtypes_without_zero(params)
        inner_state = inner.init(params)
        _warn_low_precision_state(params, inner_state)
        return initial_state(_fresh(initial_scaler), inner_state,
                             gradient_leaf_count(params), bool(underflow_diagnostics))

    def update_fn(
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        refuse_other_state(state, "tx.update(grads, opt_state, params)")
        _check_scaled(updates, state, params, "tx.update(grads, opt_state, params)")
        return guarded_step(options, updates, state, params, extra_args, fused=False)

    # On the update function too: a transformation rebuilt around it
    # (`GradientTransformationExtraArgs(tx.init, tx.update)`) keeps the fused path.
    update_fn.options = options  # type: ignore[attr-defined]
    tx = LossScalingTransformation(init_fn, update_fn)
    tx.options = options
    return tx


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
    options = getattr(getattr(tx, "update", None), "options", None)
    if isinstance(options, WrapperOptions):
        call = "ls.apply_gradients(tx, grads, opt_state, params)"
        refuse_other_state(opt_state, call)
        _check_scaled(grads, opt_state, params, call)
        return guarded_step(options, grads, opt_state, params, extra_args, fused=True)
    if isinstance(opt_state, LossScalingState):
        raise TypeError(NOT_THE_WRAPPER.format(what=_errors.describe(tx)))
    refuse_not_outermost(opt_state)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state


def _optional_count(name: str, value: int | None) -> int | None:
    return None if value is None else validation.positive_int32(name, value)


def _check_scaled(grads: Any, state: LossScalingState, params: Any, call: str) -> None:
    """Trace time only, nothing compiled: gradients of a loss that was not scaled
    (:mod:`loss_scaling.wrapper.provenance`)."""
    if not isinstance(state.scaler, NoOpLossScale):
        provenance.warn_if_loss_not_scaled(grads, state.scaler.loss_scale, params, call)


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
    "transformation. Wrapped twice, the gradients would be unscaled twice (divided by the "
    "scale squared: every step 1/scale the size it should be) by two loss scales of which "
    "only one scaled the loss. Wrap the optimizer once: "
    "`ls.with_loss_scaling(optax.adam(1e-3), ls.DynamicLossScale(...))`."
)


def _refuse_other_inner(inner: Any) -> None:
    """A ``TypeError`` naming ``inner`` and the fix: the loss scale first, the optimizer's
    factory uncalled, or a wrapper wrapped again; otherwise fail later as a missing
    ``init``."""
    if isinstance(getattr(getattr(inner, "update", None), "options", None), WrapperOptions):
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
    raise TypeError(NOT_AN_OPTIMIZER.format(what=_errors.describe(inner), hint=hint))


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
    raise TypeError(NOT_A_WRAPPER_STATE.format(call=call, what=_errors.describe(opt_state),
                                               hint=hint))
