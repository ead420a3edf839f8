"""The three loss-scale states: pytrees, pickling and `loss_scale_for` (the rule: update.py).

Each state is an immutable pytree: the values that change during training are leaves, the
configuration is static auxiliary data. Construction validates; flattening and unflattening
never do, so tree maps to ``None``, ``ShapeDtypeStruct`` or ``PartitionSpec``, Orbax and
``flax.serialization`` all work, and a state passed through ``jax.jit`` keeps every setting.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax.tree_util import GetAttrKey

from loss_scaling._errors import no_such_method, not_a_scaler, show
from loss_scaling.core.validation import (
    DynamicConfig,
    config_fields,
    dynamic_config,
    positive_normal_float32,
    scale_in_range,
    scale_range,
)

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale", "loss_scale_for"]


# ------------------------------------------------------------------------------ states


def _frozen(self: Any, name: str, *value: Any) -> None:
    """``__setattr__`` and ``__delattr__`` of the states."""
    raise dataclasses.FrozenInstanceError(
        f"{type(self).__name__} is immutable: cannot {'assign' if value else 'delete'} "
        f"{name!r}. Use `loss_scaling.update` to get the next state.")


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
    __setattr__ = __delattr__ = _frozen
    __getattr__ = no_such_method

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
    __setattr__ = __delattr__ = _frozen
    __getattr__ = no_such_method
    loss_scale: jax.Array

    def __init__(self, loss_scale: float) -> None:
        value = positive_normal_float32("loss_scale", loss_scale)
        object.__setattr__(self, "loss_scale", jnp.asarray(value, jnp.float32))

    def __repr__(self) -> str:
        return f"StaticLossScale(loss_scale={self.loss_scale!r})"


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
      below the normal float32 range is a failure, never a silent zero scale: eagerly a
      :class:`LossScaleError`; under ``jit`` recorded in the state (every later step
      skipped), and :func:`loss_scaling.check` raises it on the host.

    Args:
      init_scale: the initial factor; finite, positive, normal as float32.
      growth_factor: multiplier on growth; finite and > 1.
      backoff_factor: multiplier on backoff; in (0, 1).
      growth_interval: consecutive clean steps before a growth; an integer >= 1
        (1 grows on every clean step, as in PyTorch).
      hysteresis: consecutive non-finite steps before the first backoff; an integer >= 1.
      min_scale: optional floor for the backoff (clamps instead of failing).
      max_scale: optional ceiling for the growth.
      growth: ``"interval"`` (the default: the rule above) or ``"headroom"``.
      headroom_margin: ``growth="headroom"`` only: a power of two >= 1 kept free between
        the recent gradient maximum and the dtype's largest value (default 2**4).
      headroom_window: ``growth="headroom"`` only: how many recent clean steps' maxima
        count, an integer in [1, 65536] (default 16).
      headroom_dtype: ``growth="headroom"`` only: the compute dtype whose range counts
        (default float16; stored by name).

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
      >>> import jax.numpy as jnp
      >>> h = ls.DynamicLossScale(init_scale=1.0, growth="headroom", headroom_window=2)
      >>> for _ in range(2):   # max |g| 1 at scale 1: 2**11 * 16 * 1 <= 65504 < 2**12 * 16
      ...     h = ls.update(h, True, grads_max=jnp.float32(1.0))
      >>> float(h.loss_scale)
      2048.0
    """

    __slots__ = ("loss_scale", "growth_tracker", "nonfinite_tracker", "failure",
                 "grad_max_history", "headroom_tracker", "ceiling", "config", "_names")
    __setattr__ = __delattr__ = _frozen
    __getattr__ = no_such_method
    loss_scale: jax.Array
    growth_tracker: jax.Array
    nonfinite_tracker: jax.Array
    failure: jax.Array
    grad_max_history: jax.Array | None
    headroom_tracker: jax.Array | None
    ceiling: jax.Array | None
    config: DynamicConfig
    _names: tuple[str, ...]

    def __init__(
        self,
        init_scale: float = 2.0**15,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        growth: str = "interval",
        headroom_margin: float | None = None,
        headroom_window: int | None = None,
        headroom_dtype: Any = None,
    ) -> None:
        init = positive_normal_float32("init_scale", init_scale)
        config = dynamic_config(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            growth=growth,
            headroom_margin=headroom_margin,
            headroom_window=headroom_window,
            headroom_dtype=headroom_dtype,
        )
        scale_in_range("init_scale", init, config)
        zero = jnp.zeros((), jnp.int32)
        leaves: tuple[Any, ...] = (jnp.asarray(init, jnp.float32), zero, zero, zero)
        if config.growth == "headroom":
            leaves += (jnp.zeros((config.headroom_window,), jnp.float32), zero,
                       jnp.asarray(scale_range(config)[1], jnp.float32))
        # Each leaf its own buffer: donating one never deletes another.
        self._fill(config, tuple(jnp.array(x) for x in leaves))

    def _fill(self, config: DynamicConfig, leaves: tuple[Any, ...]) -> None:
        names = HEADROOM_LEAVES if len(leaves) == len(HEADROOM_LEAVES) else DYNAMIC_LEAVES
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "_names", names)
        for name in HEADROOM_LEAVES:
            object.__setattr__(self, name, None)
        for name, leaf in zip(names, leaves, strict=True):
            object.__setattr__(self, name, leaf)

    @classmethod
    def _from_parts(cls, config: DynamicConfig, leaves: tuple[Any, ...]) -> DynamicLossScale:
        """Rebuilds a state from :data:`DYNAMIC_LEAVES` or :data:`HEADROOM_LEAVES` values
        without validation (unflatten, serialization after checks)."""
        self = object.__new__(cls)
        self._fill(config, tuple(leaves))
        return self

    def _replace(self, **leaves: Any) -> DynamicLossScale:
        """This state with the named leaves replaced (no validation)."""
        unknown = set(leaves) - set(self._names)
        if unknown:
            raise ValueError(f"a {self.growth} DynamicLossScale has no leaves {sorted(unknown)}.")
        return DynamicLossScale._from_parts(
            self.config, tuple(leaves.get(n, getattr(self, n)) for n in self._names))

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """The names of the leaves, in flattening order."""
        return self._names

    growth_factor = property(lambda self: self.config.growth_factor, doc="Growth multiplier.")
    backoff_factor = property(lambda self: self.config.backoff_factor, doc="Backoff multiplier.")
    growth_interval = property(lambda self: self.config.growth_interval,
                               doc="Clean steps per growth.")
    hysteresis = property(lambda self: self.config.hysteresis, doc="Non-finite steps per backoff.")
    min_scale = property(lambda self: self.config.min_scale, doc="Backoff floor, or None.")
    max_scale = property(lambda self: self.config.max_scale, doc="Growth ceiling, or None.")
    growth = property(lambda self: "interval" if self.config is None else self.config.growth,
                      doc="The growth rule, 'interval' or 'headroom'.")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self.config, name)!r}"
                           for name in config_fields(self.config))
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names)
        return f"DynamicLossScale({values}, {fields})"


# typing.Union rather than `A | B | C`: a types.UnionType's __doc__ is read-only, so the
# API table (autosummary reads the object's docstring) would say "Represent a PEP 604
# union type". Both work in annotations and in isinstance.
LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]  # noqa: UP007
LossScale.__doc__ = """Any of the three loss-scale states (a type alias).

``NoOpLossScale | StaticLossScale | DynamicLossScale``, for annotations (``s: ls.LossScale``)
and ``isinstance(s, ls.LossScale)``; :func:`loss_scale_for` picks one for a compute dtype.
"""


SCALER_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)
"""The three kinds, for ``isinstance`` checks."""


def require_scaler(argument: str, value: Any) -> None:
    """A ``TypeError`` naming ``argument`` unless ``value`` is a loss-scale state."""
    if not isinstance(value, SCALER_TYPES):
        raise not_a_scaler(argument, value)


def loss_scale_for(compute_dtype: Any, **dynamic_options: Any) -> LossScale:
    """The loss scale a compute dtype needs, so one flag switches float16 / bfloat16.

    float16's narrow exponent range needs dynamic scaling; bfloat16, float32 and float64
    share float32's range and need none.

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
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"compute_dtype must be a floating dtype, got {show(compute_dtype)}.")
    if jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp:  # float16 and narrower
        return DynamicLossScale(**dynamic_options)
    return NoOpLossScale()


# ------------------------------------------------------------------ pytree registration

DYNAMIC_LEAVES = ("loss_scale", "growth_tracker", "nonfinite_tracker", "failure")
"""The leaves of a DynamicLossScale with ``growth="interval"``, in flattening order."""
HEADROOM_LEAVES = (*DYNAMIC_LEAVES, "grad_max_history", "headroom_tracker", "ceiling")
"""The leaves of a DynamicLossScale with ``growth="headroom"``, in flattening order."""
FLOAT_LEAVES = frozenset({"loss_scale", "grad_max_history", "ceiling"})
"""The float32 leaves of the scalers (the others are int32)."""


def leaf_names(scaler: Any) -> tuple[str, ...]:
    """The leaf names of any scaler, in flattening order (``()`` for NoOpLossScale)."""
    if isinstance(scaler, DynamicLossScale):
        return scaler.leaf_names
    return ("loss_scale",) if isinstance(scaler, StaticLossScale) else ()


def leaf_ndim(name: str) -> int:
    """The rank of one scaler leaf as the library builds it (before any replica axes)."""
    return 1 if name == "grad_max_history" else 0

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
    lambda s: (tuple((GetAttrKey(n), getattr(s, n)) for n in s._names), s.config),
    lambda config, children: DynamicLossScale._from_parts(config, tuple(children)),
    flatten_func=lambda s: (tuple(getattr(s, n) for n in s._names), s.config),
)


def _unpickle(cls: type, aux: Any, children: tuple[Any, ...]) -> Any:
    """Unpickling: unflatten (no validation, like every unflatten) the pickled parts."""
    if cls is NoOpLossScale:
        return object.__new__(NoOpLossScale)
    if cls is StaticLossScale:
        return _static_unflatten(None, children)
    return DynamicLossScale._from_parts(aux, children)


def _pickle_reduce(self: Any) -> tuple[Any, ...]:
    children, aux = jax.tree_util.tree_flatten(self)[0], getattr(self, "config", None)
    return (_unpickle, (type(self), aux, tuple(children)))


for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
    _cls.__reduce__ = _pickle_reduce  # type: ignore[method-assign]
