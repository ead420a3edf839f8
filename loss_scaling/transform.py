"""The Optax wrapper: unscale, test, skip or step, then update the loss scale.

``with_loss_scaling(inner, scaler)`` takes the gradients of the *scaled* loss. One update:

1. ``finite``: whether the unscaled gradients are all finite, read from the raw gradients
   in one reduction per leaf (the unscaled tree is never materialized for the test);
   AND-reduced over ``axis_name`` when given.
2. If finite, unscale and run the inner update (so clipping in the inner chain sees true
   gradients). If not, skip it: the inner state is returned untouched and the updates are
   ``-0.0`` (``p + -0.0 == p`` bit for bit, ``-0.0`` params included, unlike ``+0.0``).
3. Update the loss scale and the skip counters, always.

The fused :func:`apply_gradients` puts the inner update *and* ``apply_updates`` under
one skip decision, so the updates tree never leaves it: the cheapest path (see the
README's benchmark table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from loss_scaling import scalers, tree
from loss_scaling.scalers import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from loss_scaling.tree import AxisName

__all__ = [
    "LossScalingState",
    "apply_gradients",
    "get_loss_scale",
    "metrics",
    "value_and_grad",
    "with_loss_scaling",
]

SkipMode = Literal["auto", "cond", "select"]
_SCALER_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


class LossScalingState(NamedTuple):
    """State of :func:`with_loss_scaling`.

    Attributes:
      scaler: the loss-scale state (``NoOpLossScale``, ``StaticLossScale`` or
        ``DynamicLossScale``) that scales the *next* step's loss.
      inner_state: the wrapped optimizer's state; unchanged by skipped steps.
      skipped_steps: int32, steps skipped in total (saturating).
      consecutive_skips: int32, steps skipped since the last finite one (saturating).
      last_step_finite: bool, whether the last step's gradients were finite.
    """

    scaler: LossScale
    inner_state: optax.OptState
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    last_step_finite: jax.Array


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
    """What apply_gradients needs to fuse: the inner transformation and the settings."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: AxisName
    skip: Literal["cond", "select"]
    runtime_check: bool


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
        finite flag is AND-reduced so that every replica skips together.
      skip: how a skipped step is implemented: ``"cond"`` (a ``lax.cond`` around the
        inner update), ``"select"`` (compute, then select), or ``"auto"`` (the one
        measured faster on the current backend).
      runtime_check: passed to :func:`loss_scaling.update`: whether a backoff out of the
        float32 range raises at run time under ``jit`` (a host callback that JAX's
        dispatch pays for on every step) or only poisons the scale with NaN.

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
    if scaler is None:
        scaler = DynamicLossScale()
    if not isinstance(scaler, _SCALER_TYPES):
        raise TypeError(
            f"scaler must be a NoOpLossScale, StaticLossScale or DynamicLossScale, got {scaler!r}."
        )
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    inner = optax.with_extra_args_support(inner)
    initial_scaler = scaler

    def init_fn(params: optax.Params) -> LossScalingState:
        return LossScalingState(
            scaler=_fresh(initial_scaler),
            inner_state=inner.init(params),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            last_step_finite=jnp.ones((), jnp.bool_),
        )

    def update_fn(
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        scaler_now = state.scaler
        finite = tree.unscaled_all_finite(updates, scaler_now.loss_scale, axis_name)

        def step(operands: Any) -> Any:
            grads, inner_state, params = operands
            return inner.update(tree.unscale(scaler_now, grads), inner_state, params,
                                **extra_args)

        operands = (updates, state.inner_state, params)
        if _resolve_skip(skip) == "cond":
            def skip_step(operands: Any) -> Any:
                out_shapes = jax.eval_shape(step, operands)
                return _negative_zeros_like(out_shapes[0]), operands[1]

            new_updates, new_inner = _skip_cond(finite, step, skip_step, operands)
        else:
            stepped_updates, stepped_inner = step(operands)
            new_updates = jax.tree.map(
                lambda u: jnp.where(finite, u, jnp.full_like(u, -0.0)), stepped_updates)
            new_inner = optax.tree.where(finite, stepped_inner, state.inner_state)
        return new_updates, _next_state(state, new_inner, finite, runtime_check)

    tx = LossScalingTransformation(init_fn, update_fn)
    tx.core = _Core(inner=inner, axis_name=axis_name, skip=_resolve_skip(skip),
                    runtime_check=runtime_check)
    return tx


def _next_state(state: LossScalingState, inner_state: Any, finite: jax.Array,
                runtime_check: bool) -> LossScalingState:
    return LossScalingState(
        scaler=scalers.update(state.scaler, finite, runtime_check=runtime_check),
        inner_state=inner_state,
        skipped_steps=_count(state.skipped_steps, finite, reset=False),
        consecutive_skips=_count(state.consecutive_skips, finite, reset=True),
        last_step_finite=finite,
    )


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
      **extra_args: forwarded to the inner update.

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

    scaler_now = opt_state.scaler
    finite = tree.unscaled_all_finite(grads, scaler_now.loss_scale, core.axis_name)

    def step(operands: Any) -> Any:
        grads, inner_state, params = operands
        updates, inner_state = core.inner.update(
            tree.unscale(scaler_now, grads), inner_state, params, **extra_args)
        return optax.apply_updates(params, updates), inner_state

    operands = (grads, opt_state.inner_state, params)
    if core.skip == "cond":
        new_params, new_inner = _skip_cond(finite, step, lambda ops: (ops[2], ops[1]),
                                           operands)
    else:
        stepped_params, stepped_inner = step(operands)
        new_params = optax.tree.where(finite, stepped_params, params)
        new_inner = optax.tree.where(finite, stepped_inner, opt_state.inner_state)
    return new_params, _next_state(opt_state, new_inner, finite, core.runtime_check)


# ------------------------------------------------------------------- finding the scaler


def _unwrap_variables(x: Any) -> Any:
    """Replaces flax.nnx Variables (as found in ``nnx.Optimizer.opt_state``) by values."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return x
    if isinstance(x, nnx.Optimizer):
        x = x.opt_state
    # get_value(): flax >= 0.12 deprecates `.value` (a DeprecationWarning on every call).
    return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, x,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


def _all_loss_scaling_states(opt_state: Any) -> list[tuple[str, LossScalingState]]:
    # optax matches a NamedTuple by its class name; the isinstance filter rules out
    # any other class that happens to share the name.
    found = optax.tree_utils.tree_get_all_with_path(
        _unwrap_variables(opt_state), LossScalingState.__name__,
        filtering=lambda _, value: isinstance(value, LossScalingState),
    )
    return [(_path_str(path), value) for path, value in found]


def _path_str(path: tuple[Any, ...]) -> str:
    """A key path as Python would index it, e.g. ``.inner_states['x'].inner_state``."""
    parts = []
    for key in path:
        if isinstance(key, (optax.tree_utils.NamedTupleKey, jax.tree_util.GetAttrKey)):
            parts.append(f".{key.name}")
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(f"[{key.key!r}]")
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(f"[{key.idx}]")
        else:
            parts.append(jax.tree_util.keystr((key,)))
    return "".join(parts)


def get_loss_scale(opt_state: Any, path: str | None = None) -> LossScale:
    """The loss-scale state inside a (possibly nested) optax state.

    Finds the :func:`with_loss_scaling` state inside ``optax.chain``, ``MultiSteps``,
    ``inject_hyperparams``, ``masked`` / ``multi_transform``, a flax ``TrainState`` (or its
    ``opt_state``) and a ``flax.nnx.Optimizer`` (or its ``opt_state``).

    Args:
      opt_state: an optimizer state, TrainState or nnx Optimizer.
      path: when there are several loss scales, which one: its key path as listed in the
        error message (e.g. ``".inner_states['generator'].inner_state"``), or any part of
        it that only one of them contains (e.g. ``"['generator']"``).

    Returns:
      The loss-scale state (its leaves as arrays).

    Raises:
      ValueError: if there is no loss scale, or several and ``path`` does not pick one.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = optax.chain(optax.clip(1.0), ls.with_loss_scaling(optax.adam(1e-3)))
      >>> float(ls.get_loss_scale(tx.init(jnp.zeros(3))).loss_scale)
      32768.0
    """
    return _get_wrapper_state(opt_state, path).scaler


def _get_wrapper_state(opt_state: Any, path: str | None) -> LossScalingState:
    found = _all_loss_scaling_states(opt_state)
    if path is not None:
        exact = [(p, s) for p, s in found if p == path]
        found = exact or [(p, s) for p, s in found if path in p]
    if len(found) == 1:
        return found[0][1]
    if not found:
        where = "" if path is None else f" at path {path!r}"
        raise ValueError(
            f"No loss scale found{where} in this optimizer state: build the optimizer with "
            "`loss_scaling.with_loss_scaling(...)` and pass its state (or a TrainState / "
            "nnx.Optimizer holding it).")
    paths = ", ".join(repr(p) for p, _ in found)
    raise ValueError(
        f"Found {len(found)} loss scales, at paths {paths}: pass `path=` with one of them.")


def metrics(opt_state: Any, path: str | None = None) -> dict[str, jax.Array]:
    """Arrays to log, read from the state without a host sync.

    Args:
      opt_state: as for :func:`get_loss_scale`.
      path: as for :func:`get_loss_scale`.

    Returns:
      ``{"loss_scale", "growth_tracker", "skipped_steps", "consecutive_skips",
      "last_step_finite"}``; ``growth_tracker`` is 0 for non-dynamic scales.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> opt_state = ls.with_loss_scaling(optax.sgd(1.0)).init(jnp.zeros(2))
      >>> {k: v.item() for k, v in ls.metrics(opt_state).items()}  # doctest: +NORMALIZE_WHITESPACE
      {'loss_scale': 32768.0, 'growth_tracker': 0, 'skipped_steps': 0,
       'consecutive_skips': 0, 'last_step_finite': True}
    """
    state = _get_wrapper_state(opt_state, path)
    scaler = state.scaler
    tracker = getattr(scaler, "growth_tracker", None)
    return {
        "loss_scale": jnp.asarray(scaler.loss_scale),
        "growth_tracker": jnp.zeros((), jnp.int32) if tracker is None else tracker,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_step_finite": state.last_step_finite,
    }


# ------------------------------------------------------------------------ train step


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, differentiating the scaled loss.

    The returned function takes the loss scale first: a loss-scale state or any state
    :func:`get_loss_scale` accepts (an opt_state, a TrainState, an nnx Optimizer), then
    ``fun``'s arguments. It returns the *unscaled* loss (and aux) with the *scaled*
    gradients, ready for ``tx.update`` / :func:`apply_gradients`.

    Args:
      fun: the loss function; returns a scalar loss (or ``(loss, aux)``).
      argnums: as in ``jax.value_and_grad``, counted over ``fun``'s arguments.
      has_aux: as in ``jax.value_and_grad``.

    Returns:
      ``f(state, *args, **kwargs) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> grad_fn = ls.value_and_grad(lambda w: jnp.sum(w ** 2))
      >>> loss, grads = grad_fn(ls.StaticLossScale(8.0), jnp.array([1.0, 2.0]))
      >>> loss, grads
      (Array(5., dtype=float32), Array([16., 32.], dtype=float32))
    """

    def wrapped(state: Any, *args: Any, **kwargs: Any) -> Any:
        scaler = state if isinstance(state, _SCALER_TYPES) else get_loss_scale(state)

        def scaled(*args: Any, **kwargs: Any) -> Any:
            out = fun(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return tree.scale(scaler, loss), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(
            *args, **kwargs)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped
