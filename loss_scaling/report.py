"""Reading the wrapper's state on the host and in-graph: check, metrics and the
non-finite leaves.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling import _errors
from loss_scaling.core import headroom
from loss_scaling.core.scalers import (
    SCALER_TYPES,
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    with_failure,
)
from loss_scaling.core.update import scaler_failure_message
from loss_scaling.core.validation import normal_float32
from loss_scaling.lookup import refuse_misplaced_wrapper, wrapper_state
from loss_scaling.wrapper.state import (
    SUSPICIOUS_GROWTHS,
    UnderflowStats,
    differentiated,
    key_path_names,
    wrapper_failure_message,
)

__all__ = ["check", "metrics", "nonfinite_grad_paths"]

SUSPICIOUS_SCALE_LIMIT = 2.0**64
"""A scale this large, grown to without an overflow, is suspicious too: the scaled
gradients of a float16 model stay below 65504, so its true gradients would all be below
2**-48. ``growth="headroom"`` on an unscaled loss grows by large factors but fewer than
:data:`SUSPICIOUS_GROWTHS` times before it stops at float32's top; it passes this (about
1,300 steps at the defaults on a small quadratic)."""


def scale_suspicious(clean_growths: Any, loss_scale: Any,
                     grad_max_window: Any = None) -> Any:
    """The mis-use detector (in-graph or on the host, elementwise): many growths in a row
    without an overflow, or any that took the scale past :data:`SUSPICIOUS_SCALE_LIMIT`
    (with ``growth="headroom"``, whose ``grad_max_window`` is given, only while it is at
    most :data:`loss_scaling.core.headroom.SUSPICIOUS_GRAD_MAX`)."""
    large = (clean_growths > 0) & (loss_scale >= SUSPICIOUS_SCALE_LIMIT)
    large = headroom.large_scale_unexplained(large, grad_max_window)
    return (clean_growths >= SUSPICIOUS_GROWTHS) | large


METRICS_OF_A_SCALER = (
    "metrics(opt_state): got a {what}, a loss scale on its own. The metrics are the "
    "optimizer wrapper's counters (skipped steps, failure, gradient norm): pass the "
    "optimizer state of `ls.with_loss_scaling` (or a TrainState / nnx Optimizer holding "
    "it). A loss scale's own values are `.loss_scale` and `.growth_tracker`."
)


def metrics(opt_state: Any, path: str | None = None) -> dict[str, jax.Array]:
    """Arrays to log, read from the state without a host sync.

    Args:
      opt_state: as for :func:`get_loss_scale`.
      path: as for :func:`get_loss_scale`.

    Returns:
      ``loss_scale``, ``growth_tracker`` (0 unless dynamic); the counters
      ``skipped_steps``, ``consecutive_skips``, ``nonfinite_loss_steps`` (skips caused by
      a non-finite ``loss=``) and ``consecutive_nonfinite_losses`` (those in a row, what
      ``max_nonfinite_losses`` counts), ``replays`` and ``last_step_replays`` (``max_replays``);
      ``last_step_applied``; ``nonfinite_grad_leaves`` (leaves non-finite on the last
      skipped step); ``failed`` and ``failure`` (the :class:`loss_scaling.Failure` code
      :func:`check` raises); ``clean_growths`` and ``scale_suspicious`` (the mis-use
      :func:`check` warns about); ``grad_norm`` (of the unscaled gradients, see
      :class:`loss_scaling.LossScalingState`). With ``growth="headroom"``:
      ``grad_max_window`` (the largest unscaled max ``|g|`` in the rule's window),
      ``headroom_log2`` (``log2(finfo(headroom_dtype).max / (loss_scale *
      grad_max_window))``, inf while the window is empty) and ``scale_ceiling``. With
      ``underflow_diagnostics=True``: ``zero_grad_fraction``, ``small_grad_fraction``
      and their ``..._per_leaf`` vectors (:class:`loss_scaling.UnderflowStats`).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> opt_state = ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2))
      >>> {k: v.item() for k, v in ls.metrics(opt_state).items()}  # doctest: +NORMALIZE_WHITESPACE
      {'loss_scale': 32768.0, 'growth_tracker': 0, 'skipped_steps': 0,
       'consecutive_skips': 0, 'last_step_applied': True, 'nonfinite_loss_steps': 0,
       'consecutive_nonfinite_losses': 0, 'nonfinite_grad_leaves': 0, 'failed': False,
       'failure': 0, 'clean_growths': 0, 'scale_suspicious': False, 'grad_norm': 0.0,
       'replays': 0, 'last_step_replays': 0}
    """
    if isinstance(opt_state, SCALER_TYPES):
        raise TypeError(METRICS_OF_A_SCALER.format(what=type(opt_state).__name__))
    refuse_misplaced_wrapper(opt_state)
    state = wrapper_state(opt_state, path)
    scaler = state.scaler
    tracker = getattr(scaler, "growth_tracker", None)
    return {
        "loss_scale": jnp.asarray(scaler.loss_scale),
        "growth_tracker": jnp.zeros((), jnp.int32) if tracker is None else tracker,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_step_applied": state.last_step_applied,
        "nonfinite_loss_steps": state.nonfinite_loss_steps,
        "consecutive_nonfinite_losses": state.consecutive_nonfinite_losses,
        "nonfinite_grad_leaves": jnp.sum(state.nonfinite_grads, axis=-1, dtype=jnp.int32),
        "failed": state.failure != _errors.Failure.NONE,
        "failure": state.failure,
        "clean_growths": state.clean_growths,
        "scale_suspicious": scale_suspicious(state.clean_growths,
                                             jnp.asarray(scaler.loss_scale),
                                             headroom.window_max(scaler)),
        "grad_norm": state.grad_norm,
        "replays": state.replays,
        "last_step_replays": state.last_step_replays,
        **headroom.metrics(scaler),
        **_underflow_metrics(state.underflow),
    }


def _underflow_metrics(stats: UnderflowStats | None) -> dict[str, jax.Array]:
    if stats is None:
        return {}
    weights = stats.size.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(weights, axis=-1), 1.0)
    return {
        "zero_grad_fraction": jnp.sum(stats.zero * weights, axis=-1) / total,
        "small_grad_fraction": jnp.sum(stats.small * weights, axis=-1) / total,
        "zero_grad_fraction_per_leaf": stats.zero,
        "small_grad_fraction_per_leaf": stats.small,
    }


def nonfinite_grad_paths(opt_state: Any, params: Any, path: str | None = None) -> list[str]:
    """The gradient leaves that were non-finite on the most recent skipped step.

    A host-side helper for logs and debugging (it reads the flags, so it syncs): the
    flags themselves are ``LossScalingState.nonfinite_grads``, updated in-graph, one per
    params leaf; ``params`` (or any tree of the same structure) gives their names.

    Args:
      opt_state: as for :func:`get_loss_scale`.
      params: the params (only their structure is used).
      path: as for :func:`get_loss_scale`.

    Returns:
      Dotted key paths of the flagged leaves, e.g. ``["decoder.w"]``; empty if none.

    Raises:
      ValueError: if ``params`` does not have one leaf per flag.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = ls.with_loss_scaling(optax.sgd(1.0))
      >>> params = {"enc": {"w": jnp.ones(2)}, "dec": {"w": jnp.ones(2)}}
      >>> opt_state = tx.init(params)
      >>> grads = {"enc": {"w": jnp.ones(2)}, "dec": {"w": jnp.array([1.0, jnp.nan])}}
      >>> _, opt_state = tx.update(grads, opt_state, params)
      >>> ls.nonfinite_grad_paths(opt_state, params)
      ['dec.w']
    """
    flags = np.asarray(wrapper_state(opt_state, path).nonfinite_grads)
    names = key_path_names(differentiated(params))
    if flags.shape[-1:] != (len(names),):
        raise ValueError(
            f"params has {len(names)} leaves but the optimizer state holds "
            f"{flags.shape[-1] if flags.ndim else 0} non-finite flags: pass the params the "
            "optimizer was initialised with.")
    if not names:  # an empty params tree: reshape(-1, 0) would fail
        return []
    flagged = np.atleast_1d(flags.reshape(-1, len(names)).any(axis=0)).tolist()  # any replica
    return [name for name, flag in zip(names, flagged, strict=True) if flag]


def _local(x: Any) -> Any:
    """A replicated (or single-device) array's value on this host, without a gather: in a
    multi-process run the loss-scale leaves are replicated, so the first shard is whole."""
    return x.addressable_data(0) if isinstance(x, jax.Array) and not x.is_fully_addressable else x


def _host(x: Any) -> np.ndarray:
    return np.asarray(_local(x))


def _first_failing(tree: Any, failure: np.ndarray) -> Any:
    """One replica of a (possibly pmap-replicated) state: the first one that failed."""
    if failure.ndim == 0:
        return jax.tree.map(_host, tree)
    index = int(np.argmax(failure.reshape(-1) != _errors.Failure.NONE))
    return jax.tree.map(
        lambda x: _host(x).reshape(failure.size, *np.shape(x)[failure.ndim:])[index], tree)


def _read_once(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """The host values of a few small arrays (None stays None), in one device read."""
    return tuple(None if x is None else np.asarray(x)
                 for x in jax.device_get([_local(x) for x in arrays]))


def _failure_code(failure: np.ndarray | None, scale: np.ndarray | None) -> np.ndarray:
    """The recorded failure code, else ``INVALID_SCALE`` where the scale is not a positive
    normal float32 (a state built by unflatten or an unchecked restore, before any step);
    elementwise, for replicated states."""
    code = np.zeros((), np.int32) if failure is None else np.asarray(failure, np.int32)
    if scale is None:
        return code
    valid = normal_float32(scale)
    return np.where(code != _errors.Failure.NONE, code,
                    np.where(valid, _errors.Failure.NONE, _errors.Failure.INVALID_SCALE)
                    ).astype(np.int32)


CHECK_UNDER_JIT = (
    "ls.check raises on the host, so it cannot run inside jit (or another transformation): "
    "call it outside the train step, where you log. Inside the step, "
    "`ls.metrics(opt_state)[\"failed\"]` is the same fact as an array; "
    "`with_loss_scaling(..., on_failure=\"raise\")` raises from the step itself "
    "(debugging only: a host callback on every step)."
)


def check(state: Any, params: Any = None, path: str | None = None) -> None:
    """Raises :class:`loss_scaling.LossScaleError` on the host if the run has failed.

    Under ``jit`` a failure never raises inside the step (that would cost every step a
    host callback, and would delete donated params): it is recorded in the state, every
    later step is skipped, and this function reports it. Call it where you log; it reads
    one scalar from the device (and, only on a failure, the rest of the loss-scale state
    for the message). Params and optimizer state stay readable and checkpointable.

    Args:
      state: a loss-scale state, or anything :func:`get_loss_scale` accepts (an
        opt_state, a TrainState, an nnx Optimizer); replicated (pmap) states are fine.
      params: optional; the params (or gradients) whose leaves name the non-finite
        gradient leaves in a ``max_consecutive_skips`` message.
      path: as for :func:`get_loss_scale`.

    Returns:
      ``None`` if the state has not failed.

    Raises:
      LossScaleError: with the full message, if the state has failed.
      TypeError: when called inside ``jit`` (it reads the state on the host).

    Warns:
      LossScaleWarning: if the scale grew :data:`SUSPICIOUS_GROWTHS` (20) times in a row,
        or past ``2**64`` (with ``growth="headroom"``: while the gradients it measured
        are at most ``2**-48``), without an overflow: a loss that was not scaled, or a
        model that needs no scaling (the fallback for what the trace-time check of
        :mod:`loss_scaling.wrapper.provenance` cannot see).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(init_scale=2.0**-126))
      >>> params = jnp.ones(2)
      >>> opt_state = tx.init(params)
      >>> step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p), donate_argnums=(1, 2))
      >>> params, opt_state = step(jnp.array([jnp.inf, 0.0]), opt_state, params)   # no raise
      >>> params                      # readable, bit-identical to before the step
      Array([1., 1.], dtype=float32)
      >>> ls.check(opt_state)
      Traceback (most recent call last):
      ...
      loss_scaling.LossScaleError: loss scale backoff failed: ...
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
        raise TypeError(CHECK_UNDER_JIT)
    if isinstance(state, NoOpLossScale):
        return
    if isinstance(state, (StaticLossScale, DynamicLossScale)):
        failure, scale = _read_once((getattr(state, "failure", None), state.loss_scale))
        failure = _failure_code(failure, scale)
        if np.any(failure != _errors.Failure.NONE):
            state = with_failure(state, failure)  # the code found, also INVALID_SCALE
            raise _errors.LossScaleError(scaler_failure_message(_first_failing(state, failure)))
        return
    refuse_misplaced_wrapper(state)
    wrapper = wrapper_state(state, path)
    scaler = wrapper.scaler
    failure, growths, scale, history = _read_once((
        wrapper.failure, wrapper.clean_growths,
        None if isinstance(scaler, NoOpLossScale) else scaler.loss_scale,
        getattr(scaler, "grad_max_history", None)))
    failure = _failure_code(failure, scale)  # the wrapper's register: the one a step reads
    if np.any(failure != _errors.Failure.NONE):
        names = None if params is None else key_path_names(differentiated(params))
        failed = _first_failing(wrapper._replace(failure=jnp.asarray(failure)), failure)
        raise _errors.LossScaleError(wrapper_failure_message(failed, names))
    window_max = headroom.history_max(history)
    if scale is not None and np.any(scale_suspicious(growths, scale, window_max)):
        now = float(_host(jnp.asarray(wrapper.scaler.loss_scale)).reshape(-1)[0])
        warnings.warn(_errors.SUSPICIOUS_SCALE.format(growths=int(np.max(growths)),
                                                      scale=now), _errors.LossScaleWarning,
                      stacklevel=2)
