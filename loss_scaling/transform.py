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

import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from loss_scaling import _errors, scalers, tree
from loss_scaling._errors import Failure
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
GRADIENT_EXTRA_ARGS = ("grad",)
"""Extra arguments of ``update`` that hold gradients of the scaled loss: unscaled and checked."""
CONSUMED_EXTRA_ARGS = ("loss",)
"""Extra arguments of ``update`` that are the wrapper's own (checked) and not forwarded:
optax's line searches (``lbfgs``) and ``optax.contrib.sam`` refuse arguments they do not
know. An inner optimizer that wants the loss takes it as ``value=``, optax's name."""


class LossScalingState(NamedTuple):
    """State of :func:`with_loss_scaling`.

    Attributes:
      scaler: the loss-scale state (``NoOpLossScale``, ``StaticLossScale`` or
        ``DynamicLossScale``) that scales the *next* step's loss.
      inner_state: the wrapped optimizer's state; unchanged by skipped steps.
      skipped_steps: int32, steps skipped in total (saturating).
      consecutive_skips: int32, steps skipped since the last applied one (saturating).
      last_step_finite: bool, whether the last step was applied.
      nonfinite_loss_steps: int32, steps skipped because the ``loss`` passed to the
        update was itself non-finite (saturating).
      nonfinite_grads: bool vector with one entry per gradient leaf, in
        ``jax.tree.leaves`` order: ``True`` where that gradient leaf was non-finite on the
        most recent step skipped for its gradients (:func:`loss_scaling.nonfinite_grad_paths`
        names them). A vector, not a params-shaped tree: ``optax.tree_map_params``
        (sharding specs for optimizer states) must not mistake it for params.
      failure: int32 :class:`loss_scaling.Failure` code, 0 while healthy. Once set it never
        changes: every later step is skipped and :func:`loss_scaling.check` raises.
      failure_skips: int32, the consecutive skips when the run failed (0 while healthy).
      clean_growths: int32, growths of the scale since the last non-finite step. Many in a
        row point at a loss that was not scaled, or a model that needs no scaling
        (``metrics(...)["scale_suspicious"]``, and a warning from :func:`loss_scaling.check`).
      underflow: ``None``, or with ``underflow_diagnostics=True`` an
        :class:`UnderflowStats` of this step's gradients.
      grad_norm: float32, the global L2 norm of the last step's *unscaled* gradients
        (what PyTorch's ``clip_grad_norm_`` returns), from the same read of the gradients
        as the finite test (the sum of their squares, in float32, times the scale's
        reciprocal). On a step skipped for its gradients it is inf (NaN entries too):
        the norm of what arrived. It is inf, too, where the squares of the *scaled*
        gradients overflow float32 (above ~1.8e19 in total norm). With ``axis_name`` it
        is the same on every replica: shards of a leaf split over the axes (under
        ``shard_map``) add their squares; replicated gradients count once. 0 before the
        first step.
    """

    scaler: LossScale
    inner_state: optax.OptState
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    last_step_finite: jax.Array
    nonfinite_loss_steps: jax.Array
    nonfinite_grads: jax.Array
    failure: jax.Array
    failure_skips: jax.Array
    clean_growths: jax.Array
    underflow: UnderflowStats | None
    grad_norm: jax.Array


class UnderflowStats(NamedTuple):
    """Per gradient leaf, how much of the last step's gradient float16 could not hold.

    A step whose gradients are not finite keeps the previous values.

    Attributes:
      zero: float32 vector, one entry per gradient leaf: the fraction of entries that are
        exactly zero (in the scaled gradients: what underflowed in the backward pass).
      small: float32 vector: the fraction of entries that are nonzero but, unscaled, below
        float16's smallest normal (6.1e-5): what float16 would lose without the scale.
        A complex entry is zero when both its parts are, and small when it is nonzero
        with an unscaled modulus below 6.1e-5; so ``zero + small`` never exceeds 1.
      size: int32 vector: the entries of each floating leaf (0 for integer leaves), which
        weigh the overall fractions.
    """

    zero: jax.Array
    small: jax.Array
    size: jax.Array


SUSPICIOUS_GROWTHS = 20
"""Growths in a row without an overflow after which the scale is suspicious (2**20 up)."""

_F16_TINY = float(np.finfo(np.float16).tiny)
_BELOW_F16_TINY = float(np.nextafter(np.float32(_F16_TINY), np.float32(0)))

LOW_PRECISION_STATE = (
    "with_loss_scaling: the params {leaves} are {dtype} and the wrapped optimizer keeps its "
    "state in the params' dtype. In {dtype} that state under- and overflows (Adam's eps=1e-8 "
    "is 0 in float16: one step turns params into NaN, and no gradient check can catch it). "
    "Keep float32 master params and compute in float16 inside the loss function (cast the "
    "params there), as the README's recipes do."
)


BFLOAT16_PARAMS = (
    "with_loss_scaling: the params {leaves} are bfloat16. bfloat16 keeps 8 significant bits, "
    "so an update smaller than about 1/256 of a param rounds away (p + u == p): small "
    "learning rates and late training stall, and loss scaling cannot help (it protects the "
    "gradients, not the params). Keep float32 master params and compute in bfloat16 inside "
    "the loss function (cast the params there)."
)

NO_ZERO_PARAMS = (
    "with_loss_scaling: the params leaf {leaf!r} is {dtype}, a dtype without a zero (an "
    "exponent-only scale format): no update leaves it unchanged (a skipped step's -0.0 update "
    "is NaN in {dtype}, and optax.apply_updates computes p + u in it), so a skipped step "
    "cannot keep it. Keep such leaves out of the params given to the optimizer (e.g. in "
    "another collection), or store them as float32."
)


def _resolve_skip(skip: SkipMode, fused: bool) -> Literal["cond", "select"]:
    if skip != "auto":
        return skip
    # Measured in benchmarks/overhead.py (see docs/performance.md): the fused step is
    # cheapest as a conditional everywhere. The plain step must hand its updates out of
    # the decision; on GPU a select of them fused better than a conditional.
    if fused or jax.default_backend() == "cpu":
        return "cond"
    return "select"


def _fresh(scaler: LossScale) -> LossScale:
    # New buffers: donating an opt_state must never delete arrays the caller's scaler holds.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), scaler)


_varying_axes = tree.varying_axes


def _vary(x: Any, axes: frozenset[Any]) -> Any:
    missing = axes - _varying_axes(x)
    return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying") if missing else x


def _skip_cond(apply: jax.Array, step: Callable[[Any], Any], skip_step: Callable[[Any], Any],
               operands: Any) -> Any:
    """``lax.cond(apply, step, skip_step, operands)``, valid under ``shard_map``'s vma checks.

    Inside ``shard_map`` the two branches can disagree on the mesh axes an output varies
    over, e.g. tensor-parallel updates vary over "model" where the ``-0.0`` of a skip does
    not. Each output is cast to the union of both (``pcast`` to varying: a change of type,
    no communication), so the cond type-checks and the shard_map's ``out_specs`` judge
    the result. Outside ``shard_map`` this is a plain ``lax.cond``.
    """
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return lax.cond(apply, step, skip_step, operands)
    stepped, skipped = (jax.eval_shape(f, operands) for f in (step, skip_step))
    axes = jax.tree.map(lambda a, b: _varying_axes(a) | _varying_axes(b), stepped, skipped)

    def cast(branch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda operands: jax.tree.map(_vary, branch(operands), axes)

    return lax.cond(apply, cast(step), cast(skip_step), operands)


def _stepped_scaler(scaler: LossScale, finite: jax.Array) -> LossScale:
    """The scaler's next state, a failure recorded but never raised (eager included).

    The wrapper decides afterwards whether that step counts (``nonfinite_loss="skip"``
    discards it on a non-finite loss) and raises an eager failure itself (:func:`_report`).
    """
    if isinstance(scaler, DynamicLossScale):
        return scalers.step_recorded(scaler, finite)
    return scaler


def _count(counter: jax.Array, reset_when: jax.Array, reset: bool) -> jax.Array:
    stepped = optax.safe_increment(counter)
    return jnp.where(reset_when, jnp.zeros_like(counter) if reset else counter, stepped)


class _Core(NamedTuple):
    """The wrapper's settings, shared by ``update`` and the fused :func:`apply_gradients`."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: AxisName
    skip: SkipMode
    on_failure: scalers.OnFailure
    max_consecutive_skips: int | None
    nonfinite_loss: NonFiniteLoss
    underflow_diagnostics: bool


class LossScalingTransformation(optax.GradientTransformationExtraArgs):
    """The ``GradientTransformationExtraArgs`` returned by :func:`with_loss_scaling`.

    An ordinary optax transformation (``init``, ``update``) that also carries what
    :func:`apply_gradients` needs for the fused path.
    """

    core: _Core  # set per instance; a NamedTuple subclass without __slots__ has a __dict__


def gradient_leaf_count(params: Any) -> int:
    """How many gradient leaves an update receives for ``params``.

    The gradients mirror the params, except for optimizers whose ``params`` carry more
    than is differentiated: ``optax.lookahead`` takes ``LookaheadParams(fast, slow)`` but
    gradients of ``fast`` only.
    """
    if isinstance(params, optax.LookaheadParams):
        params = params.fast
    return len(jax.tree.leaves(params))


def with_loss_scaling(
    inner: optax.GradientTransformation,
    scaler: LossScale | None = None,
    *,
    axis_name: AxisName = None,
    skip: SkipMode = "auto",
    on_failure: scalers.OnFailure = "record",
    max_consecutive_skips: int | None = None,
    nonfinite_loss: NonFiniteLoss = "backoff",
    underflow_diagnostics: bool = False,
    runtime_check: bool | None = None,
) -> LossScalingTransformation:
    """Wraps ``inner`` so that it takes gradients of the scaled loss and skips bad steps.

    Each update unscales the gradients by the factor that scaled this step's loss, checks
    them, runs ``inner`` only if every unscaled element is finite, and then updates the
    loss scale. A skipped step leaves the inner state bit-identical and returns ``-0.0``
    updates, so ``optax.apply_updates`` leaves every parameter bit-identical too. It never
    gives up and applies a non-finite update, however many steps in a row are skipped.

    Failures are fail-closed and cost nothing on healthy steps: a backoff below the normal
    float32 range (without ``min_scale``), ``max_consecutive_skips`` reached, or a scale
    that is not a positive normal float32 (an unvalidated restore) is recorded in the
    state; from then on every step is skipped (params and inner state bit-identical, the
    scale at its last valid value, the counters counting), and
    :func:`loss_scaling.check` raises :class:`loss_scaling.LossScaleError` with the full
    message on the host. Call it where you log. An eager (un-jitted) update raises at once.

    Args:
      inner: the optimizer to wrap (any optax transformation; extra arguments given to
        ``update`` are forwarded to it, except ``loss=``, the wrapper's own: it is checked
        and not forwarded, since optax's line searches, ``optax.lbfgs`` and
        ``optax.contrib.sam`` refuse arguments they do not know; give an inner optimizer
        the loss as ``value=``). ``grad=`` (as ``optax.lbfgs`` takes it) holds gradients
        of the scaled loss too: it is unscaled and checked like them. Others (``value=``,
        ``value_fn=``, ...) pass through untouched: give them unscaled.
      scaler: the initial loss-scale state; ``DynamicLossScale()`` by default.
      axis_name: inside ``pmap`` / ``shard_map``, the axis name (or names) over which the
        finite flags are AND-reduced so that every replica skips together.
      skip: how a skipped step is implemented: ``"cond"`` (a ``lax.cond`` around the
        inner update), ``"select"`` (compute, then select), or ``"auto"`` (the one
        measured faster for the path and backend, see the performance guide).
      on_failure: ``"record"`` (the default: the failure is state, raised on the host by
        :func:`loss_scaling.check`) or ``"raise"``: also raise at once, from a host
        callback compiled into the step. Debugging only: any executable holding a
        callback leaves JAX's fast dispatch path (every step pays about 1 ms of host
        time), and a raise inside a donated step deletes the donated params and state.
      max_consecutive_skips: optional guard for runs that cannot recover: after this many
        consecutive skipped steps the run fails (as above) with the count, the scale and
        the non-finite gradient leaves, instead of skipping forever. ``None`` (the
        default) adds nothing to the step.
      nonfinite_loss: what a non-finite ``loss`` passed to ``update(..., loss=loss)`` does.
        It is not an overflow of the scaled gradients (the forward pass itself produced
        inf/NaN), so ``"skip"`` skips the step and leaves the loss scale untouched, while
        ``"backoff"`` (the default) treats it like a gradient overflow. Either way it is
        counted in ``nonfinite_loss_steps``.
      underflow_diagnostics: opt in to per-step underflow statistics
        (:class:`UnderflowStats`, read through :func:`loss_scaling.metrics`): per gradient
        leaf and overall, the fraction of entries that are exactly zero and the fraction
        that are nonzero but below float16's smallest normal once unscaled. They tell
        whether a model needs a larger scale (or none), and which layers underflow. One
        fused reduction over the gradients; ``False`` (the default) compiles nothing.
      runtime_check: deprecated; ``True`` is ``on_failure="raise"``, ``False`` the default.

    Returns:
      A :class:`LossScalingTransformation` (an ``optax.GradientTransformationExtraArgs``).

    Raises:
      ValueError: for an unknown ``skip``, ``on_failure`` or ``nonfinite_loss``, or a
        ``max_consecutive_skips`` that is not a positive integer.
      TypeError: if ``scaler`` is not a loss-scale state; from ``init``, if a params leaf
        has a dtype without a zero (``float8_e8m0fnu``), which no skipped step can keep.

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
    on_failure = scalers.resolve_on_failure(on_failure, runtime_check, "with_loss_scaling")
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
    core = _Core(inner=inner, axis_name=axis_name, skip=skip, on_failure=on_failure,
                 max_consecutive_skips=max_consecutive_skips, nonfinite_loss=nonfinite_loss,
                 underflow_diagnostics=bool(underflow_diagnostics))

    def init_fn(params: optax.Params) -> LossScalingState:
        _refuse_dtypes_without_zero(params)
        inner_state = inner.init(params)
        _warn_low_precision_state(params, inner_state)
        n_grads = gradient_leaf_count(params)
        return LossScalingState(
            scaler=_fresh(initial_scaler),
            inner_state=inner_state,
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            last_step_finite=jnp.ones((), jnp.bool_),
            nonfinite_loss_steps=jnp.zeros((), jnp.int32),
            nonfinite_grads=jnp.zeros((n_grads,), jnp.bool_),
            failure=jnp.zeros((), jnp.int32),
            failure_skips=jnp.zeros((), jnp.int32),
            clean_growths=jnp.zeros((), jnp.int32),
            underflow=UnderflowStats(jnp.zeros((n_grads,), jnp.float32),
                                     jnp.zeros((n_grads,), jnp.float32),
                                     jnp.zeros((n_grads,), jnp.int32))
            if underflow_diagnostics else None,
            grad_norm=jnp.zeros((), jnp.float32),
        )

    def update_fn(
        updates: optax.Updates,
        state: LossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScalingState]:
        check = _check(core, updates, state, extra_args)
        inverse = check.inverse

        def step(operands: Any) -> Any:
            grads, inner_state, params = operands
            updates, new_inner = inner.update(_unscale(grads, inverse), inner_state, params,
                                              **_inner_extra_args(extra_args, inverse))
            return updates, _same_dtypes(new_inner, inner_state)

        operands = (updates, state.inner_state, params)
        if _resolve_skip(core.skip, fused=False) == "cond":
            # The branches close over their inputs (operand None), as optax.apply_if_finite
            # does: measured cheaper than passing them when the updates leave the decision.
            def stepped(_: Any) -> Any:
                return step(operands)

            def skipped(_: Any) -> Any:
                out_shapes = jax.eval_shape(step, operands)
                return optax.tree.full_like(out_shapes[0], -0.0), state.inner_state

            new_updates, new_inner = _skip_cond(check.apply, stepped, skipped, None)
        else:
            stepped_updates, stepped_inner = step(operands)
            new_updates = optax.tree.where(check.apply, stepped_updates,
                                           optax.tree.full_like(stepped_updates, -0.0))
            new_inner = optax.tree.where(check.apply, stepped_inner, state.inner_state)
        return new_updates, _next_state(core, state, new_inner, check)

    tx = LossScalingTransformation(init_fn, update_fn)
    tx.core = core
    return tx


def _same_dtypes(new_state: Any, old_state: Any) -> Any:
    """The inner state in the dtypes it came in, so that a skip can return the old one.

    Only integer params change anything: optax's moments for an int32 param start as int32
    and come back float32 (optax lets the dtype drift, which retraces a jitted step).
    """
    def same(new: Any, old: Any) -> Any:
        # A Python scalar in the state (optax accepts any pytree, e.g. {"foo": 1}) has no
        # dtype: it is held as the array the conditional makes of it.
        dtype = jnp.result_type(old)
        return new if jnp.result_type(new) == dtype else jnp.asarray(new).astype(dtype)

    return jax.tree.map(same, new_state, old_state)


def _has_zero(dtype: Any) -> bool:
    """Whether ``dtype`` holds a zero (``float8_e8m0fnu``, a scale format, does not)."""
    return bool(np.asarray(0.0, np.float32).astype(dtype).astype(np.float32) == 0)


def _refuse_dtypes_without_zero(params: Any) -> None:
    """Host side, at ``init``: float params in a dtype without a zero cannot be skipped."""
    for name, leaf in zip(leaf_names(params), jax.tree.leaves(params), strict=True):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and not _has_zero(dtype):
            raise TypeError(NO_ZERO_PARAMS.format(leaf=name, dtype=jnp.dtype(dtype).name))


def _warn_low_precision_state(params: Any, inner_state: Any) -> None:
    """Host side, once at ``init``: narrow float params whose optimizer state is as narrow,
    and bfloat16 params (a :class:`loss_scaling.LossScaleWarning` each)."""
    def narrow(x: Any) -> bool:
        dtype = getattr(x, "dtype", None)
        return (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
                and jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp)

    def shown(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    named = list(zip(leaf_names(params), jax.tree.leaves(params), strict=True))
    names = [name for name, leaf in named if narrow(leaf)]
    if names and any(narrow(leaf) for leaf in jax.tree.leaves(inner_state)):
        dtype = next(leaf.dtype for leaf in jax.tree.leaves(params) if narrow(leaf))
        warnings.warn(LOW_PRECISION_STATE.format(leaves=shown(names),
                                                 dtype=jnp.dtype(dtype).name),
                      _errors.LossScaleWarning, stacklevel=3)
    bf16 = [name for name, leaf in named if getattr(leaf, "dtype", None) == jnp.bfloat16]
    if bf16:  # whatever the optimizer: the params themselves lose the updates
        warnings.warn(BFLOAT16_PARAMS.format(leaves=shown(bf16)), _errors.LossScaleWarning,
                      stacklevel=3)


def _underflow_stats(grads: Any, inverse: tree.Reciprocal | None) -> UnderflowStats:
    """Per leaf: the fractions of exact zeros (in the scaled gradients, as the backward pass
    left them), and of nonzero entries below float16's smallest normal once unscaled (in
    float32): one more read of the gradients, opt-in."""
    zero, small, size = [], [], []
    for g in jax.tree.leaves(grads):
        size.append(jnp.size(g) if tree.is_floating(g) else 0)  # weighs the overall fractions
        if not tree.is_floating(g) or not jnp.size(g):
            zero.append(jnp.zeros((), jnp.float32))
            small.append(jnp.zeros((), jnp.float32))
            continue
        # In the compute dtype, not cast back: a float16 leaf's small values must show.
        magnitude = jnp.abs(g.astype(tree.compute_dtype(g.dtype)) if inverse is None
                            else tree.unscale_leaf(g, inverse, cast_back=False))
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


def _reciprocal(scaler: LossScale) -> tree.Reciprocal | None:
    """The scaler's reciprocal; ``None`` for ``NoOpLossScale``, which compiles to nothing."""
    return None if isinstance(scaler, NoOpLossScale) else tree.reciprocal(scaler.loss_scale)


def _unscale(grads: Any, inverse: tree.Reciprocal | None) -> Any:
    return grads if inverse is None else tree.unscale_tree(grads, inverse)


def _inner_extra_args(extra_args: dict[str, Any],
                      inverse: tree.Reciprocal | None) -> dict[str, Any]:
    """The extra arguments for the inner update: ``grad=`` unscaled, ``loss=`` consumed."""
    return {name: _unscale(value, inverse) if name in GRADIENT_EXTRA_ARGS else value
            for name, value in extra_args.items() if name not in CONSUMED_EXTRA_ARGS}


class _Check(NamedTuple):
    apply: jax.Array  # run the inner step
    healthy: jax.Array  # no recorded failure and a usable scale
    grads_finite: jax.Array
    loss_finite: jax.Array
    leaf_finite: jax.Array  # one flag per gradient leaf
    grads: Any  # the scaled gradients (their leaves' names, the underflow statistics)
    inverse: tree.Reciprocal | None  # the scale's reciprocal, computed once per step
    grad_norm: jax.Array  # float32 global norm of the unscaled gradients


def _finite_leaves(grads: Any, inverse: tree.Reciprocal | None,
                   axis_name: AxisName) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per gradient leaf, whether its unscaled values are all finite; their AND; and the
    sum of squares of the (scaled) gradients, in float32, for the norm.

    On XLA CPU a plain sum (of squares) is a vectorized read, while a reduction with the
    unscale or ``abs`` as its producer runs about three times slower (benchmarks/
    step_breakdown.py). So the CPU step first screens the leaves with sums of squares
    (the same read gives the gradient norm): a finite sum proves every entry finite, and
    with a scale of at least 1 (a reciprocal of at most 1) unscaling a finite entry cannot
    overflow, also not when cast back to a narrow dtype.
    Only a group the screen does not clear (an inf or NaN, which is then skipped anyway, a
    sum that overflowed, or everything at a scale below 1) runs the exact test, under a
    conditional. Small leaves are screened and tested together
    (:func:`loss_scaling.tree.leaf_groups`): on XLA CPU every kernel of the executable
    costs about a microsecond per run, those in a branch not taken included, and a small
    model is all small leaves. Other backends run the exact test directly: a conditional
    can cost them a host round trip.
    """
    leaves = jax.tree.leaves(grads)
    groups = tree.leaf_groups(leaves)
    if jax.default_backend() != "cpu" or not groups:
        # Sibling reductions of the same leaves: XLA fuses them into one read on GPU.
        squares = _square_sum([tree.square_sum(x) for x in leaves], axis_name)
        flags, _ = tree.unscaled_finite_leaves(grads, inverse, None)
        flags, squares = _agree(flags, squares, axis_name)
        return flags, flags.all(), squares
    small_reciprocal = jnp.asarray(True)
    if inverse is not None:
        small_reciprocal = (inverse.normal <= 1) | (inverse.post < 1)
    sums = [tree.sum_screen(leaves, group) for group in groups]
    cleared = [jnp.isfinite(x) & small_reciprocal for x in sums]
    # The branch must be the same on every replica: one collective for it and the norm.
    all_cleared, squares = _agree(jnp.stack(cleared).all()[None],
                                  _square_sum(sums, axis_name), axis_name)
    all_cleared = all_cleared[0]

    def group_exact(ok: jax.Array, group: tree.LeafGroup) -> jax.Array:
        def recheck(_: Any) -> jax.Array:
            return tree.unscaled_group_finite(leaves, group, inverse)

        if group.joined:  # a few small kernels: cheaper than a conditional around them
            return recheck(None)
        # A large leaf is read again only if the screen did not clear it: a skipped step
        # rereads about what overflowed, not the whole model.
        return _skip_cond(ok, lambda _: jnp.ones((1,), jnp.bool_), recheck, None)

    def exact(_: Any) -> tuple[jax.Array, jax.Array]:
        flags = [jnp.asarray(True)] * len(leaves)
        for ok, group in zip(cleared, groups, strict=True):
            group_flags = group_exact(ok, group)
            for position, i in enumerate(group.indices):
                flags[i] = group_flags[position]
        stacked = jnp.stack(flags)
        if axis_name is not None:
            stacked = lax.pmin(stacked.astype(jnp.int32), axis_name) == 1
        return stacked, stacked.all()

    n = len(leaves)
    return (*_skip_cond(all_cleared,
                        lambda _: (jnp.ones((n,), jnp.bool_), jnp.asarray(True)), exact, None),
            squares)


def _square_sum(sums: list[jax.Array], axis_name: AxisName) -> jax.Array:
    """The float32 sum of the per-group (or per-leaf) sums of squares.

    Under ``shard_map`` a sum that varies over some of the ``axis_name`` axes is a shard's
    part of a leaf split over them (tensor parallelism): those parts add up (``psum``),
    while a sum invariant over an axis is already the whole leaf's (replicated, e.g.
    ``pmean``-ed, gradients; :func:`loss_scaling.tree.leaf_groups` never mixes the two).
    """
    names = _axis_names(axis_name)
    total = jnp.zeros((), jnp.float32)
    for part in sums:
        part = part.astype(jnp.float32)
        split = tuple(a for a in names if a in tree.varying_axes(part))
        total = total + (lax.psum(part, split) if split else part)
    return total


def _axis_names(axis_name: AxisName) -> tuple[Any, ...]:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def _agree(flags: jax.Array, squares: jax.Array,
           axis_name: AxisName) -> tuple[jax.Array, jax.Array]:
    """Flags ANDed and the sum of squares made the same over the replicas, in ONE ``pmin``.

    ``pmin(-x)`` is ``-pmax(x)``: where JAX does not track what varies (``pmap``,
    ``check_vma=False``) the replicas' gradients are taken to be the same, and the largest
    sum (an inf or NaN on one replica reaches all) is the one every replica reports.
    """
    # A NaN sum reads +inf: the min of an all-reduce need not propagate NaN, and the norm
    # of non-finite gradients is then inf on every path and device.
    squares = jnp.where(jnp.isnan(squares), jnp.inf, squares)
    if axis_name is None:
        return flags, squares
    both = lax.pmin(jnp.concatenate([flags.astype(jnp.float32), -squares[None]]), axis_name)
    return both[:-1] == 1, -both[-1]


def _check(core: _Core, grads: Any, state: LossScalingState, extra_args: dict) -> _Check:
    n_leaves = len(jax.tree.leaves(grads))
    if state.nonfinite_grads.shape[-1:] != (n_leaves,):
        raise ValueError(
            f"the gradients have {n_leaves} leaves but this optimizer state was initialised "
            f"for {state.nonfinite_grads.shape[-1]} (with_loss_scaling sizes its per-leaf "
            "diagnostics from the params given to `init`): pass gradients with the structure "
            "of the params the state was initialised with.")
    inverse = _reciprocal(state.scaler)
    leaf_finite, grads_finite, squares = _finite_leaves(grads, inverse, core.axis_name)
    grad_norm = jnp.sqrt(squares)
    if inverse is not None:  # unscaled: by the reciprocal's two exact factors
        grad_norm = (grad_norm * inverse.normal) * inverse.post
    for name in GRADIENT_EXTRA_ARGS:
        if extra_args.get(name) is not None:
            grads_finite &= tree.unscaled_finite_leaves(extra_args[name], inverse,
                                                        core.axis_name)[1]
    loss = extra_args.get("loss")
    loss_finite = jnp.asarray(True)
    if loss is not None:
        loss_finite = jnp.isfinite(jnp.asarray(loss)).all()
        if core.axis_name is not None:
            loss_finite = lax.pmin(loss_finite.astype(jnp.int32), core.axis_name) == 1
    healthy = state.failure == Failure.NONE
    if isinstance(state.scaler, DynamicLossScale):  # a failed scaler restored into a fresh
        healthy &= state.scaler.failure == Failure.NONE  # state: its own register counts
    if inverse is not None:
        healthy &= scalers.is_positive_normal(state.scaler.loss_scale)
    return _Check(healthy & grads_finite & loss_finite, healthy, grads_finite, loss_finite,
                  leaf_finite, grads, inverse, grad_norm)


def _next_state(core: _Core, state: LossScalingState, inner_state: Any,
                check: _Check) -> LossScalingState:
    applied = check.apply
    failed_before = state.failure != Failure.NONE
    if core.nonfinite_loss == "skip":
        # The forward pass, not the scale, made the loss non-finite: leave the scale be.
        # Eagerly too: a backoff discarded here must not raise (as under jit).
        stepped_scaler = _stepped_scaler(state.scaler, check.grads_finite)
        stepped_scaler = optax.tree.where(check.loss_finite, stepped_scaler, state.scaler)
    else:
        stepped_scaler = _stepped_scaler(state.scaler, check.grads_finite & check.loss_finite)
    consecutive_skips = _count(state.consecutive_skips, applied, reset=True)

    # The first failure wins and is kept; the scaler is frozen from then on.
    scaler_failure = getattr(stepped_scaler, "failure", jnp.int32(Failure.NONE))
    failure = scaler_failure
    if not isinstance(state.scaler, NoOpLossScale):
        failure = jnp.where(~scalers.is_positive_normal(state.scaler.loss_scale),
                            Failure.INVALID_SCALE, failure)
    if core.max_consecutive_skips is not None:
        failure = jnp.where(
            (failure == Failure.NONE) & (consecutive_skips >= core.max_consecutive_skips),
            Failure.TOO_MANY_SKIPS, failure)
    failure = jnp.where(failed_before, state.failure, failure).astype(jnp.int32)
    fails = ~failed_before & (failure != Failure.NONE)
    new_scaler = optax.tree.where(failed_before, state.scaler, stepped_scaler)

    # Growths since the last overflow (the mis-use detector), and the underflow statistics.
    grew = jnp.asarray(new_scaler.loss_scale) > jnp.asarray(state.scaler.loss_scale)
    clean_growths = jnp.where(check.grads_finite,
                              state.clean_growths + grew.astype(jnp.int32), 0)
    underflow = None
    if state.underflow is not None:  # non-finite gradients have no fractions: keep the last
        underflow = optax.tree.where(check.grads_finite,
                                     _underflow_stats(check.grads, check.inverse),
                                     state.underflow)
    # Flags of the last step skipped for its gradients; frozen once the run has failed.
    keep_flags = applied | ~check.healthy | check.grads_finite
    new_state = LossScalingState(
        scaler=new_scaler,
        inner_state=inner_state,
        skipped_steps=_count(state.skipped_steps, applied, reset=False),
        consecutive_skips=consecutive_skips,
        last_step_finite=applied,
        nonfinite_loss_steps=_count(state.nonfinite_loss_steps, check.loss_finite, reset=False),
        nonfinite_grads=jnp.where(keep_flags, state.nonfinite_grads, ~check.leaf_finite),
        failure=failure,
        failure_skips=jnp.where(fails, consecutive_skips, state.failure_skips),
        clean_growths=clean_growths,
        underflow=underflow,
        grad_norm=check.grad_norm,
    )
    _report(core, new_state, fails, leaf_names(check.grads))
    return new_state


def failure_message(state: LossScalingState, names: list[str] | None = None) -> str:
    """The host-side message for a failed wrapper state (concrete, one replica).

    ``names`` names the gradient leaves (:func:`leaf_names` of the params or gradients);
    without them, leaves are named by their index in ``jax.tree.leaves`` order.
    """
    code = Failure(int(np.asarray(state.failure)))
    if code == Failure.TOO_MANY_SKIPS:
        flags = np.asarray(state.nonfinite_grads).reshape(-1)
        if names is None or len(names) != flags.size:
            names = [f"leaf #{i}" for i in range(flags.size)]
        return _errors.too_many_skips_message(
            state.failure_skips, jnp.asarray(state.scaler.loss_scale),
            [name for name, bad in zip(names, flags, strict=True) if bad])
    if code == Failure.BACKOFF_UNDERFLOW:
        return scalers.failure_message(state.scaler)  # type: ignore[arg-type]
    return _errors.invalid_scale_message(jnp.asarray(state.scaler.loss_scale))


def _report(core: _Core, state: LossScalingState, fails: jax.Array, names: list[str]) -> None:
    """Eagerly, raises a failure at once; under ``jit``, only with ``on_failure="raise"``."""
    values = jax.tree.leaves(state)
    if not any(isinstance(x, jax.core.Tracer) for x in values):
        if np.any(np.asarray(state.failure)):
            raise _errors.LossScaleError(failure_message(state, names))
        return
    if core.on_failure == "raise":
        treedef = jax.tree.structure(state)
        _errors.raise_in_graph(
            fails, lambda *leaves: failure_message(jax.tree.unflatten(treedef, leaves), names),
            *values)


def leaf_names(tree: Any) -> list[str]:
    """Dotted key paths of the leaves (``"encoder.layers.0.w"``), made unique."""
    names: list[str] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".") or "params"
        while name in names:  # e.g. {"a.b": x} next to {"a": {"b": y}}
            name += "_"
        names.append(name)
    return names


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
    ``optax.apply_updates``.

    Args:
      tx: the transformation (ideally the result of :func:`with_loss_scaling`).
      grads: gradients of the scaled loss.
      opt_state: ``tx``'s state.
      params: the parameters.
      **extra_args: forwarded to the inner update, except ``loss=``, which is checked
        (see ``nonfinite_loss`` in :func:`with_loss_scaling`) and not forwarded; ``grad=``
        is unscaled and checked.

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
    inverse = check.inverse

    def step(operands: Any) -> Any:
        grads, inner_state, params = operands
        updates, new_inner = core.inner.update(
            _unscale(grads, inverse), inner_state, params,
            **_inner_extra_args(extra_args, inverse))
        return optax.apply_updates(params, updates), _same_dtypes(new_inner, inner_state)

    operands = (grads, opt_state.inner_state, params)
    if _resolve_skip(core.skip, fused=True) == "cond":
        new_params, new_inner = _skip_cond(check.apply, step, lambda ops: (ops[2], ops[1]),
                                           operands)
    else:
        stepped_params, stepped_inner = step(operands)
        new_params = optax.tree.where(check.apply, stepped_params, params)
        new_inner = optax.tree.where(check.apply, stepped_inner, opt_state.inner_state)
    return new_params, _next_state(core, opt_state, new_inner, check)
