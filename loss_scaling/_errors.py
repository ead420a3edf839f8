"""Errors raised by loss_scaling, and the in-graph check behind fail-closed updates."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax


class LossScaleError(RuntimeError):
    """The loss scale cannot continue: a backoff would leave the normal float32 range.

    Raised eagerly by :func:`loss_scaling.update`. Under ``jit`` the same message
    reaches the user as the ``JaxRuntimeError`` of the failed step.
    """

    __module__ = "loss_scaling"


BACKOFF_UNDERFLOW = (
    "loss scale backoff failed: the loss scale {old!r} times backoff_factor {factor!r} gives "
    "{new!r}, below the smallest normal float32 ({tiny!r}). Unscaling by a zero or subnormal "
    "factor is meaningless, so the step fails instead of continuing silently. The gradients "
    "keep overflowing at every scale: look for a NaN/inf in the loss or the model itself "
    "(pass `loss=loss` to the optimizer update and read `nonfinite_loss_steps` and "
    "`loss_scaling.nonfinite_grad_paths`), or pass `min_scale=...` to clamp the backoff."
)


TOO_MANY_SKIPS = (
    "{count} consecutive optimizer steps skipped (max_consecutive_skips={limit}); the loss "
    "scale is now {scale!r}. Gradient leaves non-finite on the last step: {leaves}. The run "
    "is not recovering by backing off: look for the source of the inf/NaN there (or raise "
    "max_consecutive_skips)."
)


def backoff_underflow_message(old: Any, factor: float, new: Any) -> str:
    return BACKOFF_UNDERFLOW.format(
        old=float(np.asarray(old)),
        factor=factor,
        new=float(np.asarray(new)),
        tiny=float(np.finfo(np.float32).tiny),
    )


def raise_if_backoff_underflow(
    failed: jax.Array, old_scale: jax.Array, new_scale: jax.Array, factor: float
) -> None:
    """Raises at run time, from inside a traced computation, when ``failed`` is true.

    The callback lives only in the taken branch of a ``lax.cond``, so healthy steps pay
    no host round trip. ``jax.debug.callback`` (an effect, never dead-code eliminated)
    works under ``jit``, ``pmap``, ``shard_map`` and ``vmap``; the callback re-checks the
    predicate because under ``vmap`` both branches of the ``cond`` run.
    """

    def host_check(failed, old, new):
        failed = np.asarray(failed)
        if np.any(failed):
            index = np.argmax(failed.reshape(-1))
            pick = lambda a: np.asarray(a).reshape(-1)[index] if np.ndim(a) else a  # noqa: E731
            raise LossScaleError(backoff_underflow_message(pick(old), factor, pick(new)))

    def fail(failed, old, new):
        jax.debug.callback(host_check, failed, old, new)

    lax.cond(failed, fail, lambda *_: None, failed, old_scale, new_scale)
