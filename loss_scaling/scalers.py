"""The three loss-scale states and their update rule.

Each state is an immutable pytree. The values that change during training are leaves
(``loss_scale`` float32, ``growth_tracker`` and ``nonfinite_tracker`` int32); the
configuration is static auxiliary data. Constructing a state from Python values validates
it; flattening and unflattening never do, so tree maps to ``None``, ``ShapeDtypeStruct``
or ``PartitionSpec``, Orbax and ``flax.serialization`` all work, and a state passed
through ``jax.jit`` keeps every setting.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import warnings
from typing import Any, Literal, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from loss_scaling import _errors
from loss_scaling._errors import Failure

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "loss_scale_for",
    "NoOpLossScale",
    "StaticLossScale",
    "update",
]

_F32 = np.finfo(np.float32)
_INT32_MAX = int(np.iinfo(np.int32).max)


# --------------------------------------------------------------------------- validation


def _is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened, and safe on hostile inputs (huge ints, deep nesting)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _real(name: str, value: Any) -> float:
    """``value`` as a Python float, refusing bools, strings, tracers and non-scalars."""
    if _is_traced(value):
        raise ValueError(
            f"{name} must be a concrete number, got a traced value {show(value)}: construct loss "
            "scales outside `jit` (a state passed into `jit` keeps its configuration)."
        )
    # numpy registers timedelta64 as an integer type (numbers.Real); its 0-d arrays, like
    # datetime64 and object ones, convert to a number silently: none of them is a number.
    dtype = getattr(value, "dtype", None)
    numeric = dtype is None or (isinstance(dtype, np.dtype) and (
        dtype.kind in "iu" or jnp.issubdtype(dtype, jnp.floating)))
    if isinstance(value, (bool, np.bool_)) or not numeric or not (
        isinstance(value, numbers.Real)
        or (isinstance(value, (np.ndarray, jax.Array)) and value.shape == ())
    ):
        raise ValueError(
            f"{name} must be a real number, got {show(value)} of type {type(value).__name__}.")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return float("inf")


def _float32(value: float) -> np.float32:
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(value)


def positive_normal_float32(name: str, value: Any) -> float:
    """Validates a scale-like value: finite, positive and normal *as float32*."""
    as_f32 = _float32(_real(name, value))
    if not (np.isfinite(as_f32) and as_f32 >= _F32.tiny):
        raise ValueError(
            f"{name} must be a finite, positive, normal float32 (between {_F32.tiny} and "
            f"{_F32.max}), got {show(value)}."
        )
    return float(as_f32)


def positive_int32(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or _is_traced(value):
        raise ValueError(f"{name} must be an integer, got {show(value)}.")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {show(value)} of type {type(value).__name__}."
        ) from None
    if not 1 <= as_int <= _INT32_MAX:
        raise ValueError(f"{name} must be an integer in [1, {_INT32_MAX}], got {show(value)}.")
    return as_int


def _growth_factor(value: Any) -> float:
    as_f32 = _float32(_real("growth_factor", value))
    if not (np.isfinite(as_f32) and as_f32 > 1.0):
        raise ValueError(f"growth_factor must be finite and > 1 as a float32, got {show(value)}.")
    return float(as_f32)


def _backoff_factor(value: Any) -> float:
    as_f32 = _float32(_real("backoff_factor", value))
    if not (0.0 < as_f32 < 1.0):
        raise ValueError(
            f"backoff_factor must lie in the open interval (0, 1) as a float32, got {show(value)}."
        )
    if as_f32 < _F32.tiny:
        # XLA on CPU reads a subnormal operand as 0: every backoff would give a zero scale,
        # so the first overflow would fail the run.
        raise ValueError(
            f"backoff_factor must be a normal float32 (at least {_F32.tiny}), got "
            f"{show(value)}: a subnormal factor is read as 0 on CPU, so the first backoff "
            "would leave the normal float32 range and fail the run.")
    return float(as_f32)


# ------------------------------------------------------------------------------ states


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(
        f"{type(self).__name__} is immutable: cannot assign {name!r}. Use "
        "`loss_scaling.update` to get the next state."
    )


def _frozen_delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(
        f"{type(self).__name__} is immutable: cannot delete {name!r}."
    )


class NoOpLossScale:
    """No loss scaling: the factor is 1 and every operation is the identity.

    The right choice for bfloat16 and float32 compute. It has no leaves, so
    ``scale`` / ``unscale`` / ``update`` add no operation to a compiled step.

    Examples:
      >>> import loss_scaling as ls
      >>> s = ls.NoOpLossScale()
      >>> float(s.loss_scale)
      1.0
      >>> ls.update(s, False) is s
      True
    """

    __slots__ = ()
    __setattr__ = _frozen_setattr
    __delattr__ = _frozen_delattr

    @property
    def loss_scale(self) -> jax.Array:
        """The factor, always 1.0 (float32)."""
        return jnp.ones((), jnp.float32)

    def __repr__(self) -> str:
        return "NoOpLossScale()"


class StaticLossScale:
    """A fixed loss scale.

    The factor is a leaf, not static data, so a new value does not recompile a step.

    Args:
      loss_scale: the factor; a finite, positive, normal float32.

    Raises:
      ValueError: if ``loss_scale`` is not a positive normal float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> s = ls.StaticLossScale(128.0)
      >>> ls.scale(s, jnp.float32(0.5))
      Array(64., dtype=float32)
      >>> float(ls.update(s, False).loss_scale)
      128.0
    """

    __slots__ = ("loss_scale",)
    __setattr__ = _frozen_setattr
    __delattr__ = _frozen_delattr
    loss_scale: jax.Array

    def __init__(self, loss_scale: float) -> None:
        value = positive_normal_float32("loss_scale", loss_scale)
        object.__setattr__(self, "loss_scale", jnp.asarray(value, jnp.float32))

    def __repr__(self) -> str:
        return f"StaticLossScale(loss_scale={self.loss_scale!r})"


@dataclasses.dataclass(frozen=True)
class DynamicConfig:
    """The static configuration of a :class:`DynamicLossScale` (hashable aux data)."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None


class DynamicLossScale:
    """A loss scale that backs off on non-finite gradients and grows after clean runs.

    The rule (PyTorch's ``GradScaler``, made fail-closed), applied by
    :func:`loss_scaling.update` once per step:

    * finite step: ``growth_tracker += 1`` and ``nonfinite_tracker = 0``; on reaching
      ``growth_interval`` the scale is multiplied by ``growth_factor`` (capped at
      ``max_scale``) and the tracker resets to 0. A growth that would overflow float32 is
      skipped; the tracker still resets.
    * non-finite step: ``growth_tracker = 0`` and ``nonfinite_tracker += 1`` (saturating
      at ``hysteresis``); once it reaches ``hysteresis`` the scale is multiplied by
      ``backoff_factor`` on this and every further consecutive non-finite step. A clean
      step refills the hysteresis. ``min_scale`` clamps the backoff; without it, a backoff
      below the normal float32 range is an error (:class:`LossScaleError` eagerly, a
      run-time error under ``jit``), never a silent zero scale.

    Args:
      init_scale: the initial factor; finite, positive, normal as float32.
      growth_factor: multiplier on growth; finite and > 1.
      backoff_factor: multiplier on backoff; in (0, 1).
      growth_interval: consecutive clean steps before a growth; an integer >= 1
        (1 grows on every clean step, as in PyTorch).
      hysteresis: consecutive non-finite steps before the first backoff; an integer >= 1.
      min_scale: optional floor for the backoff (clamps instead of failing).
      max_scale: optional ceiling for the growth.

    Raises:
      ValueError: naming the argument and its value, for any invalid argument.

    Examples:
      >>> import loss_scaling as ls
      >>> s = ls.DynamicLossScale(init_scale=1024.0, growth_interval=2)
      >>> s = ls.update(s, True)
      >>> float(s.loss_scale), int(s.growth_tracker)
      (1024.0, 1)
      >>> s = ls.update(s, True)   # the 2nd consecutive clean step grows
      >>> float(s.loss_scale), int(s.growth_tracker)
      (2048.0, 0)
      >>> float(ls.update(s, False).loss_scale)
      1024.0
    """

    __slots__ = ("loss_scale", "growth_tracker", "nonfinite_tracker", "failure", "config")
    __setattr__ = _frozen_setattr
    __delattr__ = _frozen_delattr
    loss_scale: jax.Array
    growth_tracker: jax.Array
    nonfinite_tracker: jax.Array
    failure: jax.Array
    config: DynamicConfig

    def __init__(
        self,
        init_scale: float = 2.0**15,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
    ) -> None:
        config, init = validate_dynamic_config(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "loss_scale", jnp.asarray(init, jnp.float32))
        object.__setattr__(self, "growth_tracker", jnp.zeros((), jnp.int32))
        object.__setattr__(self, "nonfinite_tracker", jnp.zeros((), jnp.int32))
        object.__setattr__(self, "failure", jnp.zeros((), jnp.int32))

    @classmethod
    def _from_parts(cls, config: DynamicConfig, leaves: tuple[Any, ...]) -> DynamicLossScale:
        """Rebuilds a state without validation (unflatten, serialization after checks).

        ``leaves`` are ``(loss_scale, growth_tracker, nonfinite_tracker[, failure])``; a
        missing ``failure`` (a state saved before it existed) is healthy.
        """
        if len(leaves) == len(_DYNAMIC_LEAVES) - 1:
            leaves = (*leaves, jnp.zeros((), jnp.int32))
        self = object.__new__(cls)
        object.__setattr__(self, "config", config)
        for name, leaf in zip(_DYNAMIC_LEAVES, leaves, strict=True):
            object.__setattr__(self, name, leaf)
        return self

    growth_factor = property(lambda self: self.config.growth_factor, doc="Growth multiplier.")
    backoff_factor = property(lambda self: self.config.backoff_factor, doc="Backoff multiplier.")
    growth_interval = property(lambda self: self.config.growth_interval,
                               doc="Clean steps per growth.")
    hysteresis = property(lambda self: self.config.hysteresis, doc="Non-finite steps per backoff.")
    min_scale = property(lambda self: self.config.min_scale, doc="Backoff floor, or None.")
    max_scale = property(lambda self: self.config.max_scale, doc="Growth ceiling, or None.")

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self.config, f.name)!r}"
                           for f in dataclasses.fields(self.config))
        return (f"DynamicLossScale(loss_scale={self.loss_scale!r}, "
                f"growth_tracker={self.growth_tracker!r}, "
                f"nonfinite_tracker={self.nonfinite_tracker!r}, "
                f"failure={self.failure!r}, {fields})")


# typing.Union rather than `A | B | C`: a types.UnionType's __doc__ is read-only, so the
# API table (autosummary reads the object's docstring) would say "Represent a PEP 604
# union type". Both work in annotations and in isinstance.
LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]  # noqa: UP007
LossScale.__doc__ = """Any of the three loss-scale states (a type alias).

``NoOpLossScale | StaticLossScale | DynamicLossScale``, for annotations (``s: ls.LossScale``)
and ``isinstance(s, ls.LossScale)``; :func:`loss_scale_for` picks one for a compute dtype.
"""


def validate_dynamic_config(
    *, init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
    hysteresis: Any, min_scale: Any, max_scale: Any,
) -> tuple[DynamicConfig, float]:
    """Checks every argument of :class:`DynamicLossScale`; returns the config and scale."""
    init = positive_normal_float32("init_scale", init_scale)
    config = DynamicConfig(
        growth_factor=_growth_factor(growth_factor),
        backoff_factor=_backoff_factor(backoff_factor),
        growth_interval=positive_int32("growth_interval", growth_interval),
        hysteresis=positive_int32("hysteresis", hysteresis),
        min_scale=None if min_scale is None else positive_normal_float32("min_scale", min_scale),
        max_scale=None if max_scale is None else positive_normal_float32("max_scale", max_scale),
    )
    if config.min_scale is not None and config.min_scale > init:
        raise ValueError(f"min_scale ({min_scale!r}) must not exceed init_scale ({init_scale!r}).")
    if config.max_scale is not None and config.max_scale < init:
        raise ValueError(
            f"max_scale ({max_scale!r}) must not be below init_scale ({init_scale!r}).")
    return config, init


def loss_scale_for(compute_dtype: Any, **dynamic_options: Any) -> LossScale:
    """The loss scale a compute dtype needs, so one flag switches float16 / bfloat16.

    float16's narrow exponent range needs dynamic scaling; bfloat16, float32 and float64
    share float32's range and need none: they get :class:`NoOpLossScale`, which adds no
    operation to a compiled step.

    Args:
      compute_dtype: the dtype the model computes in (anything ``jnp.dtype`` accepts).
      **dynamic_options: :class:`DynamicLossScale` arguments, used for float16 only.

    Returns:
      ``DynamicLossScale(**dynamic_options)`` for float16, else ``NoOpLossScale()``.

    Raises:
      ValueError: if ``compute_dtype`` is not a floating dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> ls.loss_scale_for(jnp.bfloat16)
      NoOpLossScale()
      >>> float(ls.loss_scale_for("float16", init_scale=1024.0).loss_scale)
      1024.0
    """
    try:
        dtype = jnp.dtype(compute_dtype)
    except TypeError:
        raise ValueError(
            f"compute_dtype must be a floating dtype, got {show(compute_dtype)}.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"compute_dtype must be a floating dtype, got {show(compute_dtype)}.")
    if jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp:  # float16 and narrower
        return DynamicLossScale(**dynamic_options)
    return NoOpLossScale()


# ------------------------------------------------------------------ pytree registration

_DYNAMIC_LEAVES = ("loss_scale", "growth_tracker", "nonfinite_tracker", "failure")

jax.tree_util.register_pytree_with_keys(
    NoOpLossScale,
    lambda s: ((), None),
    lambda aux, children: object.__new__(NoOpLossScale),
    flatten_func=lambda s: ((), None),
)


def _static_unflatten(aux: None, children: Any) -> StaticLossScale:
    self = object.__new__(StaticLossScale)
    object.__setattr__(self, "loss_scale", children[0])
    return self


jax.tree_util.register_pytree_with_keys(
    StaticLossScale,
    lambda s: (((GetAttrKey("loss_scale"), s.loss_scale),), None),
    _static_unflatten,
    flatten_func=lambda s: ((s.loss_scale,), None),
)

jax.tree_util.register_pytree_with_keys(
    DynamicLossScale,
    lambda s: (tuple((GetAttrKey(n), getattr(s, n)) for n in _DYNAMIC_LEAVES), s.config),
    lambda config, children: DynamicLossScale._from_parts(config, tuple(children)),
    flatten_func=lambda s: (tuple(getattr(s, n) for n in _DYNAMIC_LEAVES), s.config),
)


def _rebuild(cls: type, aux: Any, children: tuple[Any, ...]) -> Any:
    """Unpickling: unflatten (no validation, like every unflatten) the pickled parts."""
    if cls is NoOpLossScale:
        return object.__new__(NoOpLossScale)
    if cls is StaticLossScale:
        return _static_unflatten(None, children)
    return DynamicLossScale._from_parts(aux, children)


def _reduce(self: Any) -> tuple[Any, ...]:
    children, aux = jax.tree_util.tree_flatten(self)[0], getattr(self, "config", None)
    return (_rebuild, (type(self), aux, tuple(children)))


for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
    _cls.__reduce__ = _reduce  # type: ignore[method-assign]


# ------------------------------------------------------------------------------ update


def _as_finite_flag(grads_finite: Any) -> jax.Array:
    if isinstance(grads_finite, (bool, np.bool_)):
        return jnp.asarray(grads_finite)
    shape = getattr(grads_finite, "shape", None)
    dtype = getattr(grads_finite, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.bool_):
        raise ValueError(
            "grads_finite must be a scalar bool (a Python bool or a bool array of shape ()), "
            f"got {grads_finite!r}."
        )
    return jnp.asarray(grads_finite)


def _saturating_increment(counter: jax.Array) -> jax.Array:
    """``counter + 1``, staying at int32's max instead of wrapping."""
    return jnp.where(counter < _INT32_MAX, counter + 1, counter)


def _dynamic_step(
    state: DynamicLossScale, finite: jax.Array
) -> tuple[DynamicLossScale, jax.Array]:
    """One application of the rule; returns (new state, whether it failed on this step).

    Fail closed and sticky: a backoff below the normal float32 range, or a scale that is
    not a positive normal float32 on arrival, records a :class:`Failure` code and keeps
    every value as it was (the scale at its last valid value, never 0, subnormal or NaN);
    a failed state never changes again.
    """
    config = state.config
    scale, tracker, streak = state.loss_scale, state.growth_tracker, state.nonfinite_tracker
    healthy = state.failure == 0
    valid = is_positive_normal(scale)

    # Clean step: count, and grow on the growth_interval-th one unless that overflows.
    # Both counters saturate at int32's max (optax.safe_increment style): hysteresis and
    # growth_interval may be anything in [1, 2**31 - 1], and no counter ever wraps.
    counted = _saturating_increment(tracker)
    grows = counted >= config.growth_interval
    grown = scale * jnp.float32(config.growth_factor)
    if config.max_scale is not None:
        grown = jnp.minimum(grown, jnp.float32(config.max_scale))
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    clean_scale = jnp.where(grows, grown, scale)
    clean_tracker = jnp.where(grows, jnp.zeros_like(tracker), counted)

    # Non-finite step: back off once the hysteresis is used up.
    bad_streak = jnp.minimum(_saturating_increment(streak), config.hysteresis)
    backs_off = bad_streak >= config.hysteresis
    shrunk = scale * jnp.float32(config.backoff_factor)
    if config.min_scale is not None:
        shrunk = jnp.maximum(shrunk, jnp.float32(config.min_scale))
    # `>= tiny` rather than `> 0`: XLA on CPU flushes subnormals to zero, GPUs may not.
    underflow = ~finite & backs_off & ~(shrunk >= jnp.float32(_F32.tiny))

    code = jnp.where(~valid, Failure.INVALID_SCALE,
                     jnp.where(underflow, Failure.BACKOFF_UNDERFLOW, Failure.NONE))
    fails = healthy & (code != Failure.NONE)
    frozen = ~healthy | fails
    stepped = (
        jnp.where(finite, clean_scale, jnp.where(backs_off, shrunk, scale)),
        jnp.where(finite, clean_tracker, jnp.zeros_like(tracker)),
        jnp.where(finite, jnp.zeros_like(streak), bad_streak),
    )
    old = (scale, tracker, streak)
    new_state = DynamicLossScale._from_parts(config, (
        *(jnp.where(frozen, before, after) for before, after in zip(old, stepped, strict=True)),
        jnp.where(healthy, code.astype(jnp.int32), state.failure),
    ))
    return new_state, fails


_dynamic_step_jit = jax.jit(_dynamic_step)


def step_recorded(state: DynamicLossScale, finite: jax.Array) -> DynamicLossScale:
    """:func:`update`'s new state with a failure only recorded, never raised (eager too)."""
    finite = jnp.asarray(finite)
    if any(_is_traced(x) for x in jax.tree.leaves((state, finite))):
        return _dynamic_step(state, finite)[0]
    return _dynamic_step_jit(state, finite)[0]


def is_positive_normal(scale: Any) -> jax.Array:
    """In-graph: whether ``scale`` is a finite, positive, normal float32 (NaN is not)."""
    scale = jnp.asarray(scale, jnp.float32)
    return (scale >= jnp.float32(_F32.tiny)) & (scale <= jnp.float32(_F32.max))


OnFailure = Literal["record", "raise"]


def resolve_on_failure(on_failure: Any, runtime_check: bool | None, where: str) -> OnFailure:
    """Checks ``on_failure``; maps the deprecated ``runtime_check`` onto it, with a warning."""
    if runtime_check is not None:
        warnings.warn(
            f"{where}(runtime_check=...) is deprecated: failures are now recorded in the state "
            "(check them on the host with `loss_scaling.check(state)`). Use "
            "on_failure='raise' for the immediate host-callback raise runtime_check=True "
            "gave, or leave the default on_failure='record'.",
            DeprecationWarning, stacklevel=3)
        on_failure = "raise" if runtime_check else "record"
    if on_failure not in ("record", "raise"):
        raise ValueError(
            f"on_failure must be 'record' (the default: the failure is kept in the state and "
            f"`loss_scaling.check` raises it on the host) or 'raise' (an immediate raise from "
            f"a host callback, for debugging), got {on_failure!r}.")
    return on_failure


def failure_message(scaler: DynamicLossScale | StaticLossScale) -> str:
    """The host-side message for a failed scaler (concrete, unreplicated values)."""
    code = Failure(int(np.asarray(getattr(scaler, "failure", Failure.INVALID_SCALE))))
    if code == Failure.BACKOFF_UNDERFLOW:
        assert isinstance(scaler, DynamicLossScale)
        return _errors.backoff_underflow_message(scaler.loss_scale, scaler.config.backoff_factor)
    return _errors.invalid_scale_message(scaler.loss_scale)


def update(
    state: LossScale,
    grads_finite: Any,
    *,
    on_failure: OnFailure = "record",
    runtime_check: bool | None = None,
) -> LossScale:
    """Returns the state for the next step, given whether this step's gradients were finite.

    Call it on every step, skipped or not, after the optimizer step. ``NoOpLossScale`` and
    ``StaticLossScale`` are returned unchanged; ``DynamicLossScale`` follows the rule in
    its docstring.

    A backoff that would leave the normal float32 range (without ``min_scale``), or a
    scale that is not a positive normal float32 on arrival, fails closed: called eagerly,
    ``update`` raises :class:`LossScaleError`; under ``jit`` the returned state records
    the failure (``state.failure != 0``), keeps its last valid scale and never changes
    again, and :func:`loss_scaling.check` raises the full message on the host. Nothing is
    compiled into the step for this but a few scalar operations.

    Args:
      state: the current loss-scale state.
      grads_finite: a scalar bool (Python or array), e.g. from :func:`all_finite`.
      on_failure: ``"record"`` (the default) or ``"raise"``: under ``jit``, also raise at
        once from a host callback when the state fails. Debugging only: any executable
        holding a callback leaves JAX's fast dispatch path (about 1 ms of host time per
        step, see the README), and a raise inside a donated step deletes its inputs.
      runtime_check: deprecated; ``True`` is ``on_failure="raise"``, ``False`` the default.

    Returns:
      The new state, of the same kind and configuration.

    Raises:
      LossScaleError: called eagerly, when the new state has failed.
      ValueError: if ``grads_finite`` is not a scalar bool, or ``on_failure`` is unknown.
      TypeError: if ``state`` is not a loss-scale state.

    Examples:
      >>> import jax
      >>> import loss_scaling as ls
      >>> s = ls.DynamicLossScale(init_scale=2.0**-125)
      >>> s = ls.update(s, False)   # 2**-126 is still normal
      >>> ls.update(s, False)
      Traceback (most recent call last):
      ...
      loss_scaling.LossScaleError: loss scale backoff failed: ...
      >>> failed = jax.jit(ls.update)(s, False)     # under jit: recorded, not raised
      >>> float(failed.loss_scale), int(failed.failure)
      (1.1754943508222875e-38, 1)
    """
    on_failure = resolve_on_failure(on_failure, runtime_check, "update")
    if isinstance(state, (NoOpLossScale, StaticLossScale)):
        _as_finite_flag(grads_finite)
        return state
    if not isinstance(state, DynamicLossScale):
        raise TypeError(
            f"state must be a NoOpLossScale, StaticLossScale or DynamicLossScale, got {state!r}."
        )
    finite = _as_finite_flag(grads_finite)
    if any(_is_traced(x) for x in jax.tree.leaves((state, finite))):
        new_state, fails = _dynamic_step(state, finite)
        if on_failure == "raise":
            _errors.raise_in_graph(fails, _message_from_leaves(new_state.config),
                                   *jax.tree.leaves(new_state))
        return new_state
    new_state, _ = _dynamic_step_jit(state, finite)
    if np.any(np.asarray(new_state.failure)):
        raise _errors.LossScaleError(failure_message(new_state))
    return new_state


def _message_from_leaves(config: DynamicConfig) -> Any:
    return lambda *leaves: failure_message(DynamicLossScale._from_parts(config, leaves))
