"""Errors raised by loss_scaling, the failure codes states record, and their messages
(built from the recorded state alone)."""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax


class LossScaleError(RuntimeError):
    """The loss scale cannot continue (see :class:`Failure` for the reasons).

    Raised on the host by :func:`loss_scaling.check` when a state records a failure, and
    at once by the eager paths (:func:`loss_scaling.update`, an un-jitted optimizer
    update). Under ``jit`` nothing is raised unless ``on_failure="raise"`` was chosen: the
    failure is recorded in the state and every later step is skipped.
    """

    __module__ = "loss_scaling"


class NoLossScaleFound(ValueError, LookupError):
    """No :func:`loss_scaling.with_loss_scaling` state in the given state (a ``ValueError``
    for callers, a ``LookupError`` by nature): lets a caller tell "none" from "several"."""

    __module__ = "loss_scaling"


class RestoreError(ValueError):
    """A flax restore of a loss-scale state failed; the message names the state's path."""

    __module__ = "loss_scaling"


class LossScaleWarning(UserWarning):
    """Something about the loss scale looks wrong, but the run can continue."""

    __module__ = "loss_scaling"


SUSPICIOUS_SCALE = (
    "the loss scale grew {growths} times in a row without a single overflow (it is now "
    "{scale!r}); scaled gradients overflow sooner or later. Probably the loss was not scaled "
    "(differentiate `loss_scaling.scale(state, loss)`, or use `loss_scaling.value_and_grad`), "
    "the gradients were unscaled twice (`loss_scaling.unscale` before the optimizer wrapper, "
    "which unscales them itself), or the model needs no loss scaling (NoOpLossScale, or "
    "bfloat16). `underflow_diagnostics=True` shows how much of the gradients float16 loses."
)


class Failure(enum.IntEnum):
    """Why a state failed; stored as an int32 (0 while healthy).

    Attributes:
      NONE: healthy.
      BACKOFF_UNDERFLOW: a backoff would have taken the scale below the smallest normal
        float32 (no ``min_scale`` set); the scale stays at its last valid value.
      INVALID_SCALE: the scale was not a positive normal float32 when a step ran (a state
        that reached the step without validation: an unchecked restore, pickle,
        ``tree_unflatten``).
      TOO_MANY_SKIPS: ``max_consecutive_skips`` steps in a row were skipped.
      NONFINITE_LOSS: the ``loss=`` given to the update was not finite on
        ``max_nonfinite_losses`` steps in a row: the forward pass itself keeps failing,
        which no loss scale can fix.
    """

    NONE = 0
    BACKOFF_UNDERFLOW = 1
    INVALID_SCALE = 2
    TOO_MANY_SKIPS = 3
    NONFINITE_LOSS = 4

    __module__ = "loss_scaling"


_F32 = np.finfo(np.float32)

# The parts every failure message shares: what stopping means, and where to look.
_STOPS = "the run stops (every later step is skipped; params and optimizer state are kept)"
_FIND_OVERFLOW = ("`loss_scaling.find_overflow(loss_fn, *args)` names the layer, op and line of "
                  "the first inf/NaN that matters")

BACKOFF_UNDERFLOW = (
    "loss scale backoff failed: the loss scale {old!r} times backoff_factor {factor!r} gives "
    "{new!r}, below the smallest normal float32 ({tiny!r}), so " + _STOPS + ". The "
    "gradients overflow at every scale: look for a NaN/inf in the loss or the model (pass "
    "`loss=loss` to the optimizer update, read `loss_scaling.nonfinite_grad_paths`), or pass "
    "`min_scale=...` to clamp the backoff. " + _FIND_OVERFLOW + "; "
    "`loss_scaling.float16_report` shows whether the model fits float16 at all."
)

INVALID_SCALE = (
    "the loss scale is {value!r}, not a finite, positive, normal float32 (between {tiny!r} "
    "and {max!r}), so " + _STOPS + ". It reached the step without validation (pickle, "
    "`tree_unflatten`, a restore that bypassed `loss_scaling.restore_loss_scale`): restore "
    "the loss scale through `loss_scaling.restore_loss_scale`, which validates it."
)

TOO_MANY_SKIPS = (
    "{count} consecutive optimizer steps skipped ({setting}); the loss "
    "scale is now {scale!r}. Gradient leaves non-finite on the last skipped step: {leaves}. "
    "Backing off does not help, so " + _STOPS + ": look for the source of the inf/NaN there "
    "(or raise max_consecutive_skips). " + _FIND_OVERFLOW + "; "
    "`loss_scaling.float16_report` shows whether the model fits float16 at all."
)

NONFINITE_LOSS = (
    "the loss was not finite (inf/NaN) on {count} consecutive steps "
    "({setting}; the loss scale is {scale!r}), so " + _STOPS
    + ". The loss is computed before it is scaled: the forward pass itself fails (a float16 "
    "overflow, a log of 0, a bad batch), which no loss scale can fix. " + _FIND_OVERFLOW
    + "; compute that part in float32, or fix the data."
)


_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


def show(value: Any, limit: int = 80, *, type_only: bool = False) -> str:
    """The one formatter of values in messages: a short repr that never fails (huge ints,
    deep nesting, hostile ``__repr__``); ``type_only``: the value's type (``"an object of
    type module.Name"``), for a wrong argument whose repr says nothing useful."""
    if type_only:
        return f"an object of type {type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = _repr.repr(value)
    except Exception:  # repr of hostile input: the message must still be built
        return f"<a {type(value).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _host_float(x: Any) -> float:
    """A float32 array's value as a Python float, which the templates format."""
    return float(np.asarray(x, np.float32))


UNKNOWN_LEAVES = ("not known to a loss scale on its own (`loss_scaling.check(opt_state, "
                  "params)` names them)")


def failure_message(code: Any, *, scale: Any, backoff_factor: float | None = None,
                    count: Any = None, leaves: list[str] | None = None) -> str:
    """The one message of each :class:`Failure` code, from recorded values (host side).

    Args:
      code: the code (not ``NONE``).
      scale: the loss scale the state holds (its last valid one; for ``INVALID_SCALE``
        the invalid value).
      backoff_factor: the scaler's (``BACKOFF_UNDERFLOW``).
      count: the count that ended the run (the wrapper's ``failure_skips``), or ``None``
        for a loss scale on its own, which does not hold it.
      leaves: the names of the gradient leaves non-finite on the last skipped step
        (``TOO_MANY_SKIPS``), or ``None`` where they are not known.
    """
    code = Failure(int(np.asarray(code)))
    counted = (None if count is None else int(np.asarray(count)))
    if code == Failure.BACKOFF_UNDERFLOW:
        assert backoff_factor is not None
        # In Python floats: a host callback runs on a thread that flushes float32 subnormals.
        old = _host_float(scale)
        return BACKOFF_UNDERFLOW.format(old=old, factor=backoff_factor,
                                        new=old * backoff_factor, tiny=float(_F32.tiny))
    if code == Failure.TOO_MANY_SKIPS:
        return TOO_MANY_SKIPS.format(
            count="max_consecutive_skips" if counted is None else counted,
            setting=("recorded in this loss scale" if counted is None
                     else f"max_consecutive_skips={counted}"),
            scale=_host_float(scale),
            leaves=UNKNOWN_LEAVES if leaves is None else (
                ", ".join(leaves) or "none (the loss was non-finite)"))
    if code == Failure.NONFINITE_LOSS:
        return NONFINITE_LOSS.format(
            count="max_nonfinite_losses" if counted is None else counted,
            setting="with_loss_scaling's max_nonfinite_losses", scale=_host_float(scale))
    return INVALID_SCALE.format(value=_host_float(scale), tiny=float(_F32.tiny),
                                max=float(_F32.max))


def raise_in_graph(newly_failed: jax.Array, message: Callable[..., str], *values: Any) -> None:
    """The opt-in immediate raise: a host callback in the taken branch of a ``lax.cond``.

    ``jax.debug.callback`` (an effect, never dead-code eliminated) works under ``jit``,
    ``pmap``, ``shard_map`` and ``vmap``; the callback re-checks the flag because under
    ``vmap`` both branches run. Any executable holding it is dispatched on JAX's slower
    path, and a raise inside a donated step deletes the donated inputs: debugging only.
    """

    def host_check(newly_failed: Any, *values: Any) -> None:
        flags = np.asarray(newly_failed)
        if not flags.any():
            return
        if flags.ndim:  # batched by vmap: report the first failing member
            index = int(np.argmax(flags.reshape(-1)))
            values = tuple(np.asarray(v).reshape(flags.size, *np.shape(v)[flags.ndim:])[index]
                           for v in values)
        raise LossScaleError(message(*values))

    lax.cond(newly_failed, lambda *a: jax.debug.callback(host_check, *a), lambda *a: None,
             newly_failed, *values)


_MUST_BE_A_SCALER = ("{argument} must be a loss-scale state (NoOpLossScale, StaticLossScale or "
                     "DynamicLossScale), got ")

NOT_A_SCALER = _MUST_BE_A_SCALER + (
    "{what}. An optimizer state built with `ls.with_loss_scaling` (or a TrainState or nnx "
    "Optimizer around one) holds one: `ls.get_loss_scale(opt_state)` returns it."
)

NUMBER_NOT_A_SCALER = _MUST_BE_A_SCALER + (
    "the number {value} ({what}): a factor is not a state. Pass `ls.StaticLossScale({value})`, "
    "or for a dynamic scale `ls.get_loss_scale(opt_state)` of a `ls.with_loss_scaling` state."
)


def not_a_scaler(argument: str, value: Any) -> TypeError:
    """The error for ``argument``, which is not a loss-scale state (named by its type: a
    whole optimizer state printed would bury the fix; a number, by its value too)."""
    if (isinstance(value, (int, float, np.number)) and not isinstance(value, bool)) or (
            isinstance(value, np.ndarray) and value.shape == ()):
        number = value.item() if isinstance(value, (np.number, np.ndarray)) else value
        return TypeError(NUMBER_NOT_A_SCALER.format(argument=argument, value=show(number),
                                                    what=show(value, type_only=True)))
    return TypeError(NOT_A_SCALER.format(argument=argument, what=show(value, type_only=True)))


# Methods of PyTorch's GradScaler (and Keras'), which these states do not have: the
# functions that do the same, for the AttributeError a migrating user gets.
_METHOD_HINTS = {
    "scale": "`ls.scale(state, loss)`",
    "unscale_": "nothing: the optax wrapper unscales the gradients itself "
                "(`ls.unscale(state, grads)` to read them)",
    "unscale": "`ls.unscale(state, grads)`",
    "update": "`state = ls.update(state, grads_finite)`, which returns the next state",
    "step": "`ls.apply_gradients(tx, grads, opt_state, params)` with "
            "`tx = ls.with_loss_scaling(optimizer)`",
    "get_scale": "`state.loss_scale`",
    "get_growth_tracker": "`state.growth_tracker`",
    "state_dict": "`ls.state_dict(state)`",
    "load_state_dict": "`state = ls.from_state_dict(d)`",
}


def no_such_method(self: Any, name: str) -> Any:
    """``__getattr__`` of the loss-scale states: a missing attribute, named with the
    function to use when it is one of GradScaler's methods."""
    hint = _METHOD_HINTS.get(name)
    message = f"{type(self).__name__!r} object has no attribute {name!r}"
    if hint:
        message += (f": a loss-scale state is an immutable pytree read by functions, as "
                    f"in optax; use {hint}")
    raise AttributeError(message)
