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
from loss_scaling.core import fields
from loss_scaling.core.fields import DynamicConfig
from loss_scaling.core.validation import positive_normal_float32, scale_in_range

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

    __slots__ = (*fields.ALL_DYNAMIC_LEAF_NAMES, "config", "_names")
    __setattr__ = __delattr__ = _frozen
    __getattr__ = no_such_method
    # For the type checker: the leaves of fields.LEAVES (a rule's own are None without it).
    loss_scale: jax.Array
    growth_tracker: jax.Array
    nonfinite_tracker: jax.Array
    failure: jax.Array | None
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
        settings = locals()  # the arguments: every setting (fields.SETTINGS) and the scale
        config = fields.dynamic_config(**{name: settings[name] for name in fields.SETTING_NAMES})
        scale_in_range("init_scale", init, config)
        _fill(self, config, fields.initial_leaves(init, config))

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """The names of the leaves, in flattening order."""
        return self._names

    def __repr__(self) -> str:
        settings = ", ".join(f"{name}={getattr(self.config, name)!r}"
                             for name in fields.shown(self.config.growth))
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names)
        return f"DynamicLossScale({values}, {settings})"


def _setting_property(name: str, doc: str) -> property:
    def get(self: DynamicLossScale) -> Any:
        return getattr(self.config, name)

    return property(get, doc=doc)


for _setting in fields.SETTINGS:  # each setting read through the config, as a property
    setattr(DynamicLossScale, _setting.name,
            _setting_property(_setting.name, _setting.metadata["doc"]))


def _fill(state: DynamicLossScale, config: DynamicConfig, leaves: tuple[Any, ...]) -> None:
    alone = len(leaves) == len(fields.dynamic_leaf_names(config.growth))
    names = fields.dynamic_leaf_names(config.growth, alone)
    object.__setattr__(state, "config", config)
    object.__setattr__(state, "_names", names)
    for name in fields.ALL_DYNAMIC_LEAF_NAMES:
        object.__setattr__(state, name, None)
    for name, leaf in zip(names, leaves, strict=True):
        object.__setattr__(state, name, leaf)


def dynamic_from_leaves(config: DynamicConfig, leaves: Any) -> DynamicLossScale:
    """A ``DynamicLossScale`` of ``config`` holding ``leaves`` (in
    :func:`fields.dynamic_leaf_names` order, with ``failure`` or without it: a wrapper's),
    without validation: unflatten, and the checkpoint formats after their own checks."""
    state = object.__new__(DynamicLossScale)
    _fill(state, config, tuple(leaves))
    return state


def replace_leaves(state: DynamicLossScale, **leaves: Any) -> DynamicLossScale:
    """``state`` with the named leaves replaced (no validation)."""
    unknown = set(leaves) - set(state.leaf_names)
    if unknown:
        raise ValueError(f"a {state.config.growth} DynamicLossScale has no leaves "
                         f"{sorted(unknown)}.")
    return dynamic_from_leaves(state.config, tuple(leaves.get(n, getattr(state, n))
                                                   for n in state.leaf_names))


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

def holds_failure(scaler: Any) -> bool:
    """Whether ``scaler`` is a ``DynamicLossScale`` with its own ``failure`` leaf (on its
    own), not one a ``with_loss_scaling`` state holds (whatever the leaf's value: a
    placeholder may be None)."""
    return isinstance(scaler, DynamicLossScale) and fields.FAILURE in scaler.leaf_names


def without_failure(scaler: LossScale) -> LossScale:
    """``scaler`` as a ``with_loss_scaling`` state holds it: a ``DynamicLossScale``
    without its ``failure`` leaf (the wrapper's register is the one); the others as they
    are. The code goes to the wrapper's register (``wrapper.state.carried_failure``)."""
    if not holds_failure(scaler):
        return scaler
    assert isinstance(scaler, DynamicLossScale)
    names = fields.dynamic_leaf_names(scaler.config.growth, alone=False)
    return dynamic_from_leaves(scaler.config, tuple(getattr(scaler, n) for n in names))


def with_failure(scaler: LossScale, code: Any) -> LossScale:
    """``scaler`` on its own, its ``failure`` leaf ``code`` (a ``DynamicLossScale``; the
    others have none and are returned as they are): what ``get_loss_scale`` returns for a
    wrapper's scaler, the wrapper's register read into it."""
    if not isinstance(scaler, DynamicLossScale):
        return scaler
    values = {**{n: getattr(scaler, n) for n in scaler.leaf_names}, fields.FAILURE: code}
    return dynamic_from_leaves(scaler.config, tuple(
        values[n] for n in fields.dynamic_leaf_names(scaler.config.growth)))


def leaf_names(scaler: Any) -> tuple[str, ...]:
    """The leaf names of any scaler, in flattening order (``()`` for NoOpLossScale)."""
    if isinstance(scaler, DynamicLossScale):
        return scaler.leaf_names
    return (fields.LOSS_SCALE,) if isinstance(scaler, StaticLossScale) else ()


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
    lambda s: (tuple((GetAttrKey(n), getattr(s, n)) for n in s.leaf_names), s.config),
    dynamic_from_leaves,
    flatten_func=lambda s: (tuple(getattr(s, n) for n in s.leaf_names), s.config),
)


def _unpickle(cls: type, aux: Any, children: tuple[Any, ...]) -> Any:
    """Unpickling: unflatten (no validation, like every unflatten) the pickled parts."""
    if cls is NoOpLossScale:
        return object.__new__(NoOpLossScale)
    if cls is StaticLossScale:
        return _static_unflatten(None, children)
    return dynamic_from_leaves(aux, children)


def _pickle_reduce(self: Any) -> tuple[Any, ...]:
    children, aux = jax.tree_util.tree_flatten(self)[0], getattr(self, "config", None)
    return (_unpickle, (type(self), aux, tuple(children)))


for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
    _cls.__reduce__ = _pickle_reduce  # type: ignore[method-assign]
