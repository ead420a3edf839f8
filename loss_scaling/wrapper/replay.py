"""Replay: a batch whose gradients overflow is recomputed at the backed-off scale inside
the same compiled step, up to ``max_replays`` times, instead of being dropped.

:func:`replay` runs right after the first :func:`~loss_scaling.wrapper.transform.decide`:

    while the gradients are not finite, the loss is finite, the state is healthy,
          replays < max_replays, and a backoff lowers the scale without failing:
        scaler = backoff_now(scaler)              # hysteresis ignored: else the batch is lost
        loss, grads = value_and_grad(scale(scaler, value_fn(params)))
        decision = decide(grads, scaler)          # the same screen, flags, norm, agreement

One ``lax.while_loop`` (one compiled copy of the forward and backward pass, besides the
user's own). Its condition is built from flags that :func:`decide` has already agreed
over ``axis_name`` and from the scaler, which is the same on every replica, so every
replica runs the same number of replays. A step that needs none runs the condition once
(a few scalar operations) and nothing else. Then the guarded step goes on with the final
gradients and the backed-off scaler: a replay that ends finite is applied and its
``_next_state`` sees a clean step; one that finds the loss itself non-finite is skipped as
a non-finite ``loss=`` is (its backoffs discarded: the forward pass, not the scale, is at
fault); one that uses up its replays, or reaches a scale that cannot go lower
(``min_scale``, the float32 range), is skipped and backed off once more as usual.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from loss_scaling._errors import Failure, show
from loss_scaling.core import tree
from loss_scaling.core.numerics import skip_cond
from loss_scaling.core.scalers import DynamicLossScale, replace_leaves
from loss_scaling.core.update import backoff_step
from loss_scaling.wrapper.state import (
    REPLAY_EXTRA_ARG,
    LossScalingState,
    WrapperOptions,
    differentiated,
)

NO_VALUE_FN = (
    "with_loss_scaling(max_replays={n}) recomputes a batch whose gradients overflow, so its "
    "update needs the loss as a function of the params: pass `value_fn=lambda params: "
    "loss_fn(params, batch)` (the plain, unscaled loss) to the update (docs/replay.md), or "
    "max_replays=0 to skip such steps."
)
NOT_CALLABLE = "value_fn must be a function of the params returning the loss, got {what}."
NOT_A_SCALAR = (
    "value_fn must return the scalar loss (unscaled; the wrapper scales it), got {what}. "
    "For a loss function with aux, pass `value_fn=lambda p: loss_fn(p, batch)[0]`."
)
OTHER_STRUCTURE = (
    "value_fn's gradients have the structure {got}, but the gradients passed to the update "
    "have {want}: value_fn must be the loss as a function of the params given to the "
    "update (with optax.lookahead, of the fast params, `params.fast`)."
)
NO_PARAMS = (
    "with_loss_scaling(max_replays={n}) recomputes a batch whose gradients overflow by "
    "calling value_fn on the params, but the update got params=None: pass them, "
    "`tx.update(grads, opt_state, params, value_fn=...)`, or pass max_replays=0."
)


def enabled(options: WrapperOptions, state: LossScalingState) -> bool:
    """Whether this step can replay: ``max_replays > 0`` and a scale that backs off."""
    return options.max_replays > 0 and isinstance(state.scaler, DynamicLossScale)


def inner_takes_value_fn(inner: Any) -> bool:
    """Whether the inner ``update`` accepts ``value_fn=`` (optax's line searches do;
    ``optax.contrib.sam`` refuses unknown arguments), read from its signature."""
    try:
        parameters = inspect.signature(inner.update).parameters.values()
    except (TypeError, ValueError):  # no signature to read: forward, as without replay
        return True
    return any(p.kind == p.VAR_KEYWORD or p.name == REPLAY_EXTRA_ARG for p in parameters)


def refuses_value_fn(options: WrapperOptions, extra_args: dict[str, Any],
                     error: TypeError) -> bool:
    """Whether the inner update refused the ``value_fn=`` that replay forwarded to it.

    An ``optax.chain`` takes any keyword and hands it to every member, so its signature
    cannot say whether one of them (``optax.contrib.sam``) refuses it: the step then
    calls the inner update again without it (Python's own message names the keyword;
    there is no other signal to read).
    """
    return (options.max_replays > 0 and REPLAY_EXTRA_ARG in extra_args
            and f"keyword argument '{REPLAY_EXTRA_ARG}'" in str(error))


def _value_fn(options: WrapperOptions, extra_args: dict[str, Any],
              params: Any) -> Callable[..., Any]:
    value_fn = extra_args.get(REPLAY_EXTRA_ARG)
    if value_fn is None:
        raise ValueError(NO_VALUE_FN.format(n=options.max_replays))
    if not callable(value_fn):
        raise TypeError(NOT_CALLABLE.format(what=show(value_fn, type_only=True)))
    if params is None:
        raise ValueError(NO_PARAMS.format(n=options.max_replays))
    return value_fn


def scaled_value_and_grad(value_fn: Callable[..., Any], scaler: Any, params: Any,
                          like: Any) -> tuple[jax.Array, Any]:
    """The unscaled loss and the gradients of the scaled loss, in ``like``'s types."""
    def scaled(p: Any) -> tuple[jax.Array, jax.Array]:
        loss = value_fn(p)
        if getattr(loss, "shape", None) != () and not isinstance(loss, (int, float)):
            raise TypeError(NOT_A_SCALAR.format(what=show(loss, type_only=True)))
        return tree.scale(scaler, loss), loss

    (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    got, want = jax.tree.structure(grads), jax.tree.structure(like)
    if got != want:  # type: ignore[operator]  # PyTreeDef defines ==, jaxlib's stub does not
        raise ValueError(OTHER_STRUCTURE.format(got=got, want=want))
    return loss, optax.tree.cast_like(grads, like)


def replay(options: WrapperOptions, state: LossScalingState, params: Any,
           extra_args: dict[str, Any], decision: Any,
           decide: Callable[..., Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The loop in the module docstring: ``(final decision, its scaler, extra_args)``.

    ``decide`` is :func:`~loss_scaling.wrapper.transform.decide` (passed in: the transform module
    imports this one). A ``grad=`` extra argument (``optax.lbfgs``'s) is the gradients of
    ``value_fn``: each replay replaces it by its own, as it replaces ``loss=``.
    """
    value_fn = _value_fn(options, extra_args, params)
    params = differentiated(params)
    # Types only: a traced value closed over by the loop would be another operand of it.
    first_grads = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, g.dtype),
                               decision.grads)

    def more(carry: tuple[Any, Any]) -> jax.Array:
        last, scaler = carry
        lowered, code = backoff_step(scaler)
        return (~last.grads_finite & last.loss_finite & last.healthy
                & (last.replays < options.max_replays)
                & (code == Failure.NONE)
                & (jnp.asarray(lowered.loss_scale) < scaler.loss_scale))

    def again(carry: tuple[Any, Any]) -> tuple[Any, Any]:
        last, scaler = carry
        scaler = backoff_step(scaler)[0]
        loss, grads = scaled_value_and_grad(value_fn, scaler, params, first_grads)
        extra = {**extra_args, "loss": loss}
        if extra_args.get("grad") is not None:
            extra["grad"] = grads
        new = decide(options, grads, state._replace(scaler=scaler), extra)
        return new._replace(replays=last.replays + 1), scaler

    def replayed(grads: Any) -> tuple[Any, Any]:
        final, scaler = lax.while_loop(more, again, (decision._replace(grads=grads),
                                                     state.scaler))
        # A non-finite loss is the forward pass's fault, not the scale's: skipped as a
        # non-finite `loss=` is, from the scaler the step began with (scalars only).
        scaler = optax.tree.where(final.loss_finite, scaler, state.scaler)
        return final, scaler

    def kept(grads: Any) -> tuple[Any, Any]:
        return decision._replace(grads=grads), state.scaler

    # The loop sits in a conditional of its own, ahead of the step's: a healthy step passes
    # the gradients through it (they are its only operand, and dead after it, so XLA
    # aliases them) and runs none of the loop. Inside the step's own conditional, the
    # replay's read of the params next to the branch that updates them in place made XLA
    # copy params and optimizer state on every step (2.1x at 20M params).
    need = ~decision.grads_finite & decision.loss_finite & decision.healthy
    if not isinstance(need, jax.core.Tracer) and not need:
        # Eagerly the conditional runs only the branch taken, so a healthy step would never
        # call value_fn: check its output here, as a jitted step (which traces both) does.
        jax.eval_shape(lambda p: scaled_value_and_grad(value_fn, state.scaler, p, first_grads),
                       params)
    final, scaler = skip_cond(need, replayed, kept, decision.grads)
    if extra_args.get("grad") is not None:
        extra_args = {**extra_args, "grad": final.grads}
    return final, scaler, extra_args


def no_growth_after(replays: jax.Array, backed_off: Any, stepped: Any) -> Any:
    """The scaler after a step: a replayed one stays at the backed-off scale.

    A growth due on the replayed step (``growth_interval=1``) is not taken: it would go
    straight back to the scale that just overflowed. The growth tracker is as the clean
    step left it (0 where that growth was due), so the next clean step grows.
    """
    grew = jnp.asarray(stepped.loss_scale) > jnp.asarray(backed_off.loss_scale)
    return optax.tree.where(
        (replays > 0) & grew, replace_leaves(stepped, loss_scale=backed_off.loss_scale), stepped)


def saturating_add(counter: jax.Array, amount: jax.Array) -> jax.Array:
    """``counter + amount`` (both int32, ``amount >= 0``), staying at int32's max."""
    top = jnp.iinfo(jnp.int32).max
    return jnp.where(counter > top - amount, top, counter + amount).astype(jnp.int32)
