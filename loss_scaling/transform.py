"""The Optax wrapper: unscale, test, skip or step, then update the loss scale.

``with_loss_scaling(inner, scaler)`` takes the gradients of the *scaled* loss. One update:

1. ``finite``: per gradient leaf, whether its unscaled values are all finite, read from
   the raw gradients in one reduction per leaf (the unscaled tree is never materialized
   for the test); AND-reduced over ``axis_name`` when given. With ``loss=...``, the loss
   must be finite too.
2. If finite, unscale and run the inner update (so clipping in the inner chain sees true
   gradients). If not, skip it: the inner state is returned untouched and the updates are
   ``-0.0`` (``p + -0.0 == p`` bit for bit, ``-0.0`` params included, unlike ``+0.0``).
3. Update the loss scale, the counters and the per-leaf diagnostics, always.

The fused :func:`apply_gradients` puts the inner update *and* ``apply_updates`` under
one skip decision, so the updates tree never leaves it: the cheapest path (see the
README's benchmark table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from loss_scaling import _errors, scalers, tree
from loss_scaling.scalers import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from loss_scaling.tree import AxisName

__all__ = [
    "LossScalingState",
    "LossScalingTransformation",
    "apply_gradients",
    "with_loss_scaling",
]

SkipMode = Literal["auto", "cond", "select"]
NonFiniteLoss = Literal["backoff", "skip"]
SCALER_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


class LossScalingState(NamedTuple):
    """State of :func:`with_loss_scaling`.

    Attributes:
      scaler: the loss-scale state (``NoOpLossScale``, ``StaticLossScale`` or
        ``DynamicLossScale``) that scales the *next* step's loss.
      inner_state: the wrapped optimizer's state; unchanged by skipped steps.
      skipped_steps: int32, steps skipped in total (saturating).
      consecutive_skips: int32, steps skipped since the last finite one (saturating).
      last_step_finite: bool, whether the last step was applied.
      nonfinite_loss_steps: int32, steps skipped because the ``loss`` passed to the
        update was itself non-finite (saturating).
      nonfinite_grads: bool vector with one entry per params leaf, in ``jax.tree.leaves``
        order: ``True`` where that gradient leaf was non-finite on the most recent
        skipped step (:func:`loss_scaling.nonfinite_grad_paths` names them). A vector,
        not a params-shaped tree: ``optax.tree_map_params`` (sharding specs for optimizer
        states) must not mistake it for params, and its structure must not depend on
        the params, which ``tree_map_params`` replaces by one placeholder.
    """

    scaler: LossScale
    inner_state: optax.OptState
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    last_step_finite: jax.Array
    nonfinite_loss_steps: jax.Array
    nonfinite_grads: jax.Array


def _resolve_skip(skip: SkipMode) -> Literal["cond", "select"]:
    if skip == "auto":
        # Measured in benchmarks/overhead.py: a conditional is the cheaper skip on
        # CPU and GPU alike (see the README's tables).
        return "cond"
    return skip


def _fresh(scaler: LossScale) -> LossScale:
    # New buffers: donating an opt_state must never delete arrays the caller's scaler holds.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), scaler)


def _negative_zeros_like(shapes: Any) -> Any:
    return jax.tree.map(lambda s: jnp.full(s.shape, -0.0, s.dtype), shapes)


def _varying_axes(x: Any) -> frozenset[Any]:
    """The ``shard_map`` axes over which ``x`` (an array or a ShapeDtypeStruct) varies."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary(x: Any, axes: frozenset[Any]) -> Any:
    missing = axes - _varying_axes(x)
    return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying") if missing else x


def _skip_cond(finite: jax.Array, step: Callable[[Any], Any], skip_step: Callable[[Any], Any],
               operands: Any) -> Any:
    """``lax.cond(finite, step, skip_step, operands)``, valid under ``shard_map``'s vma checks.

    Inside ``shard_map`` the two branches can disagree on the mesh axes an output varies
    over, e.g. tensor-parallel updates vary over "model" where the ``-0.0`` of a skip does
    not. Each output is cast to the union of both (``pcast`` to varying: a change of type,
    no communication), so the cond type-checks and the shard_map's ``out_specs`` judge
    the result. Outside ``shard_map`` this is a plain ``lax.cond``.
    """
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return lax.cond(finite, step, skip_step, operands)
    stepped, skipped = (jax.eval_shape(f, operands) for f in (step, skip_step))
    axes = jax.tree.map(lambda a, b: _varying_axes(a) | _varying_axes(b), stepped, skipped)

    def cast(branch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda operands: jax.tree.map(_vary, branch(operands), axes)

    return lax.cond(finite, cast(step), cast(skip_step), operands)


def _count(counter: jax.Array, finite: jax.Array, reset: bool) -> jax.Array:
    stepped = optax.safe_increment(counter)
    return jnp.where(finite, jnp.zeros_like(counter) if reset else counter, stepped)


class _Core(NamedTuple):
    """The wrapper's settings, shared by ``update`` and the fused :func:`apply_gradients`."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: AxisName
    skip: Literal["cond", "select"]
    runtime_check: bool
    max_consecutive_skips: int | None
    nonfinite_loss: NonFiniteLoss


class LossScalingTransformation(optax.GradientTransformationExtraArgs):
    """The ``GradientTransformationExtraArgs`` returned by :func:`with_loss_scaling`.

    An ordinary optax transformation (``init``, ``update``) that also carries what
    :func:`apply_gradients` needs for the fused path.
    """

    core: _Core  # set per instance; a NamedTuple subclass without __slots__ has a __dict__


def with_loss_scaling(
    inner: optax.GradientTransformation,
    scaler: LossScale | None = None,
    *,
    axis_name: AxisName = None,
    skip: SkipMode = "auto",
    runtime_check: bool = True,
    max_consecutive_skips: int | None = None,
    nonfinite_loss: NonFiniteLoss = "backoff",
) -> LossScalingTransformation:
    """Wraps ``inner`` so that it takes gradients of the scaled loss and skips bad steps.

    Each update unscales the gradients by the factor that scaled this step's loss, checks
    them, runs ``inner`` only if they are all finite, and then updates the loss scale. A
    non-finite step leaves the inner state bit-identical and returns ``-0.0`` updates, so
    ``optax.apply_updates`` leaves every parameter bit-identical too. It never gives up and
    applies a non-finite update, however many steps in a row are skipped.

    Args:
      inner: the optimizer to wrap (any optax transformation; extra arguments given to
        ``update`` are forwarded to it).
      scaler: the initial loss-scale state; ``DynamicLossScale()`` by default.
      axis_name: inside ``pmap`` / ``shard_map``, the axis name (or names) over which the
        finite flags are AND-reduced so that every replica skips together.
      skip: how a skipped step is implemented: ``"cond"`` (a ``lax.cond`` around the
        inner update), ``"select"`` (compute, then select), or ``"auto"`` (the one
        measured faster on the current backend).
      runtime_check: passed to :func:`loss_scaling.update`: whether a backoff out of the
        float32 range raises at run time under ``jit`` (a host callback that JAX's
        dispatch pays for on every step) or only poisons the scale with NaN.
      max_consecutive_skips: optional guard for runs that cannot recover: after this many
        consecutive skipped steps the step fails (``LossScaleError`` eagerly, a run-time
        error under ``jit``) with the count, the scale and the non-finite gradient leaves,
        instead of skipping forever. ``None`` (the default) compiles no check.
      nonfinite_loss: what a non-finite ``loss`` passed to ``update(..., loss=loss)`` does.
        It is not an overflow of the scaled gradients (the forward pass itself produced
        inf/NaN), so ``"skip"`` skips the step and leaves the loss scale untouched, while
        ``"backoff"`` (the default) treats it like a gradient overflow. Either way it is
        counted in ``nonfinite_loss_steps``.

    Returns:
      A :class:`LossScalingTransformation` (an ``optax.GradientTransformationExtraArgs``).

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
    """
    if skip not in ("auto", "cond", "select"):
        raise ValueError(f"skip must be 'auto', 'cond' or 'select', got {skip!r}.")
    if nonfinite_loss not in ("backoff", "skip"):
        raise ValueError(f"nonfinite_loss must be 'backoff' or 'skip', got {nonfinite_loss!r}.")
    if max_consecutive_skips is not None:
        max_consecutive_skips = scalers.positive_int32("max_consecutive_skips",
                                                       max_consecutive_skips)
    if scaler is None:
        scaler = DynamicLossScale()
    if not isinstance(scaler, SCALER_TYPES):
        raise TypeError(
            f"scaler must be a NoOpLossScale, StaticLossScale or DynamicLossScale, got {scaler!r}."
        )
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    inner = optax.with_extra_args_support(inner)
    initial_scaler = scaler
    core = _Core(inner=inner, axis_name=axis_name, skip=_resolve_skip(skip),
                 runtime_check=runtime_check, max_consecutive_skips=max_consecutive_skips,
                 nonfinite_loss=nonfinite_loss)

    def init_fn(params: optax.Params) -> LossScalingState:
        return LossScalingState(
            scaler=_fresh(initial_scaler),
            inner_state=inner.init(params),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            last_step_finite=jnp.ones((), jnp.bool_),
            nonfinite_loss_steps=jnp.zeros((), jnp.int32),
            nonfinite_grads=jnp.zeros((len(jax.tree.leaves(params)),), jnp.bool_),
        )

    def update_fn(
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        check = _check(core, updates, state, extra_args)

        def step(operands: Any) -> Any:
            grads, inner_state, params = operands
            return inner.update(tree.unscale(state.scaler, grads), inner_state, params,
                                **extra_args)

        operands = (updates, state.inner_state, params)
        if core.skip == "cond":
            def skip_step(operands: Any) -> Any:
                out_shapes = jax.eval_shape(step, operands)
                return _negative_zeros_like(out_shapes[0]), operands[1]

            new_updates, new_inner = _skip_cond(check.apply, step, skip_step, operands)
        else:
            stepped_updates, stepped_inner = step(operands)
            new_updates = jax.tree.map(
                lambda u: jnp.where(check.apply, u, jnp.full_like(u, -0.0)), stepped_updates)
            new_inner = optax.tree.where(check.apply, stepped_inner, state.inner_state)
        return new_updates, _next_state(core, state, new_inner, check)

    tx = LossScalingTransformation(init_fn, update_fn)
    tx.core = core
    return tx


class _Check(NamedTuple):
    apply: jax.Array  # run the inner step
    grads_finite: jax.Array
    loss_finite: jax.Array
    leaf_finite: Any  # per-leaf flags, shaped like the gradients


def _check(core: _Core, grads: Any, state: LossScalingState, extra_args: dict) -> _Check:
    leaf_finite, grads_finite = tree.unscaled_finite_leaves(
        grads, state.scaler.loss_scale, core.axis_name)
    loss = extra_args.get("loss")
    loss_finite = jnp.asarray(True)
    if loss is not None:
        loss_finite = jnp.isfinite(jnp.asarray(loss)).all()
        if core.axis_name is not None:
            loss_finite = lax.pmin(loss_finite.astype(jnp.int32), core.axis_name) == 1
    return _Check(grads_finite & loss_finite, grads_finite, loss_finite, leaf_finite)


def _next_state(core: _Core, state: LossScalingState, inner_state: Any,
                check: _Check) -> LossScalingState:
    applied = check.apply
    if core.nonfinite_loss == "skip":
        # The forward pass, not the scale, made the loss non-finite: leave the scale be.
        new_scaler = scalers.update(state.scaler, check.grads_finite,
                                    runtime_check=core.runtime_check)
        new_scaler = optax.tree.where(check.loss_finite, new_scaler, state.scaler)
    else:
        new_scaler = scalers.update(state.scaler, applied, runtime_check=core.runtime_check)
    flags = jax.tree.leaves(check.leaf_finite)
    leaf_ok = jnp.stack(flags) if flags else jnp.ones((0,), jnp.bool_)
    nonfinite_grads = jnp.where(applied, state.nonfinite_grads, ~leaf_ok)
    new_state = LossScalingState(
        scaler=new_scaler,
        inner_state=inner_state,
        skipped_steps=_count(state.skipped_steps, applied, reset=False),
        consecutive_skips=_count(state.consecutive_skips, applied, reset=True),
        last_step_finite=applied,
        nonfinite_loss_steps=_count(state.nonfinite_loss_steps, check.loss_finite, reset=False),
        nonfinite_grads=nonfinite_grads,
    )
    if core.max_consecutive_skips is not None:
        _guard_consecutive_skips(core.max_consecutive_skips, new_state, check.leaf_finite)
    return new_state


def leaf_names(tree: Any) -> list[str]:
    """Dotted key paths of the leaves (``"encoder.layers.0.w"``), made unique."""
    names: list[str] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".") or "params"
        while name in names:  # e.g. {"a.b": x} next to {"a": {"b": y}}
            name += "_"
        names.append(name)
    return names


def _guard_consecutive_skips(limit: int, state: LossScalingState, leaf_finite: Any) -> None:
    """Fails the step once ``limit`` steps in a row were skipped (eagerly or in-graph)."""
    names = leaf_names(leaf_finite)
    flags = jax.tree.leaves(leaf_finite)
    leaf_ok = jnp.stack(flags) if flags else jnp.ones((0,), jnp.bool_)
    reached = state.consecutive_skips >= limit

    def message(count: Any, scale: Any, ok: Any) -> str:
        bad = [name for name, good in zip(names, np.asarray(ok).reshape(-1), strict=True)
               if not good]
        return _errors.TOO_MANY_SKIPS.format(
            count=int(np.asarray(count)), limit=limit, scale=float(np.asarray(scale)),
            leaves=", ".join(bad) or "none (the loss was non-finite)")

    values = (state.consecutive_skips, jnp.asarray(state.scaler.loss_scale), leaf_ok)
    if not any(isinstance(x, jax.core.Tracer) for x in values):
        if bool(reached):
            raise _errors.LossScaleError(message(*values))
        return

    def host_check(reached: Any, *values: Any) -> None:
        if np.any(reached):
            raise _errors.LossScaleError(message(*values))

    lax.cond(reached, lambda *a: jax.debug.callback(host_check, *a), lambda *a: None,
             reached, *values)


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
    step (close to a bare optimizer step). A skipped step returns ``params`` itself. Any
    other ``tx`` falls back to ``tx.update`` followed by ``optax.apply_updates``.

    Args:
      tx: the transformation (ideally the result of :func:`with_loss_scaling`).
      grads: gradients of the scaled loss.
      opt_state: ``tx``'s state.
      params: the parameters.
      **extra_args: forwarded to the inner update; ``loss=`` is also checked (see
        ``nonfinite_loss`` in :func:`with_loss_scaling`).

    Returns:
      ``(new_params, new_opt_state)``.

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
    core = getattr(tx, "core", None)
    if not isinstance(core, _Core) or not isinstance(opt_state, LossScalingState):
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        return optax.apply_updates(params, updates), opt_state

    check = _check(core, grads, opt_state, extra_args)

    def step(operands: Any) -> Any:
        grads, inner_state, params = operands
        updates, inner_state = core.inner.update(
            tree.unscale(opt_state.scaler, grads), inner_state, params, **extra_args)
        return optax.apply_updates(params, updates), inner_state

    operands = (grads, opt_state.inner_state, params)
    if core.skip == "cond":
        new_params, new_inner = _skip_cond(check.apply, step, lambda ops: (ops[2], ops[1]),
                                           operands)
    else:
        stepped_params, stepped_inner = step(operands)
        new_params = optax.tree.where(check.apply, stepped_params, params)
        new_inner = optax.tree.where(check.apply, stepped_inner, opt_state.inner_state)
    return new_params, _next_state(core, opt_state, new_inner, check)
